"""Options are promises: --world-sizes, --dtypes and --without constrain every world started and
every example run -- the built-in battery's included."""

from __future__ import annotations

import re

from ddpcheck import cli
from ddpcheck._internal.world.worlds import World
from ddpcheck.errors import ExitCode


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
    assert err == (f"ddpcheck check local: starting worlds (world sizes {sizes}), then the "
                   "battery: 15 scenarios at each\n"), err
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
    out, _ = _check(capsys, monkeypatch, "--world-sizes", "1", "--examples", "20",
                    "--dtypes", "float32")
    assert "float64" in _not_exercised(out) and "float32" not in _not_exercised(out), out
    assert ("needs float64 (a dtype not checked: --dtypes is float64 alone by default, or "
            "--without excludes it)") in out, out


def test_without_constrains_the_battery_and_the_random_examples(capsys, monkeypatch):
    out, _ = _check(capsys, monkeypatch, "--world-sizes", "1", "--examples", "20",
                    "--without", "accumulation,checkpoint,clipping")
    assert {"accumulation", "checkpoint", "clipping"} <= _not_exercised(out), out
