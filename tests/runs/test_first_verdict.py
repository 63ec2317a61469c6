"""The first verdict is minimal: a battery failure in ``ddpcheck check`` is followed by a search
for a smaller counterexample at its world size (``_runs.smaller``), and every verdict ends with
the features its counterexample exercises.

The search's refusals run on a stand-in for ``check_example`` (no world): a failure that passes
when run again, a hang, a slow machine or the search's own error leave the battery's verdict
standing, and a Ctrl-C goes through. One ``ddpcheck check`` of a seeded accumulation bug runs
in real worlds, in this process.
"""

from __future__ import annotations

import re

import pytest

from ddpcheck import cli, targets
from ddpcheck._runs import smaller
from ddpcheck._runs.replay import from_repr
from ddpcheck.battery import BATTERY
from ddpcheck.errors import Divergence, EquivalenceError, ExitCode, Inconclusive
from ddpcheck.models import ModelSpec, SpecData
from ddpcheck.scenario import Scenario
from tests.patience import patience

BATTERY_SCENARIO = dict(BATTERY)["sample-branch-accumulate"]
ACCUMULATION_BUG = "ddpcheck.mutation.catalogue:SumsEachMicroBatch()"


def _error(scenario, kind: str = "reference differs (gradient)") -> EquivalenceError:
    return EquivalenceError(
        [Divergence(0, 2, 0, "head.weight", kind)],
        scenario=scenario,
        world_size=2,
        target=targets.PARALLEL,
        replay="replay: -",
        name="sample-branch-accumulate",
    )


def _search(monkeypatch, check, battery=BATTERY_SCENARIO, **budget) -> smaller.Search:
    monkeypatch.setattr(smaller, "check_example", check)
    return smaller.smaller(
        targets.PARALLEL, _error(battery), world_sizes=(2,), **{"seconds": 5.0, **budget}
    )


def test_a_failure_needing_accumulation_is_shrunk_and_confirmed(monkeypatch):
    calls = []

    def check(target, scenario, world_size, *settings, **run):
        calls.append(scenario)
        if scenario.accumulation > 1:
            raise _error(scenario)
        return ()  # the notes of a pass

    search = _search(monkeypatch, check)
    assert search.error is not None, search.why
    shrunk = search.error.scenario
    assert shrunk.accumulation == 2 and shrunk.steps == 1 and shrunk.global_batch == 1, shrunk
    assert smaller.size(shrunk, 2) < smaller.size(BATTERY_SCENARIO, 2)
    assert calls[-1] == shrunk and calls.count(shrunk) == 2  # run once more: the confirmation


def test_a_batch_plan_broken_over_epochs_is_searched_among_epochs_alone(monkeypatch):
    # accelerate's ignored split_batches keyword breaks the batch plan and, in plain scenarios,
    # steps the LR schedule W times: the search must not trade the first for the second
    epochs = dict(BATTERY)["epochs-accumulate"]
    drawn = []

    def check(target, scenario, world_size, *settings, **run):
        drawn.append(scenario)
        if scenario.epochs is None:
            raise _error(scenario, "LR schedule differs")
        raise _error(scenario, "sample of another step")

    monkeypatch.setattr(smaller, "check_example", check)
    fed = _error(epochs, "sample of another step")
    search = smaller.smaller(targets.PARALLEL, fed, world_sizes=(2,), seconds=5.0)
    assert search.error is not None and search.error.kinds == ["sample of another step"]
    assert drawn and all(scenario.epochs is not None for scenario in drawn)


def test_a_checkpoint_that_failed_in_the_world_it_resumed_in_is_searched_there_too(monkeypatch):
    # checkpoint-resume at W=1 resumes at W=2: a bug of several ranks fails it "at W=1"
    resumed = dict(BATTERY)["checkpoint-resume"]
    found = EquivalenceError(
        [Divergence(0, 1, 0, "fc1.weight", "reference differs (gradient)")],
        scenario=resumed,
        world_size=1,
        target=targets.PARALLEL,
        replay="replay: -",
        name="checkpoint-resume",
    )
    assert smaller.searched_sizes(found) == (1, 2)

    def check(target, scenario, world_size, *settings, **run):
        if world_size == 2:
            raise _error(scenario)
        return ()  # the notes of a pass

    monkeypatch.setattr(smaller, "check_example", check)
    search = smaller.smaller(targets.PARALLEL, found, world_sizes=(1, 2, 3), seconds=5.0)
    assert search.error is not None and search.error.scenario.checkpoint_after is None, search


def test_a_failure_that_passes_when_run_again_leaves_the_battery_verdict(monkeypatch):
    seen: set[str] = set()

    def check(target, scenario, world_size, *settings, **run):  # fails the first time only: a race
        if repr(scenario) not in seen:
            seen.add(repr(scenario))
            raise _error(scenario)
        return ()  # the notes of a pass

    search = _search(monkeypatch, check)
    assert search.error is None and search.why.endswith("but it passed when run again (a race?)"), (
        search.why
    )


def test_a_failure_no_smaller_than_the_battery_leaves_its_verdict(monkeypatch):
    def check(target, scenario, world_size, *settings, **run):
        raise _error(scenario)

    smallest = Scenario(ModelSpec(width=2), data=SpecData(2), global_batch=1, steps=1)
    search = _search(monkeypatch, check, smallest, seconds=1.0)
    assert search.error is None and search.why.endswith("is no smaller"), search.why


@pytest.mark.parametrize(
    "raised, why",
    [
        (lambda s: _error(s, "rank timed out"), "no example drawn failed"),  # a hang: no verdict
        (
            lambda s: Inconclusive("the ranks were still working"),
            "the search stopped: Inconclusive",
        ),
        (lambda s: RuntimeError("ddpcheck's own bug"), "the search stopped: RuntimeError"),
    ],
)
def test_hangs_slowness_and_errors_in_the_search_leave_the_battery_verdict(
    monkeypatch, raised, why
):
    def check(target, scenario, world_size, *settings, **run):
        raise raised(scenario)

    search = _search(monkeypatch, check, examples=5, seconds=1.0)
    assert search.error is None and search.why.startswith(why), search.why


def test_a_search_that_fails_itself_leaves_the_battery_verdict(monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("no strategy")

    monkeypatch.setattr(smaller, "_strategy", broken)
    search = _search(monkeypatch, None)
    assert search.error is None and search.why == "the search failed: ValueError: no strategy"


def test_a_ctrl_c_in_the_search_is_raised(monkeypatch):
    def check(target, scenario, world_size, *settings, **run):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _search(monkeypatch, check)


def _printed_scenario(out: str) -> Scenario:
    return from_repr(re.search(r"^scenario: (.*)$", out, re.M).group(1))


@pytest.mark.slow
def test_check_shows_a_smaller_counterexample_than_the_battery_and_what_it_exercises(
    capsys, monkeypatch
):
    # ~2 s and 26 examples on a quiet machine; the budget scales with the machine's load
    monkeypatch.setattr(smaller, "SECONDS", patience(smaller.SECONDS))
    status = cli.main(["check", ACCUMULATION_BUG, "--world-sizes", "2"])
    out = capsys.readouterr().out
    assert status == ExitCode.FOUND, out
    assert (
        "battery: sample-branch-accumulate failed at world size 2 (reference differs "
        "(gradient)); searching for a smaller counterexample"
    ) in out, out
    assert "smaller counterexample found and confirmed" in out, out
    shrunk = _printed_scenario(out)
    assert smaller.size(shrunk, 2) < smaller.size(BATTERY_SCENARIO, 2), out
    assert f"--world-size 2 --scenario '{shrunk!r}'" in out  # its replay line
    *_, exercises, survey = out.rstrip().splitlines()
    assert exercises.startswith("the shrunk counterexample exercises: float64, accumulation, "), out
    assert survey.endswith(f"ddpcheck survey '{ACCUMULATION_BUG}' --world-sizes 2"), out


@pytest.mark.slow
def test_check_keeps_the_battery_verdict_when_the_search_finds_nothing(capsys, monkeypatch):
    monkeypatch.setattr(smaller, "EXAMPLES", 1)
    monkeypatch.setattr(smaller, "check_example", lambda *args, **kwargs: ())  # every one passes
    status = cli.main(["check", ACCUMULATION_BUG, "--world-sizes", "2"])
    out = capsys.readouterr().out
    assert status == ExitCode.FOUND, out
    assert "none found (1 example, " in out and "the battery scenario stands" in out, out
    assert _printed_scenario(out) == BATTERY_SCENARIO, out
    assert (
        "the battery scenario (not shrunk) exercises: float64, accumulation, uneven-batches, "
        "broadcast (what the bug needs is among them)"
    ) in out, out
