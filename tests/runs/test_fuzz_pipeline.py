"""``fuzz`` runs its random examples one behind the other (``_runs.pipeline``) and shrinks the
first failure in a second Hypothesis run that draws the same examples: the verdicts are those of
examples run one at a time."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

import ddpcheck
from ddpcheck import targets
from ddpcheck._runs import engine
from ddpcheck._runs.admission import Settings
from ddpcheck._runs.fuzz import fuzz
from ddpcheck._runs.pipeline import Outcome
from ddpcheck.errors import Inconclusive
from ddpcheck.mutation.catalogue import by_name
from ddpcheck.scenario import Scenario
from tests.patience import patience

_RUNS_IN_THIS_PROCESS = [0]


class FailsOnlyTheFirstTime(targets.ParallelTarget):
    """Gradients doubled in the first example each rank process runs, right afterwards."""

    def after_backward(self, model, optimizer):
        super().after_backward(model, optimizer)
        if _RUNS_IN_THIS_PROCESS[0] == 0:
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(2)

    def after_step(self, model, optimizer):
        _RUNS_IN_THIS_PROCESS[0] += 1
        return super().after_step(model, optimizer)


FAILS_ONLY_THE_FIRST_TIME = FailsOnlyTheFirstTime()


def test_the_examples_and_their_order_are_those_drawn_one_at_a_time(monkeypatch):
    """Every scenario Hypothesis draws runs, once, in the order drawn: the same list a run
    that judged each example before drawing the next (seeded) gets."""
    ran = []
    run = engine.one_behind_the_other

    def recording(items, settings, **kwargs):
        for item, outcome in run(items, settings, **kwargs):
            ran.append(item[1:])
            yield item, outcome

    monkeypatch.setattr(engine, "one_behind_the_other", recording)
    result = fuzz(targets.PARALLEL, examples=12, world_sizes=(2, 3), seed=5)
    assert not result.found and result.examples == len(ran) == 12
    drawn = []

    def drawing(items, settings, **kwargs):  # what the drawing thread hands over, nothing run
        for item in items:
            drawn.append(item[1:])
            yield item, Outcome()

    monkeypatch.setattr(engine, "one_behind_the_other", drawing)
    fuzz(targets.PARALLEL, examples=12, world_sizes=(2, 3), seed=5)
    assert drawn == ran


@pytest.mark.slow
def test_the_first_failure_is_drawn_again_and_shrunk():
    result = fuzz(by_name("NoDivide").target, examples=50, world_sizes=(2,), seed=1)
    assert result.found and "intermittent" not in str(result.error)
    # shrinking ran examples beyond the first failure: the second run reached and reproduced it
    assert result.examples > result.first_failure


def test_a_failure_that_does_not_fail_again_is_reported_as_intermittent():
    result = fuzz(FAILS_ONLY_THE_FIRST_TIME, examples=5, world_sizes=(1,), seed=2)
    assert result.found and result.first_failure == 1
    assert "intermittent" in str(result.error)


@dataclasses.dataclass(frozen=True)
class HangsOnlyTheFirstTime(targets.ParallelTarget):
    """Rank 1 waits for nothing (asleep, as in a deadlock) in the first example any rank of any
    world runs -- the first to create ``marker`` -- and never again."""

    marker: str = ""
    every_time: bool = False

    def after_backward(self, model, optimizer):
        if dist.get_rank() == 1 and (self.every_time or self._first()):
            time.sleep(3600)
        super().after_backward(model, optimizer)

    def _first(self) -> bool:
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return False
        return True


@pytest.mark.slow
def test_a_hang_that_does_not_recur_is_no_verdict(tmp_path):
    target = HangsOnlyTheFirstTime(marker=str(tmp_path / "hung"))
    with pytest.raises(Inconclusive) as info:
        fuzz(target, examples=5, world_sizes=(2,), seed=2, deadline=patience(2))
    text = str(info.value)
    assert "intermittent" not in text, text
    assert "hung once (its ranks waiting, not working), then passed" in text, text
    assert "in after_backward" in text, text  # the stacks of the hang, for the record


@pytest.mark.slow
def test_assert_equivalent_reports_a_hang_only_once_it_hung_twice(tmp_path):
    once = HangsOnlyTheFirstTime(marker=str(tmp_path / "hung"))
    with pytest.raises(Inconclusive, match="hung once"):
        ddpcheck.assert_equivalent(once, Scenario(), world_sizes=(2,), deadline=patience(2))
    always = HangsOnlyTheFirstTime(every_time=True)
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        ddpcheck.assert_equivalent(always, Scenario(), world_sizes=(2,), deadline=patience(2))
    assert info.value.kinds == ["rank timed out"]


class LeavesAThread(targets.ParallelTarget):
    """Every example leaves a thread running in each rank: its world is replaced after it."""

    def after_step(self, model, optimizer):
        threading.Thread(target=threading.Event().wait, daemon=True).start()
        return super().after_step(model, optimizer)


LEAVES_A_THREAD = LeavesAThread()


@pytest.mark.slow
def test_an_example_queued_in_a_world_then_replaced_runs_again_in_a_new_one():
    """Each example's world is replaced once it is judged, so the example queued behind it is
    lost every time and runs again, alone, in a new world -- never judged from the old one, and
    never out of order with the one queued next."""
    result = fuzz(LEAVES_A_THREAD, examples=3, world_sizes=(2,), seed=4)
    assert not result.found and result.examples == 3, result
    assert any("new world" in note for note in result.notes), result.notes


@pytest.mark.slow
def test_checkpoint_examples_run_in_halves_behind_each_other_with_the_verdicts_of_one_alone(
    monkeypatch,
):
    """A scenario with ``checkpoint_after`` is queued like any other: its second half is
    submitted once its reference is computed, before the next example is launched (which then
    runs behind it, or beside it in the resumed world of another size) -- and every example gets
    the verdict it gets alone: a pass, a resumed world's rank failure, a checkpoint bug's rows."""
    from ddpcheck._runs import example, pipeline
    from ddpcheck.battery import BATTERY
    from ddpcheck.errors import EquivalenceError
    from tests.runs.test_checkpoint import LoadFailsOnRank1, _resumed

    calls = []
    for name in ("launch", "resume"):
        real = getattr(pipeline, name)

        def recording(launched_or_target, *args, _real=real, _name=name, **kwargs):
            calls.append(_name if _name == "launch" else f"resume {launched_or_target.resumes}")
            return _real(launched_or_target, *args, **kwargs)

        monkeypatch.setattr(pipeline, name, recording)
    plain = dict(BATTERY)["mlp-sgd"]
    items = [(0, 2, _resumed(at=3)), (1, 2, plain), (2, 2, _resumed(at=None)), (3, 2, plain)]

    def verdicts(target):
        out = []
        for _, outcome in pipeline.one_behind_the_other(
            items, Settings(deadline=60.0), target_of=lambda _: target
        ):
            assert outcome.skipped is None, outcome
            out.append(
                None
                if outcome.error is None
                else [(r.step, r.world_size, r.rank, r.kind) for r in outcome.error.divergences]
            )
        return out

    assert verdicts(targets.PARALLEL) == [None] * 4
    # each checkpoint example resumed right after its reference, before the next one launched
    assert calls == ["launch", "resume True", "launch", "resume False"] * 2
    # a rank of the resumed world fails (its world is replaced, and the example queued behind
    # it runs again in a new one), as check_example reports it alone (test_checkpoint.py)
    assert verdicts(LoadFailsOnRank1()) == [
        [("-", 3, 1, "rank failed")],
        None,
        [("-", 2, 1, "rank failed")],
        None,
    ]
    forgets = by_name("ForgetsScheduler").target
    alone = []
    for _, world_size, scenario in items[:3:2]:
        with pytest.raises(EquivalenceError) as caught:
            example.check_example(forgets, scenario, world_size)
        alone.append([(r.step, r.world_size, r.rank, r.kind) for r in caught.value.divergences])
    assert verdicts(forgets) == [alone[0], None, alone[1], None]
