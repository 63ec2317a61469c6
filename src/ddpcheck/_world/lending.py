"""A thread that lends its waits: while it waits for ranks to answer it does nothing else, so
another thread whose work must not interleave with its own (torch's global random generator, the
caller's own hooks) may run then -- ``_runs.fuzz`` draws the next example in those waits."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["lending_waits", "released"]


class _Lender(threading.local):
    lock: threading.Lock | None = None
    held = False  # this thread holds the lock now


_lender = _Lender()


@contextlib.contextmanager
def lending_waits(lock: threading.Lock) -> Iterator[None]:
    """While the block runs, this thread holds ``lock`` -- except while it waits for ranks to
    answer, when it does nothing else: a thread whose work must not interleave with this one's
    (torch's global random generator, the caller's own hooks) gets those waits (``_runs.fuzz``
    draws the next example there). Also lends the waits of :func:`released`."""
    previous = (_lender.lock, _lender.held)
    _lender.lock, _lender.held = lock, False
    try:
        lock.acquire()
        _lender.held = True
        yield
    finally:
        if _lender.held:  # not when Ctrl-C came while it was taken back (released)
            lock.release()
        _lender.lock, _lender.held = previous


@contextlib.contextmanager
def released() -> Iterator[None]:
    """Inside :func:`lending_waits`: its lock released for the block (a wait of the caller's)."""
    lock = _lender.lock
    if lock is None or not _lender.held:
        yield
        return
    _lender.held = False
    lock.release()
    try:
        yield
    finally:
        lock.acquire()  # a Ctrl-C here leaves it released, and lending_waits knows
        _lender.held = True
