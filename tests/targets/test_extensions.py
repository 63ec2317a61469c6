"""A lock a killed C++ extension build left is removed, and only that one: a lock a live process
holds stays (``ddpcheck.targets.extensions``). Issue 37: DeepSpeed's op build killed at a deadline
left ``lock`` in its build directory, and every later build waited for it forever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from torch.utils.file_baton import FileBaton

from ddpcheck.targets.extensions import LOCK, build_directory, held_open, remove_stale_lock
from tests.patience import patience

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc (Linux)")

#: What torch's FileBaton.try_acquire does, then waits to be killed mid-"build".
_BUILDER = (
    "import os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)\n"
    "print('holding', flush=True)\n"
    "time.sleep(600)\n"
)


def _builder(lock: str) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", _BUILDER, lock], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "holding"
    return process


def test_the_lock_of_a_killed_build_is_removed_and_the_next_build_proceeds(tmp_path):
    lock = str(tmp_path / LOCK)
    process = _builder(lock)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=patience(30))
    assert os.path.exists(lock) and held_open(lock) is False
    assert remove_stale_lock(str(tmp_path)) is True
    assert not os.path.exists(lock)
    baton = FileBaton(lock)  # torch's own: the next build takes its turn at once
    assert baton.try_acquire()
    baton.release()


def test_a_lock_a_live_build_holds_stays(tmp_path):
    lock = str(tmp_path / LOCK)
    process = _builder(lock)
    try:
        assert held_open(lock) is True
        assert remove_stale_lock(str(tmp_path)) is False
        assert os.path.exists(lock)
    finally:
        process.kill()
        process.wait(timeout=patience(30))
    assert remove_stale_lock(str(tmp_path)) is True  # its holder is gone now
    baton = FileBaton(lock)  # held here, in this process, as torch's builder holds it
    assert baton.try_acquire()
    try:
        assert remove_stale_lock(str(tmp_path)) is False
    finally:
        baton.release()


def test_no_lock_nothing_to_do_and_the_build_folder_is_torchs(tmp_path, monkeypatch):
    assert remove_stale_lock(str(tmp_path)) is False
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build_directory("some_op") == str(tmp_path / "some_op")
