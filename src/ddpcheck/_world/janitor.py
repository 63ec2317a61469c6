"""Cleans up after a world whose parent died without doing it (SIGKILL, or any death that skips
``atexit``): one tiny process per world, started before the ranks.

Why a separate process: the parent may die without running any code, and a rank may be stuck in
a C-level gloo collective and never run Python again, so neither can be relied on. The ranks
themselves die with the parent (``PR_SET_PDEATHSIG``); what would stay is the world's temporary
directory and any process a target started inside a rank (each rank leads its own process group).

Protocol, over a pipe whose only writer is the parent: ``group <pgid>`` for each rank spawned;
``done`` when the parent cleaned up itself. On end-of-file without ``done`` -- the parent is gone,
the kernel closed its end -- the janitor SIGKILLs every group and removes the directory (and any
other it was given: the fork server's, ``forking.leftovers``).

Limit: a child the parent creates with a bare ``os.fork()`` (not the ranks, not ``subprocess``:
both close the pipe) holds the write end too, so the janitor also waits for that child to exit.

This file runs as a script (``python -I -S janitor.py FD DIR [DIR ...]``): stdlib only, no torch, no
ddpcheck, so it starts in tens of milliseconds. It lives in its own session, so a Ctrl-C or a
SIGTERM sent to the parent's process group does not reach it before it has done its job.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

__all__ = ["Janitor"]

#: Seconds the janitor keeps retrying to remove the directory (a dying rank may still be
#: writing its log when the first attempt runs).
REMOVE_DEADLINE = 5.0


class Janitor:
    """Parent side: start the janitor of ``world_dir``; tell it each rank's process group."""

    def __init__(self, world_dir: str, *also: str):
        read_end, write_end = os.pipe()
        self._write_end: int | None = write_end  # None once released
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    os.path.abspath(__file__),
                    str(read_end),
                    world_dir,
                    *also,
                ],
                # No stdio of ours: a caller reading our stdout/stderr to EOF must not wait for
                # the janitor.
                pass_fds=(read_end,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def watch(self, pgid: int) -> None:
        self._send(f"group {pgid}\n")

    def release(self, timeout: float = 2.0) -> None:
        """The parent cleaned up itself: let the janitor exit without doing anything."""
        if self._write_end is None:
            return
        self._send("done\n")
        os.close(self._write_end)
        self._write_end = None
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout)

    def _send(self, text: str) -> None:
        if self._write_end is not None:
            try:
                os.write(self._write_end, text.encode())
            except OSError:  # the janitor died: nothing to tell it any more
                pass


def _serve(fd: int, directories: list[str]) -> int:
    """Janitor side: read the pipe until EOF; clean up unless the parent said ``done``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    groups: list[int] = []
    done = False
    with os.fdopen(fd, "rb") as pipe:
        for line in pipe:
            word, _, arg = line.decode(errors="replace").strip().partition(" ")
            if word == "group" and arg.isdigit():
                groups.append(int(arg))
            elif word == "done":
                done = True
    if done:
        return 0
    for pgid in groups:
        _kill_group(pgid)
    end = time.monotonic() + REMOVE_DEADLINE
    for directory in directories:
        while os.path.exists(directory) and time.monotonic() < end:
            shutil.rmtree(directory, ignore_errors=True)
            if os.path.exists(directory):
                time.sleep(0.1)
    return 0


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


if __name__ == "__main__":
    sys.exit(_serve(int(sys.argv[1]), sys.argv[2:]))
