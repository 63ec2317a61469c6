"""Searching a target for a counterexample within a time budget.

Invariant: a *search* is a callable ``search(target, budget_seconds, *, world_sizes, deadline) ->
Outcome``; it runs examples in the persistent worlds until one diverges (``outcome.counterexample``
is set), its examples run out (``outcome.exhausted``), or ``budget_seconds`` of examples have run
-- the one example in flight is allowed to finish, under a deadline of at most
``max(MIN_DEADLINE, what is left of the budget)``. World start-up and the single-process
references are paid by :func:`warm_up`, outside the budget, because they are shared by every
target searched in this process.

:func:`battery_search` walks the built-in battery (``ddpcheck.battery.BATTERY``) x world sizes,
world size major -- W=2 first, the cheapest world where replicas can disagree, then 3 (divisor and
ordering bugs that W=2 hides), 4, and 1 last (a bug visible at W=1 is visible at W=2 too).
:func:`default_search` is the Hypothesis-driven search with shrinking, which falls back on it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterable, Sequence

from ddpcheck._internal.options import DEFAULT_DEADLINE, DEFAULT_WORLD_SIZES
from ddpcheck._internal.validation import check_positive_number, check_world_sizes

__all__ = ["Counterexample", "Outcome", "Scored", "Search", "battery_search", "default_search",
           "find_counterexample", "score", "table_lines", "warm_up"]

#: Seconds an example may always take, however little budget is left. A healthy example takes
#: milliseconds, but a loaded 2-core machine stretches that by orders of magnitude, and a timeout
#: counts as a kill -- so this stays generous: it only bounds how long a hanging one is waited for.
MIN_DEADLINE = 15.0
#: World sizes of the battery search, in the order it tries them.
SEARCH_ORDER = (2, 3, 4, 1)


@dataclasses.dataclass
class Counterexample:
    """The first failing example a search found."""

    name: str  # scenario name (battery) or a short description
    scenario: Any
    world_size: int
    kind: str  # the first divergence's kind, e.g. "reference differs (gradient)"
    error: Any  # the ddpcheck.EquivalenceError, with its table and replay line

    def one_line(self) -> str:
        first = self.error.divergences[0]
        where = "" if first.name in ("-", None) else f" {first.name}"
        step = "" if first.step == "-" else f" step {first.step}"
        return f"{self.name} W={self.world_size}{step}: {self.kind}{where}"


@dataclasses.dataclass
class Outcome:
    counterexample: Counterexample | None
    examples: int  # examples run, the failing one included
    seconds: float
    exhausted: bool  # every example of the search ran (False: the budget ran out first)


Search = Callable[..., Outcome]

_REFERENCES: dict[str, Any] = {}


def _reference(name: str, scenario: Any) -> Any:
    from ddpcheck.api import prepare_reference

    if name not in _REFERENCES:
        _REFERENCES[name] = prepare_reference(scenario)
    return _REFERENCES[name]


def _battery_examples(world_sizes: Sequence[int]) -> list[tuple[str, Any, int]]:
    from ddpcheck.battery import BATTERY

    ordered = [w for w in SEARCH_ORDER if w in world_sizes]
    ordered += [w for w in world_sizes if w not in ordered]
    return [(name, scenario, w) for w in ordered for name, scenario in BATTERY]


def warm_up(world_sizes: Iterable[int]) -> None:
    """Start the worlds and compute the battery's references (shared by every search)."""
    from ddpcheck.battery import BATTERY
    from ddpcheck._internal.options import STARTUP_DEADLINE
    from ddpcheck._internal.world import get_world

    for name, scenario in BATTERY:
        _reference(name, scenario)
    for w in world_sizes:
        # a fresh world's first example would otherwise pay for importing the harness
        get_world(w).run(_import_harness, deadline=STARTUP_DEADLINE, what="warm-up")


def _import_harness() -> None:
    """Inside a rank: import what examples use (cheap once imported)."""
    import ddpcheck.mutation.catalogue  # noqa: F401 -- also imports parallel and the targets
    import ddpcheck._internal.runner  # noqa: F401


def battery_search(target: Any, budget_seconds: float, *, world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
                   deadline: float = DEFAULT_DEADLINE) -> Outcome:
    """Battery x world sizes, in :data:`SEARCH_ORDER`, until the first divergence."""
    from ddpcheck.api import check_example
    from ddpcheck.errors import EquivalenceError

    check_positive_number("budget_seconds", budget_seconds)
    sizes = check_world_sizes("world_sizes", world_sizes)
    started = time.perf_counter()
    examples = 0
    for name, scenario, w in _battery_examples(sizes):
        spent = time.perf_counter() - started
        if spent >= budget_seconds:
            return Outcome(None, examples, spent, exhausted=False)
        if target.supports(scenario) is not None:
            continue
        examples += 1
        try:
            check_example(target, scenario, w, reference=_reference(name, scenario), name=name,
                          deadline=min(deadline, max(MIN_DEADLINE, budget_seconds - spent)))
        except EquivalenceError as err:
            found = Counterexample(name, scenario, w, err.kinds[0], err)
            return Outcome(found, examples, time.perf_counter() - started, exhausted=False)
    return Outcome(None, examples, time.perf_counter() - started, exhausted=True)


def default_search() -> Search:
    """The search ``ddpcheck mutants`` uses: random examples shrunk by Hypothesis, then the
    battery for whatever budget is left (:func:`ddpcheck.fuzz.shrinking_search`)."""
    from ddpcheck.fuzz import shrinking_search

    return shrinking_search


def find_counterexample(target: Any, budget_seconds: float, *, search: Search | None = None,
                        **options: Any) -> Counterexample | None:
    """The first counterexample ``search`` (default :func:`default_search`) finds, or None."""
    return (search or default_search())(target, budget_seconds, **options).counterexample


# ---------------------------------------------------------------------------------------------
# Scoring a mutant catalogue


@dataclasses.dataclass
class Scored:
    """One row of the mutant table."""

    name: str
    bug_class: str
    outcome: Outcome
    control: bool = False  # the unmutated target: it must *not* be killed

    @property
    def killed(self) -> bool:
        return self.outcome.counterexample is not None

    @property
    def as_expected(self) -> bool:
        return self.killed != self.control

    def row(self) -> list[str]:
        o = self.outcome
        if self.killed:
            verdict = "FALSE ALARM" if self.control else "killed"
        elif self.control:
            verdict = "passes" if o.exhausted else "passes (budget)"
        else:
            verdict = "SURVIVED" if o.exhausted else "SURVIVED (budget)"
        found = o.counterexample.one_line() if o.counterexample else "-"
        return [self.name, self.bug_class, verdict, str(o.examples), f"{o.seconds:.2f}", found]


TABLE_HEADER = ["mutant", "class", "killed?", "examples", "seconds", "counterexample"]


def table_lines(rows: list[list[str]], widths: list[int] | None = None) -> list[str]:
    """Markdown-compatible table lines (header, rule, rows), columns padded to ``widths``."""
    widths = widths or [max(len(r[i]) for r in [TABLE_HEADER] + rows)
                        for i in range(len(TABLE_HEADER))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return [line(TABLE_HEADER), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
            *[line(r) for r in rows]]


def score(mutants: Iterable[Any], budget_seconds: float, *, control: Any = None,
          world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES, search: Search | None = None,
          deadline: float = DEFAULT_DEADLINE, on_row: Callable[[Scored], None] | None = None) -> list[Scored]:
    """Search every mutant (``ddpcheck.mutation.catalogue.Mutant``) for a counterexample within
    ``budget_seconds`` each; ``control`` (the unmutated target), if given, is searched first with
    no budget limit short of exhausting the search. ``on_row`` sees each row as it completes."""
    search = search or default_search()
    out = []
    todo = [(m.name, m.bug_class, m.target, False) for m in mutants]
    if control is not None:
        todo.insert(0, ("(unmutated)", "-", control, True))
    for name, bug_class, target, is_control in todo:
        budget = float("inf") if is_control else budget_seconds
        warm_up(world_sizes)  # respawns a world the previous mutant broke, outside the budget
        outcome = search(target, budget, world_sizes=world_sizes, deadline=deadline)
        scored = Scored(name, bug_class, outcome, control=is_control)
        out.append(scored)
        if on_row is not None:
            on_row(scored)
    return out
