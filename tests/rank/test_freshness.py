"""Fresh code for fresh runs: after a user edits a module the ranks imported, the next example
runs in a new world, on the new code, and ddpcheck says so once."""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
import time

import pytest

import ddpcheck


@pytest.mark.slow
def test_an_edited_target_module_gets_a_fresh_world(tmp_path, monkeypatch, capfd):
    # One interpreter, as a notebook: check, edit the module on disk, reload it, check again.
    # This test process is that interpreter (its own process once cost ~8 s of CPU: an
    # interpreter, torch, a fork server); the module's name is its own, so no other test meets it.
    name = "edited_target_of_test_freshness"
    path = tmp_path / f"{name}.py"
    path.write_text(
        textwrap.dedent("""
        from ddpcheck import targets
        class T(targets.ParallelDDPTarget):
            def after_backward(self, model, optimizer):
                model.finish_gradient_sync()
        TARGET = T()
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    module = importlib.import_module(name)
    try:
        ddpcheck.check_example(module.TARGET, ddpcheck.Scenario(), 2)
        first = ddpcheck.get_world(2).pids
        path.write_text(
            path.read_text().replace(
                "model.finish_gradient_sync()", "pass  # the edit: no synchronisation at all"
            )
        )
        os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
        importlib.reload(module)
        # the new (broken) code is what is judged: it raises at W=1 too, a set-up error
        with pytest.raises(ddpcheck.DdpcheckError):
            ddpcheck.check_example(module.TARGET, ddpcheck.Scenario(), 2)
        assert set(first).isdisjoint(ddpcheck.get_world(2).pids)  # a fresh world
    finally:
        sys.modules.pop(name, None)
    err = capfd.readouterr().err
    assert err.count(f"{name}.py changed since the ranks imported it") == 1, err
