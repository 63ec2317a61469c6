"""Why a ``World.run`` did not complete: every rank's state, and who is to blame.

Plain data, built by the parent (``worlds``) and read by the front ends; no process handling here.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

from ddpcheck._base import errors
from ddpcheck._base.errors import DdpcheckError, WorldStartError  # the world raises WorldStartError

if TYPE_CHECKING:
    from ddpcheck._world.sequences import Disagreement

__all__ = ["Failure", "RankState", "Status", "WorldFailure", "WorldStartError"]


class Status(str, enum.Enum):
    """What one rank did during a failed ``World.run`` (a ``str``: ``"raised"`` compares equal,
    as it did before these had a type)."""

    RETURNED = "returned"
    RAISED = "raised"
    EXITED = "exited"  # the process died
    STUCK = "stuck"  # out past the deadline, waiting
    WORKING = "working"  # out past the deadline, still computing (a slow machine)
    UNFIT = "unfit"  # returned, but left what later code computes changed
    REFUSED = "refused"  # ddpcheck's own outcome, raised in the rank

    __str__ = str.__str__  # "raised" in messages, not "Status.RAISED"


class Failure(str, enum.Enum):
    """Why a ``World.run`` did not complete: :attr:`WorldFailure.kind` (a ``str`` too)."""

    RAISED = "raised"
    EXITED = "exited"
    TIMEOUT = "timeout"
    SLOW = "slow"
    MISMATCH = "mismatch"
    CONTAMINATED = "contaminated"
    REFUSED = "refused"

    __str__ = str.__str__


@dataclasses.dataclass(frozen=True)
class RankState:
    """What one rank did during a failed ``World.run``."""

    rank: int
    status: Status
    #: traceback, exit description, stack dump, what an unfit rank changed, or (refused) the
    #: ddpcheck outcome the task raised as "ExceptionName: message"
    detail: str = ""
    log_tail: str = ""  # last lines the rank wrote to stdout/stderr

    def describe(self) -> str:
        head = {
            "returned": f"rank {self.rank}: returned normally",
            "raised": f"rank {self.rank}: raised",
            "exited": f"rank {self.rank}: process exited ({self.detail})",
            "stuck": f"rank {self.rank}: did not return in time; it was here:",
            "working": f"rank {self.rank}: still working when the wait ended; it was here:",
            "unfit": f"rank {self.rank}: returned, but left what later code computes changed: "
            f"{self.detail}",
            "refused": f"rank {self.rank}: ddpcheck refused the task: {self.detail}",
        }[self.status]
        body = "" if self.status in ("returned", "exited", "unfit", "refused") else self.detail
        text = head + ("\n" + _indent(body) if body else "")
        if self.log_tail and self.status != "returned":
            text += "\n" + _indent("last output of the rank:\n" + self.log_tail)
        return text


class WorldFailure(DdpcheckError):
    """A ``World.run`` that did not complete on every rank (``ddpcheck.World``'s own failure;
    ``check_example`` turns it into the rows of an ``EquivalenceError``).

    ``kind`` is ``"raised"`` (a rank raised an exception), ``"exited"`` (a rank process died),
    ``"timeout"`` (the deadline passed with the ranks still out and waiting, on each other or on
    anything else: hung), ``"slow"`` (they were still working -- on a CPU or waiting for one --
    however long the wait went on: ``progress.Overtime``; ``slowness`` says how long; no verdict
    on the target), ``"mismatch"`` (the ranks issued different collectives
    at the same index, or a rank finished with fewer: the cause, whatever happened next; reported
    as soon as the sequences show it cannot resolve), ``"contaminated"`` (every rank returned,
    but one left a change that alters what later code computes, such as a global module hook:
    ``ddpcheck._rank.fitness``; ``results`` then holds every rank's result, so the
    numbers are judged first) or ``"refused"`` (ddpcheck's own code in the ranks raised one of
    its outcomes -- a default hook that cannot serve this target declines the example --, not the
    target's fault). ``ranks`` holds one :class:`RankState` per rank; ``disagreement`` the first
    collective where the ranks' sequences disagree (a
    ``ddpcheck._world.sequences.Disagreement``, or None when they agree, with
    ``collectives`` then saying how many they issued); ``notes`` what the ranks left behind and
    ddpcheck put right (``World.notes``).
    """

    def __init__(
        self,
        kind: Failure | str,
        world_size: int,
        ranks: list[RankState],
        what: str,
        disagreement: Disagreement | None = None,
        collectives: str = "",
        *,
        results: list[object] | None = None,
        notes: tuple[str, ...] = (),
        slowness: str = "",
    ):
        self.kind = Failure(kind)
        self.world_size = world_size
        self.ranks = ranks
        self.what = what
        self.disagreement = disagreement
        self.collectives = collectives
        self.results = results
        self.notes = notes
        self.slowness = slowness
        super().__init__(self._format())

    @property
    def guilty(self) -> list[int]:
        """The ranks the evidence singles out: the ranks that died, else those that raised, else
        (contamination) those left unfit; for a pure hang, the stuck ranks the others wait for
        (those that issued nothing where the others did). For a mismatch, none: which side of
        it is wrong the sequences cannot tell (the majority may be the side that skipped a
        collective), so the message says what each side issued (``Disagreement.sides``)."""
        if self.kind == "mismatch":
            return []
        for status in ("exited", "raised", "refused") + (
            ("unfit",) if self.kind == "contaminated" else ()
        ):
            bad = [s.rank for s in self.ranks if s.status == status]
            if bad:
                return bad
        stuck = [s.rank for s in self.ranks if s.status in ("stuck", "working")]
        behind = [] if self.disagreement is None else self.disagreement.behind
        return [r for r in stuck if r in behind] or stuck

    def refusal(self) -> DdpcheckError:
        """For a ``"refused"`` failure: the outcome ddpcheck's own code raised in the ranks (the
        first refusing rank's), rebuilt here -- a decline, or its glue's ``InternalError``."""
        state = next(s for s in self.ranks if s.status == "refused")
        name, _, message = state.detail.partition(": ")
        cls = getattr(errors, name, None)
        if not (isinstance(cls, type) and issubclass(cls, DdpcheckError)):
            cls = errors.SetupError
        return cls(message)

    def _format(self) -> str:
        verdict = {
            "raised": "a rank raised",
            "exited": "a rank process exited",
            "timeout": "the deadline passed with the ranks waiting",
            "slow": f"not finished: {self.slowness} -- too slow for the deadline on this "
            "machine, not hung",
            "mismatch": "the ranks issued mismatched collectives",
            "contaminated": "a rank left a change that alters what later code computes",
            "refused": "ddpcheck refused the task in the ranks",
        }[self.kind]
        guilty = self.guilty
        blame = (
            f"guilty rank(s): {', '.join(map(str, guilty))}"
            if guilty
            else "no rank singled out: the evidence shows what each side issued, not which is wrong"
        )
        lines = [f"{self.what} failed in a world of {self.world_size}: {verdict} ({blame})"]
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
                text = text.replace(
                    f"rank {state.rank}:", f"ranks {', '.join(map(str, ranks))}:", 1
                )
            lines.append(text)
        return "\n".join(lines)


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.rstrip().splitlines())
