"""torch's JIT-built C++ extensions, as a framework target meets them: a lock a killed build left.

Frameworks build C++ ops on first use through ``torch.utils.cpp_extension.load`` (DeepSpeed's
shared-memory op on its CPU accelerator: 100-285 s on 2 loaded cores). Builds of one
extension in several processes take turns through torch's ``FileBaton``: a file named ``lock`` in
the extension's build directory, created with ``O_CREAT | O_EXCL`` and held open by the building
process until it removes it; every other process polls, without a deadline, until the file is
gone. A build that is killed (a rank past its deadline, Ctrl-C) leaves the file behind, and every
later process would wait for it forever.

Invariant: :func:`remove_stale_lock` removes a lock only when no live process holds it open --
the building process holds it from the moment it exists, so an unheld lock belongs to a dead one
-- and only where it can tell (Linux: every process's ``/proc/PID/fd``); cleaners serialise on
the build directory (``flock``), so two of them never judge one lock at the same time: the second
sees the lock a new build created meanwhile, and that build holds it. Every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator

__all__ = ["build_directory", "held_open", "remove_stale_lock"]

#: The name torch's ``FileBaton`` gives its lock in an extension's build directory.
LOCK = "lock"


def build_directory(name: str) -> str | None:
    """Where torch builds the extension ``name`` (``TORCH_EXTENSIONS_DIR`` or its default
    folder); None with a torch that does not say."""
    from torch.utils import cpp_extension

    where = getattr(cpp_extension, "_get_build_directory", None)  # torch's own answer, 1.x-2.13
    return None if where is None else where(name, verbose=False)


def held_open(path: str) -> bool | None:
    """True when a live process holds ``path`` open, False when none does, None when this
    process cannot tell (no ``/proc``, or a process of this user whose descriptors it cannot
    read). Processes of other users are not read: they cannot build in this user's folders."""
    try:
        wanted = os.stat(path)
    except FileNotFoundError:
        return False
    try:
        pids = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return None
    uid = os.getuid()
    for pid in pids:
        folder = f"/proc/{pid}/fd"
        try:
            descriptors = os.listdir(folder)
        except FileNotFoundError:  # it exited meanwhile
            continue
        except PermissionError:
            try:
                if os.stat(f"/proc/{pid}").st_uid != uid:
                    continue
            except OSError:
                continue
            return None
        for fd in descriptors:
            try:
                found = os.stat(os.path.join(folder, fd))
            except OSError:  # closed meanwhile, or not a file
                continue
            if (found.st_dev, found.st_ino) == (wanted.st_dev, wanted.st_ino):
                return True
    return False


def remove_stale_lock(directory: str) -> bool:
    """Remove the build lock in ``directory`` if no live process holds it (see the module's
    invariant); True when it removed one."""
    lock = os.path.join(directory, LOCK)
    if not os.path.exists(lock):
        return False
    with _serialised(directory) as alone:
        if not alone or held_open(lock) is not False:
            return False
        try:
            os.remove(lock)
        except FileNotFoundError:
            return False
        return True


#: Seconds a cleaner waits for another to finish judging a lock (each takes milliseconds).
SERIALISE_WAIT = 30.0


@contextlib.contextmanager
def _serialised(directory: str) -> Iterator[bool]:
    """An exclusive ``flock`` on ``directory`` for the block (True), or False after
    :data:`SERIALISE_WAIT`: one cleaner at a time."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        end = time.monotonic() + SERIALISE_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > end:
                    yield False
                    return
                time.sleep(0.01)
        yield True
    finally:
        os.close(fd)  # releases the flock
