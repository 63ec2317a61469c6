"""One property per invariant of the oracle, for each built-in target that must pass.

Random models, orderings, world sizes, bucket sizes, optimizers, batches, steps, accumulation and
dtypes come from ``ddpcheck.strategies``; a failure shows Hypothesis's shrunk example and the
divergence table with its replay line.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, given

from ddpcheck import check_example, features, targets
from ddpcheck import strategies as dst

TARGETS = {
    "PARALLEL": targets.PARALLEL,
    "TORCH_DDP": targets.TORCH_DDP,
    "TORCH_ZERO": targets.TORCH_ZERO,
}
MIXED = dst.scenarios(models=dst.models(mixed_dtypes=True), dtypes=("float64", "float32"))


def _check(name, scenario, world_size, checks):
    target = TARGETS[name]
    assume(features.declines(target, scenario, world_size) is None)
    check_example(target, scenario, world_size, checks=checks)


@pytest.mark.slow
@pytest.mark.parametrize("name", TARGETS)
@given(scenario=MIXED, world_size=dst.world_sizes(min_size=2))
def test_replicas_stay_bitwise_identical(name, scenario, world_size):
    _check(name, scenario, world_size, {"replicas"})


@pytest.mark.slow
@pytest.mark.parametrize("name", TARGETS)
@given(scenario=MIXED, world_size=dst.world_sizes())
def test_replicas_match_the_full_batch_reference(name, scenario, world_size):
    _check(name, scenario, world_size, {"reference"})


@pytest.mark.slow
@pytest.mark.parametrize("name", TARGETS)
@given(scenario=dst.scenarios(), world_size=dst.world_sizes())
def test_optimizer_state_matches_and_lives_where_it_should(name, scenario, world_size):
    _check(name, scenario, world_size, {"state"})


@pytest.mark.slow
@pytest.mark.parametrize("name", TARGETS)
@given(scenario=dst.scenarios(max_steps=2), world_size=dst.world_sizes(min_size=2))
def test_communication_stays_within_budget(name, scenario, world_size):
    _check(name, scenario, world_size, {"budget"})


@pytest.mark.slow
@pytest.mark.parametrize("name", TARGETS)
@given(scenario=dst.scenarios(max_accumulation=3), world_size=dst.world_sizes())
def test_no_sync_accumulation_equals_one_large_batch(name, scenario, world_size):
    assume(scenario.accumulation > 1)
    # The reference is one backward over the whole batch; the target accumulates micro-batches.
    _check(name, scenario, world_size, {"replicas", "reference"})
