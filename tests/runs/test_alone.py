"""A failure that needs no data parallelism is the target's set-up error (issue 50, item 3):
exit 2 naming the hook and the traceback from the target's frame, never exit 1 -- and a failure
that needs a second rank stays exit 1.

Targets travel to the ranks by pickle: module-level classes here."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ddpcheck
from ddpcheck import cli, targets
from ddpcheck._rank import runner
from ddpcheck._runs.alone import TargetSetupError, raised_in, setup_error
from ddpcheck._world.failures import Failure, RankState, Status, WorldFailure
from ddpcheck._world.sequences import NO_COLLECTIVE
from ddpcheck.errors import ExitCode
from ddpcheck.scenario import Scenario

SCENARIO = Scenario(steps=1)


class WrapTypo(ddpcheck.Target):
    """A typo in the glue: wrap raises TypeError at every world size."""

    def wrap(self, module):
        return torch.nn.parallel.DistributedDataParallel(module, bucket_cap=1)


class RaisesAfterSync(targets.ParallelDDPTarget):
    """Synchronises, then raises at every world size: after collectives, outside set-up, so only
    the run at W=1 can show it needs no second rank."""

    def after_backward(self, model, optimizer):
        model.finish_gradient_sync()
        raise ValueError("the glue reads a key that is never there")


class RaisesWithPeers(targets.ParallelDDPTarget):
    """Raises only with peers (after its collectives): a data-parallel failure, exit 1."""

    def after_backward(self, model, optimizer):
        model.finish_gradient_sync()
        if dist.get_world_size() > 1:
            raise RuntimeError("only with several ranks")


class WrapRaisesWithPeers(ddpcheck.Target):
    """Raises in wrap, before any collective, only with peers -- as torch DDP's constructor does
    on parameters that differ across ranks: it needs W > 1, so it stays exit 1."""

    def wrap(self, module):
        if dist.get_world_size() > 1:
            raise TypeError("only with several ranks, in wrap")
        return module


def test_a_hook_raising_at_every_world_size_is_a_setup_error_naming_the_hook():
    for world_size in (1, 2):
        with pytest.raises(TargetSetupError) as caught:
            ddpcheck.check_example(WrapTypo(), SCENARIO, world_size)
        error, text = caught.value, str(caught.value)
        assert error.exit_code == ExitCode.SETUP and isinstance(error, ddpcheck.SetupError)
        assert error.hook == "wrap", text
        assert "WrapTypo fails without data parallelism: `wrap` (test_alone.py:" in text, text
        assert "TypeError:" in text and "bucket_cap" in text, text
        assert "not a data-parallel bug" in text and "in wrap" in text, text
        assert "rank_main" not in text, text  # the traceback from the target's frame on


def test_a_failure_after_collectives_is_confirmed_at_world_size_one():
    with pytest.raises(TargetSetupError) as caught:
        ddpcheck.check_example(RaisesAfterSync(), SCENARIO, 2)
    error, text = caught.value, str(caught.value)
    assert error.hook == "after_backward", text
    assert "raised ValueError at world size 2, and the same at world size 1" in text, text
    assert "the glue reads a key that is never there" in text, text


def test_a_failure_that_needs_peers_stays_a_verdict():
    with pytest.raises(ddpcheck.EquivalenceError) as caught:
        ddpcheck.check_example(RaisesWithPeers(), SCENARIO, 2)
    assert caught.value.exit_code == ExitCode.FOUND
    assert caught.value.kinds[0] == "rank failed", str(caught.value)
    assert "only with several ranks" in str(caught.value)


def test_the_command_line_exits_2_naming_the_hook(capsys):
    status = cli.main(
        ["check", "tests.runs.test_alone:WrapTypo()", "--examples", "1", "--world-sizes", "2"]
    )
    out = capsys.readouterr()
    assert status == ExitCode.SETUP, out.out + out.err
    assert "`wrap`" in out.err and "TypeError" in out.err and "diverged" not in out.out


def test_the_hook_is_the_first_frame_outside_ddpcheck_torch_and_the_standard_library():
    text = (
        "Traceback (most recent call last):\n"
        f'  File "{ddpcheck.__file__}", line 3, in rank_main\n    x()\n'
        f'  File "{torch.__file__}", line 9, in __call__\n    y()\n'
        '  File "/home/me/mydp.py", line 80, in _launch\n    z()\n'
        '  File "/home/me/other.py", line 5, in helper\n    w()\n'
        "KeyError: 'grad'\n"
    )
    raised = raised_in(text)
    assert raised is not None
    assert (raised.exception, raised.function, raised.line) == ("KeyError", "_launch", 80)
    assert raised.summary.startswith('  File "/home/me/mydp.py"')
    assert not raised.in_setup


def test_a_mutant_whose_bug_raises_without_peers_is_still_killed():
    """The mutant score counts it: ddpcheck caught the bug, as the target's set-up error."""
    from ddpcheck.mutation.search import ALONE, battery_search

    outcome = battery_search(WrapTypo(), 120.0, world_sizes=(1,))
    found = outcome.counterexample
    assert found is not None and found.kind == ALONE, outcome
    assert found.one_line().endswith(f"W=1: {ALONE} (`wrap`)"), found.one_line()


def test_a_setup_hook_raising_only_with_peers_stays_a_verdict():
    with pytest.raises(ddpcheck.EquivalenceError) as caught:
        ddpcheck.check_example(WrapRaisesWithPeers(), SCENARIO, 2)
    assert caught.value.kinds[0] == "rank failed", str(caught.value)


def _failure(world_size: int, function: str, collectives: str) -> WorldFailure:
    trace = (
        "Traceback (most recent call last):\n"
        f'  File "{runner.__file__}", line 284, in setup\n    x()\n'
        f'  File "/home/me/glue.py", line 9, in {function}\n    y()\n'
        "TypeError: bad\n"
    )
    ranks = [RankState(r, Status.RAISED, trace) for r in range(world_size)]
    return WorldFailure(Failure.RAISED, world_size, ranks, "example", None, collectives)


def test_where_w1_cannot_run_a_setup_hook_raising_before_any_collective_is_set_up():
    """The fallback ``_runs.example`` asks only where the example cannot run at W=1."""
    error = setup_error(WrapTypo(), SCENARIO, _failure(2, "wrap", NO_COLLECTIVE))
    assert error is not None and error.hook == "wrap" and error.world_size == 2
    assert "in a set-up hook before any collective, at world size 2" in str(error)
    after = "every rank issued the same 1 collectives; the last was index 0: broadcast"
    assert setup_error(WrapTypo(), SCENARIO, _failure(2, "wrap", after)) is None
