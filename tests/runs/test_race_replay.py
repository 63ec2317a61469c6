"""A possibly racy verdict's replay line never passes silently (issue 50, item 5): it repeats the
example (``--repeat N``, stopping at the first failure), and a replay that does not reproduce it
says "not reproduced in N runs: a race" with exit 5 (``Inconclusive``), never 0."""

from __future__ import annotations

import ddpcheck
from ddpcheck import cli, targets
from ddpcheck._base.errors import Divergence
from ddpcheck._runs import smaller
from ddpcheck._runs.replay import RACE_REPEATS, possibly_racy, replay_command
from ddpcheck.errors import ExitCode
from ddpcheck.scenario import Scenario

SCENARIO = Scenario(steps=1, bucket_size_mb=1e-6)  # one bucket per parameter: reads to race


def _verdict() -> ddpcheck.EquivalenceError:
    return ddpcheck.EquivalenceError(
        [Divergence(0, 2, 0, "fc1.weight", "replicas differ (gradient)")],
        scenario=SCENARIO,
        world_size=2,
        target=targets.PARALLEL,
        replay=replay_command(targets.PARALLEL, SCENARIO, 2),
    )


def test_a_racy_verdicts_replay_line_repeats_the_example():
    error = possibly_racy(_verdict())
    assert error.replay.endswith(f" --repeat {RACE_REPEATS}")
    assert f"replay: {error.replay}" in str(error)


def test_a_battery_verdict_whose_smaller_failure_raced_gets_the_repeating_line(monkeypatch):
    why = "a smaller example failed (head SGD B=1 steps=1), but it passed when run again (a race?)"
    monkeypatch.setattr(
        smaller, "smaller", lambda *a, **k: smaller.Search(None, 3, 0.1, why, raced=True)
    )
    found = _verdict()
    found.name = "mlp-sgd"
    said: list[str] = []
    verdict, _ = smaller.first_verdict(
        targets.PARALLEL,
        found,
        world_sizes=(2,),
        without=frozenset(),
        seed=None,
        say=said.append,
        run=ddpcheck._runs.settings.DEFAULT_SETTINGS,
    )
    assert verdict.replay.endswith(f"--repeat {RACE_REPEATS}"), verdict.replay


def test_a_replay_that_does_not_reproduce_says_so_and_never_exits_0(capsys):
    argv = ["replay", "parallel", "--world-size", "2", "--scenario", repr(SCENARIO)]
    assert cli.main([*argv, "--repeat", "2"]) == ExitCode.INCONCLUSIVE
    err = capsys.readouterr().err
    assert "not reproduced in 2 runs: a race" in err, err
    assert cli.main(argv) == ExitCode.OK  # one run, as every replay line without --repeat


def test_the_race_that_reads_before_wait_never_replays_to_0(capsys):
    spec = "ddpcheck.mutation.catalogue:ReadsBeforeWait()"
    argv = ["replay", spec, "--world-size", "2", "--scenario", repr(SCENARIO)]
    status = cli.main([*argv, "--repeat", str(RACE_REPEATS)])
    out = capsys.readouterr()
    assert status in (ExitCode.FOUND, ExitCode.INCONCLUSIVE), out.out + out.err
    if status == ExitCode.INCONCLUSIVE:
        assert f"not reproduced in {RACE_REPEATS} runs: a race" in out.err, out.err
    else:
        assert "ReadsBeforeWait diverged" in out.out, out.out
