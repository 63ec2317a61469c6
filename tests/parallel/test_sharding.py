"""parallel.sharding: each rule's invariant, and the validator of a rule's answer.

Pure functions, no world: the distributed behaviour of every rule is covered by
tests/parallel/test_sharded_optimizer.py (bitwise equivalence at W = 1..4 and W > number of params).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel import InvalidArgument, sharding

RULES = [sharding.modulo, sharding.contiguous, sharding.greedy]
DTYPES = [torch.float64, torch.float32, torch.bfloat16]


@st.composite
def param_lists(draw):
    """Lists of 0..12 tensors with 0..40 elements and mixed dtypes. Shrinks towards few small."""
    sizes = draw(st.lists(st.integers(0, 40), max_size=12))
    return [torch.empty(n, dtype=draw(st.sampled_from(DTYPES))) for n in sizes]


def nbytes(p):
    return p.numel() * p.element_size()


@settings(max_examples=150, deadline=None)
@given(params=param_lists(), world_size=st.integers(1, 8))
def test_every_rule_returns_one_valid_owner_per_param_deterministically(params, world_size):
    for rule in RULES:
        owners = rule(params, world_size)
        assert sharding.check_owners(owners, params, world_size, rule=rule, group_index=0) == list(
            owners
        )
        assert rule(list(params), world_size) == owners  # a pure function of sizes and order


@settings(max_examples=150, deadline=None)
@given(params=param_lists(), world_size=st.integers(1, 8))
def test_contiguous_owners_never_decrease_and_greedy_is_within_the_lpt_bound(params, world_size):
    owners = sharding.contiguous(params, world_size)
    assert owners == sorted(owners)
    loads = [0] * world_size
    for p, o in zip(params, sharding.greedy(params, world_size)):
        loads[o] += nbytes(p)
    total = sum(nbytes(p) for p in params)
    largest = max((nbytes(p) for p in params), default=0)
    # list scheduling: the heaviest rank carries at most the mean share plus one largest tensor
    assert max(loads) <= total / world_size + largest


def test_modulo_is_the_seed_rule_and_ties_break_towards_lower_index_and_rank():
    same = [torch.empty(4) for _ in range(5)]
    assert sharding.modulo(same, 3) == [0, 1, 2, 0, 1]
    assert sharding.greedy(same, 3) == [0, 1, 2, 0, 1]
    sizes = [torch.empty(n) for n in (1, 8, 2, 8, 5)]
    # by bytes: index 1 -> rank 0, index 3 (tie, later) -> rank 1, then 5, 2, 1 -> rank 2
    assert sharding.greedy(sizes, 3) == [2, 0, 2, 1, 2]
    assert sharding.contiguous([torch.empty(4) for _ in range(4)], 2) == [0, 0, 1, 1]


def test_greedy_balances_a_large_embedding_that_modulo_and_contiguous_do_not():
    params = [torch.empty(1000)] + [torch.empty(100) for _ in range(30)]  # 4000 bytes in total

    def worst(rule):
        loads = [0, 0, 0, 0]
        for p, o in zip(params, rule(params, 4)):
            loads[o] += p.numel()
        return max(loads)

    assert worst(sharding.greedy) == 1000
    assert worst(sharding.modulo) > 1000 and worst(sharding.contiguous) >= 1000


def test_world_larger_than_the_group_leaves_ranks_without_params():
    params = [torch.empty(3), torch.empty(3)]
    for rule in RULES:
        owners = rule(params, 5)
        assert len(owners) == 2 and all(0 <= o < 5 for o in owners)
        assert len(set(owners)) == 2, rule  # two params never share a rank when ranks are free
    assert sharding.contiguous([], 3) == sharding.greedy([], 3) == sharding.modulo([], 3) == []


def _rule(params, world_size):
    return []


@pytest.mark.parametrize(
    "answer, fragments",
    [
        (
            [0, 1],
            [
                "tests.parallel.test_sharding._rule for param group 4 returned 2 owners for 3 "
                "parameters",
                "exactly one owner rank per parameter",
            ],
        ),
        (
            [0, 1.0, 0],
            [
                "returned owner 1.0 (type float) for parameter 1",
                "integer ranks in [0, world_size=2)",
            ],
        ),
        ([0, True, 0], ["returned owner True (type bool) for parameter 1"]),
        ([0, 0, 2], ["returned owner 2 for parameter 2, outside [0, world_size=2)"]),
        ([-1, 0, 0], ["returned owner -1 for parameter 0, outside [0, world_size=2)"]),
        (None, ["returned None; a sharding rule must return a sequence with one owner rank"]),
        ("011", ["returned '011'"]),
    ],
)
def test_bad_rule_answers_name_the_rule_group_and_parameter(answer, fragments):
    params = [torch.empty(1)] * 3
    with pytest.raises(InvalidArgument) as info:
        sharding.check_owners(answer, params, 2, rule=_rule, group_index=4)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_a_tensor_answer_is_accepted_as_its_integers():
    assert sharding.check_owners(
        torch.tensor([1, 0]), [torch.empty(1)] * 2, 2, rule=_rule, group_index=0
    ) == [1, 0]
