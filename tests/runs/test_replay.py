"""Trustworthy verdicts, A: a failure's replay line rebuilds exactly the target that failed.

The replay line is the proof behind exit status 1, so it must never name another target: a
plain-class target is rebuilt from the arguments it was built with, a dataclass from its fields,
a module attribute by its name -- each verified by rebuilding it in this process -- and a target
that cannot be rebuilt is refused when the check starts, before any world runs.
"""

from __future__ import annotations

import functools
import os
import pickle
import shlex
import subprocess
import sys

import pytest

import ddpcheck
from ddpcheck import targets, zoo
from ddpcheck import check_example
from ddpcheck.cli import resolve_target
from ddpcheck._internal.runs.replay import evaluate, target_spec
from ddpcheck.scenario import Scenario
from tests import verdict_helpers as h
from tests.patience import patience

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _table(text: str) -> list[str]:
    """The divergence table of an EquivalenceError's message (header to the first blank line)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("step  W  rank"))
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


@pytest.fixture
def no_world(monkeypatch):
    """Fail the test if anything tries to start a world."""
    from ddpcheck._internal.world import worlds as world

    def refuse(*args, **kwargs):
        raise AssertionError("a world was started; the refusal should come first")

    monkeypatch.setattr(world, "get_world", refuse)


def test_a_plain_class_target_fails_and_its_replay_line_fails_the_same_way():
    scenario = Scenario(zoo.MLP)
    target = h.MyTarget(scale_bug=True)
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        check_example(target, scenario, 2)
    err = info.value
    assert "reference differs (gradient)" in err.kinds
    spec = "tests.verdict_helpers:MyTarget(scale_bug=True)"
    assert err.replay.startswith(f"python -m ddpcheck replay {shlex.quote(spec)} --world-size 2")
    assert f"replay: {err.replay}" in str(err)

    argv = shlex.split(err.replay)
    argv[0] = sys.executable
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=patience(300))
    assert out.returncode == 1, out.stdout + out.stderr
    assert _table(out.stdout) == _table(str(err))
    assert f"replay: {err.replay}" in out.stdout  # the replay prints the same line again

    # The line the harness used to print, MyTarget(), is a target without the bug: it passes.
    check_example(h.MyTarget(), scenario, 2)


@pytest.mark.parametrize("target, spec", [
    (h.SCALED, "tests.verdict_helpers:SCALED"),
    (targets.PARALLEL, "ddpcheck.targets:PARALLEL"),
    (h.MyTarget(), "tests.verdict_helpers:MyTarget()"),
    (h.MyTarget(True), "tests.verdict_helpers:MyTarget(True)"),
    (h.Positional(True, h.a_rule),
     "tests.verdict_helpers:Positional(True, tests.verdict_helpers.a_rule)"),
    (h.NoInit(), "tests.verdict_helpers:NoInit()"),
    (h.ScaledDataclass(rule=h.a_rule, scale=2.0),
     "tests.verdict_helpers:ScaledDataclass(rule=tests.verdict_helpers.a_rule, scale=2.0)"),
    (targets.ParallelTarget(bucket_size_mb=1.0),
     "ddpcheck.targets:ParallelTarget(bucket_size_mb=1.0)"),
    # a function field: the dataclass's repr (<function greedy at 0x...>) is not code
    (targets.ParallelTarget(sharding_rule=__import__("parallel.sharding").sharding.greedy),
     "ddpcheck.targets:ParallelTarget(sharding_rule=parallel.sharding.greedy)"),
])
def test_targets_round_trip_through_their_spec(target, spec):
    assert target_spec(target) == spec
    for rebuilt in (evaluate(spec), resolve_target(spec)):  # the command line's evaluation
        assert type(rebuilt) is type(target)
        assert _state(rebuilt) == _state(target)
    # A copy (what a rank unpickles) keeps the recorded call: it is replayable too, by its
    # call when it is no longer the module attribute itself.
    copy = pickle.loads(pickle.dumps(target))
    assert vars(copy).get("_ddpcheck_call") == vars(target).get("_ddpcheck_call")
    assert _state(evaluate(target_spec(copy))) == _state(target)


def _state(target):
    """A target's state: its attributes but the recorded call, pickled for comparison."""
    return pickle.dumps({k: v for k, v in vars(target).items() if k != "_ddpcheck_call"})


def test_a_class_without_init_still_takes_no_arguments():
    with pytest.raises(TypeError, match=r"NoInit\(\) takes no arguments"):
        h.NoInit(1)


def test_a_dataclass_target_configured_by_the_scenario_round_trips():
    configured = targets.PARALLEL.configure(Scenario(bucket_size_mb=2.0))
    assert target_spec(configured) == "ddpcheck.targets:ParallelTarget(bucket_size_mb=2.0)"


def _main_target():
    cls = type("InMain", (h.MyTarget,), {"__module__": "__main__"})
    setattr(sys.modules["__main__"], "InMain", cls)  # so that it pickles, as in a script
    return cls(scale_bug=True)


def _local_target():
    class Local(h.MyTarget):
        pass

    return Local(scale_bug=True)


def _mutated():
    target = h.MyTarget()
    target.scale_bug = True  # the call that built it no longer describes it
    return target


@pytest.mark.parametrize("make, phrases", [
    (lambda: h.MyTarget(scale_bug=h.Opaque()),
     ["target tests.verdict_helpers.MyTarget cannot be replayed",
      "does not evaluate (SyntaxError",
      "assign it to a module-level name (MY_TARGET = MyTarget(...)) in tests.verdict_helpers, or "
      "make MyTarget a dataclass whose fields hold its whole state"]),
    (_mutated,
     ["tests.verdict_helpers:MyTarget() builds a different target (scale_bug=True on the "
      "target, False rebuilt)"]),
    (lambda: h.ScaledDataclass(rule=functools.partial(h.a_rule)),  # picklable, repr not code
     ["target tests.verdict_helpers.ScaledDataclass cannot be replayed", "does not evaluate"]),
    (_main_target,
     ["its class InMain is defined in __main__ (the script being run)",
      "define the class in an importable module and import it into the script"]),
    (_local_target, ["cannot be pickled", "define the class at module level"]),
])
def test_an_unreplayable_target_is_refused_before_any_world(no_world, make, phrases):
    try:
        target = make()
        for check in (lambda: check_example(target, Scenario(), 2),
                      lambda: ddpcheck.assert_equivalent(target, world_sizes=(2,))):
            with pytest.raises(ddpcheck.InvalidArgument) as info:
                check()
            for phrase in phrases:
                assert phrase in str(info.value)
    finally:
        if hasattr(sys.modules["__main__"], "InMain"):
            delattr(sys.modules["__main__"], "InMain")


def test_a_target_changed_after_its_check_is_verified_again():
    target = h.MyTarget()
    assert target_spec(target) == "tests.verdict_helpers:MyTarget()"
    target.scale_bug = True
    with pytest.raises(ddpcheck.InvalidArgument, match="builds a different target"):
        target_spec(target)
