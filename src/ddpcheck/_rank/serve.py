"""The world, seen from inside a rank process: join the group, then serve tasks until told to stop.

Invariant: a rank answers every task with exactly one message (``boundary``) -- ``Returned``:
the result, the user files imported (``freshness``), and what the task left behind
(``fitness.restore``: changes to later computations, what was put right, whether the process
must be replaced); ``Refused`` when ddpcheck's own code raised one of its outcomes (a default
hook declining the example); or ``Raised``, with the traceback -- and never runs two tasks at
once; it
leads its own session and process group (so the parent can kill whatever a target started in it),
dies with its parent (``PR_SET_PDEATHSIG``), ignores Ctrl-C (the parent decides when ranks stop),
and leaves with ``os._exit`` (see :func:`_exit`).

The parent sets :data:`WORLD_DIR_ENV` for its ranks; ``ddpcheck._world.worlds`` reads it to
refuse starting a world from inside a rank (see ``world._refuse_nested_start``).
"""

from __future__ import annotations

import ctypes
import datetime
import faulthandler
import gc
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, NoReturn, TextIO, TypedDict

from ddpcheck._base.errors import DdpcheckError
from ddpcheck._base.options import STARTUP_DEADLINE
from ddpcheck._rank.boundary import Answer, Launch, Raised, Refused, Returned

if TYPE_CHECKING:  # a rank imports torch once its log is set up (rank_main)
    import torch

__all__ = [
    "NESTED_MARKER",
    "READY_ENV",
    "SEQUENCE_SLOTS",
    "SHUTDOWN",
    "WORLD_DIR_ENV",
    "log_of",
    "rank_main",
    "rank_name",
    "sequence_file",
    "serving",
    "world_dir_of",
]


class _NcclOptions(TypedDict, total=False):
    """``init_process_group``'s keywords for NCCL only."""

    device_id: torch.device


#: The message that tells a rank to exit.
SHUTDOWN = b""
#: Set by the parent in its ranks' environment: the world's directory.
WORLD_DIR_ENV = "DDPCHECK_WORLD_DIR"
#: File a rank creates in the world directory when re-importing the main module started a world.
NESTED_MARKER = "nested-start"

#: Set by the parent for the fork server: the file ``preload`` creates once its imports are done
#: (``_world.forking.wait_ready`` waits for it, with a deadline).
READY_ENV = "DDPCHECK_FORKSERVER_READY"

#: Sets of sequence files per rank: the running task's, and a queued task's
#: (``_world.worlds.World.submit``).
SEQUENCE_SLOTS = 2


def sequence_file(first: str, slot: int) -> str:
    """The sequence file of ``slot``, from the first slot's path (a rank and its world agree)."""
    return first if slot == 0 else f"{first}.{slot}"


_serving = False
_NAME_PREFIX = "ddpcheck-rank"


def rank_name(rank: int, world_size: int, world_dir: str) -> str:
    """A rank's process name. It carries the world's directory: a rank forked from a fork server
    has the server's environment, not :data:`WORLD_DIR_ENV`, while it re-imports the main module
    -- and the name is set before that (``multiprocessing.spawn.prepare``)."""
    return f"{_NAME_PREFIX}{rank}-of-{world_size}@{world_dir}"


def world_dir_of(name: str) -> str | None:
    """The world directory in a :func:`rank_name`, else None."""
    head, at, world_dir = name.partition("@")
    return world_dir if at and head.startswith(_NAME_PREFIX) else None


def log_of(name: str) -> str | None:
    """The log of the rank named ``name`` (:func:`rank_name`), else None."""
    world_dir = world_dir_of(name)
    if world_dir is None:
        return None
    rank = name[len(_NAME_PREFIX) :].partition("-of-")[0]
    return os.path.join(world_dir, f"rank{rank}.log") if rank.isdigit() else None


def serving() -> bool:
    """True inside a rank that has joined its world (as opposed to spawn's start-up)."""
    return _serving


def _install_dumps(stack_file: TextIO, log: TextIO) -> None:
    """faulthandler's handlers, installed afresh: SIGUSR1 dumps every thread's stack to
    ``stack_file`` (a hang's diagnosis), and a crash (SIGABRT from gloo, SIGSEGV) leaves its
    Python stack in ``log``, whose tail the parent reports with the exit status. Afresh before
    every task, because a library may put the signal handlers back as Python's ``signal`` module
    saw them, which is blind to faulthandler's: Lightning's ``Trainer`` resets every signal to
    ``SIG_DFL`` at the end of ``fit``, after which a hang's SIGUSR1 killed the rank instead of
    dumping its stacks. (Both calls keep an installed handler as it is, hence the undoing.)"""
    faulthandler.unregister(signal.SIGUSR1)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    faulthandler.disable()
    faulthandler.enable(file=log, all_threads=True)


def rank_main(launch: Launch, conn: Connection) -> None:
    """Join the process group on ``launch.device`` (``_base.devices``), then run tasks from the
    parent, arriving on ``conn``, until told to stop. A forked rank takes ``launch.environ``, the
    parent's environment as it launched the world (it sets ``WORLD_DIR_ENV``, and whatever the
    user set since: ``NCCL_*``, ``CUDA_VISIBLE_DEVICES``, ...)."""
    global _serving
    if launch.environ is not None:  # forked: the fork server's environment, not the parent's
        os.environ.clear()
        os.environ.update(launch.environ)
        numpy = sys.modules.get("numpy")  # ... and its numpy random state, the same in every rank
        if numpy is not None:
            numpy.random.seed()  # fresh entropy, as a spawned rank's
    # Its own group first: killing the group then kills whatever a target starts from here.
    try:
        os.setsid()
    except OSError:  # already a group leader
        pass
    _die_with_parent(launch.parent_pid)
    # Ctrl-C reaches the whole process group; the parent decides when ranks stop. A spawned rank
    # started with SIGINT blocked (``_world.interrupts``): what came since is dropped.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    # Append: the parent pointed this process's stdout/stderr at the same file while spawning
    # it, so whatever happened during spawn's start-up is already there.
    log = open(launch.log_path, "a", buffering=1)  # noqa: SIM115 -- the rank's stdout for its life
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    stack_file = open(launch.stack_path, "w")  # noqa: SIM115 -- faulthandler's, for the rank's life
    _install_dumps(stack_file, log)

    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        import torch
        import torch.distributed as dist

        from ddpcheck._base.devices import enter_rank
        from ddpcheck._rank import fitness
        from ddpcheck._rank import recorder as comm
        from ddpcheck._rank.freshness import ImportTracker

        # Two cores host up to W ranks: intra-op threads would only oversubscribe them.
        torch.set_num_threads(1)
        placed = enter_rank(launch.device, launch.rank)
        # NCCL: create the communicator now, inside the start-up deadline (the keyword only
        # there: torch before 2.3 has no device_id)
        nccl: _NcclOptions = {"device_id": placed} if launch.backend == "nccl" else {}
        dist.init_process_group(
            launch.backend,
            store=dist.FileStore(launch.store_path, launch.world_size),
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=datetime.timedelta(seconds=STARTUP_DEADLINE),
            **nccl,
        )
        comm.install()
        # The first optimizer a process builds imports torch._dynamo (seconds); pay that here,
        # inside the start-up deadline, not inside the first example's.
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        comm.record_to(launch.sequence_path)
        # What start-up imported (torch, dynamo: ~285k objects) lives as long as the rank: moved
        # out of the collector's reach, the full collection fitness runs after a task that left a
        # process group scans only what tasks created -- 140 ms per collection otherwise, twice
        # per example (bench/rank_gc.py: a target creating a group per example, 13x less CPU).
        gc.freeze()
        # What the process holds is read when the first task arrives: by then every rank has
        # joined, and descriptors open only during start-up (rendezvous) are closed.
        baseline = None
        sequence_slot = 0
        imports = ImportTracker()
        _send(conn, Returned(os.getpid(), imports.new_files()))
    except BaseException:
        _send(conn, Raised(traceback.format_exc()))
        _exit(1, log)
    _serving = True
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            _exit(0, log)  # the parent is gone
        if payload == SHUTDOWN:
            _exit(0, log)
        if baseline is None:
            baseline = fitness.baseline(tuple(comm.wrapped()))
        try:
            # the pickled task, then one byte: the slot of its sequence file (a task queued
            # behind another writes the other one; _world.worlds.SEQUENCE_SLOTS)
            _install_dumps(stack_file, log)  # whatever the last task's libraries did to them
            paths, task = pickle.loads(payload[:-1])
            slot = payload[-1]
            if slot != sequence_slot:
                comm.record_to(sequence_file(launch.sequence_path, slot))
                sequence_slot = slot
            else:
                comm.restart_sequence()
            sys.path[:0] = [path for path in paths if path not in sys.path]
            fn, args = pickle.loads(task)
            result = fn(*args)
            # the record goes back whatever the task left: the numbers are judged first
            fit, baseline = fitness.restore(baseline)
            message: Answer = Returned(
                result,
                imports.new_files(),
                tuple(fit.unfit),
                tuple(fit.notes),
                bool(fit.replace or fit.unfit),
            )
        except DdpcheckError as exc:  # ddpcheck declining the task in here: not the target's
            fit, baseline = fitness.restore(baseline)
            message = Refused(type(exc).__name__, str(exc), bool(fit.replace or fit.unfit))
        except BaseException:  # report everything, SystemExit included, then keep serving
            message = Raised(traceback.format_exc())
        _send(conn, message)


def _send(conn: Connection, message: Answer) -> None:
    try:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        # ddpcheck's own transport failed (a record holding what cannot travel, a dependency
        # missing in here): an outcome of ddpcheck's, never a rank error -- which the parent
        # would read as the target's bug -- nor a lost rank
        data = pickle.dumps(
            Refused(
                "SetupError",
                f"ddpcheck could not send this rank's result back to the checking process: {exc!r}",
                replace=True,
            )
        )
    conn.send_bytes(data)


def _exit(code: int, log: TextIO) -> NoReturn:
    """Leave without running gloo's destructors.

    Tearing the process group down right before exit races with gloo's worker threads (SIGABRT in
    about 1 of 55 short worlds on torch 2.13); ``os._exit`` skips that teardown entirely.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    log.flush()
    os._exit(code)


def _die_with_parent(parent_pid: int) -> None:
    """Make the kernel SIGKILL this rank if the parent dies, so no rank outlives its harness."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    if os.getppid() != parent_pid:
        os._exit(1)
