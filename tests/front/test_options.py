"""Options are promises: --world-sizes, --dtypes and --without constrain every world started and
every example run -- the built-in battery's included."""

from __future__ import annotations

import dataclasses
import re

import pytest

from ddpcheck import cli
from ddpcheck._runs.fuzz import fuzz
from ddpcheck._world.worlds import World
from ddpcheck.errors import ExitCode, NothingChecked
from ddpcheck.targets import PARALLEL, ParallelTarget


def _check(capsys, monkeypatch, *argv: str) -> tuple[str, list[int]]:
    started: list[int] = []
    start = World.start

    def recording(self, *args, **kwargs):
        started.append(self.world_size)
        return start(self, *args, **kwargs)

    monkeypatch.setattr(World, "start", recording)
    status = cli.main(["check", "local", *argv])
    out, err = capsys.readouterr()
    assert status == ExitCode.OK, out + err
    # off a terminal, a line per phase: this one before the battery, none per example (the
    # random examples' is "fuzzing ..." on stdout; tests/front/test_progress.py, the terminal)
    sizes = argv[argv.index("--world-sizes") + 1]
    assert err == (
        f"ddpcheck check local: starting worlds (world sizes {sizes}), then the "
        "battery: 17 scenarios at each\n"
    ), err
    return out, started


def _not_exercised(out: str) -> set[str]:
    found = re.search(r"not exercised: ([^)]*)\)", out.splitlines()[-1])
    return set(found.group(1).split(", ")) if found else set()


def test_world_sizes_start_no_other_world(capsys, monkeypatch):
    # the battery's checkpoint scenario resumes at W=2 elsewhere: here, in the world of 1
    out, started = _check(capsys, monkeypatch, "--world-sizes", "1", "--examples", "30")
    assert set(started) == {1}, started
    assert "checkpoint" not in _not_exercised(out), out


def test_dtypes_constrain_the_battery_and_the_random_examples(capsys, monkeypatch):
    out, _ = _check(
        capsys, monkeypatch, "--world-sizes", "1", "--examples", "20", "--dtypes", "float32"
    )
    assert "float64" in _not_exercised(out) and "float32" not in _not_exercised(out), out
    assert (
        "needs float64 (a dtype not checked: --dtypes is float64 alone by default, or "
        "--without excludes it)"
    ) in out, out


def test_without_constrains_the_battery_and_the_random_examples(capsys, monkeypatch):
    out, _ = _check(
        capsys,
        monkeypatch,
        "--world-sizes",
        "1",
        "--examples",
        "20",
        "--without",
        "accumulation,checkpoint,clipping",
    )
    assert {"accumulation", "checkpoint", "clipping"} <= _not_exercised(out), out


@dataclasses.dataclass(frozen=True)
class ShortRunsOnly(ParallelTarget):
    """The parallel target, declining runs of 3 steps or more (some of those drawn)."""

    def supports(self, scenario):
        return "runs of 3 steps or more" if scenario.steps >= 3 else None


SHORT_RUNS_ONLY = ShortRunsOnly()


def test_the_closing_line_counts_the_drawn_examples_the_target_declined(capsys):
    status = cli.main(
        [
            "check",
            "tests.front.test_options:SHORT_RUNS_ONLY",
            "--world-sizes",
            "1",
            "--examples",
            "10",
        ]
    )
    out = capsys.readouterr().out
    assert status == ExitCode.OK, out
    declined = re.search(
        r"and 10 random examples \((\d+) more drawn and declined by the target, "
        r"most often: runs of 3 steps or more\)",
        out.splitlines()[-1],
    )
    assert declined and int(declined.group(1)) > 0, out


def test_options_that_leave_nothing_to_draw_announce_no_random_examples(capsys):
    status = cli.main(["check", "parallel", "--world-sizes", "1", "--without", "float64"])
    out, err = capsys.readouterr()
    assert status == ExitCode.NOTHING_CHECKED, out + err
    assert "fuzzing" not in out, out
    cannot = "every dtype asked for (float64) is ruled out: float64 is excluded with --without"
    assert f"random examples: none can be drawn: {cannot}" in out, out
    assert err.strip().endswith(f"no random example can be drawn: {cannot}"), err
    with pytest.raises(NothingChecked, match=re.escape(cannot)):  # the API says the same
        fuzz(PARALLEL, world_sizes=(1,), without=("float64",))
