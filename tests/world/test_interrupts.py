"""Ctrl-C held back while ddpcheck starts a process, never lost (``_world.interrupts``).

A signal landing inside ``Process.start`` left a rank running that no world knew; ignoring SIGINT
while the fork server started (so that it inherits the ignoring) lost the Ctrl-C that came then.
Each test makes the signal land exactly there -- raised from inside the start -- and checks that
it still ends what runs, once what was started is known, and leaves nothing.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from multiprocessing import forkserver

import pytest

from ddpcheck._world import forking, interrupts
from ddpcheck._world.worlds import World
from tests.patience import patience

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@contextlib.contextmanager
def _ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt here, as in a terminal (a suite started in the background
    inherits it ignored)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers belong to the main thread")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_held_ctrl_c_is_raised_once_the_block_has_ended():
    ran = []
    with _ctrl_c_raises():
        with pytest.raises(KeyboardInterrupt), interrupts.held():
            signal.raise_signal(signal.SIGINT)
            ran.append("the rest of the block")
        assert ran == ["the rest of the block"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with interrupts.held(deliver=False):  # the way out already: dropped
            signal.raise_signal(signal.SIGINT)
        # pending while blocked, then held: not lost
        with pytest.raises(KeyboardInterrupt), interrupts.held(), interrupts.blocked_for_children():
            signal.raise_signal(signal.SIGINT)
            ran.append("blocked")
        assert ran[-1] == "blocked"


def _children(pid: int) -> set[int]:
    found = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.add(int(entry))
        except OSError:
            pass
    return found


def test_a_ctrl_c_while_a_rank_starts_leaves_no_rank_running(monkeypatch):
    """The signal lands after the fork server forked a rank, before the rank got what it runs
    (the issue's case: the rank then waited for its data for ever, holding the resource
    tracker's pipe). The world finishes starting what it must know to kill, then the Ctrl-C
    kills every rank."""
    server = forking._running_pid() if forking.start_method() == "forkserver" else None
    if server is None:
        pytest.skip("ranks are forked from ddpcheck's fork server only where it runs")
    forking.wait_ready(patience(60))
    before = _children(server)
    real = forkserver.connect_to_new_process
    calls = []

    def connect_to_new_process(fds):
        answer = real(fds)
        calls.append(1)
        if len(calls) == 1:
            signal.raise_signal(signal.SIGINT)
        return answer

    monkeypatch.setattr(forkserver, "connect_to_new_process", connect_to_new_process)
    world = World(2)
    with _ctrl_c_raises(), pytest.raises(KeyboardInterrupt):
        world.start()
    monkeypatch.undo()
    end = time.monotonic() + patience(5)
    while any(map(_alive, _children(server) - before)) and time.monotonic() < end:
        time.sleep(0.05)
    left = [pid for pid in _children(server) - before if _alive(pid)]
    for pid in left:  # never leave one, even when failing
        os.kill(pid, signal.SIGKILL)
    assert calls and not left, f"ranks left running after Ctrl-C: {left}"
    assert not world.alive and world.pids == []


FORK_SERVER_START = """
import os, signal, time
from multiprocessing import forkserver
from ddpcheck._world import forking

real = forkserver.ensure_running

def ensure_running():
    real()
    signal.raise_signal(signal.SIGINT)  # Ctrl-C lands while the server starts

forkserver.ensure_running = ensure_running
try:
    forking.start_method()
    print("lost", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
server = forking._running_pid()
os.kill(server, signal.SIGINT)  # a Ctrl-C to the group, while the server imports torch
time.sleep(0.5)
print("server", "alive" if forking._alive(server) else "dead", flush=True)
forking.stop()
print("stopped" if not forking._alive(server) else "left running", flush=True)
"""


def test_a_ctrl_c_while_the_fork_server_starts_is_not_lost():
    """It reaches the command once the server is started and known (so it is stopped at exit),
    and the server, importing torch, ignores it and the ones after."""
    out = subprocess.run(
        [sys.executable, "-c", FORK_SERVER_START],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=patience(60),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert out.stdout.split("\n")[:3] == ["interrupted", "server alive", "stopped"], (
        out.stdout + out.stderr
    )
    assert "KeyboardInterrupt" not in out.stderr, out.stderr  # not the server's either


TRACKER_HELD_OPEN = """
import os, time
from multiprocessing import resource_tracker
from ddpcheck import cli

resource_tracker.ensure_running()
pid = resource_tracker._resource_tracker._pid
child = os.fork()  # holds the tracker's pipe, as a half-started rank did
if child == 0:
    time.sleep(120)
    os._exit(0)
started = time.monotonic()
cli._stop_resource_tracker()
print(f"{time.monotonic() - started:.2f}", flush=True)
try:
    os.kill(pid, 0)
    print("tracker alive")
except ProcessLookupError:
    print("tracker gone")
os.kill(child, 9)
"""


def test_the_exit_waits_for_the_resource_tracker_within_a_deadline():
    """A process that still holds the tracker's pipe kept the exit waiting for as long as it
    lived (over 10 minutes after an interrupted start): now the tracker is killed after
    ``cli.TRACKER_DEADLINE``."""
    from ddpcheck.cli import TRACKER_DEADLINE

    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TRACKER_HELD_OPEN)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=patience(60),
    )
    seconds, state = out.stdout.split("\n")[:2]
    assert state == "tracker gone", out.stdout + out.stderr
    assert TRACKER_DEADLINE <= float(seconds) < TRACKER_DEADLINE + patience(2), out.stdout


def _deep(depth: int) -> None:
    if depth:
        _deep(depth - 1)
    raise KeyboardInterrupt


class _Terminated(KeyboardInterrupt):
    pass


def _terminated() -> None:
    raise _Terminated


def test_an_entry_point_lets_the_same_ctrl_c_out_in_one_line():
    """The KeyboardInterrupt (a subclass too: the command line's SIGTERM) goes on out of a
    public entry point, naming where it landed instead of ddpcheck's frames."""
    with pytest.raises(KeyboardInterrupt) as info:
        interrupts.interruptible(_deep)(20)
    line = _deep.__code__.co_firstlineno + 3  # its raise
    where = f"in _deep, test_interrupts.py:{line}"
    assert str(info.value) == f"ddpcheck._deep was interrupted ({where})"
    frames = [entry.name for entry in info.traceback]
    assert frames == ["test_an_entry_point_lets_the_same_ctrl_c_out_in_one_line", "entry_point"]
    with pytest.raises(_Terminated):
        interrupts.interruptible(_terminated)()


def test_a_ctrl_c_that_python_lost_is_raised_again(monkeypatch):
    """Python drops a KeyboardInterrupt raised inside a gc callback (Hypothesis keeps one): the
    command's handler raises it again until it has been taken."""
    insistent = interrupts.Insistent(again_after=0.3)

    def lose(phase, info):
        if phase == "start":
            signal.raise_signal(signal.SIGINT)  # "Exception ignored in: <function lose ...>"

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers belong to the main thread")
    lost = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: lost.append(unraisable))
    previous = signal.signal(signal.SIGINT, insistent)
    try:
        with pytest.raises(KeyboardInterrupt):  # raised again, within the test
            gc.callbacks.append(lose)
            try:
                gc.collect()
            finally:
                gc.callbacks.remove(lose)
            end = time.monotonic() + patience(5)
            while time.monotonic() < end:
                time.sleep(0.01)
        insistent.taken()
        assert [u.exc_type for u in lost][:1] == [KeyboardInterrupt]  # the first one was lost
        time.sleep(1.0)  # taken: no more
    finally:
        signal.signal(signal.SIGINT, previous)


def _loses_it(then: str) -> str:
    try:
        signal.raise_signal(signal.SIGINT)
    except KeyboardInterrupt:  # as code catching everything, or a gc callback, does
        pass
    if then == "raises":
        raise RecursionError("what an interrupted import left behind")
    time.sleep(patience(60))  # goes on with its work
    return "ended"


def test_an_entry_point_raises_a_lost_ctrl_c_again():
    """In a script (Python's own SIGINT handler, which the entry point keeps while it runs):
    the KeyboardInterrupt comes out all the same, and instead of what the loss left behind."""
    with _ctrl_c_raises():
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt, match=r"^ddpcheck\._loses_it was interrupted"):
            interrupts.interruptible(_loses_it)("runs on")
        assert time.monotonic() - started < interrupts.AGAIN_AFTER + patience(5)
        with pytest.raises(KeyboardInterrupt) as info:
            interrupts.interruptible(_loses_it)("raises")
        assert isinstance(info.value.__cause__, RecursionError)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back


def test_a_ctrl_c_raised_again_while_the_first_is_handled_reads_as_one_interruption():
    """On a slow machine the insistent handler may raise its second KeyboardInterrupt while the
    clean-up of the first still runs: a script's traceback then shows one, not two chained."""

    @interrupts.interruptible
    def cleaning_up_slowly() -> None:
        try:
            raise KeyboardInterrupt
        finally:
            raise KeyboardInterrupt  # the second, raised while the first is handled

    with pytest.raises(KeyboardInterrupt) as info:
        cleaning_up_slowly()
    shown = "".join(traceback.format_exception(info.value))
    assert "During handling of the above exception" not in shown, shown
    assert shown.count("Traceback (most recent call last)") == 1, shown
    assert "cleaning_up_slowly was interrupted (in cleaning_up_slowly" in shown, shown
