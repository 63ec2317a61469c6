"""The pytest plugin names the outcome of a failed test: a bug in the target (``ExitCode.FOUND``)
is never confused with a set-up problem, and the summary counts each."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from tests.patience import patience


def test_a_failed_test_says_which_outcome_it_was(tmp_path):
    (tmp_path / "test_user.py").write_text(textwrap.dedent("""
        import ddpcheck

        def test_setup():
            raise ddpcheck.InvalidArgument("world_sizes=(0,) must list positive integers")

        def test_nothing():
            raise ddpcheck.NothingChecked("every example was declined")

        def test_internal():
            raise ddpcheck.InternalError("ddpcheck's glue code for DeepSpeedTarget failed")

        def test_plain():
            assert 1 == 2
    """))
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                           "test_user.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=patience(120))
    out = done.stdout
    assert done.returncode == 1, out
    assert "ExitCode.SETUP: usage or set-up, not the target's fault" in out, out
    assert "ExitCode.NOTHING_CHECKED: nothing was checked" in out, out
    assert "ExitCode.INTERNAL: ddpcheck's own code failed, not a verdict" in out, out
    assert ("ddpcheck outcomes of failed tests: 1 INTERNAL (ddpcheck's own code failed, not a "
            "verdict on the target); 1 NOTHING_CHECKED (nothing was checked (every example "
            "skipped or declined)); 1 SETUP (usage or set-up, not the target's fault)" in out), out
