"""Properties of ``parallel.ShardedOptimizer`` alone, on random parameter lists.

With identical, exactly representable gradients on every rank (multiples of 1/8, so averaging W
copies is exact), the sharded step is the plain optimizer's step *bitwise*, for any rule, world
size and optimizer; and a checkpoint saved at world size W resumes at W' exactly as the
uninterrupted single-process run continues.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpcheck import strategies as dst
from ddpcheck._runs.example import note_example
from ddpcheck._world.registry import get_world
from parallel import ShardedOptimizer, sharding

RULES = {"modulo": sharding.modulo, "contiguous": sharding.contiguous, "greedy": sharding.greedy}
DTYPES = {"float64": torch.float64, "float32": torch.float32}

# Each example here runs one or two worlds of several steps: half the profile's count keeps the
# CI budget; the thorough profile still scales it up.
HALF = settings(max_examples=max(10, settings.default.max_examples // 2))

shapes = st.lists(
    st.tuples(
        st.lists(st.integers(1, 4), min_size=1, max_size=2).map(tuple),
        st.sampled_from(sorted(DTYPES)),
    ),
    min_size=1,
    max_size=7,
)


def make_params(spec):
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(shape, generator=g, dtype=torch.float64).to(DTYPES[d]).requires_grad_()
        for shape, d in spec
    ]


def grad(param, step, index):
    """Multiples of 1/8 in [-1, 1]: W identical copies average exactly for W <= 4."""
    g = torch.Generator().manual_seed(7919 * step + index)
    return torch.randint(-8, 9, param.shape, generator=g).to(param.dtype) / 8


def groups(params, two):
    if not two or len(params) < 2:
        return [{"params": params}]
    return [{"params": params[0::2]}, {"params": params[1::2], "lr": 0.05}]


def train(params, optimizer, first, last):
    for step in range(first, last):
        for i, p in enumerate(params):
            p.grad = grad(p, step, i)
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in params]


def _rank_sharded(spec, optimizer, two, rule, steps):
    cls, kwargs = optimizer
    params = make_params(spec)
    opt = ShardedOptimizer(groups(params, two), cls, sharding_rule=RULES[rule], **kwargs)
    return train(params, opt, 0, steps)


def _rank_save(spec, optimizer, two, rule, steps):
    cls, kwargs = optimizer
    params = make_params(spec)
    opt = ShardedOptimizer(groups(params, two), cls, sharding_rule=RULES[rule], **kwargs)
    values = train(params, opt, 0, steps)
    opt.consolidate_state_dict(to=0)
    return values, (opt.state_dict() if dist.get_rank() == 0 else None)


def _rank_resume(spec, optimizer, two, rule, values, state, first, last):
    cls, kwargs = optimizer
    params = make_params(spec)
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)
    opt = ShardedOptimizer(groups(params, two), cls, sharding_rule=RULES[rule], **kwargs)
    opt.load_state_dict(copy.deepcopy(state))
    return train(params, opt, first, last)


def plain(spec, optimizer, two, steps):
    cls, kwargs = optimizer
    params = make_params(spec)
    return train(params, cls(groups(params, two), **kwargs), 0, steps)


def assert_bitwise(per_rank, expected, what):
    for rank, got in enumerate(per_rank):
        for i, (p, e) in enumerate(zip(got, expected)):
            assert torch.equal(p, e), (
                f"{what}: rank {rank}, parameter {i} differs by "
                f"{(p.double() - e.double()).abs().max().item():.3g}"
            )


@pytest.mark.slow
@HALF
@given(
    spec=shapes,
    optimizer=dst.optimizers(),
    two=st.booleans(),
    rule=st.sampled_from(tuple(RULES)),
    world_size=dst.world_sizes(),
    steps=st.integers(1, 3),
)
def test_sharded_step_equals_the_local_step_on_identical_gradients(
    spec, optimizer, two, rule, world_size, steps
):
    note_example()
    got = get_world(world_size).run(_rank_sharded, spec, optimizer, two, rule, steps)
    assert_bitwise(got, plain(spec, optimizer, two, steps), f"W={world_size} rule={rule}")


@pytest.mark.slow
@HALF
@given(
    spec=shapes,
    optimizer=dst.optimizers(),
    two=st.booleans(),
    rules=st.tuples(st.sampled_from(tuple(RULES)), st.sampled_from(tuple(RULES))),
    sizes=st.tuples(dst.world_sizes(), dst.world_sizes()),
    steps=st.integers(1, 2),
)
def test_checkpoint_saved_at_w_resumes_at_w_prime(spec, optimizer, two, rules, sizes, steps):
    note_example()
    saved = get_world(sizes[0]).run(_rank_save, spec, optimizer, two, rules[0], steps)
    values, state = saved[0]
    resumed = get_world(sizes[1]).run(
        _rank_resume, spec, optimizer, two, rules[1], values, state, steps, steps + 2
    )
    assert_bitwise(
        resumed,
        plain(spec, optimizer, two, steps + 2),
        f"saved at W={sizes[0]} ({rules[0]}), resumed at W={sizes[1]} ({rules[1]})",
    )
