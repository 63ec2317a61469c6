"""Fresh code for fresh runs: after a user edits a module the ranks imported, the next example
runs in a new world, on the new code, and ddpcheck says so once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.patience import patience

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_an_edited_target_module_gets_a_fresh_world(tmp_path):
    # One interpreter, as a notebook: check, edit the module on disk, reload it, check again.
    (tmp_path / "mytarget.py").write_text(
        textwrap.dedent("""
        from ddpcheck import targets
        class T(targets.ParallelDDPTarget):
            def after_backward(self, model, optimizer):
                model.finish_gradient_sync()
        TARGET = T()
    """)
    )
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent("""
        import importlib, os, pathlib, time
        import ddpcheck, mytarget

        if __name__ == "__main__":
            ddpcheck.check_example(mytarget.TARGET, ddpcheck.Scenario(), 2)
            first = ddpcheck.get_world(2).pids
            path = pathlib.Path(mytarget.__file__)
            path.write_text(path.read_text().replace(
                "model.finish_gradient_sync()", "pass  # the edit: no synchronisation at all"))
            os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
            importlib.reload(mytarget)
            try:
                ddpcheck.check_example(mytarget.TARGET, ddpcheck.Scenario(), 2)
            except ddpcheck.DdpcheckError as err:  # it raises at W=1 too: a set-up error
                print("JUDGED", type(err).__name__, str(err).splitlines()[0])
            print("FRESH", set(first).isdisjoint(ddpcheck.get_world(2).pids))
    """)
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=patience(300),
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FRESH True" in out.stdout
    assert "JUDGED" in out.stdout  # the new (broken) code is what was judged
    assert out.stderr.count("mytarget.py changed since the ranks imported it") == 1, out.stderr
