"""Progress from the first second: on a terminal ``ddpcheck check`` keeps one live line from
start-up through the battery to the random examples -- a quiet minute on a loaded machine never
looks like a hang -- and never writes a report line over it; off a terminal, a line per phase and
none per example, the report on stdout as before.
"""

from __future__ import annotations

import io
import os
import re
import select
import subprocess
import sys
import time

import pytest

from ddpcheck._front.terminal import ProgressLine
from ddpcheck.errors import ExitCode
from tests.patience import patience

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Seconds from the process's start to its first line, on any machine: the line is drawn before
#: torch loads (which alone took 3.8 s at load 9 on the 2-core machine).
FIRST_LINE = 2.0


def _screen(raw: str) -> list[str]:
    """The lines a terminal shows after ``raw``: ``\\r`` returns to the line's start, ``ESC[K``
    erases from the cursor to its end."""
    lines: list[str] = []
    line: list[str] = []
    col = 0
    for token in re.findall(r"\x1b\[K|.|\n", raw, re.S):
        if token == "\x1b[K":
            del line[col:]
        elif token == "\r":
            col = 0
        elif token == "\n":
            lines.append("".join(line))
            line, col = [], 0
        else:
            line[col : col + 1] = [token]
            col += 1
    return [*lines, "".join(line)]


def _in_a_terminal(argv: list[str]) -> tuple[float, str, int]:
    """Run ``argv`` with a pseudo-terminal as stdin, stdout and stderr: the seconds from its
    start to its first output, everything it wrote, its exit status."""
    wait = patience(300)  # first: the first call measures this machine, taking seconds
    master, slave = os.openpty()
    started = time.monotonic()
    proc = subprocess.Popen(
        argv, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, start_new_session=True
    )
    os.close(slave)
    first, chunks = None, []
    deadline = started + wait
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every holder of the terminal closed it
                break
            if not data:
                break
            if first is None:
                first = time.monotonic() - started
            chunks.append(data)
        status = proc.wait(timeout=wait)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        os.close(master)
    return first, b"".join(chunks).decode(errors="replace"), status


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "openpty"), reason="no pseudo-terminals here")
def test_on_a_terminal_a_live_line_from_the_first_second_names_the_battery_progress():
    first, raw, status = _in_a_terminal(
        [
            sys.executable,
            "-m",
            "ddpcheck",
            "check",
            "parallel",
            "--examples",
            "2",
            "--world-sizes",
            "1",
        ]
    )
    assert status == ExitCode.OK, raw
    assert first is not None and first < FIRST_LINE, f"first output after {first} s:\n{raw!r}"
    assert raw.startswith("\r\x1b[K  starting worlds ... ("), raw[:200]
    shown = re.findall(r"\r\x1b\[K  ([^\r\n]*?) \(\d+ s\)", raw)
    battery = [s for s in shown if re.fullmatch(r"battery [1-9]\d*/17", s)]
    assert battery and battery[-1] == "battery 17/17", shown
    assert "random examples 2/2" in shown, shown
    # the report as a pipe would get it, no progress left on any line of the screen
    lines = [line for line in _screen(raw) if line]
    assert lines[0].startswith("battery: 16 examples equivalent (world sizes [1])"), lines
    assert lines[-2] == "fuzzing parallel with 2 random examples at world sizes 1", lines
    assert lines[-1].startswith(
        "ddpcheck check parallel: nothing found in 16 battery and 2 random examples"
    ), lines
    assert not [line for line in lines if re.search(r"\(\d+ s\)$", line)], lines


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_live_line_is_lifted_for_other_output_and_erased_at_the_end(capsys):
    stream = _Terminal()
    line = ProgressLine(stream, started=time.monotonic(), report=stream)
    line.phase("battery 0/4", "not on a terminal")
    line.show("battery 1/4")
    with line.paused():
        stream.write("a report line\n")
    line.close()
    line.show("after the end")
    assert _screen(stream.getvalue()) == ["a report line", ""], repr(stream.getvalue())
    assert stream.getvalue().count("battery 1/4") >= 2, repr(stream.getvalue())  # drawn again

    piped = io.StringIO()
    off = ProgressLine(piped)
    off.show("battery 1/4")
    off.phase("battery 0/4", "the battery starts")
    with off.paused():
        piped.write("a report line\n")
    off.close()
    assert piped.getvalue() == "the battery starts\na report line\n"
    assert capsys.readouterr().err == ""

    read, write = os.pipe()  # the report through a pipe (`| tee`): its reader may print late
    with os.fdopen(read) as _reader, os.fdopen(write, "w") as writer:
        assert not ProgressLine(_Terminal(), report=writer).live
        assert ProgressLine(_Terminal(), report=_Terminal()).live
