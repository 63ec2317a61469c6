"""How rank processes start: forked from a server that has imported torch, else spawned.

Why: a spawned rank imports torch and dynamo itself -- a W=2 world took ~2.4 s to start on the
2-core machine, a W=4 world ~4.6 s, and every world a failure replaces pays it again. Forked
from multiprocessing's fork server, which imported them once (``_internal.rank.preload``), a
W=2 world starts in ~0.1 s. The server is started once per process, by ddpcheck (a rank's
output goes to its log: ``preload``); a fork server someone else started has other imports, so
ddpcheck spawns beside it instead.

What a fork server changes, and how it is kept as before: ranks are the server's children, not
this process's (``parent_of_ranks`` is what a rank checks to die with its parent); they inherit
the server's environment (a rank learns its world from its process name,
``rank.serve.rank_name``); and the server's socket lives in multiprocessing's temporary
directory, which a janitor removes if this process dies without doing so (``leftovers``).
The server imports, of ddpcheck, only ``rank.serve`` and what it needs (options, errors): every
other module a rank runs it imports after the fork, so an edited module reaches the next world.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from multiprocessing import forkserver, util

from ddpcheck._internal.world.processes import environment

__all__ = ["PRELOAD", "booting", "forked", "leftovers", "parent_of_ranks", "start_method"]

#: The module the fork server imports before it forks any rank.
PRELOAD = "ddpcheck._internal.rank.preload"

_LOCK = threading.Lock()
_started_pid: int | None = None  # the fork server ddpcheck started, while it runs
_has_forked = False  # ... and whether it has forked a rank yet (it has finished importing)


def _running_pid() -> int | None:
    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)


def start_method(warnings: str | None = None) -> str:
    """``"forkserver"`` once ddpcheck's fork server runs (started here on first use, or again if
    it died, with ``PYTHONWARNINGS=warnings`` for its imports), ``"spawn"`` where there is none
    to be had."""
    global _started_pid, _has_forked
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    with _LOCK:
        running = _running_pid()
        if running is not None and running != _started_pid:
            return "spawn"  # someone else's server: its imports are not ours
        if running is None:
            multiprocessing.set_forkserver_preload([PRELOAD])
            _has_forked = False
        # Its output stays this process's: a process of the caller's own that the server forks
        # prints where the caller's do; a rank's goes to its log (``preload``).
        with environment(**({"PYTHONWARNINGS": warnings} if warnings else {})):
            forkserver.ensure_running()  # at once if it runs; restarted if it died
        if _running_pid() != running:
            _has_forked = False
        _started_pid = _running_pid()
        return "forkserver"


def booting() -> bool:
    """True from the start of ddpcheck's fork server until it forks its first rank: forking
    waits for its imports (~2.5 s), so a world launched now would block this process."""
    return _started_pid is not None and not _has_forked


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
