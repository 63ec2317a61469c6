"""Persistent multi-process ``torch.distributed`` worlds with deadlines.

Invariant: ``World.run(fn, *args)`` returns every rank's ``fn(*args)`` only when *all* ranks
returned. If any rank raises, exits, misses the deadline or is left unfit, it raises
:class:`WorldFailure` naming each rank's state (traceback, exit code, or a faulthandler dump of
where it was stuck) and the first collective where the ranks' sequences disagree
(``sequences``), and the world is torn down -- no process is left -- so the next
:func:`get_world` spawns a fresh one. Every wait here has a deadline.

Why persistent: starting a gloo world costs ~0.2 s at W=2 with its ranks forked from ddpcheck's
fork server (``forking``), seconds spawned (2.0 s at W=2, 4.6 s at W=4 on our machines); one
example in a running world costs milliseconds. Worlds are kept per world size until they fail or
the interpreter exits. Rendezvous uses a ``FileStore`` in a fresh temporary directory: no port is
ever fixed, and ``pytest -n auto`` workers cannot collide.

Isolation between tasks: after every task each rank checks that its process is still fit
(``ddpcheck._rank.fitness``); an unfit rank fails the task as ``"contaminated"`` naming
what changed, so the example that did the damage is blamed, not the next. Every failed ``run`` kills
the world; a run that *completed* keeps it even when the caller finds the results wrong
(``ddpcheck.check_example`` replaces it after a collective mismatch): its ranks passed the fitness
check and agreed on every collective, and keeping the world spares shrinking a respawn per
failing example (spawned, mutant kills took 95-127 s instead of ~2 s; docs/platform.md). Each rank
leads its own process group, and a kill kills the groups: processes a target started die with the
world.

Start-up and shutdown hygiene: a world started inside a rank (a script calling ddpcheck at import
time without ``if __name__ == "__main__":``, which spawn re-imports in every rank) is refused with
one line (:class:`WorldStartError`). A rank's output goes to its log from the first line spawn
runs. Every world has a janitor process (``janitor``) that removes its directory and
kills its process groups if the parent dies without doing so (SIGKILL); the ranks die with the
parent (``PR_SET_PDEATHSIG``). The command line turns SIGTERM into an orderly stop (exit 143); API
users get no handler (the janitor makes one unnecessary, and a library should not take a signal).

Hang diagnosis at the speed of the evidence: while a task runs, the parent re-reads the sequence
files every ``collection.POLL_INTERVAL``; once they show a collective that can never complete (ranks
issued different collectives at one index, or one that a rank which already returned never
issued) and the evidence stays unchanged for ``collection.EVIDENCE_GRACE``, the task fails as a
``"mismatch"`` naming the collective and its call site, long before the deadline. Hangs without
such evidence still wait for the deadline.
"""

from __future__ import annotations

import math

# Plain multiprocessing, not torch.multiprocessing: results travel as pickled bytes, so torch's
# shared-memory tensor reductions would only add file-descriptor traffic.
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing import forkserver, resource_tracker
from typing import Any

from ddpcheck._base.devices import backend_for, check_device, check_fits
from ddpcheck._base.errors import InvalidArgument
from ddpcheck._base.options import (
    DEFAULT_DEADLINE,
    STARTUP_DEADLINE,
    check_deadline,
    check_world_size,
)
from ddpcheck._rank.boundary import Launch
from ddpcheck._rank.freshness import announce, changed
from ddpcheck._rank.serve import (
    SEQUENCE_SLOTS,
    SHUTDOWN,
    WORLD_DIR_ENV,
    rank_main,
    rank_name,
    sequence_file,
)
from ddpcheck._world import forking, interrupts
from ddpcheck._world.collection import Collection
from ddpcheck._world.failures import WorldFailure, WorldStartError
from ddpcheck._world.janitor import Janitor
from ddpcheck._world.processes import (
    check_main_module_importable,
    environment,
    kill_group,
    output_to,
    pickle_task,
    refuse_nested_start,
)

__all__ = ["Pending", "TaskLost", "World"]

_NUMPY_WARNING = "ignore:Failed to initialize NumPy"


def rank_warnings() -> str:
    """``PYTHONWARNINGS`` for ranks and the fork server: torch warns at import when numpy is
    missing; they ignore it."""
    return ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), _NUMPY_WARNING]))


# ---------------------------------------------------------------------------------------------
# The world, seen from the parent process


class World:
    """``world_size`` real processes joined in one ``torch.distributed`` process group.

    Collective: ``run`` executes ``fn`` on every rank at once; ``fn`` may use any collective of the
    default group. Not thread-safe: one ``run`` at a time.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str | None = None,
        device: str = "cpu",
        start_method: str = "auto",
    ):
        check_world_size("world_size", world_size)
        if start_method not in ("auto", "spawn", "forkserver"):
            raise InvalidArgument(
                f"start_method={start_method!r} is not supported; use 'auto' (ddpcheck's fork "
                "server where it can run one, else spawn: _world.forking), 'spawn' or "
                "'forkserver' (fork is unsafe once torch has started threads)"
            )
        self.world_size = world_size
        self.device = check_device(device)  # every rank computes there (_base.devices)
        self.backend = backend_for(device, backend)
        self.start_method = start_method
        # fixed at start
        self._dir: str | None = None
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._logs: list[str] = []
        self._stacks: list[str] = []
        # per-rank collective sequence files (ddpcheck._rank.recorder), two sets: a task
        # queued behind a running one writes the other (SEQUENCE_SLOTS)
        self._sequences: list[list[str]] = [[], []]
        # per slot: its files being emptied once their task was read (_empty_later)
        self._emptying: list[Future | None] = [None] * SEQUENCE_SLOTS
        self._janitor: Janitor | None = None
        # grown by every task: user source files the ranks imported -> their mtime then
        self._sources: dict[str, int] = {}
        # lifecycle
        self._alive = False
        self._booting: float | None = None  # launched, not yet joined: the start-up deadline
        self._path: set[str] = set()  # sys.path entries the ranks have
        self._runs = 0
        self._in_flight: list[Pending] = []  # submitted, not collected: running, then queued
        #: what the last task left behind in the ranks and ddpcheck put right, one line each
        #: (``ddpcheck._rank.fitness``); empty when the processes were as they started
        self.notes: tuple[str, ...] = ()
        #: rank -> what the last task changed that alters later computations (a global module
        #: hook): the task's results were returned all the same, to be judged first; the world
        #: was replaced
        self.unfit: dict[int, str] = {}
        self._last_sequences: list[str] = []

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    @property
    def janitor_pid(self) -> int | None:
        """The world's janitor process (``ddpcheck._world.janitor``), while the world
        lives."""
        return None if self._janitor is None else self._janitor.pid

    def start(self, deadline: float = STARTUP_DEADLINE) -> World:
        """Spawn the ranks and wait until every one has joined the process group."""
        self.launch(deadline)
        if self._booting is not None:
            self._await_start(self._booting)
        return self

    def launch(self, deadline: float = STARTUP_DEADLINE) -> World:
        """Spawn the ranks and return at once; the first task (or :meth:`start`) waits for them
        to join. Ranks spend ~2 s importing torch and joining the group: launched first, a
        world boots while this process imports, draws and computes references."""
        if self._alive:
            return self
        check_fits(self.device, (self.world_size,), self.backend)  # no GPU: one line, no spawn
        refuse_nested_start()
        check_main_module_importable()
        warnings = rank_warnings()
        method = self.start_method
        if method == "auto":
            method = forking.start_method(warnings)
        ctx = multiprocessing.get_context(method)
        with interrupts.held():  # a directory made is a directory known
            self._dir = tempfile.mkdtemp(prefix=f"ddpcheck-w{self.world_size}-")
            LIVE_WORLDS.add(self)  # from here on, kill() (and shutdown_worlds) cleans up
            self._alive = True
        self._path = set(sys.path)  # the ranks get this process's sys.path
        store_path = os.path.join(self._dir, "store")
        self._procs, self._conns = [], []
        self._logs = [os.path.join(self._dir, f"rank{r}.log") for r in range(self.world_size)]
        self._stacks = [os.path.join(self._dir, f"rank{r}.stack") for r in range(self.world_size)]
        self._sequences = [
            [
                sequence_file(os.path.join(self._dir, f"rank{r}.collectives"), slot)
                for r in range(self.world_size)
            ]
            for slot in range(SEQUENCE_SLOTS)
        ]
        self._emptying = [None] * SEQUENCE_SLOTS  # a killed world's files are gone with it
        try:
            if self.start_method == "forkserver":  # asked for: whoever's server it is
                forkserver.ensure_running()
            if method == "forkserver":  # forking before the server's imports end would block
                forking.wait_ready(max(deadline, 1.0))
            # Ctrl-C waits for the janitor and every rank to be started and known: one landing
            # in a rank's start left it running unseen (``interrupts``)
            with interrupts.held():
                self._janitor = Janitor(self._dir, *forking.leftovers(method))
                # Spawned ranks learn their world's directory from the environment, which marks
                # them as ranks (see refuse_nested_start); forked ones from their process name.
                with environment(PYTHONWARNINGS=warnings, **{WORLD_DIR_ENV: self._dir}):
                    self._spawn(ctx, store_path, method, self._dir, self._janitor)
        except BaseException:
            self.kill()
            raise
        self._booting = time.monotonic() + deadline
        return self

    def _await_start(self, end: float) -> None:
        """Wait (until the launch's deadline, ``end``) for every rank to join the process
        group."""
        self._booting = None
        try:
            # a world launched long ago has its answers waiting: a second to read them
            Collection(
                self, "world start-up", max(end - time.monotonic(), 1.0), starting=True
            ).collect()
        except WorldFailure as failure:  # not the target's fault: the environment's
            self.kill()
            raise WorldStartError(
                f"could not start a world of {self.world_size} ranks; "
                f"nothing was checked.\n{failure}"
            ) from None
        except BaseException:
            self.kill()
            raise

    def _spawn(
        self, ctx: Any, store_path: str, method: str, world_dir: str, janitor: Janitor
    ) -> None:
        # multiprocessing's helper processes inherit our stdout: start them before redirecting.
        resource_tracker.ensure_running()
        forked = method == "forkserver"
        parent_pid = forking.parent_of_ranks(method)
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=rank_main,
                name=rank_name(rank, self.world_size, world_dir),
                args=(
                    Launch(
                        rank,
                        self.world_size,
                        self.backend,
                        store_path,
                        self._logs[rank],
                        self._stacks[rank],
                        parent_pid,
                        self._sequences[0][rank],
                        self.device,
                        dict(os.environ) if forked else None,
                    ),
                    child_end,
                ),
                daemon=True,
            )
            with output_to(self._logs[rank]), interrupts.blocked_for_children():
                proc.start()  # spawned: SIGINT blocked until rank_main ignores it
            if forked:
                forking.forked()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)
            janitor.watch(proc.pid)  # the rank leads its own process group

    def close(self, timeout: float = 5.0) -> None:
        """Ask every rank to exit, then make sure it has (killing stragglers). A world still
        booting is killed at once: its ranks read no message before they have joined; and so is
        one running tasks (Ctrl-C came meanwhile): its ranks would read it only after them."""
        if not self._alive:
            return
        if self._booting is not None or self._in_flight:
            self.kill()
            return
        for conn in self._conns:
            try:
                conn.send_bytes(SHUTDOWN)
            except OSError:
                pass
        end = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, end - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill every rank, and every process it started, now; remove the world's files. Safe to
        call twice."""
        for pending in self._in_flight:  # never to be collected: their ranks are gone
            pending.lost = True
        self._in_flight = []
        for proc in self._procs:
            kill_group(proc)
        for proc in self._procs:
            proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        if self._janitor is not None:
            self._janitor.release()
            self._janitor = None
        self._sources = {}
        self._alive = False
        self._booting = None
        LIVE_WORLDS.discard(self)

    # -- running work ------------------------------------------------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        deadline: float = DEFAULT_DEADLINE,
        what: str | None = None,
    ) -> list[Any]:
        """Run ``fn(*args)`` on every rank; return the per-rank results, rank 0 first.

        ``fn`` and ``args`` travel by pickle, so ``fn`` must be defined at module level of an
        importable module. On any failure the world is killed and :class:`WorldFailure` raised.
        """
        return self.submit(fn, *args, deadline=deadline, what=what).collect()

    def submit(
        self,
        fn: Callable[..., Any],
        *args: Any,
        deadline: float = DEFAULT_DEADLINE,
        what: str | None = None,
    ) -> Pending:
        """Start ``fn(*args)`` on every rank and return at once; :meth:`Pending.collect` waits
        for the results (the deadline counts from here). Meanwhile this process is free -- the
        oracle computes its reference while the ranks train.

        One more task may be submitted while one runs: it is queued in the ranks' pipes and
        starts on each rank as soon as that rank answered the first, so the ranks do not wait
        while this process judges the first (``_runs.pipeline``); its deadline counts from the
        moment the first was collected. Collect in submission order. If the world is replaced
        before the queued task was collected (the first failed, or left its processes unfit), it
        never ran in a fit world: its ``collect`` raises :class:`TaskLost`, and the caller runs it
        again. A door of its own (``ddpcheck.get_world(W).submit``): ``deadline`` is checked
        here; a run admitted at another door takes :meth:`enqueue`."""
        check_deadline("deadline", deadline)
        return self.enqueue(fn, *args, deadline=deadline, what=what)

    def enqueue(
        self,
        fn: Callable[..., Any],
        *args: Any,
        deadline: float,
        what: str | None = None,
    ) -> Pending:
        """:meth:`submit` for a task whose deadline a door admitted (``_runs.admission``): not
        checked again."""
        queued = bool(self._in_flight)  # behind the running task: the world is alive and busy
        if queued and len(self._in_flight) >= SEQUENCE_SLOTS:
            raise RuntimeError(
                f"{self!r} runs one task and queues one: collect before submitting a third"
            )
        if not queued and self._alive and any(p.exitcode is not None for p in self._procs):
            # A rank died *between* tasks (gloo's teardown race can SIGABRT an idle rank, see
            # docs/platform.md): no task of ours was running, so blame none -- start afresh.
            self.kill()
        stale = changed(self._sources) if self._alive and not queued else []
        if stale:  # the ranks hold code that no longer exists on disk
            announce(stale)
            self.kill()
        # what the ranks have not seen of this process's sys.path yet travels with the task
        added = [] if not self._alive else [p for p in sys.path if p not in self._path]
        payload = pickle_task(fn, args, added)
        if not self._alive:
            self.start()
        elif self._booting is not None:  # launched: wait for the ranks to join
            self._await_start(self._booting)
        self._path.update(added)
        if not queued:
            for path in self._stacks:
                open(path, "w").close()
        return self._send_task(payload, fn, deadline, what)

    def _send_task(
        self, payload: bytes, fn: Callable[..., Any], deadline: float, what: str | None
    ) -> Pending:
        slot = self._runs % SEQUENCE_SLOTS
        self._runs += 1
        # Empty, before any rank starts this task: a slow rank's file must not show an earlier
        # task's collectives to the evidence polling (``collection``).
        emptying, self._emptying[slot] = self._emptying[slot], None
        if emptying is not None:
            emptying.result()
        else:
            _empty(self._sequences[slot])
        pending = Pending(
            self,
            what or str(getattr(fn, "__qualname__", repr(fn))),
            deadline,
            slot,
            started=not self._in_flight,
        )
        try:
            for conn in self._conns:
                conn.send_bytes(payload + slot.to_bytes(1, "little"))
        except OSError:
            if not self._in_flight:  # a broken pipe: ranks may be mid-task, never reuse them
                self.kill()
                raise
            # A rank of the running task has died: collecting that task reports it, from the
            # evidence a kill now would remove; this one never runs.
            pending.lost = True
            return pending
        except BaseException:
            self.kill()
            raise
        self._in_flight.append(pending)
        return pending

    def collective_sequences(self) -> list[str]:
        """Each rank's collective sequence (``ddpcheck._rank.recorder`` format) of the
        last task, read when it ended (the world may since have been replaced)."""
        return list(self._last_sequences)

    def _empty_slot_later(self, slot: int) -> None:
        """The slot's task was read (``collection``): its files are emptied off this thread, so
        that the slot's next task finds them empty."""
        self._emptying[slot] = _empty_later(self._sequences[slot])

    def _finish(self, pending: Pending) -> list[Any]:
        """Collect ``pending``, the running task, by its deadline; see :meth:`run`. The task
        queued behind it starts now: its deadline counts from here."""
        self.notes, self.unfit, self._last_sequences = (), {}, []
        try:
            return Collection(
                self,
                pending.what,
                max(pending.end - time.monotonic(), 0.0),
                slot=pending.slot,
                allowed=pending.deadline,
            ).collect()
        except WorldFailure:
            raise
        except BaseException:  # Ctrl-C: ranks are mid-task, never reuse them
            self.kill()
            raise
        finally:
            if self._in_flight and self._in_flight[0] is pending:
                self._in_flight.pop(0)
                for queued in self._in_flight:
                    queued.start_clock()

    def __repr__(self) -> str:
        state = "alive" if self._alive else "stopped"
        return (
            f"World(world_size={self.world_size}, backend={self.backend!r}, "
            f"device={self.device!r}, {state})"
        )


def _empty(paths: list[str]) -> None:
    """Empty the files that exist, creating none: run off the main thread while a kill removes
    the world's directory, a file created again between its emptied listing and its removal
    left the directory behind."""
    for path in paths:
        try:
            os.truncate(path, 0)
        except OSError:  # not written yet, or the world was killed meanwhile
            pass


#: One thread for every world's emptying (started on first use): a thread per task cost
#: 0.12 ms of CPU to start, twice a hand-over to a waiting one.
_EMPTIER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddpcheck-empty")


def _empty_later(paths: list[str]) -> Future | None:
    """Empty ``paths`` off this thread: on ext4, emptying a file that holds data waits for the
    journal (0.2 ms a file here, 90% of it waiting), which was 6% of this process's time per
    random example when done right before the next task went out. None: emptied here, as the
    interpreter is exiting (no new work for threads then)."""
    try:
        return _EMPTIER.submit(_empty, list(paths))
    except RuntimeError:
        _empty(paths)
        return None


#: Every world started and not yet closed or killed (``registry.shutdown_worlds`` stops them).
LIVE_WORLDS: set[World] = set()


class TaskLost(Exception):
    """A queued task whose world was replaced before it was collected (:meth:`World.submit`):
    it did not run in a fit world -- run it again. Never a verdict."""


class Pending:
    """A task submitted to every rank of a world (:meth:`World.submit`), not yet collected."""

    def __init__(self, world: World, what: str, deadline: float, slot: int, started: bool):
        self.world, self.what, self.slot = world, what, slot
        self.deadline = deadline  # seconds the task may take once it runs
        self.end = time.monotonic() + deadline if started else math.inf  # queued: not yet
        self.lost = False  # the world was replaced before this task was collected
        self._done = False

    @property
    def done(self) -> bool:
        """Collected (or abandoned) already."""
        return self._done

    def start_clock(self) -> None:
        """The task before this one was collected: this one runs now, its deadline from here."""
        if self.end == math.inf:
            self.end = time.monotonic() + self.deadline

    def collect(self) -> list[Any]:
        """Every rank's result, rank 0 first (what :meth:`World.run` returns), or
        :class:`WorldFailure`; :class:`TaskLost` for a queued task whose world was replaced
        before (see :meth:`World.submit`). Once only."""
        if self._done:
            raise RuntimeError(f"{self.what} was collected already")
        if not self.lost and self.world._in_flight[:1] != [self]:
            raise RuntimeError(
                f"{self.what} collected out of order: collect tasks in the "
                "order they were submitted"
            )
        self._done = True
        if self.lost:
            raise TaskLost(f"{self.what}: its world was replaced before it was collected")
        return self.world._finish(self)

    def abandon(self) -> None:
        """The caller will not collect (it failed meanwhile): the ranks are mid-task, so the
        world is replaced."""
        if not self._done:
            self._done = True
            if not self.lost:
                self.world.kill()
