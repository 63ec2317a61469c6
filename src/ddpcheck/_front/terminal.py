"""The command line's progress line: on a terminal, one live line from the first second to the
verdict (start-up, the battery, the random examples), its seconds ticking while nothing reports,
so a quiet minute on a loaded machine never looks like a hang; elsewhere one line per phase, since
a log has no use for a line per example.

Only the front door writes to the terminal: the run layers report progress through callbacks
(``assert_equivalent(progress=...)``, ``fuzz(progress=...)``, ``survey(progress=...)``) and the
command line turns them into this line. Imports no torch: the line is up before torch loads
(~1.5 s quiet, 4 s on a loaded machine).
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

__all__ = ["ProgressLine"]

#: Seconds between redraws while no progress is reported (the elapsed time moves on).
TICK = 1.0
#: Erase the terminal line the cursor is on, from its start.
_ERASE = "\r\033[K"


class ProgressLine:
    """What a command is doing now, on ``stream`` (stderr): :meth:`show` rewrites the live line
    on a terminal; :meth:`phase` also says it in one line off a terminal; output of any other
    kind goes inside :meth:`paused`, which lifts the line off while it is written."""

    def __init__(
        self,
        stream: TextIO | None = None,
        started: float | None = None,
        report: TextIO | None = None,
    ):
        self.stream = stream if stream is not None else sys.stderr
        # Not live where the report goes through a pipe (`ddpcheck check | tee log`): what reads
        # it may print to this terminal after the line is drawn again, onto the same row.
        self.live = _is_terminal(self.stream) and not _is_pipe(
            report if report is not None else sys.stdout
        )
        self.started = time.monotonic() if started is None else started
        self._text = ""
        self._shown = False  # the live line is on the screen
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._ticker: threading.Thread | None = None

    def show(self, text: str) -> None:
        """On a terminal, the live line says ``text`` from now on (with the seconds elapsed)."""
        if not self.live or self._closed.is_set():
            return
        with self._lock:
            self._text = text
            self._draw()
        if self._ticker is None:
            self._ticker = threading.Thread(
                target=self._tick, name="ddpcheck-progress", daemon=True
            )
            self._ticker.start()

    def phase(self, text: str, line: str) -> None:
        """A phase begins: ``text`` on the live line, or ``line`` printed once off a terminal."""
        if self.live:
            self.show(text)
        elif not self._closed.is_set():
            with self._lock:
                self._write(line + "\n")

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Other output (a report line on stdout): the live line is erased first and drawn
        again below it, so the two never share a line."""
        with self._lock:
            self._erase()
            try:
                yield
            finally:
                with contextlib.suppress(OSError, ValueError):
                    sys.stdout.flush()
                self._draw()

    def close(self) -> None:
        """No more progress: the live line is erased and the ticking stops."""
        self._closed.set()
        with self._lock:
            self._erase()
            self._text = ""
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join(timeout=TICK)

    def _tick(self) -> None:
        while not self._closed.wait(TICK):
            with self._lock:
                self._draw()

    def _draw(self) -> None:
        if not self.live or not self._text or self._closed.is_set():
            return
        text = f"  {self._text} ({time.monotonic() - self.started:.0f} s)"
        self._shown = self._write(_ERASE + text[: _width(self.stream) - 1]) or self._shown

    def _erase(self) -> None:
        if self._shown:
            self._write(_ERASE)
            self._shown = False

    def _write(self, text: str) -> bool:
        """Write and flush; a terminal that went away ends the line, never the command."""
        try:
            self.stream.write(text)
            self.stream.flush()
            return True
        except (OSError, ValueError):
            self._closed.set()
            return False


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no such method, or closed
        return False


def _is_pipe(stream: TextIO) -> bool:
    try:
        mode = os.fstat(stream.fileno()).st_mode
    except (AttributeError, OSError, ValueError):  # no file behind it
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def _width(stream: TextIO) -> int:
    """The terminal's columns: a longer line would wrap, and ``\\r`` rewrites only its last row."""
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        columns = 0
    return columns if columns > 0 else 80  # a pseudo-terminal nobody sized says 0
