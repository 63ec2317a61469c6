"""The pytest plugin names the outcome of a failed test: a bug in the target (``ExitCode.FOUND``)
is never confused with a set-up problem, and the summary counts each."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

from tests.patience import patience


def test_a_failed_test_says_which_outcome_it_was(tmp_path):
    (tmp_path / "test_user.py").write_text(
        textwrap.dedent("""
        import ddpcheck

        def test_setup():
            raise ddpcheck.InvalidArgument("world_sizes=(0,) must list positive integers")

        def test_nothing():
            raise ddpcheck.NothingChecked("every example was declined")

        def test_internal():
            raise ddpcheck.InternalError("ddpcheck's glue code for DeepSpeedTarget failed")

        def test_plain():
            assert 1 == 2
    """)
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "test_user.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=patience(120),
    )
    out = done.stdout
    assert done.returncode == 1, out
    assert "ExitCode.SETUP: usage or set-up, not the target's fault" in out, out
    assert "ExitCode.NOTHING_CHECKED: nothing was checked" in out, out
    assert "ExitCode.INTERNAL: ddpcheck's own code failed, not a verdict" in out, out
    assert (
        "ddpcheck outcomes of failed tests: 1 INTERNAL (ddpcheck's own code failed, not a "
        "verdict on the target); 1 NOTHING_CHECKED (nothing was checked (every example "
        "skipped or declined)); 1 SETUP (usage or set-up, not the target's fault)" in out
    ), out


def _sections(out):
    """Each failed test's report, by test name."""
    parts = re.split(r"^_{3,} (test_\w+) _{3,}$", out, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


@pytest.mark.slow
def test_a_failed_tests_traceback_stops_at_its_call_into_ddpcheck(tmp_path):
    (tmp_path / "test_user.py").write_text(
        textwrap.dedent("""
        import ddpcheck
        from ddpcheck import features, targets

        class Glue(ddpcheck.Target):
            def supports(self, scenario):
                raise ddpcheck.InternalError("ddpcheck's glue failed")

        def test_outcome():
            ddpcheck.assert_equivalent(targets.LOCAL, world_sizes=(0,))

        def test_internal():
            features.declines(Glue(), ddpcheck.Scenario(ddpcheck.zoo.MLP))
    """)
    )
    for tb in ("auto", "short"):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-p",
                "no:cacheprovider",
                f"--tb={tb}",
                "test_user.py",
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=patience(120),
        )
        sections = _sections(done.stdout)
        outcome, internal = sections["test_outcome"], sections["test_internal"]
        # the test's own line, then the outcome: no file, line or source of ddpcheck's
        assert "ddpcheck.assert_equivalent(targets.LOCAL, world_sizes=(0,))" in outcome, outcome
        assert re.search(
            r"^E +ddpcheck\.errors\.InvalidArgument: world_sizes=\(0,\) contains 0", outcome, re.M
        ), outcome
        assert "ddpcheck/" not in outcome and "def " not in outcome.replace("def test_", ""), (
            outcome
        )
        # ddpcheck's own failure keeps its frames: they are the evidence
        assert "ddpcheck/targets/support.py" in internal, internal
        assert "why = target.supports(scenario)" in internal, internal
