"""Ctrl-C in the checking process: held back while a process starts, raised again if Python lost
it, and let out of the API as the same ``KeyboardInterrupt`` in one line -- never swallowed.

Why: a ``KeyboardInterrupt`` lands between any two bytecodes. Landing inside ``Process.start``,
after the fork server had forked a rank but before this process learnt its pid, it left a rank
nobody knew to kill, which held multiprocessing's resource tracker open: the command printed
"interrupted", then waited for the tracker for as long as the rank lived. And ignoring SIGINT
while the fork server started (so that it inherits the ignoring) lost a Ctrl-C that came then:
the run went on to its end.

:func:`held`: inside the block, SIGINT (and SIGTERM, where the command line turned it into an
exception) is recorded instead of raised, then raised again, through the handler that was there,
as the block ends -- so a process started inside is either started and known, or not started.
Only the main thread runs Python's signal handlers; elsewhere the block changes nothing (a
``KeyboardInterrupt`` cannot land in another thread).

:func:`blocked_for_children`: SIGINT blocked in this thread while the block starts a process,
which begins with it blocked too (a blocked signal stays pending, never lost; the process then
ignores it and unblocks it: ``_rank.preload``, ``_rank.serve``) -- the way multiprocessing starts
its resource tracker. Here the blocked signal stays pending until the block ends.

:class:`Insistent`: a SIGINT handler that raises the ``KeyboardInterrupt`` again until someone
took it: Python loses one raised inside a gc or weakref callback, and code catching everything
swallows it or turns it into another error. The command line keeps one while it runs; a public
entry point keeps one while it runs in place of Python's own (:func:`insisting`).

:func:`interruptible`: a public entry point, out of which a Ctrl-C comes as the same
``KeyboardInterrupt``, saying in one line where it landed instead of ddpcheck's frames.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TypeVar

__all__ = ["AGAIN_AFTER", "Insistent", "blocked_for_children", "held", "insisting", "interruptible"]

F = TypeVar("F", bound=Callable[..., object])

#: The signals :func:`held` holds back, where their handler is Python code.
HELD = (signal.SIGINT, signal.SIGTERM)


def _python_handler(handler: object) -> bool:
    return callable(handler)  # not SIG_DFL or SIG_IGN (ints), not None (set outside Python)


@contextlib.contextmanager
def held(deliver: bool = True) -> Iterator[None]:
    """SIGINT and SIGTERM recorded while the block runs, then delivered to the handler that was
    there (``deliver=False``: dropped, for a block that is the way out already)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []

    def record(signum: int, frame: FrameType | None) -> None:
        if signum not in arrived:
            arrived.append(signum)

    previous = {}
    try:
        for signum in HELD:
            handler = signal.getsignal(signum)
            if _python_handler(handler):
                previous[signum] = handler
                signal.signal(signum, record)
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if deliver:
            for number in arrived:
                signal.raise_signal(number)  # raises here what the handler raises


@contextlib.contextmanager
def blocked_for_children() -> Iterator[None]:
    """SIGINT blocked in this thread while the block starts processes, which inherit the block
    (and keep it across ``exec``); call inside :func:`held`, which takes a SIGINT that arrives
    meanwhile as the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


#: Seconds between two deliveries of a Ctrl-C nobody has taken yet (:class:`Insistent`): longer
#: than a ``KeyboardInterrupt`` takes to unwind through ddpcheck's clean-ups (milliseconds; a
#: queued example let finish: at most 2 s, ``_runs.pipeline``), short beside the issue's "within
#: seconds".
AGAIN_AFTER = 2.0


class Insistent:
    """A SIGINT handler that raises ``KeyboardInterrupt``, and raises it again every
    :data:`AGAIN_AFTER` seconds until :meth:`taken` is called: the command line's while it runs,
    a public entry point's in place of Python's own (:func:`insisting`; a library takes no
    signal beyond that).

    Why: in 3 of 54 Ctrl-Cs at random moments of ``ddpcheck check`` (``bench/ctrl_c.py``) the
    ``KeyboardInterrupt`` was lost and the run went on to its end: Python drops an exception
    raised inside a gc callback (Hypothesis keeps one: "Exception ignored in ... gc_callback") or
    a weakref callback (the import system's module locks), and code that catches everything
    swallows it or turns it into another error (an interrupted ``import numpy.linalg`` came back
    as a ``RecursionError``). :attr:`came` says one came, whatever became of it."""

    def __init__(self, again_after: float = AGAIN_AFTER):
        self.came: float | None = None  # when the first Ctrl-C came
        self._again_after = again_after
        self._taken = threading.Event()
        self._lock = threading.Lock()  # once taken, no signal is sent any more

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.came is None:
            self.came = time.monotonic()
            threading.Thread(target=self._insist, name="ddpcheck-ctrl-c", daemon=True).start()
        raise KeyboardInterrupt

    def taken(self) -> None:
        """The ``KeyboardInterrupt`` arrived where it is handled: no more of them."""
        with self._lock:
            self._taken.set()

    def _insist(self) -> None:
        main = threading.main_thread().ident
        assert main is not None  # the main thread has started: it runs this program
        while not self._taken.wait(self._again_after):
            with self._lock:
                if not self._taken.is_set():
                    # a signal, not _thread.interrupt_main(): that one waits for the main
                    # thread to run Python code, and a wait without a timeout never returns
                    signal.pthread_kill(main, signal.SIGINT)


@contextlib.contextmanager
def insisting() -> Iterator[Insistent | None]:
    """While the block runs, Python's default SIGINT handler is an :class:`Insistent` one: the
    same ``KeyboardInterrupt``, raised again if it was lost. A caller's own handler, an ignored
    SIGINT, another thread, or an :class:`Insistent` in place already (the command line's, an
    entry point's inside another) are left as they are: then None."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield None
        return
    insistent = Insistent()
    signal.signal(signal.SIGINT, insistent)
    try:
        yield insistent
    finally:
        insistent.taken()
        signal.signal(signal.SIGINT, signal.default_int_handler)


def interruptible(fn: F) -> F:
    """``fn``, a public entry point, whose ``KeyboardInterrupt`` (``Terminated`` too) comes out
    as the same exception with one line saying where it landed instead of ddpcheck's frames --
    dozens of them, through Hypothesis and the worlds, for a Ctrl-C that is nobody's bug. The
    ranks of the example it interrupted were stopped on the way out; the persistent worlds stay
    for the next call (all of them stop at exit). While it runs, a Ctrl-C that Python lost is
    raised again (:func:`insisting`), and after one, whatever ``fn`` came to is the interrupt's.
    Every other exception passes through untouched (this frame adds two lines to a script's
    traceback; pytest hides it)."""
    name = f"ddpcheck.{fn.__name__}"

    @functools.wraps(fn)
    def entry_point(*args: object, **kwargs: object) -> object:
        __tracebackhide__ = True  # pytest leaves this frame out of its reports
        with insisting() as insistent:
            try:
                result = fn(*args, **kwargs)
            except KeyboardInterrupt as exc:
                if not exc.args:  # (an entry point inside another: the innermost one says it)
                    exc.args = (f"{name} was interrupted{_where(exc)}",)
                # the caught exception itself, from here; a Ctrl-C raised again while the first
                # was being handled (Insistent, on a slow machine) is the same interruption:
                # its context, the first one, is not shown as a second traceback
                raise exc.with_traceback(None) from None
            except BaseException as exc:
                if insistent is None or insistent.came is None:
                    raise
                # what a lost Ctrl-C left behind (an import it broke)
                raise KeyboardInterrupt(f"{name} was interrupted{_where(exc)}") from exc
            if insistent is not None and insistent.came is not None:
                raise KeyboardInterrupt(f"{name} was interrupted")  # lost on the way
            return result

    return entry_point  # type: ignore[return-value]


def _where(exc: BaseException) -> str:
    """`` (in FUNCTION, FILE:LINE)``: the innermost frame of ``exc``'s traceback."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return ""
    code = tb.tb_frame.f_code
    return f" (in {code.co_name}, {os.path.basename(code.co_filename)}:{tb.tb_lineno})"
