"""Fresh code for fresh runs: a persistent world must not check code that no longer exists.

A rank imports a user's module once and keeps it; after the user edits the file (and re-runs in
the same interpreter, a notebook), the persistent ranks would judge the old code. So each rank
reports the source files of the modules it imported -- outside the Python installation, i.e. the
user's code, this repository's included -- with their modification times, and before every task
the parent compares them with the files on disk: one changed file and the world is replaced.

Invariant: :func:`changed` returns the files whose ``st_mtime_ns`` differs from the one recorded
when a rank imported them (or that are gone). The cost is one ``stat`` per recorded file per task.
"""

from __future__ import annotations

import os
import sys
import sysconfig

__all__ = ["ImportTracker", "announce", "changed"]


def _installation_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs |= {sys.prefix, sys.base_prefix, sys.exec_prefix}
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs if d)


class ImportTracker:
    """Inside a rank: the user source files imported since the last call, with their mtimes."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._installed = _installation_dirs()

    def new_files(self) -> dict[str, int]:
        names = set(sys.modules) - self._seen
        self._seen |= names
        found = {}
        for name in names:
            path = getattr(sys.modules.get(name), "__file__", None)
            if not path or not path.endswith(".py"):
                continue
            real = os.path.realpath(path)
            if real.startswith(self._installed):
                continue
            try:
                found[real] = os.stat(real).st_mtime_ns
            except OSError:
                pass
        return found


def changed(files: dict[str, int]) -> list[str]:
    """The recorded files that changed on disk (or disappeared) since they were imported."""
    stale = []
    for path, mtime in files.items():
        try:
            if os.stat(path).st_mtime_ns != mtime:
                stale.append(path)
        except OSError:
            stale.append(path)
    return stale


_ANNOUNCED: set[tuple[str, int]] = set()


def announce(paths: list[str]) -> None:
    """Say once per edit that a world is replaced because its ranks hold outdated code."""
    fresh = []
    for path in paths:
        try:
            key = (path, os.stat(path).st_mtime_ns)
        except OSError:
            key = (path, -1)
        if key not in _ANNOUNCED:
            _ANNOUNCED.add(key)
            fresh.append(os.path.relpath(path))
    if fresh:
        print(
            f"ddpcheck: {', '.join(fresh)} changed since the ranks imported it; starting fresh "
            "worlds",
            file=sys.stderr,
        )
