"""Tensor parallelism on a (dp, tp) mesh: torch's styles under torch_tp and torch_2d match the
one-process reference; ranks of a tensor-parallel group fed different inputs stay bitwise
identical yet wrong, and only the reference sees it; replicas that drift are named by their axis;
plans are valid by construction; torch's DTensor hang on empty reshapes is declined, not run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ddpcheck
from ddpcheck import EquivalenceError, InvalidArgument, Scenario
from ddpcheck._language.batches import global_indices
from ddpcheck._language.battery import TENSOR_PARALLEL_BATTERY
from ddpcheck._language.plans import plans, sharded_models, tensor_parallel_scenarios
from ddpcheck._language.sharded_models import (
    HEAD_NORM,
    REGION_STYLES,
    SEQUENCE,
    VOCABULARY_STYLES,
    ShardedBlock,
    ShardedSpec,
    plan_choices,
    sequence_data,
)
from ddpcheck._language.tensor_parallel import TensorParallel, data_coordinate, mesh_problem
from ddpcheck._oracle.mesh_axes import shared_axis
from ddpcheck.targets import support
from ddpcheck.targets.catalogue import PARALLEL, TORCH_2D, TORCH_TP
from ddpcheck.targets.parallel_tp import no_head_norm
from ddpcheck.targets.tensor_parallel import TorchTPTarget, empty_micro_batch, torch_plan

#: Every parameter sharded over tp (no bias on a replicated layer, no norm): the full tensors
#: every rank gathers are the same whatever each rank computed, so replicas cannot disagree.
ALL_SHARDED = Scenario(
    ShardedSpec(blocks=(ShardedBlock("mlp", 4, bias=False),), width=4),
    data=sequence_data,
    global_batch=4,
    steps=2,
    seed=5,
    tensor_parallel=TensorParallel(
        (
            ("inp", "colwise-replicate"),
            ("blocks.0.up", "colwise"),
            ("blocks.0.down", "rowwise"),
            ("head", "colwise-replicate"),
        )
    ),
)


def _shuffled_inputs(module: nn.Module, args: tuple) -> tuple:
    """Each rank's own order of the batch's inputs (not of its targets): a tensor-parallel
    group whose data loaders are seeded per rank."""
    (x,) = args
    if x.shape[0] < 2:
        return args
    rank = torch.distributed.get_rank()
    return (x.roll(rank + 1, dims=0),)


@dataclasses.dataclass(frozen=True)
class RankSeededInputs(TorchTPTarget):
    """torch_tp whose tensor-parallel ranks each see the batch's inputs in their own order."""

    def parallelize(self, module, mesh):
        module = super().parallelize(module, mesh)
        module.register_forward_pre_hook(_shuffled_inputs)
        return module


@dataclasses.dataclass(frozen=True)
class DriftingNorm(TorchTPTarget):
    """torch_tp whose rank 1 nudges its replicated norm weight after every step."""

    def after_step(self, model, optimizer):
        if torch.distributed.get_rank() == 1:
            with torch.no_grad():
                model.blocks[1].norm.weight.to_local().add_(1e-3)


def test_the_tensor_parallel_battery_matches_the_reference():
    for name, scenario in TENSOR_PARALLEL_BATTERY:
        assert ddpcheck.check_example(TORCH_TP, scenario, 2) == (), name
    mesh = dict(TENSOR_PARALLEL_BATTERY)["tp2-mesh-accumulate"]
    assert ddpcheck.check_example(TORCH_2D, mesh, 4) == ()  # dp=2 x tp=2


def test_tensor_parallel_ranks_fed_different_inputs_are_identical_yet_wrong():
    assert ddpcheck.check_example(TORCH_TP, ALL_SHARDED, 2) == ()
    with pytest.raises(EquivalenceError) as caught:
        ddpcheck.check_example(RankSeededInputs(), ALL_SHARDED, 2)
    kinds = {d.kind for d in caught.value.divergences}
    # only the reference sees it: its gradients and parameters, and the loss each rank computed
    # from inputs paired with another sample's targets
    assert all(k.startswith("reference differs") or k == "loss differs" for k in kinds), kinds
    assert not any("replicas" in k for k in kinds)


def test_replicas_that_drift_are_named_by_their_axis_and_placement():
    scenario = dataclasses.replace(
        ALL_SHARDED,
        model=ShardedSpec(blocks=(ShardedBlock("mlp", 4), ShardedBlock("norm")), width=4),
    )
    with pytest.raises(EquivalenceError) as caught:
        ddpcheck.check_example(DriftingNorm(), scenario, 2)
    first = caught.value.divergences[0]
    # the nudge after step 0 shows first in step 1's gradients computed from the nudged weight:
    # the row-wise bias's, replicated over tp
    assert first.kind == "replicas differ along tp (gradient)", caught.value
    assert (first.name, first.rank) == ("blocks.0.down.bias", 1)
    assert first.detail.startswith("placed Replicate() along tp;"), first.detail


def test_the_data_follows_the_mesh():
    tp2 = TensorParallel(tp=2)
    assert [data_coordinate(tp2, r, 4) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert data_coordinate(None, 3, 4) == (3, 4)
    assert data_coordinate(TensorParallel(), 3, 4) == (0, 1)  # tp = W
    scenario = dataclasses.replace(ALL_SHARDED, global_batch=5, tensor_parallel=tp2)
    batch = global_indices(scenario, 0, 3, 4)
    assert (batch.rank, batch.world_size) == (1, 2)
    assert mesh_problem(tp2, 3) == "tp=2 does not divide the world of 3 ranks into dp groups"
    assert [shared_axis(0, r, 2) for r in (1, 2, 3)] == ["tp", "dp", "dp and tp"]


def test_bad_plans_are_refused_naming_the_module():
    with pytest.raises(InvalidArgument, match="module 'fc' the style 'diagonal'"):
        TensorParallel((("fc", "diagonal"),))
    with pytest.raises(InvalidArgument, match="names module 'fc' twice"):
        TensorParallel((("fc", "colwise"), ("fc", "rowwise")))
    with pytest.raises(InvalidArgument, match="tp=0"):
        TensorParallel(tp=0)
    with pytest.raises(InvalidArgument, match="tensor_parallel="):
        Scenario(tensor_parallel=2)


@settings(max_examples=40, deadline=None, database=None)
@given(data=st.data(), tp=st.sampled_from((1, 2, 3, 4)))
def test_drawn_plans_name_real_linears_and_shard_no_dimension_emptily(data, tp):
    spec = dataclasses.replace(data.draw(sharded_models()), tokens=data.draw(st.booleans()))
    plan = data.draw(plans(spec, tp))
    model = spec()
    styles = torch_plan(plan)  # every style name maps to one of torch's
    assert set(styles) == {name for name, _ in plan}
    for name, style in plan:
        linear = model.get_submodule(name)
        if style in REGION_STYLES:  # a sequence-parallel norm, or its block: a token per rank
            norm = linear if style == "sequence" else linear.norm
            assert isinstance(norm, (nn.LayerNorm, nn.RMSNorm)), (name, style)
            assert len(torch.chunk(torch.empty(SEQUENCE), tp)) == tp
            continue
        if style in VOCABULARY_STYLES:  # an embedding's rows: a word of the vocabulary each
            assert isinstance(linear, nn.Embedding), (name, style)
            assert len(torch.chunk(torch.empty(linear.num_embeddings), tp)) == tp
            continue
        if style == HEAD_NORM:  # a q/k norm of attention split along whole heads
            assert isinstance(linear, nn.RMSNorm), (name, style)
            assert (name.rsplit(".", 1)[0] + ".q", "colwise") in plan, (name, plan)
            continue
        assert isinstance(linear, nn.Linear)
        sharded = linear.out_features if style.startswith("colwise") else linear.in_features
        pieces = torch.chunk(torch.empty(sharded), tp)  # torch's shards of that dimension
        assert len(pieces) == tp and all(p.numel() for p in pieces), (name, style, sharded)
        if style == "colwise":  # a local output feeds its row-wise partner: even shards only
            assert linear.out_features % tp == 0


def test_q_k_norms_are_sharded_with_their_heads_or_declined_naming_why():
    block = ShardedBlock("attention", 4, kv_heads=2, qk_norm=True)
    spec = ShardedSpec(blocks=(block,), width=4, head_dim=1)
    split = [f for f in plan_choices(spec, 2)[1] if ("blocks.0.q", "colwise") in f]
    assert split and all(("blocks.0.q_norm", HEAD_NORM) in f for f in split), split
    assert not any(("blocks.0.q_norm", HEAD_NORM) in f for f in plan_choices(spec, 3)[1])
    scenario = Scenario(spec, data=sequence_data, tensor_parallel=TensorParallel(split[0]))
    assert "a q/k norm over the heads" in no_head_norm(scenario)
    with pytest.raises(InvalidArgument, match="qk_norm"):
        ShardedBlock("mlp", qk_norm=True)


@settings(max_examples=30, deadline=None, database=None)
@given(data=st.data(), world_size=st.sampled_from((1, 2, 3, 4)))
def test_drawn_scenarios_fit_their_world(data, world_size):
    scenario = data.draw(tensor_parallel_scenarios(world_size=world_size))
    assert mesh_problem(scenario.tensor_parallel, world_size) is None
    assert "tensor-parallel" in ddpcheck.features.of(scenario, world_size)


def test_who_gets_tensor_parallel_scenarios():
    assert support.battery_for(TORCH_TP) is TENSOR_PARALLEL_BATTERY
    assert support.battery_for(PARALLEL) is not TENSOR_PARALLEL_BATTERY
    _, scenario = TENSOR_PARALLEL_BATTERY[0]
    assert "tensor-parallel" in support.declines(PARALLEL, scenario, 2)
    assert "checks tensor-parallel scenarios" in support.declines(TORCH_TP, Scenario(), 2)
    assert "torch_2d adds FSDP2" in support.declines(
        TORCH_TP, dict(TENSOR_PARALLEL_BATTERY)["tp2-mesh-accumulate"], 4
    )


def test_an_empty_micro_batch_is_declined_for_torchs_dtensor_hang():
    tiny = dataclasses.replace(ALL_SHARDED, global_batch=1, accumulation=2)
    why = empty_micro_batch(tiny, 2)
    assert "leave a micro-batch empty" in why and "bench/dtensor_empty_reshape.py" in why
    assert empty_micro_batch(ALL_SHARDED, 2) is None
    assert TORCH_TP.supports_at(tiny, 2) == why


@settings(max_examples=10, deadline=None, database=None)
@given(scenario=ddpcheck.strategies.exercising("tensor-parallel", world_size=4))
def test_exercising_tensor_parallel_draws_meshes(scenario):
    assert scenario.tensor_parallel is not None
    assert scenario.tensor_parallel.degree(4) in (2, 4)
