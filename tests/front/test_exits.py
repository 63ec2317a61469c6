"""Exit codes with one meaning each: 0 nothing found, 1 a counterexample in the target, 2 usage or
set-up (not the target's fault), 3 nothing was checked. Every case here is caught before a world
runs, so each must answer in seconds and without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import ddpcheck
from ddpcheck import targets

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class DeclinesEverything(targets.ParallelTarget):
    def supports(self, scenario):
        return "this target only runs on Tuesdays"


DECLINES_EVERYTHING = DeclinesEverything()


def _ddpcheck(*args: str, cwd: str = ROOT, env: dict | None = None):
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "ddpcheck", *args], capture_output=True,
                         text=True, timeout=120, cwd=cwd, env={**os.environ, **(env or {})})
    return out, time.perf_counter() - started


@pytest.mark.parametrize("source, message", [
    ("raise RuntimeError('no GPU here')\n", "RuntimeError: no GPU here"),
    ("def broken(:\n", "SyntaxError"),
])
def test_a_module_that_cannot_be_imported_is_a_setup_error(tmp_path, source, message):
    (tmp_path / "badmod.py").write_text(source)
    out, seconds = _ddpcheck("check", "badmod:T", cwd=str(tmp_path))
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr
    assert seconds < 5 + 10  # interpreter + torch import on a loaded 2-core machine


def test_worlds_that_cannot_fit_the_machine_are_refused_before_spawning():
    out, _ = _ddpcheck("check", "--world-sizes", "2,4096", "--examples", "1")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "would start 4096 rank processes" in out.stderr
    assert "Traceback" not in out.stderr


def test_an_unwritable_trace_output_is_refused_before_any_world_runs(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    (folder / "trace.json").mkdir()  # a directory where the file should go: never writable
    out, _ = _ddpcheck("trace", "-o", str(folder / "trace.json"))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "cannot be written" in out.stderr and "Traceback" not in out.stderr


def test_a_target_that_declines_everything_does_not_exit_0():
    out, _ = _ddpcheck("check", "tests.front.test_exits:DECLINES_EVERYTHING", "--examples",
                       "5")
    assert out.returncode == 3, out.stdout + out.stderr
    assert "nothing was checked" in out.stderr
    assert "only runs on Tuesdays" in out.stderr


def test_replaying_a_declined_scenario_checks_nothing():
    out, _ = _ddpcheck("replay", "tests.front.test_exits:DECLINES_EVERYTHING", "--world-size",
                       "2", "--scenario", "ddpcheck.Scenario(model=ddpcheck.zoo.MLP)")
    assert out.returncode == 3, out.stdout + out.stderr


def test_assert_equivalent_raises_nothing_checked_not_success():
    with pytest.raises(ddpcheck.NothingChecked, match="only runs on Tuesdays"):
        ddpcheck.assert_equivalent(DECLINES_EVERYTHING, world_sizes=(2,))
    assert issubclass(ddpcheck.NothingChecked, ddpcheck.SetupError)
    assert not issubclass(ddpcheck.SetupError, AssertionError)  # never a failed assertion


def test_help_states_the_exit_codes():
    out, _ = _ddpcheck("check", "--help")
    assert "3 nothing was checked" in out.stdout.replace("\n", " ").replace("  ", " ")
