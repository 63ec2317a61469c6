"""Process plumbing for worlds: spawning quietly, killing whole process groups, reading what a
rank left behind (logs, stack dumps, exit statuses), and refusing what spawn cannot do.

Parent side only; ``worlds`` composes these into a World.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from ddpcheck._base.errors import InvalidArgument
from ddpcheck._rank.boundary import Answer
from ddpcheck._rank.serve import NESTED_MARKER, WORLD_DIR_ENV, world_dir_of
from ddpcheck._world.failures import WorldStartError

__all__ = [
    "check_main_module_importable",
    "dump_stacks",
    "environment",
    "exit_description",
    "kill_group",
    "output_to",
    "pickle_task",
    "read",
    "receive",
    "refuse_nested_start",
    "tail",
    "trim_dump",
]


def trim_dump(dump: str) -> str:
    """Drop the frames below the rank's task loop: they are the same in every dump."""
    kept, below_loop = [], False
    for line in dump.strip().splitlines():
        is_frame = line.lstrip().startswith("File ")
        if is_frame and below_loop:
            continue
        below_loop = is_frame and "in rank_main" in line
        kept.append(line)
    return "\n".join(kept)


def kill_group(proc: BaseProcess) -> None:
    """SIGKILL the process group ``proc`` leads (itself and whatever it started), and ``proc``
    itself in case it died or was killed before it could lead one."""
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.exitcode is None:  # not reaped yet, so the pid is still this process's
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Set environment variables for the processes spawned inside the block."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def output_to(path: str) -> Iterator[None]:
    """Point this process's stdout and stderr (file descriptors 1 and 2) at ``path`` while a rank
    is spawned, so the rank's output goes to its log from its first line -- spawn re-imports the
    main module before our code runs in it. Our own output in those milliseconds goes there too."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        saved = (os.dup(1), os.dup(2))
    except OSError:  # no stdout or stderr to redirect
        yield
        return
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.dup2(log, 1)
        os.dup2(log, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (log, *saved):
            os.close(fd)


def refuse_nested_start() -> None:
    """No world inside a rank. While spawn re-imports the main module in a new rank (a script
    that calls ddpcheck without ``if __name__ == "__main__":``), leave quietly and leave a marker
    the parent turns into one clear line; anywhere else in a rank, raise. A rank forked from the
    fork server knows its world by its process name until ``rank_main`` sets the variable."""
    this = multiprocessing.process.current_process()
    world_dir = os.environ.get(WORLD_DIR_ENV) or world_dir_of(this.name)
    if not world_dir:
        return
    if getattr(this, "_inheriting", False):
        try:
            open(os.path.join(world_dir, NESTED_MARKER), "a").close()
        finally:
            os._exit(3)
    raise WorldStartError(
        "a ddpcheck world cannot be started from inside a ddpcheck rank "
        "process (a target or task called ddpcheck)"
    )


def check_main_module_importable() -> None:
    """spawn re-imports the parent's ``__main__`` in every rank; a script read from stdin or a
    deleted file cannot be, and every rank would die before reporting anything."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path and getattr(main, "__spec__", None) is None and not os.path.exists(path):
        raise WorldStartError(
            f"the main module {path!r} is not a file, so spawned ranks cannot import it; run "
            "your code from a file or with `python -m`, and define targets in an importable "
            "module"
        )


def pickle_task(fn: Callable[..., object], args: tuple, paths: list[str] | None = None) -> bytes:
    """The message a rank runs: ``(paths, pickled (fn, args))``. ``paths``: ``sys.path`` entries
    this process gained since the rank was spawned (a script's folder, the working directory),
    put first in the rank's path *before* the task is unpickled, so it finds their modules."""
    try:
        task = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise InvalidArgument(
            f"cannot send {fn!r} with its arguments to the rank processes: {exc}. Everything a "
            "world runs travels by pickle, so functions, targets and model factories must be "
            "defined at module level of an importable module (not inside a function, not a "
            "lambda, not in __main__ of an interactive session)"
        ) from exc
    return pickle.dumps((paths or [], task), protocol=pickle.HIGHEST_PROTOCOL)


def receive(conn: Connection) -> Answer | None:
    """The rank's answer waiting on ``conn``; None when the rank is gone without one."""
    try:
        if not conn.poll(0):
            return None
        return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return None


def exit_description(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def tail(path: str, lines: int = 30) -> str:
    """The last ``lines`` of a rank's log; a crash's Python stack (faulthandler) whole.

    A rank killed by a signal leaves faulthandler's dump as the last thing in its log, one
    block per thread: with a few threads alive, the last lines alone would cut off the header
    and the crashing thread's frames, the two things the report is for."""
    text = read(path).rstrip()
    crash = text.rfind("Fatal Python error:")
    if crash < 0:
        return "\n".join(text.splitlines()[-lines:])
    before = text[:crash].rstrip().splitlines()[-5:]  # what the rank said just before
    return "\n".join(before + _crashing_thread(text[crash:].splitlines()))


def _crashing_thread(dump: list[str]) -> list[str]:
    """faulthandler's header and the current thread's frames; other threads counted, not
    listed; the list of extension modules left out."""
    kept: list[str] = []
    others = 0
    keeping = True
    for line in dump:
        if line.startswith("Thread 0x"):
            others, keeping = others + 1, False
        elif line.startswith("Current thread 0x"):
            keeping = True
        elif line.startswith("Extension modules:"):
            keeping = False
        if keeping:
            kept.append(line)
    while kept and not kept[-1].strip():
        kept.pop()
    if others:
        kept.append(
            f"(the stack{'s' if others > 1 else ''} of {others} other "
            f"thread{'s' if others > 1 else ''} left out)"
        )
    return kept


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def _whole(dump: str) -> bool:
    """The dump holds the main thread's frames down to the rank's task loop."""
    return "most recent call first" in dump and "in rank_main" in dump


def dump_stacks(
    procs: Sequence[BaseProcess], stack_paths: list[str], ranks: list[int], deadline: float = 20.0
) -> dict[int, str]:
    """Ask stuck ranks for their Python stacks (faulthandler on SIGUSR1) and read them.

    A dump arrives once its rank is next on a CPU: milliseconds, but seconds on a loaded
    machine, where faulthandler may also be preempted halfway through it, thread by thread. So a
    dump is awaited until it holds the main thread's task loop (``rank_main``, below the frames
    a diagnosis is for), then until it stops growing; for a tenth of the ``deadline`` the ranks
    had (itself scaled to the machine), at least 5 s, ending as soon as every dump is in."""
    dumps: dict[int, str] = {}
    for rank in ranks:
        proc = procs[rank]
        try:
            if proc.pid is None:  # never started: nothing to ask
                raise ProcessLookupError
            os.kill(proc.pid, signal.SIGUSR1)
        except ProcessLookupError:
            dumps[rank] = f"(process gone: {exit_description(proc.exitcode)})"
    end = time.monotonic() + max(5.0, deadline / 10)
    waiting = [r for r in ranks if r not in dumps]
    while waiting and time.monotonic() < end:
        time.sleep(0.05)
        waiting = [r for r in waiting if not _whole(read(stack_paths[r]))]
    # the other threads' blocks may still be on their way: done once the files stop growing
    sizes: list[int] = []
    while time.monotonic() < end + 2.0:
        time.sleep(0.2)
        now = [_size(stack_paths[r]) for r in ranks if r not in dumps]
        if now == sizes:
            break
        sizes = now
    for rank in ranks:
        if rank not in dumps:
            dumps[rank] = trim_dump(read(stack_paths[rank])) or "(no stack dump arrived)"
    return dumps
