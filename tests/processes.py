"""Which processes a piece of test code started, observed in the process table.

Why not patch the function that starts worlds: a path that reaches another function (the
command line launches worlds through ``launch_worlds``, not ``get_world``) slips past the patch
and the test cannot fail. The process table sees every road. :func:`no_process_started` first
stops this process's persistent worlds, so code that needed one would have to start it; ddpcheck
keeps every process it starts (a world, its ranks, the fork server) until the world is stopped or
the interpreter exits, so what a block started is still there when it ends.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest


def _parents() -> dict[int, int]:
    """pid -> parent pid, for every process visible in /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def descendants(pid: int | None = None) -> dict[int, str]:
    """Every live process below ``pid`` (default: this one) -> its command line."""
    parents = _parents()
    found, frontier = set(), {os.getpid() if pid is None else pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return {child: _command_line(child) for child in sorted(found)}


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "(gone)"


@contextlib.contextmanager
def none_started() -> Iterator[None]:
    """Fail if the block leaves a process below this one that was not there before it, with no
    persistent world alive as it starts (a world the block used would have to start)."""
    from ddpcheck._world.registry import shutdown_worlds

    shutdown_worlds()
    before = descendants()
    yield
    started = {pid: line for pid, line in descendants().items() if pid not in before}
    assert not started, f"processes were started: {started}"


@pytest.fixture
def no_process_started() -> Iterator[None]:
    """The test's body starts no process (see :func:`none_started`)."""
    with none_started():
        yield
