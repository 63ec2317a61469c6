"""Per-rank registration orders (``Scenario.rank_orders``, feature ``rank-orders``, class G1).

The permutation changes only the order in which tensors are registered -- names, shapes, values
and what forward computes stay -- every rank gets its own, and the reference keeps the canonical
order. ``parallel.DDP`` (and ``ShardedOptimizer`` behind it) pair tensors in rank 0's order, so
they pass; torch DDP declines the feature; the G1 mutant (buckets over this rank's order) fails
with rows that name the parameters.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import ddpcheck
from ddpcheck import check_example, features, targets, zoo
from ddpcheck import strategies as dst
from ddpcheck._oracle.reference import reference_run
from ddpcheck._rank.orders import permute_registration
from ddpcheck._rank.runner import run_example
from ddpcheck._world.registry import get_world
from ddpcheck.battery import BATTERY
from ddpcheck.models import KINDS, Layer, ModelSpec, SpecData
from ddpcheck.mutation.catalogue import by_name
from ddpcheck.scenario import build_model
from parallel import DDP, ShardedOptimizer

SPEC = ModelSpec(layers=tuple(Layer(kind=k) for k in KINDS), tie_head=True)
ORDERED = dict(BATTERY)["rank-orders-adam"]


def _order(module):
    return ([n for n, _ in module.named_parameters()], [n for n, _ in module.named_buffers()])


@pytest.mark.parametrize(
    "model",
    [SPEC, zoo.Tied, zoo.WithBuffers, zoo.UnusedAndFrozen],
    ids=["spec", "tied", "buffers", "frozen"],
)
def test_the_permutation_keeps_names_shapes_values_and_forward(model):
    scenario = ddpcheck.Scenario(model=model, data=getattr(model, "data", zoo.regression_data))
    canonical = build_model(scenario, 0)
    x, _ = scenario.data(0, 5, torch.float64)
    orders = set()
    for seed in range(4):
        permuted = build_model(scenario, 0)
        permute_registration(permuted, seed)
        params, buffers = _order(permuted)
        orders.add((tuple(params), tuple(buffers)))
        assert sorted(params) == sorted(_order(canonical)[0])  # a tied weight keeps its name
        assert sorted(buffers) == sorted(_order(canonical)[1])
        theirs = dict(canonical.named_parameters()) | dict(canonical.named_buffers())
        for name, tensor in [*permuted.named_parameters(), *permuted.named_buffers()]:
            assert torch.equal(tensor, theirs[name]) and tensor.stride() == theirs[name].stride()
            assert tensor.requires_grad == theirs[name].requires_grad
        assert torch.equal(permuted(x), canonical(x))
    assert len(orders) > 1  # the seed matters


def test_containers_keep_their_order():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    before = list(model._modules)
    permute_registration(model, 1)
    assert list(model._modules) == before


def rank_orders_seen(scenario):
    """This rank's registration order as the target received it (run by a world's ranks)."""
    target = OrderSpy()
    run_example(target, scenario)
    return OrderSpy.seen


@dataclasses.dataclass(frozen=True)
class OrderSpy(targets.Target):
    seen = None

    def wrap(self, module):
        OrderSpy.seen = _order(module)
        return module


def test_every_rank_gets_its_own_order_and_the_reference_keeps_the_canonical_one():
    scenario = dataclasses.replace(ORDERED, steps=1)
    seen = get_world(3).run(rank_orders_seen, scenario)
    canonical = _order(build_model(scenario, scenario.seed))
    assert all(sorted(s[0]) == sorted(canonical[0]) for s in seen)
    assert len({tuple(s[0]) for s in seen} | {tuple(canonical[0])}) == 4  # rank 0 permuted too
    unordered = dataclasses.replace(scenario, rank_orders=False)
    assert get_world(3).run(rank_orders_seen, unordered) == [canonical] * 3
    ref, plain = reference_run(scenario), reference_run(unordered)
    assert list(ref.steps[0].params) == list(plain.steps[0].params) == canonical[0]
    assert all(torch.equal(ref.steps[0].params[n], plain.steps[0].params[n]) for n in canonical[0])


def test_the_feature_is_declared_generated_and_declined_where_unsupported():
    assert "rank-orders" in features.of(ORDERED)
    assert "rank-orders" not in features.of(dataclasses.replace(ORDERED, rank_orders=False))
    assert "rank_orders=True" in repr(ORDERED)
    assert "rank_orders" not in repr(dataclasses.replace(ORDERED, rank_orders=False))
    for target in (targets.TORCH_DDP, targets.TORCH_ZERO):
        assert "rank-orders" in features.declines(target, ORDERED, 2)
    for target in (targets.PARALLEL, targets.PARALLEL_DDP):
        assert features.declines(target, ORDERED, 2) is None


@settings(max_examples=30, database=None, deadline=None)
@given(st.data())
def test_strategies_generate_it_only_where_allowed(data):
    assert data.draw(dst.exercising("rank-orders", world_size=2)).rank_orders
    assert not data.draw(dst.scenarios(without=["rank-orders"])).rank_orders


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("target", ["parallel", "parallel_ddp"])
def test_parallel_passes_per_rank_orders(target, world_size):
    for scenario in (
        ORDERED,
        dataclasses.replace(ORDERED, bucket_size_mb=1e-4, accumulation=2),
        ddpcheck.Scenario(
            zoo.Tied,
            param_groups=zoo.BiasGroups(),
            rank_orders=True,
            optimizer=torch.optim.AdamW,
            seed=3,
            global_batch=7,
        ),
        CLIPPED,
    ):
        check_example(targets.BUILTIN[target], scenario, world_size)


#: Found by the fuzzer: clipping over model.parameters() sums the norm in each rank's order, and
#: at W=3 the ranks' clip coefficients differed by an ulp (replicas differ by 5e-17).
CLIPPED = ddpcheck.Scenario(
    ModelSpec(layers=(Layer(),), width=2),
    data=SpecData(2),
    global_batch=2,
    steps=1,
    reduction="sum",
    seed=57,
    max_grad_norm=0.5,
    rank_orders=True,
)


def ddp_layout_and_owners():
    """Build a per-rank permuted model, wrap it: what each rank pairs by name (run by ranks)."""
    scenario = dataclasses.replace(ORDERED, model=SPEC, data=SpecData(SPEC.width))
    module = build_model(scenario, 0)
    permute_registration(module, 100 + dist.get_rank())
    model = DDP(module, bucket_size_mb=1e-4)
    optimizer = ShardedOptimizer(list(module.parameters()), torch.optim.SGD, lr=0.1)
    names = {p: n for n, p in module.named_parameters()}
    owners = sorted((names[p], optimizer.owner_of(p)) for p in module.parameters())
    mine = _order(module)[0]
    return model.bucket_layout, owners, mine


def test_ddp_and_the_sharded_optimizer_pair_by_rank_zeros_order():
    results = get_world(2).run(ddp_layout_and_owners)
    (layout, owners, rank0), (layout1, owners1, rank1) = results
    assert rank0 != rank1  # the ranks did register differently
    assert layout == layout1 and owners == owners1
    trainable = [n for n in rank0 if n in {m for bucket in layout for m in bucket}]
    assert [n for bucket in layout for n in bucket] == trainable[::-1]  # reverse of rank 0's


def test_the_g1_mutant_is_caught_naming_the_parameters():
    with pytest.raises(ddpcheck.EquivalenceError) as caught:
        check_example(by_name("OwnRegistrationOrder").target, ORDERED, 2)
    error = caught.value
    assert "replicas differ (gradient)" in error.kinds
    named = {d.name for d in error.divergences}
    assert named & {n for n, _ in build_model(ORDERED, 0).named_parameters()}
