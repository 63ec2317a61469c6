"""Persistent multi-process ``torch.distributed`` worlds with deadlines.

Invariant: ``World.run(fn, *args)`` returns the list of every rank's ``fn(*args)`` only when *all*
ranks returned. If any rank raises, exits, or misses the deadline, it raises :class:`WorldFailure`
naming each rank's state (its traceback, its exit code, or a faulthandler dump of where it was
stuck) and the first collective where the ranks' sequences disagree (``ddpcheck._internal.sequences``), and
the world is torn down -- no process is left -- so the next :func:`get_world` spawns a
fresh one. Every wait here has a deadline.

Why persistent: spawning a gloo world costs seconds (2.0 s at W=2, 4.6 s at W=4 on our machines),
one equivalence example in a running world costs milliseconds. Worlds are kept per world size and
reused until they fail or the interpreter exits.

Rendezvous uses a ``FileStore`` in a fresh temporary directory, so no port is ever fixed and
``pytest -n auto`` workers cannot collide.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import datetime
import faulthandler
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import wait as _wait_any
from typing import Any, Callable

from ddpcheck._internal.validation import InvalidArgument, check_deadline, check_world_size

__all__ = [
    "WorldStartError",
    "DEFAULT_DEADLINE",
    "RankState",
    "World",
    "WorldFailure",
    "get_world",
    "shutdown_worlds",
]

#: Seconds one ``World.run`` may take before the world is declared hung.
DEFAULT_DEADLINE = 60.0
#: Seconds a freshly spawned world may take to import torch and rendezvous (W=8 took 11.4 s here).
STARTUP_DEADLINE = 120.0
#: Once one rank has failed, how long the others get to finish before they are presumed stuck
#: waiting for it in a collective.
FAILURE_GRACE = 2.0

_SHUTDOWN = b""
_NUMPY_WARNING = "ignore:Failed to initialize NumPy"


# ---------------------------------------------------------------------------------------------
# Reports


@dataclasses.dataclass(frozen=True)
class RankState:
    """What one rank did during a failed ``World.run``."""

    rank: int
    status: str  # "returned" | "raised" | "exited" | "stuck"
    detail: str = ""  # traceback, exit description or stack dump
    log_tail: str = ""  # last lines the rank wrote to stdout/stderr

    def describe(self) -> str:
        head = {
            "returned": f"rank {self.rank}: returned normally",
            "raised": f"rank {self.rank}: raised",
            "exited": f"rank {self.rank}: process exited ({self.detail})",
            "stuck": f"rank {self.rank}: did not return in time; it was here:",
        }[self.status]
        body = "" if self.status in ("returned", "exited") else self.detail
        text = head + ("\n" + _indent(body) if body else "")
        if self.log_tail and self.status != "returned":
            text += "\n" + _indent("last output of the rank:\n" + self.log_tail)
        return text


class WorldFailure(Exception):
    """A ``World.run`` that did not complete on every rank.

    ``kind`` is ``"raised"`` (a rank raised an exception), ``"exited"`` (a rank process died),
    ``"timeout"`` (the deadline passed) or ``"mismatch"`` (the ranks issued different collectives
    at the same index, or a rank finished with fewer: the cause, whatever happened next).
    ``ranks`` holds one :class:`RankState` per rank; ``disagreement`` the first collective where
    the ranks' sequences disagree (a ``ddpcheck._internal.sequences.Disagreement``, or None when they agree,
    with ``collectives`` then saying how many they issued).
    """

    def __init__(self, kind: str, world_size: int, ranks: list[RankState], what: str,
                 disagreement: Any = None, collectives: str = ""):
        self.kind = kind
        self.world_size = world_size
        self.ranks = ranks
        self.what = what
        self.disagreement = disagreement
        self.collectives = collectives
        super().__init__(self._format())

    @property
    def guilty(self) -> list[int]:
        """The ranks to blame: for a mismatch, those outside the majority at the first
        disagreement; else the ranks that died, else those that raised; for a pure hang, the
        stuck ranks the others wait for (those that issued nothing where the others did)."""
        if self.kind == "mismatch" and self.disagreement is not None:
            return self.disagreement.deviants
        for status in ("exited", "raised"):
            bad = [s.rank for s in self.ranks if s.status == status]
            if bad:
                return bad
        stuck = [s.rank for s in self.ranks if s.status == "stuck"]
        behind = [] if self.disagreement is None else self.disagreement.behind
        return [r for r in stuck if r in behind] or stuck

    def _format(self) -> str:
        verdict = {
            "raised": "a rank raised",
            "exited": "a rank process exited",
            "timeout": "the deadline passed",
            "mismatch": "the ranks issued mismatched collectives",
        }[self.kind]
        lines = [f"{self.what} failed in a world of {self.world_size}: {verdict} "
                 f"(guilty rank(s): {', '.join(map(str, self.guilty))})"]
        if self.disagreement is not None:
            lines.append(self.disagreement.describe())
        elif self.collectives:
            lines.append(self.collectives)
        # The same exception on several ranks is reported once, with the ranks that share it.
        seen: dict[tuple[str, str], list[int]] = {}
        for state in self.ranks:
            seen.setdefault((state.status, state.detail), []).append(state.rank)
        for state in self.ranks:
            ranks = seen.get((state.status, state.detail))
            if ranks is None:
                continue
            del seen[(state.status, state.detail)]
            text = state.describe()
            if len(ranks) > 1:
                text = text.replace(f"rank {state.rank}:", f"ranks {', '.join(map(str, ranks))}:", 1)
            lines.append(text)
        return "\n".join(lines)


class WorldStartError(RuntimeError):
    """The rank processes could not start or join the process group (an environment problem,
    such as a main module that spawn cannot re-import, never a verdict on a target)."""


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.rstrip().splitlines())


# ---------------------------------------------------------------------------------------------
# The world, seen from the parent process


class World:
    """``world_size`` real processes joined in one ``torch.distributed`` process group.

    Collective: ``run`` executes ``fn`` on every rank at once; ``fn`` may use any collective of the
    default group. Not thread-safe: one ``run`` at a time.
    """

    def __init__(self, world_size: int, *, backend: str | None = None,
                 start_method: str = "spawn"):
        check_world_size("world_size", world_size)
        if start_method not in ("spawn", "forkserver"):
            raise InvalidArgument(
                f"start_method={start_method!r} is not supported; use 'spawn' or 'forkserver' "
                "(fork is unsafe once torch has started threads)")
        self.world_size = world_size
        self.backend = backend or _default_backend()
        self.start_method = start_method
        # fixed at start
        self._dir: str | None = None
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._logs: list[str] = []
        self._stacks: list[str] = []
        self._sequences: list[str] = []  # per-rank collective sequence files (ddpcheck._internal.recorder)
        # lifecycle
        self._alive = False
        self._runs = 0

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def start(self, deadline: float = STARTUP_DEADLINE) -> "World":
        """Spawn the ranks and wait until every one has joined the process group."""
        # Plain multiprocessing, not torch.multiprocessing: results travel as pickled bytes, so
        # torch's shared-memory tensor reductions would only add file-descriptor traffic.
        import multiprocessing

        if self._alive:
            return self
        ctx = multiprocessing.get_context(self.start_method)
        _check_main_module_importable()
        self._dir = tempfile.mkdtemp(prefix=f"ddpcheck-w{self.world_size}-")
        store_path = os.path.join(self._dir, "store")
        self._procs, self._conns = [], []
        self._logs = [os.path.join(self._dir, f"rank{r}.log") for r in range(self.world_size)]
        self._stacks = [os.path.join(self._dir, f"rank{r}.stack") for r in range(self.world_size)]
        self._sequences = [os.path.join(self._dir, f"rank{r}.collectives")
                           for r in range(self.world_size)]
        # torch warns at import when numpy is missing; in a rank that is noise on the user's
        # terminal (spawn imports it before our log redirection), so the children ignore it.
        saved = os.environ.get("PYTHONWARNINGS")
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [saved, _NUMPY_WARNING]))
        try:
            self._spawn(ctx, store_path)
        finally:
            if saved is None:
                del os.environ["PYTHONWARNINGS"]
            else:
                os.environ["PYTHONWARNINGS"] = saved
        _LIVE.add(self)
        self._alive = True
        try:
            self._collect("world start-up", deadline)
        except WorldFailure as failure:  # not the target's fault: the environment's
            self.kill()
            raise WorldStartError(f"could not start a world of {self.world_size} ranks; "
                                  f"nothing was checked.\n{failure}") from None
        except BaseException:
            self.kill()
            raise
        return self

    def _spawn(self, ctx: Any, store_path: str) -> None:
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_rank_main,
                name=f"ddpcheck-rank{rank}-of-{self.world_size}",
                args=(rank, self.world_size, self.backend, store_path, child_end,
                      self._logs[rank], self._stacks[rank], os.getpid(),
                      self._sequences[rank]),
                daemon=True,
            )
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)

    def close(self, timeout: float = 5.0) -> None:
        """Ask every rank to exit, then make sure it has (killing stragglers)."""
        if not self._alive:
            return
        for conn in self._conns:
            try:
                conn.send_bytes(_SHUTDOWN)
            except OSError:
                pass
        end = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, end - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill every rank now and remove the world's files. Safe to call twice."""
        for proc in self._procs:
            if proc.is_alive():
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, TypeError):
                    pass
        for proc in self._procs:
            proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self._alive = False
        _LIVE.discard(self)

    # -- running work ------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, deadline: float = DEFAULT_DEADLINE,
            what: str | None = None) -> list[Any]:
        """Run ``fn(*args)`` on every rank; return the per-rank results, rank 0 first.

        ``fn`` and ``args`` travel by pickle, so ``fn`` must be defined at module level of an
        importable module. On any failure the world is killed and :class:`WorldFailure` raised.
        """
        check_deadline("deadline", deadline)
        payload = _pickle_task(fn, args)
        if self._alive and any(p.exitcode is not None for p in self._procs):
            # A rank died *between* tasks (gloo's teardown race can SIGABRT an idle rank, see
            # platform-notes.md): no task of ours was running, so blame none -- start afresh.
            self.kill()
        if not self._alive:
            self.start()
        self._runs += 1
        for path in self._stacks:
            open(path, "w").close()
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
            return self._collect(what or getattr(fn, "__qualname__", repr(fn)), deadline)
        except WorldFailure:
            raise
        except BaseException:  # Ctrl-C, or a broken pipe: ranks are mid-task, never reuse them
            self.kill()
            raise

    def collective_sequences(self) -> list[str]:
        """Each rank's collective sequence file (``ddpcheck._internal.recorder`` format) for the last task."""
        return [_read(path) for path in self._sequences]

    def _collect(self, what: str, deadline: float) -> list[Any]:
        """Wait for one message from every rank, or fail with every rank's state."""
        n = self.world_size
        results: list[Any] = [None] * n
        states: dict[int, RankState] = {}
        pending = set(range(n))
        end = time.monotonic() + deadline
        failed_at: float | None = None
        kind: str | None = None
        while pending:
            limit = end if failed_at is None else min(end, failed_at + FAILURE_GRACE)
            timeout = limit - time.monotonic()
            if timeout <= 0:
                break
            waitables = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            ready = _wait_any(waitables, timeout)
            for rank in sorted(pending):
                conn, proc = self._conns[rank], self._procs[rank]
                if conn in ready or proc.sentinel in ready:
                    message = _receive(conn)
                    if message is None:  # the process died without answering
                        proc.join(1.0)
                        states[rank] = RankState(rank, "exited", _exit_description(proc.exitcode),
                                                 log_tail=_tail(self._logs[rank]))
                        kind = kind or "exited"
                    elif message[0] == "ok":
                        results[rank] = message[1]
                        states[rank] = RankState(rank, "returned")
                    else:
                        states[rank] = RankState(rank, "raised", message[1],
                                                 log_tail=_tail(self._logs[rank]))
                        kind = kind or "raised"
                    pending.discard(rank)
                    if kind is not None and failed_at is None:
                        failed_at = time.monotonic()
        if not pending and kind is None:
            return results
        dumps = self._dump_stacks(sorted(pending))
        for rank in sorted(pending):
            states[rank] = RankState(rank, "stuck", dumps[rank], log_tail=_tail(self._logs[rank]))
        failure = self._failure(kind or "timeout", [states[r] for r in range(n)], what)
        self.kill()
        raise failure

    def _failure(self, kind: str, states: list[RankState], what: str) -> WorldFailure:
        """The failure, with the first collective where the ranks' sequences disagree; a real
        mismatch (different collectives, or a finished rank that issued fewer) is the kind."""
        from ddpcheck._internal import sequences

        seqs = [sequences.parse(text) for text in self.collective_sequences()]
        finished = [s.rank for s in states if s.status == "returned"]
        disagreement = sequences.diagnose(seqs, finished)
        if disagreement is not None and disagreement.mismatched:
            kind = "mismatch"
        summary = "" if disagreement is not None else sequences.agreement_summary(seqs)
        return WorldFailure(kind, self.world_size, states, what, disagreement, summary)

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask stuck ranks for their Python stacks (faulthandler on SIGUSR1) and read them."""
        dumps: dict[int, str] = {}
        for rank in ranks:
            proc = self._procs[rank]
            try:
                os.kill(proc.pid, signal.SIGUSR1)
            except ProcessLookupError:
                dumps[rank] = f"(process gone: {_exit_description(proc.exitcode)})"
        end = time.monotonic() + 2.0
        waiting = [r for r in ranks if r not in dumps]
        while waiting and time.monotonic() < end:
            time.sleep(0.05)
            waiting = [r for r in waiting if "most recent call first" not in _read(self._stacks[r])]
        time.sleep(0.05)  # let faulthandler finish the dump it started
        for rank in ranks:
            if rank not in dumps:
                dumps[rank] = _trim_dump(_read(self._stacks[rank])) or "(no stack dump arrived)"
        return dumps

    def __repr__(self) -> str:
        state = "alive" if self._alive else "stopped"
        return f"World(world_size={self.world_size}, backend={self.backend!r}, {state})"


def _trim_dump(dump: str) -> str:
    """Drop the frames below the rank's task loop: they are the same in every dump."""
    kept, below_loop = [], False
    for line in dump.strip().splitlines():
        is_frame = line.lstrip().startswith("File ")
        if is_frame and below_loop:
            continue
        below_loop = is_frame and "in _rank_main" in line
        kept.append(line)
    return "\n".join(kept)


def _check_main_module_importable() -> None:
    """spawn re-imports the parent's ``__main__`` in every rank; a script read from stdin or a
    deleted file cannot be, and every rank would die before reporting anything."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path and getattr(main, "__spec__", None) is None and not os.path.exists(path):
        raise WorldStartError(
            f"the main module {path!r} is not a file, so spawned ranks cannot import it; run "
            "your code from a file or with `python -m`, and define targets in an importable "
            "module")


def _default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"


def _pickle_task(fn: Callable[..., Any], args: tuple) -> bytes:
    try:
        return pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise InvalidArgument(
            f"cannot send {fn!r} with its arguments to the rank processes: {exc}. Everything a "
            "world runs travels by pickle, so functions, targets and model factories must be "
            "defined at module level of an importable module (not inside a function, not a "
            "lambda, not in __main__ of an interactive session)") from exc


def _receive(conn: Any) -> tuple | None:
    try:
        if not conn.poll(0):
            return None
        return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return None


def _exit_description(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _tail(path: str, lines: int = 15) -> str:
    text = _read(path).rstrip()
    return "\n".join(text.splitlines()[-lines:])


# ---------------------------------------------------------------------------------------------
# Registry of persistent worlds (one per world size, backend and start method)

_WORLDS: dict[tuple, World] = {}
_LIVE: set[World] = set()
_LOCK = threading.Lock()


def get_world(world_size: int, *, backend: str | None = None, start_method: str = "spawn") -> World:
    """The persistent world of this size, spawned on first use and after a failure."""
    check_world_size("world_size", world_size)
    key = (world_size, backend, start_method)
    with _LOCK:
        world = _WORLDS.get(key)
        if world is None or not world.alive:
            world = World(world_size, backend=backend, start_method=start_method)
            _WORLDS[key] = world
    return world.start()


def shutdown_worlds() -> None:
    """Stop every world this process started. Runs at interpreter exit too."""
    with _LOCK:
        worlds = list(_LIVE)
        _WORLDS.clear()
    for world in worlds:
        world.close()


atexit.register(shutdown_worlds)


# ---------------------------------------------------------------------------------------------
# The world, seen from inside a rank process


def _rank_main(rank: int, world_size: int, backend: str, store_path: str, conn: Any,
               log_path: str, stack_path: str, parent_pid: int,
               sequence_path: str | None = None) -> None:
    """Join the process group, then run tasks from the parent until told to stop."""
    _die_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group; the parent decides when ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log = open(log_path, "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    # A rank that crashes (SIGABRT from gloo, SIGSEGV) leaves its Python stack in its log, whose
    # tail the parent reports with the exit status.
    faulthandler.enable(file=log, all_threads=True)

    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        import torch
        import torch.distributed as dist

        from ddpcheck._internal import recorder as comm

        # Two cores host up to W ranks: intra-op threads would only oversubscribe them.
        torch.set_num_threads(1)
        dist.init_process_group(
            backend,
            store=dist.FileStore(store_path, world_size),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=STARTUP_DEADLINE),
        )
        comm.install()
        # The first optimizer a process builds imports torch._dynamo (seconds); pay that here,
        # inside the start-up deadline, not inside the first example's.
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        comm.record_to(sequence_path)
        _send(conn, ("ok", os.getpid()))
    except BaseException:
        _send(conn, ("error", traceback.format_exc()))
        _exit(1, log)
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            _exit(0, log)  # the parent is gone
        if payload == _SHUTDOWN:
            _exit(0, log)
        try:
            fn, args = pickle.loads(payload)
            comm.restart_sequence()
            result = fn(*args)
            message = ("ok", result)
        except BaseException:  # report everything, SystemExit included, then keep serving
            message = ("error", traceback.format_exc())
        _send(conn, message)


def _send(conn: Any, message: tuple) -> None:
    try:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # an unpicklable result becomes a rank error, not a lost rank
        data = pickle.dumps(("error", f"result of the task could not be pickled: {exc!r}"))
    conn.send_bytes(data)


def _exit(code: int, log: Any) -> None:
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
