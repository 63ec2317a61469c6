"""The loop hooks on real worlds, no framework needed: a target that owns its loop
(``Target.fit``), sharded gradients recorded from their owners, and what a broken integration of
either is told."""

from __future__ import annotations

import pytest
import torch

import ddpcheck
from ddpcheck import targets, zoo
from ddpcheck.mutation.broken_loop import EngineTarget, Zero2Target
from ddpcheck.scenario import Scenario
from tests.targets.own_loop import HalfOwnedZero2, HandLoopTarget

#: micro-batches, a schedule, clipping, Adam state, uneven shards: every hook has work
BUSY = Scenario(
    zoo.SampleBranch,
    optimizer=torch.optim.Adam,
    optimizer_kwargs={"lr": 0.01},
    lr_decay=0.5,
    global_batch=7,
    steps=2,
    accumulation=2,
    max_grad_norm=1.0,
)


def test_a_target_that_owns_its_loop_is_recorded_at_every_step_it_reports():
    ddpcheck.check_example(HandLoopTarget(), BUSY, 2)
    with pytest.raises(ddpcheck.SetupError) as info:
        ddpcheck.check_example(HandLoopTarget(record_every=2), BUSY, 2)
    assert "fails without data parallelism" in str(info.value), str(info.value)
    assert "recorded 1 of the scenario's 2 step(s)" in str(info.value)


def test_the_engine_idiom_steps_after_every_micro_batch_and_holds():
    # step(), the schedule and zero_grad() after each micro-batch, gated; backward reduces
    ddpcheck.check_example(EngineTarget(), BUSY, 3)


def test_sharded_gradients_are_judged_as_their_owners_hold_them():
    plain = Scenario(
        zoo.Tied,
        optimizer=torch.optim.Adam,
        optimizer_kwargs={"lr": 0.01},
        global_batch=5,
        steps=2,
        accumulation=2,
    )
    ddpcheck.check_example(Zero2Target(), plain, 3)  # non-owners keep their local gradients
    with pytest.raises(ddpcheck.SetupError) as info:
        ddpcheck.check_example(HalfOwnedZero2(), plain, 2)
    assert "fails without data parallelism" in str(info.value), str(info.value)
    assert "are owned by no rank" in str(info.value)


class ClipsWithTheDefault(Zero2Target):
    """Averages gradients in ``step()`` yet claims clipping with the default hook, which cannot
    clip there."""

    supported_features = Zero2Target.supported_features | {"clipping"}


def test_a_default_hook_that_cannot_serve_the_target_declines_the_example():
    # (it raised NotImplementedError in the ranks: a rank error, read as the target's bug)
    with pytest.raises(ddpcheck.NothingChecked, match="averages gradients inside optimizer"):
        ddpcheck.check_example(ClipsWithTheDefault(), BUSY, 2)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: ddpcheck.models.Layer(kind="lstm"), "kind='lstm' must be one of"),
        (lambda: ddpcheck.models.Layer(use="often"), "use='often' must be one of"),
        (lambda: ddpcheck.models.ModelSpec(width=1), "width=1 must be at least 2"),
        (
            lambda: ddpcheck.models.ModelSpec(layers=(ddpcheck.models.Layer(),), registration=(1,)),
            "must be a permutation",
        ),
        (lambda: zoo.GPTConfig(width=3, heads=2), "width must be a positive multiple of heads"),
    ],
)
def test_the_scenario_language_refuses_with_its_own_outcome(build, message):
    with pytest.raises(ddpcheck.InvalidArgument, match=message):
        build()


class ShardedWithoutOwners(targets.ParallelTarget):
    """Declares sharded gradients, keeps the default owners, and its optimizer names none."""

    sharded_gradients = True

    def make_optimizer(self, params, optimizer_cls, **kwargs):
        return optimizer_cls(params, **kwargs)

    def after_backward(self, model, optimizer):
        model.finish_gradient_sync()


def test_a_default_hook_the_target_set_up_wrong_is_its_set_up_not_a_verdict():
    # (a TypeError in the ranks: a rank error, read as the target's bug)
    with pytest.raises(ddpcheck.InvalidArgument, match="declares sharded_gradients, but SGD has"):
        ddpcheck.check_example(ShardedWithoutOwners(), Scenario(zoo.Tied, steps=1), 2)
