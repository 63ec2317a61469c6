"""Calls of a user's sharding rule inside rank processes, each under a deadline.

Invariant: the rule is never called in the parent. Every call runs inside a rank process of a
persistent world (one rank for the pure checks, 2..4 for the cross-rank check) under two
deadlines: a ``SIGALRM`` interval timer that interrupts a call still running after ``limit``
seconds (loops, ``time.sleep``, lock waits), and a ``faulthandler`` watchdog that dumps the stack
and ends the rank a few seconds later (a hang inside C code that never returns to the
interpreter; see ``_Guard``). Before each call the rank writes which input it is calling the
rule on to a progress file, so the parent (``ddpcheck._rules.check``) knows which input was
to blame when a rank dies or the world's own deadline passes.
"""

from __future__ import annotations

import faulthandler
import math
import numbers
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterable, Sequence, Sized
from types import FrameType
from typing import TypeAlias, TypedDict

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from ddpcheck._rules.params import (
    ParamSpec,
    describe,
    param_lists_strategy,
    parameter_lists,
)

__all__ = [
    "Answer",
    "BALANCE_WORLD_SIZES",
    "HARD_FLOOR",
    "HARD_GRACE",
    "HARD_REFRESH",
    "KINDS",
    "MAX_WORLD_SIZE",
    "Rule",
    "SearchResult",
    "answers_in_rank",
    "brief_owners",
    "hang_text",
    "rule_name",
    "search_in_rank",
]

#: Violation kinds, in the order they are reported.
KINDS = (
    "raised",
    "hangs",
    "crashed",
    "wrong length",
    "not an integer",
    "out of range",
    "nondeterministic",
    "rank-dependent",
)
#: World sizes of the pure checks (drawn; several exceed the length of many lists).
MAX_WORLD_SIZE = 8
#: World sizes of the balance report on GPT-like parameters.
BALANCE_WORLD_SIZES = (2, 3, 4, 8)
#: Seconds after the per-call deadline before a call stuck in C code ends its rank (at most
#: HARD_REFRESH more, and never before HARD_FLOOR seconds; see ``_Guard``).
HARD_GRACE = 2.0
HARD_REFRESH = 5.0
HARD_FLOOR = 10.0

#: Frames under this folder (the ddpcheck package) are ddpcheck's, not the rule's.
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------
# One guarded call of the rule (inside a rank process)


class _Hung(BaseException):
    """Raised into a call of the rule by SIGALRM (BaseException: ``except Exception`` in the rule
    cannot swallow it)."""


class _Stop(BaseException):
    """Ends the Hypothesis search at once (a hang is not shrunk: each attempt costs a deadline)."""


#: A sharding rule: ``(parameters, world_size) ->`` one owner rank per parameter -- what the
#: user's rule returns is checked (:func:`_validate`), so any value.
Rule: TypeAlias = Callable[[list[torch.Tensor], int], object]
#: One call of the rule: ``("ok", owners)``, or ``(kind, detail)`` of what went wrong (the
#: payload is a tuple exactly when the kind is "ok").
Answer: TypeAlias = tuple[str, "tuple[int, ...] | str"]


class SearchResult(TypedDict):
    """What :func:`search_in_rank` answers."""

    found: dict[str, str]  # kind -> the message of its smallest violation
    examples: int
    budget_reached: bool
    sample: list[tuple[ParamSpec, ...]]
    gpt_owners: dict[int, list[int]]


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise _Hung()


class _Progress:
    """The progress file of one rank: which call of the rule is running, if any."""

    def __init__(self, directory: str, rank: int):
        self.path = os.path.join(directory, f"rank{rank}.calling")
        self.hang_path = os.path.join(directory, f"rank{rank}.hung")
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self.hang_file = open(self.hang_path, "w")  # noqa: SIM115 -- closed by close()

    def calling(self, where: str) -> None:
        data = ("calling\n" + where).encode()
        os.pwrite(self._fd, data, 0)
        os.ftruncate(self._fd, len(data))

    def idle(self) -> None:
        os.ftruncate(self._fd, 0)

    def close(self) -> None:
        os.close(self._fd)
        self.hang_file.close()


class _Guard:
    """Deadlines around every call of the rule in this rank, and the search's time budget.

    Each call gets a ``SIGALRM`` after ``limit`` seconds. The hard stop, a ``faulthandler``
    watchdog that dumps the stack and ends the process, is armed for the guard's whole life and
    pushed back at the start of a call once it is ``HARD_REFRESH`` seconds old (re-arming it per
    call costs a thread join, milliseconds on a loaded machine), so it fires within
    ``limit + HARD_GRACE + HARD_REFRESH`` seconds of the start of a call that never returns to
    the interpreter, and never during a call that returns within ``limit``.
    """

    def __init__(self, limit: float, progress: _Progress, budget: float):
        self.limit = limit
        self.progress = progress
        self.ends = time.monotonic() + budget
        self.out_of_time = False
        self._saved: Callable[[int, FrameType | None], object] | int | None = None
        self._armed_at = -math.inf

    def __enter__(self) -> _Guard:
        self._saved = signal.signal(signal.SIGALRM, _on_alarm)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, self._saved)
        self.progress.close()

    def _arm(self) -> None:
        now = time.monotonic()
        if now - self._armed_at > HARD_REFRESH:
            faulthandler.dump_traceback_later(
                max(self.limit + HARD_GRACE, HARD_FLOOR) + HARD_REFRESH,
                exit=True,
                file=self.progress.hang_file,
            )
            self._armed_at = now

    def call(self, rule: Rule, params: list[torch.Tensor], world_size: int, where: str) -> Answer:
        """``("ok", owners)``, or ``(kind, detail)``: ``raised``, ``hangs`` or the kind of an
        invalid answer (validated inside the deadline too: the answer is the rule's object)."""
        if time.monotonic() > self.ends:
            self.out_of_time = True
            raise _Stop()
        self._arm()
        self.progress.calling(where)
        try:
            signal.setitimer(signal.ITIMER_REAL, self.limit)
            try:
                try:
                    answer = rule(list(params), world_size)
                except _Hung:
                    raise
                except BaseException as exc:  # SystemExit too: a rule returns, it does not exit
                    return "raised", _exception_text(exc)
                return _validate(answer, len(params), world_size)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _Hung as hung:
            return "hangs", hang_text(self.limit, hung)
        finally:
            self.progress.idle()


def hang_text(limit: float, hung: BaseException | None = None) -> str:
    text = f"did not return within the {limit:g} s deadline (--deadline)"
    frames = traceback.extract_tb(hung.__traceback__) if hung is not None else []
    theirs = [f for f in frames if not os.path.abspath(f.filename).startswith(_HERE + os.sep)]
    if theirs:  # the innermost frame outside ddpcheck: where the rule was
        text += f"; it was at {theirs[-1].filename}:{theirs[-1].lineno} in {theirs[-1].name}"
    return text


def _exception_text(exc: BaseException) -> str:
    try:
        return f"raised {type(exc).__name__}: {_short(str(exc))}"
    except Exception:
        return f"raised {type(exc).__name__}"


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _safe_repr(value: object) -> str:
    try:
        return _short(repr(value), 120)
    except Exception:
        return f"<{type(value).__name__} whose repr raised>"


def _validate(answer: object, n: int, world_size: int) -> Answer:
    """``("ok", owners tuple)`` or ``(kind, detail)`` for an answer of the rule."""
    try:
        if isinstance(answer, torch.Tensor):
            answer = answer.tolist()
        if isinstance(answer, (str, bytes, dict)) or not isinstance(answer, Sized):
            return "wrong length", (
                f"returned {_safe_repr(answer)}, not a sequence; a rule "
                "returns one owner rank per parameter"
            )
        owners = _listed(answer)
    except Exception as exc:
        return "wrong length", (
            f"returned {_safe_repr(answer)}, which cannot be read as a "
            f"sequence ({type(exc).__name__}: {_short(str(exc), 100)})"
        )
    if len(owners) != n:
        return "wrong length", (
            f"returned {len(owners)} owner{'' if len(owners) == 1 else 's'} "
            f"for {n} parameter{'' if n == 1 else 's'}; a rule returns exactly "
            "one owner rank per parameter, in order"
        )
    ranks: list[int] = []
    for i, owner in enumerate(owners):
        if isinstance(owner, bool) or not isinstance(owner, numbers.Integral):
            return "not an integer", (
                f"returned owner {_safe_repr(owner)} (type "
                f"{type(owner).__name__}) for parameter {i}; owners are int "
                "ranks"
            )
        if not 0 <= int(owner) < world_size:
            return "out of range", (
                f"returned owner {owner!r} for parameter {i}; owners must be "
                f"in [0, world_size={world_size})"
            )
        ranks.append(int(owner))
    return "ok", tuple(ranks)


def _listed(value: Sized) -> list[object]:
    if not isinstance(value, Iterable):
        raise TypeError(f"'{type(value).__name__}' object is not iterable")
    return list(value)


def _answer(
    guard: _Guard, rule: Rule, params: list[torch.Tensor], world_size: int, where: str, call: str
) -> Answer:
    return guard.call(rule, params, world_size, f"{call}\n{where}")


def _twice(
    guard: _Guard, rule: Rule, specs: Sequence[ParamSpec], world_size: int, where: str
) -> Answer:
    """Call the rule twice on one input: ``("ok", owners)``, or ``(kind, detail)`` of its first
    violation."""
    params = [s.tensor() for s in specs]
    kind, first = _answer(guard, rule, params, world_size, where, "the first call")
    if not isinstance(first, tuple):  # not "ok": its detail
        return kind, first
    kind, again = _answer(guard, rule, params, world_size, where, "the second call")
    if not isinstance(again, tuple):  # not "ok": its detail
        return kind, f"on the second call (the first answered {brief_owners(first)}), {again}"
    if again != first:
        return "nondeterministic", (
            f"answered {brief_owners(first)} and then "
            f"{brief_owners(again)}; a rule must be a pure function "
            "of the parameters' shapes, dtypes and order and of "
            "world_size"
        )
    return "ok", first


def _where(world_size: int, specs: Sequence[ParamSpec], name: str | None = None) -> str:
    return f"at world size {world_size} on {describe(specs, name)}"


# ---------------------------------------------------------------------------------------------
# The pure checks: one task in a world of one rank


_FOUND = {
    kind: type(f"RuleViolation_{kind.replace(' ', '_').replace('-', '_')}", (Exception,), {})
    for kind in KINDS
}


def search_in_rank(
    rule: Rule, examples: int, seed: int | None, limit: float, directory: str, budget: float
) -> SearchResult:
    """Hypothesis search, then the named lists; the smallest violation of each kind found, and on
    success the owners on GPT-like parameters for the balance report."""
    # `one` below reads these names: its source is what Hypothesis derives the derandomized
    # seed from (function_digest), so it stays as it was
    smallest = _Smallest(rule_name(rule))
    found, note = smallest.found, smallest.note
    tried: list[tuple[ParamSpec, ...]] = []
    gpt_owners: dict[int, list[int]] = {}

    with _Guard(limit, _Progress(directory, 0), budget) as guard:
        # Explicit settings, no database: the user's Hypothesis profile and examples do not apply.
        @settings(
            max_examples=examples,
            derandomize=seed is None,
            database=None,
            deadline=None,
            phases=(Phase.generate, Phase.shrink),
            verbosity=Verbosity.quiet,
            report_multiple_bugs=True,
            print_blob=False,
            suppress_health_check=list(HealthCheck),
        )
        @given(specs=param_lists_strategy(), world_size=st.integers(1, MAX_WORLD_SIZE))
        def one(specs: tuple[ParamSpec, ...], world_size: int) -> None:
            if not found:
                tried.append(specs)
            kind, detail = _twice(guard, rule, specs, world_size, _where(world_size, specs))
            if kind == "ok":
                return
            note(kind, detail, specs, world_size)
            if kind == "hangs":
                raise _Stop()  # not shrunk: every attempt would cost a deadline
            raise _FOUND[kind](detail)  # one exception type per kind: each is shrunk on its own

        if seed is not None:
            one = hypothesis_seed(seed)(one)
        try:
            try:
                one()
            except Exception:  # our violations (one, several, or flaky): `found` holds them
                if not found:
                    raise
            if not found:
                _named_lists(guard, rule, smallest, gpt_owners)
        except _Stop:
            pass
    return {
        "found": {kind: message for kind, (_, message) in found.items()},
        "examples": len(tried),
        "budget_reached": guard.out_of_time,
        "sample": _sample(tried),
        "gpt_owners": gpt_owners,
    }


class _Smallest:
    """The smallest violation of each kind noted: ``found`` maps a kind to its key (parameters,
    world size) and its message."""

    def __init__(self, name: str):
        self.name = name  # the rule's (rule_name)
        self.found: dict[str, tuple[tuple, str]] = {}

    def note(
        self,
        kind: str,
        detail: tuple[int, ...] | str,  # a violation's detail (typed as _twice answers it)
        specs: Sequence[ParamSpec],
        world_size: int,
        list_name: str | None = None,
    ) -> None:
        # Fewest parameters, then smallest world; among equals the latest, which Hypothesis's
        # shrinker found simpler than the ones before it.
        key = (len(specs), world_size)
        if kind not in self.found or key <= self.found[kind][0]:
            where = _where(world_size, specs, list_name)
            self.found[kind] = (key, f"{kind}: {self.name} {where}: {detail}")


def _named_lists(
    guard: _Guard, rule: Rule, smallest: _Smallest, gpt_owners: dict[int, list[int]]
) -> None:
    """The rule on every named parameter list at every world size: its first violation noted
    (then :class:`_Stop`), and the owners on the GPT-like lists kept for the balance report."""
    for list_name, specs in parameter_lists().items():
        for world_size in range(1, MAX_WORLD_SIZE + 1):
            kind, answer = _twice(
                guard, rule, specs, world_size, _where(world_size, specs, list_name)
            )
            if not isinstance(answer, tuple):  # not "ok": its detail
                smallest.note(kind, answer, specs, world_size, list_name)
                raise _Stop()
            if list_name == "gpt-like" and world_size in BALANCE_WORLD_SIZES:
                gpt_owners[world_size] = list(answer)


def _sample(tried: list[tuple[ParamSpec, ...]], count: int = 24) -> list[tuple[ParamSpec, ...]]:
    """Some of the drawn lists, for the cross-rank check: the first ones and a spread."""
    if len(tried) <= count:
        chosen = tried
    else:
        step = len(tried) / count
        chosen = [tried[int(i * step)] for i in range(count)]
    return sorted(set(chosen), key=lambda specs: (len(specs), [s.describe() for s in specs]))


# ---------------------------------------------------------------------------------------------
# The cross-rank check: one task in each world of 2..4 ranks


def answers_in_rank(
    rule: Rule,
    lists: list[tuple[str | None, Sequence[ParamSpec]]],
    limit: float,
    directory: str,
    budget: float,
) -> list[Answer]:
    """Inside a rank: this rank's answer (or failure) on each list at the world's size; stops at
    the first hang (the other ranks' answers on later lists would not be compared anyway)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    answers: list[Answer] = []
    with _Guard(limit, _Progress(directory, rank), budget) as guard:
        for list_name, specs in lists:
            params = [s.tensor() for s in specs]
            try:
                answer = _answer(
                    guard,
                    rule,
                    params,
                    world_size,
                    f"in a world of {world_size} processes on rank {rank}, on "
                    f"{describe(specs, list_name)}",
                    "the call",
                )
            except _Stop:  # out of time: compare what every rank got through
                break
            answers.append(answer)
            if answer[0] == "hangs":
                break
    return answers


def rule_name(rule: object) -> str:
    """How messages name a rule: ``module.qualname`` when it has one, else its repr."""
    name = getattr(rule, "__qualname__", None) or getattr(rule, "__name__", None)
    module = getattr(rule, "__module__", None)
    return f"{module}.{name}" if name and module else repr(rule)


def brief_owners(answer: Sequence[int], limit: int = 12) -> str:
    text = ", ".join(map(str, list(answer)[:limit]))
    return f"[{text}{', ...' if len(answer) > limit else ''}]"
