"""Focus (``--only``, ``only=``): every example checked exercises one of the features named --
the battery scenarios that do, random examples drawn to -- and a focus nothing can serve is
refused at the door (``_runs.admission``), before any process starts."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

import ddpcheck
from ddpcheck import features, targets
from ddpcheck import strategies as dst
from ddpcheck.battery import BATTERY
from ddpcheck.mutation import catalogue
from tests.patience import patience
from tests.processes import none_started


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(dst.examples(targets.PARALLEL, world_sizes=(1, 2, 3), only=("accumulation", "buffers")))
def test_every_drawn_example_exercises_a_feature_of_the_focus(example):
    scenario, world_size = example
    assert features.of(scenario, world_size) & {"accumulation", "buffers"}


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(dst.examples(targets.PARALLEL, world_sizes=(1, 2), only=("uneven-batches",)))
def test_a_feature_one_rank_cannot_exercise_is_drawn_where_it_can(example):
    scenario, world_size = example
    assert world_size == 2 and "uneven-batches" in features.of(scenario, world_size)


def test_the_battery_keeps_the_scenarios_that_exercise_the_focus():
    report = ddpcheck.assert_equivalent(
        targets.PARALLEL, world_sizes=(2,), only=("clipping",), deadline=patience(60)
    )
    clipping = {name for name, sc in BATTERY if "clipping" in features.of(sc, 2)}
    assert report.count >= 1 and {name for name, _, _ in report.examples} <= clipping
    skipped = {name: why for name, _, why in report.skipped}
    assert set(skipped) == {name for name, _ in BATTERY} - clipping, report.skipped
    # what the target declines says so first; the rest, that it is out of focus
    assert all(
        why == "exercises none of only=clipping" or why.startswith("needs ")
        for why in skipped.values()
    ), report.skipped


def test_random_examples_focused_on_accumulation_find_an_accumulation_bug():
    result = ddpcheck.fuzz(
        catalogue.by_name("SumsEachMicroBatch").target,
        examples=20,
        world_sizes=(2,),
        only=("accumulation",),
        deadline=patience(60),
    )
    assert result.found, result
    assert "accumulation" in features.of(result.error.scenario, result.error.world_size)


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: ddpcheck.assert_equivalent(targets.TORCH_DDP, only=("rank-orders",)),
            "only: TorchDDPTarget does not support 'rank-orders'",
        ),
        (  # an opt-in feature whose flag the target leaves unset: its class's own reason
            lambda: ddpcheck.fuzz(targets.TORCH_DDP, only=("param-dtype",), dtypes=("float32",)),
            r"only: TorchDDPTarget does not support 'param-dtype' \(TorchDDPTarget declines it: "
            "a param_dtype policy is the target's to apply",
        ),
        (
            lambda: ddpcheck.fuzz(targets.PARALLEL, only=("autocast",), without=("autocast",)),
            "only: 'autocast' is also in without",
        ),
        (
            lambda: ddpcheck.fuzz(targets.PARALLEL, only=("float32",), dtypes=("float64",)),
            "only: 'float32' needs float32, not among dtypes=float64",
        ),
        (
            lambda: ddpcheck.fuzz(targets.PARALLEL, only=("autocast",), dtypes=("float64",)),
            "only: 'autocast' needs float32, not among dtypes=float64",
        ),
    ],
)
def test_a_focus_nothing_can_serve_is_refused_before_any_process(call, message):
    with none_started(), pytest.raises(ddpcheck.InvalidArgument, match=message):
        call()
