"""Waiting for one task's answers: every rank's result, or a failure naming every rank's state.

Why an object of its own: the wait is one loop with a dozen pieces of state (the answers so far,
what the sequence files last showed and since when, when the first rank failed, how far past the
deadline the ranks still work, what the task left behind) and several ways to end; as one method
of ``World`` it could not be read at once. :class:`Collection` keeps that state in fields and
each phase in a method short enough to read: :meth:`~Collection._gather` what the ranks sent (one
message per rank: died without answering, ``Returned``, ``Refused`` or ``Raised``),
:meth:`~Collection._watch` the sequence files for a collective that cannot complete,
:meth:`~Collection._past_limit` tell a failure's grace from a hang from slowness past the
deadline (``progress.Overtime``), then :meth:`~Collection._conclude`: the results, or the failure
with the stacks of the ranks still out. ``worlds.World`` starts one per task (and one for its
start-up) and owns everything else: processes, files, queued tasks.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sized
from multiprocessing.connection import wait as _wait_any
from typing import Any, Protocol

from ddpcheck._rank.boundary import Raised, Refused, Returned
from ddpcheck._rank.serve import NESTED_MARKER
from ddpcheck._world import progress
from ddpcheck._world.failures import Failure, RankState, Status, WorldFailure, WorldStartError
from ddpcheck._world.lending import released
from ddpcheck._world.processes import dump_stacks, exit_description, read, receive, tail

__all__ = ["EVIDENCE_GRACE", "FAILURE_GRACE", "POLL_INTERVAL", "Collection", "Host"]

#: Once one rank has failed, how long the others get to finish before they are presumed stuck
#: waiting for it in a collective.
FAILURE_GRACE = 2.0
#: Seconds between two readings of the sequence files while a task runs (the first reading comes
#: this long after the task started, so a healthy example, ~10 ms, never pays for one).
POLL_INTERVAL = 0.3
#: Seconds the sequence files must keep showing the same collective that cannot complete, with no
#: rank returning meanwhile, before the task is failed as a mismatch: long enough for a rank that
#: only looks stuck to move on, far shorter than any deadline.
EVIDENCE_GRACE = 2.0


class Host(Protocol):
    """What a collection reads and sets on its world: ``worlds.World``, which imports this
    module (a Protocol, so that this one need not import it back)."""

    world_size: int
    _dir: str | None
    _procs: list[Any]
    _conns: list[Any]
    _logs: list[str]
    _stacks: list[str]
    _sequences: list[list[str]]
    _sources: dict[str, int]
    notes: tuple[str, ...]
    unfit: dict[int, str]
    _last_sequences: list[str]

    @property
    def _in_flight(self) -> Sized: ...

    def kill(self) -> None: ...

    def _empty_slot_later(self, slot: int) -> None: ...


class Collection:
    """Wait for one message from every rank of ``world``, or fail with every rank's state.

    While waiting, the sequence files are watched for a collective that cannot complete
    (:meth:`_hopeless`); start-up issues no collectives, so it is not watched. ``deadline``: the
    seconds left to wait; ``allowed``: the task's whole deadline, of which a queued task has
    ``deadline`` left (None: the same)."""

    def __init__(
        self,
        world: Host,
        what: str,
        deadline: float,
        *,
        starting: bool = False,
        slot: int = 0,
        allowed: float | None = None,
    ):
        self.world, self.what, self.starting, self.slot = world, what, starting, slot
        self.allowed = deadline if allowed is None else allowed
        n = world.world_size
        self.results: list[Any] = [None] * n
        self.states: dict[int, RankState] = {}
        self.pending = set(range(n))
        started = time.monotonic()
        self.end = started + deadline
        self.next_poll = started + POLL_INTERVAL
        self.evidence: tuple | None = None  # what the sequence files last showed, and since when
        self.evidence_since = 0.0
        self.failed_at: float | None = None
        self.kind: Failure | None = None
        self.left: dict[str, list[int]] = {}  # what the task left behind (put right) -> ranks
        self.replacing = False  # a rank's process cannot be put right: replace the world after
        # past the deadline: hung, or working on a slow or loaded machine? (progress)
        self.overtime = progress.Overtime(self.allowed, started, self._progress)

    def collect(self) -> list[Any]:
        """Every rank's result, rank 0 first; or :class:`WorldFailure` (the world killed unless
        every rank answered and it can serve the next task)."""
        try:
            while self.pending:
                if not self._round():
                    break
        except WorldStartError as error:  # from here: the user's frames, none of the wait's
            raise error.with_traceback(None) from None
        return self._conclude()

    # -- waiting -------------------------------------------------------------------------------

    def _watching(self) -> bool:
        """Whether the sequence files are read: never at start-up, nor once a rank failed."""
        return not self.starting and self.kind is None

    def _round(self) -> bool:
        """Wait once for answers (until the next reading of the sequence files, at most), and
        read what came; False: the wait is over with ranks still out."""
        limit = (
            self.end if self.failed_at is None else min(self.end, self.failed_at + FAILURE_GRACE)
        )
        now = time.monotonic()
        if now >= limit:
            return self._past_limit(now)
        timeout = (min(limit, self.next_poll) if self._watching() else limit) - now
        self._gather(self._wait(max(timeout, 0.0)))
        return self._watch()

    def _past_limit(self, now: float) -> bool:
        """The wait reached its limit: a failed rank's peers had their grace (over); past the
        deadline the ranks still out are hung or too slow (over), or still working (wait on, the
        answers still collected meanwhile)."""
        if self.failed_at is not None:
            return False
        decided = self.overtime.decide(now, self.pending)
        if isinstance(decided, str):
            self.kind = Failure(decided)
            return False
        self.end = decided
        return True

    def _wait(self, timeout: float) -> list[Any]:
        """The pipes and process sentinels of the ranks still out that are ready, within
        ``timeout`` seconds (the thread's waits lent meanwhile: ``lending``)."""
        world = self.world
        waitables = [world._conns[r] for r in self.pending] + [
            world._procs[r].sentinel for r in self.pending
        ]
        with released():
            return _wait_any(waitables, timeout)

    # -- what the ranks sent -------------------------------------------------------------------

    def _gather(self, ready: list[Any]) -> None:
        """Read the answer of every rank whose pipe or process is ``ready``; the first failure
        starts the grace of the others (:data:`FAILURE_GRACE`)."""
        for rank in sorted(self.pending):
            conn, proc = self.world._conns[rank], self.world._procs[rank]
            if conn in ready or proc.sentinel in ready:
                self._receive(rank)
                self.pending.discard(rank)
                if self.kind is not None and self.failed_at is None:
                    self.failed_at = time.monotonic()

    def _receive(self, rank: int) -> None:
        """One rank's message: its result, or how it failed."""
        message = receive(self.world._conns[rank])
        if message is None:  # the process died without answering
            self._died(rank)
        elif isinstance(message, Returned):  # unfit or not: judge the result first
            self._returned(rank, message)
        elif isinstance(message, Refused):  # ddpcheck's own outcome, in the rank
            self._refused(rank, message)
        else:
            self._raised(rank, message)

    def _died(self, rank: int) -> None:
        proc = self.world._procs[rank]
        proc.join(1.0)
        if self.starting:
            self._refuse_if_nested()
        self.states[rank] = RankState(
            rank,
            Status.EXITED,
            exit_description(proc.exitcode),
            log_tail=tail(self.world._logs[rank]),
        )
        self.kind = self.kind or Failure.EXITED

    def _returned(self, rank: int, message: Returned) -> None:
        self.results[rank] = message.result
        self.world._sources.update(message.files)
        self.replacing = self.replacing or message.replace
        for note in message.notes:
            self.left.setdefault(note, []).append(rank)
        self.states[rank] = (
            RankState(
                rank,
                Status.UNFIT,
                "; ".join(message.unfit),
                log_tail=tail(self.world._logs[rank]),
            )
            if message.unfit
            else RankState(rank, Status.RETURNED)
        )

    def _refused(self, rank: int, message: Refused) -> None:
        self.states[rank] = RankState(rank, Status.REFUSED, f"{message.outcome}: {message.message}")
        self.replacing = self.replacing or message.replace
        self.kind = self.kind or Failure.REFUSED

    def _raised(self, rank: int, message: Raised) -> None:
        self.states[rank] = RankState(
            rank, Status.RAISED, message.traceback, log_tail=tail(self.world._logs[rank])
        )
        self.kind = self.kind or Failure.RAISED

    def _refuse_if_nested(self) -> None:
        """A rank left because re-importing the main module started a world: say so, once."""
        world_dir = self.world._dir
        if world_dir is not None and os.path.exists(os.path.join(world_dir, NESTED_MARKER)):
            main = getattr(sys.modules.get("__main__"), "__file__", None) or "the main module"
            raise WorldStartError(
                f"{main} calls ddpcheck when it is imported, and every rank process re-imports "
                "the main module (multiprocessing's spawn); put that call under "
                '`if __name__ == "__main__":`'
            )

    # -- what the sequence files show ----------------------------------------------------------

    def _watch(self) -> bool:
        """Every :data:`POLL_INTERVAL`, read the sequence files; False: they showed the same
        collective that cannot complete for :data:`EVIDENCE_GRACE`, the ranks still out are
        stuck (a mismatch)."""
        now = time.monotonic()
        if not (self.pending and self._watching() and now >= self.next_poll):
            return True
        self.next_poll = now + POLL_INTERVAL
        seen = self._hopeless()
        if seen is None or seen != self.evidence:
            self.evidence, self.evidence_since = seen, now
        elif now - self.evidence_since >= EVIDENCE_GRACE:
            self.kind = Failure.MISMATCH  # unchanged for the grace: the pending ranks are stuck
            return False
        return True

    def _read_sequences(self) -> list[str]:
        return [read(path) for path in self.world._sequences[self.slot]]

    def _hopeless(self) -> tuple | None:
        """The sequence files' texts and the finished ranks if they show a collective that can
        never complete (``sequences.Disagreement.mismatched``: different collectives at one
        index, or one that a finished rank never issued), else None. Identical files are never
        parsed."""
        finished = set(range(self.world.world_size)) - self.pending
        texts = self._read_sequences()
        from ddpcheck._world import sequences  # (see _failure)

        if sequences.same_texts(texts):
            return None
        disagreement = sequences.diagnose([sequences.parse(t) for t in texts], finished)
        if disagreement is None or not disagreement.mismatched:
            return None
        return tuple(texts), frozenset(finished)

    def _progress(self, ranks: set[int]) -> tuple[progress.Reading | None, int]:
        """What ``ranks``' processes have done so far (``progress.read``), and how many bytes
        of collectives all ranks have written to the slot's sequence files."""
        reading = progress.read({r: self.world._procs[r].pid for r in ranks}, time.monotonic())
        written = 0
        for path in self.world._sequences[self.slot]:
            try:
                written += os.path.getsize(path)
            except OSError:
                pass
        return reading, written

    # -- the end -------------------------------------------------------------------------------

    def _conclude(self) -> list[Any]:
        """The wait is over: leave the world its notes, the sequences and the unfit ranks; then
        the results, or the failure."""
        world = self.world
        world.notes = tuple(
            f"{note} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))})"
            for note, ranks in self.left.items()
        )
        if self.replacing:
            world.notes += (
                "a new world for the next task: this one's processes could not be put "
                "back as they started",
            )
        world._last_sequences = self._read_sequences()  # before a kill removes the files
        world.unfit = {r: s.detail for r, s in self.states.items() if s.status == Status.UNFIT}
        if not self.pending and self.kind is None:  # done: the caller judges, then `unfit`
            if self.replacing:
                world.kill()
            elif not self.starting:  # read: the slot's next task finds its files empty
                world._empty_slot_later(self.slot)
            return self.results
        if self._answered_with_a_refusal():
            raise self._refusal()
        raise self._breakdown()

    def _answered_with_a_refusal(self) -> bool:
        """Every rank answered, at least one refused, and none raised or died."""
        return (
            not self.pending
            and self.kind == Failure.REFUSED
            and all(
                s.status in (Status.RETURNED, Status.REFUSED, Status.UNFIT)
                for s in self.states.values()
            )
        )

    def _refusal(self) -> WorldFailure:
        """Every rank answered: the world can serve the next task -- unless one is queued,
        which a rank that refused early may have started while its peers still issued this
        task's collectives."""
        failure = self._failure(Failure.REFUSED)
        if self.replacing or len(self.world._in_flight) > 1:
            self.world.kill()
        return failure

    def _breakdown(self) -> WorldFailure:
        """Ranks are still out: their stacks, then the world killed."""
        world, kind = self.world, self.kind
        dumps = dump_stacks(world._procs, world._stacks, sorted(self.pending), self.allowed)
        status = Status.WORKING if kind == Failure.SLOW else Status.STUCK
        for rank in sorted(self.pending):
            self.states[rank] = RankState(
                rank, status, dumps[rank], log_tail=tail(world._logs[rank])
            )
        failure = self._failure(
            kind or Failure.TIMEOUT,
            self.overtime.describe(time.monotonic()) if kind == Failure.SLOW else "",
        )
        world.kill()
        return failure

    def _failure(self, kind: Failure, slowness: str = "") -> WorldFailure:
        """The failure, with the first collective where the ranks' sequences disagree; a real
        mismatch (different collectives, or a finished rank that issued fewer) is the kind."""
        # here, not at import: it loads torch (records), and the command line launches its
        # worlds before importing torch, so the ranks boot while it imports (bench/throughput)
        from ddpcheck._world import sequences

        states = [self.states[r] for r in range(self.world.world_size)]
        seqs = [sequences.parse(text) for text in self._read_sequences()]
        finished = [s.rank for s in states if s.status in (Status.RETURNED, Status.UNFIT)]
        disagreement = sequences.diagnose(seqs, finished)
        if disagreement is not None and disagreement.mismatched:
            kind = Failure.MISMATCH
        if kind == Failure.REFUSED and any(
            s.status in (Status.RAISED, Status.EXITED) for s in states
        ):
            kind = next(
                Failure(s.status) for s in states if s.status in (Status.RAISED, Status.EXITED)
            )
        summary = "" if disagreement is not None else sequences.agreement_summary(seqs)
        return WorldFailure(
            kind,
            self.world.world_size,
            states,
            self.what,
            disagreement,
            summary,
            notes=self.world.notes,
            slowness=slowness,
        )
