"""How rank processes start: forked from a server that has imported torch, else spawned.

Why: a spawned rank imports torch and dynamo itself -- a W=2 world took ~2.4 s to start on the
2-core machine, a W=4 world ~4.6 s, and every world a failure replaces pays it again. Forked
from multiprocessing's fork server, which imported them once (``_rank.preload``), a
W=2 world starts in ~0.1 s. The server is started once per process, by ddpcheck (a rank's
output goes to its log: ``preload``); a fork server someone else started has other imports, so
ddpcheck spawns beside it instead.

What a fork server changes, and how it is kept as before: ranks are the server's children, not
this process's (``parent_of_ranks`` is what a rank checks to die with its parent); they inherit
the server's environment (a rank learns its world from its process name,
``_rank.serve.rank_name``); and the server's socket lives in multiprocessing's temporary
directory, which a janitor removes if this process dies without doing so (``leftovers``).
The server imports, of ddpcheck, only ``_rank.serve`` and what it needs (options, errors): every
other module a rank runs it imports after the fork, so an edited module reaches the next world.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
from multiprocessing import forkserver, resource_tracker, util

from ddpcheck._rank.serve import READY_ENV
from ddpcheck._world import interrupts
from ddpcheck._world.failures import WorldStartError
from ddpcheck._world.processes import environment

__all__ = [
    "PRELOAD",
    "booting",
    "forked",
    "leftovers",
    "parent_of_ranks",
    "start_method",
    "stop",
    "wait_ready",
]

#: The module the fork server imports before it forks any rank.
PRELOAD = "ddpcheck._rank.preload"

_LOCK = threading.Lock()
_started_pid: int | None = None  # the fork server ddpcheck started, while it runs
_has_forked = False  # ... and whether it has forked a rank yet (it has finished importing)
_ready_path: str | None = None  # the file the server creates once it has imported torch
_starts = 0

#: Seconds :func:`stop` waits for the killed server to be reaped (it takes milliseconds).
STOP_DEADLINE = 5.0


def _running_pid() -> int | None:
    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)


def start_method(warnings: str | None = None) -> str:
    """``"forkserver"`` once ddpcheck's fork server runs (started here on first use, or again if
    it died, with ``PYTHONWARNINGS=warnings`` for its imports), ``"spawn"`` where there is none
    to be had: not Linux (macOS has the start method, but forking after torch's import is why
    CPython spawns there), or a fork server someone else started in this process."""
    global _started_pid, _has_forked, _ready_path, _starts
    if (
        not sys.platform.startswith("linux")
        or "forkserver" not in multiprocessing.get_all_start_methods()
    ):
        return "spawn"
    with _LOCK:
        running = _running_pid()
        if running is not None and running != _started_pid:
            return "spawn"  # someone else's server: its imports are not ours
        if running is None:  # (a server that died keeps its preload list when restarted)
            multiprocessing.set_forkserver_preload([PRELOAD])
        _starts += 1  # a file of its own for a server (re)started by this call
        ready = os.path.join(util.get_temp_dir(), f"ddpcheck-forkserver-ready-{_starts}")
        # A Ctrl-C meanwhile is this process's once the server is started and known.
        with interrupts.held():
            # The tracker first: starting it unblocks SIGINT in this thread (multiprocessing's
            # way), and it must be known too (a Ctrl-C in its start left it unrecorded)
            resource_tracker.ensure_running()
            # Its output stays this process's: a process of the caller's own that the server
            # forks prints where the caller's do; a rank's goes to its log (``preload``). It
            # starts with SIGINT blocked, then ignores it (``preload``; the server itself
            # ignores it only after its imports).
            with (
                interrupts.blocked_for_children(),
                environment(
                    **{READY_ENV: ready}, **({"PYTHONWARNINGS": warnings} if warnings else {})
                ),
            ):
                forkserver.ensure_running()  # at once if it runs; restarted if it died
            if _running_pid() != running:  # started (again) just now
                _has_forked, _ready_path = False, ready
            _started_pid = _running_pid()
        return "forkserver"


def wait_ready(deadline: float) -> None:
    """Wait until ddpcheck's fork server has imported torch (forking a rank before blocks
    without a deadline), at most ``deadline`` seconds; raise :class:`WorldStartError` if it
    exits or takes longer."""
    if not booting() or _ready_path is None:
        return
    end = time.monotonic() + deadline
    while not os.path.exists(_ready_path):
        if not _alive(_started_pid):
            raise WorldStartError(
                "ddpcheck's fork server exited while importing torch; its output is above"
            )
        if time.monotonic() > end:
            raise WorldStartError(
                f"ddpcheck's fork server did not import torch within "
                f"{deadline:.0f} s; nothing was checked"
            )
        time.sleep(0.01)


def _alive(pid: int | None) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def booting() -> bool:
    """True from the start of ddpcheck's fork server until it has imported torch (or forked a
    rank): forking waits for those imports (~2.5 s), so a world launched now would block."""
    return (
        _started_pid is not None
        and not _has_forked
        and not (_ready_path is not None and os.path.exists(_ready_path))
    )


def forked() -> None:
    """A rank was forked: the server has finished importing."""
    global _has_forked
    _has_forked = True


def parent_of_ranks(method: str) -> int:
    """The pid a rank of ``method`` has as its parent (it dies with that process)."""
    if method == "forkserver":
        return _running_pid() or os.getpid()
    return os.getpid()


def leftovers(method: str) -> tuple[str, ...]:
    """What a world of ``method`` leaves if this process dies unannounced: the temporary
    directory holding the fork server's socket."""
    if method != "forkserver":
        return ()
    return (util.get_temp_dir(),)


def stop() -> None:
    """Stop the fork server ddpcheck started, at once (called at this process's exit, after every
    world is shut down). Left to itself, the server would notice only after its own imports
    (~3 s, for a command that ended in a set-up error) and then tear down torch's interpreter
    (~1 s) -- holding the caller's stdout open all that time, so ``ddpcheck ... | tee`` and a
    captured run waited for it after the verdict. It holds nothing but imports: SIGKILL loses
    nothing. A fork server someone else started is theirs to stop."""
    global _started_pid, _has_forked, _ready_path
    with _LOCK:
        pid = _running_pid()
        if pid is None or pid != _started_pid:
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _reap(pid, STOP_DEADLINE)  # our child: reaped here, not left a zombie
        _started_pid, _has_forked, _ready_path = None, False, None


def _reap(pid: int, deadline: float) -> None:
    """Wait for our child ``pid`` to exit, at most ``deadline`` seconds."""
    end = time.monotonic() + deadline
    while True:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] or time.monotonic() > end:
                return
        except ChildProcessError:  # reaped already
            return
        time.sleep(0.005)
