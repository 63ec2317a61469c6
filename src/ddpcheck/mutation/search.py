"""Searching a target for a counterexample within a time budget.

Invariant: a *search* is a callable ``search(target, budget_seconds, *, world_sizes, deadline) ->
Outcome``; it runs examples in the persistent worlds until one diverges (``outcome.counterexample``
is set), its examples run out (``outcome.exhausted``), or ``budget_seconds`` of examples have run
-- the one example in flight is allowed to finish, under a deadline of at most
``max(MIN_DEADLINE, what is left of the budget)``. World start-up and the single-process
references are paid by :func:`warm_up`, outside the budget, because they are shared by every
target searched in this process.

:func:`battery_search` walks the built-in battery (``ddpcheck.battery.BATTERY``; the
tensor-parallel one for a target that applies plans) x world sizes,
world size major -- W=2 first, the cheapest world where replicas can disagree, then 3 (divisor and
ordering bugs that W=2 hides), 4, and 1 last (a bug visible at W=1 is visible at W=2 too).
:func:`shrinking_search` (the default of ``ddpcheck mutants``) fuzzes first, for a counterexample
Hypothesis has shrunk, and falls back on the battery.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from collections.abc import Callable, Iterable, Sequence

from ddpcheck._base.errors import EquivalenceError, NothingChecked
from ddpcheck._base.options import (
    DEFAULT_DEADLINE,
    DEFAULT_WORLD_SIZES,
    STARTUP_DEADLINE,
    check_positive_number,
    check_world_sizes,
)
from ddpcheck._language.battery import BATTERY, PIPELINE_BATTERY, TENSOR_PARALLEL_BATTERY
from ddpcheck._language.messages import scenario_line as brief
from ddpcheck._language.scenario import Scenario
from ddpcheck._oracle.reference import Reference
from ddpcheck._runs.alone import TargetSetupError
from ddpcheck._runs.example import check_example, prepare_reference
from ddpcheck._runs.fuzz import fuzz
from ddpcheck._runs.settings import Settings
from ddpcheck._world.registry import get_world
from ddpcheck.targets.protocol import Target
from ddpcheck.targets.support import battery_for, declines

__all__ = [
    "Counterexample",
    "Outcome",
    "Search",
    "battery_search",
    "brief",
    "shrinking_search",
    "warm_up",
]

#: Seconds an example may always take, however little budget is left. A healthy example takes
#: milliseconds, but a loaded 2-core machine stretches that by orders of magnitude, and a timeout
#: counts as a kill -- so this stays generous: it only bounds how long a hanging one is waited for.
MIN_DEADLINE = 15.0
#: World sizes of the battery search, in the order it tries them.
#: The kind a mutant is killed by when its bug raises without data parallelism (exit 2 for a user)
ALONE = "fails without data parallelism"

SEARCH_ORDER = (2, 3, 4, 1)


@dataclasses.dataclass
class Counterexample:
    """The first failing example a search found."""

    name: str  # scenario name (battery) or a short description
    scenario: Scenario
    world_size: int
    kind: str  # the first divergence's kind, e.g. "reference differs (gradient)"
    #: with its table and replay line; or the mutant's bug fails without data parallelism
    #: (``_runs.alone``): exit 2 for a user, still caught
    error: EquivalenceError | TargetSetupError

    def one_line(self) -> str:
        if isinstance(self.error, TargetSetupError):
            return f"{self.name} W={self.world_size}: {self.kind} (`{self.error.hook}`)"
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

_REFERENCES: dict[str, Reference] = {}


def _reference(name: str, scenario: Scenario) -> Reference:
    if name not in _REFERENCES:
        _REFERENCES[name] = prepare_reference(scenario)
    return _REFERENCES[name]


def _battery_examples(
    target: Target, world_sizes: Sequence[int]
) -> list[tuple[str, Scenario, int]]:
    """The battery ``target`` is checked on (the tensor-parallel one for a target that applies
    plans, ``targets.support.battery_for``) x world sizes, in search order."""
    ordered = [w for w in SEARCH_ORDER if w in world_sizes]
    ordered += [w for w in world_sizes if w not in ordered]
    return [(name, scenario, w) for w in ordered for name, scenario in battery_for(target)]


def warm_up(world_sizes: Iterable[int], modules: Iterable[str] = ()) -> None:
    """Start the worlds, import ``modules`` (the targets' own) in every rank, and compute the
    battery's references: shared by every search, so paid outside the budgets."""
    for name, scenario in [*BATTERY, *TENSOR_PARALLEL_BATTERY, *PIPELINE_BATTERY]:
        _reference(name, scenario)
    for w in world_sizes:
        # a fresh world's first example would otherwise pay for importing the harness
        get_world(w).run(
            _import, ("ddpcheck._rank.runner", *modules), deadline=STARTUP_DEADLINE, what="warm-up"
        )


def _import(modules: tuple[str, ...]) -> None:
    """Inside a rank: import what examples use (cheap once imported)."""
    for name in modules:
        importlib.import_module(name)


def battery_search(
    target: Target,
    budget_seconds: float,
    *,
    world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
    deadline: float = DEFAULT_DEADLINE,
) -> Outcome:
    """Battery x world sizes, in :data:`SEARCH_ORDER`, until the first divergence."""
    check_positive_number("budget_seconds", budget_seconds)
    sizes = check_world_sizes("world_sizes", world_sizes)
    started = time.perf_counter()
    examples = 0
    for name, scenario, w in _battery_examples(target, sizes):
        spent = time.perf_counter() - started
        if spent >= budget_seconds:
            return Outcome(None, examples, spent, exhausted=False)
        if declines(target, scenario, w) is not None:
            continue
        examples += 1
        try:
            check_example(
                target,
                scenario,
                w,
                Settings(deadline=min(deadline, max(MIN_DEADLINE, budget_seconds - spent))),
                reference=_reference(name, scenario),
                name=name,
            )
        except EquivalenceError as err:
            found = Counterexample(name, scenario, w, err.kinds[0], err)
            return Outcome(found, examples, time.perf_counter() - started, exhausted=False)
        except NothingChecked:  # declined once running (a data path's world size): no example
            examples -= 1
        except TargetSetupError as err:  # the bug needs no second rank: caught all the same
            found = Counterexample(name, scenario, w, ALONE, err)
            return Outcome(found, examples, time.perf_counter() - started, exhausted=False)
    return Outcome(None, examples, time.perf_counter() - started, exhausted=True)


def shrinking_search(
    target: Target,
    budget_seconds: float,
    *,
    world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
    deadline: float = DEFAULT_DEADLINE,
    fuzz_share: float = 0.5,
    examples: int = 200,
    fuzz_config: bool = False,
) -> Outcome:
    """Up to ``examples`` random examples first, for a
    *shrunk* counterexample, within ``fuzz_share`` of the budget; if they find none, the
    built-in battery (not shrunk, but aimed at every bug class) gets the rest.
    ``fuzz_config``: the random examples draw the target's options too (the mutants behind an
    option, ``catalogue.OPTION_CATALOGUE``)."""
    check_positive_number("budget_seconds", budget_seconds)
    started = time.perf_counter()
    share = budget_seconds * fuzz_share
    try:
        result = fuzz(
            target,
            examples=examples,
            world_sizes=world_sizes,
            deadline=deadline,
            time_budget=None if share == float("inf") else share,
            fuzz_config=fuzz_config,
        )
    except TargetSetupError as alone:  # the bug needs no second rank: caught all the same
        found = Counterexample(
            f"random[{brief(alone.scenario)}]", alone.scenario, alone.world_size, ALONE, alone
        )
        return Outcome(found, 1, time.perf_counter() - started, exhausted=False)
    err = result.error
    if err is not None:
        found = Counterexample(
            f"random[{brief(err.scenario)}]", err.scenario, err.world_size, err.kinds[0], err
        )
        return Outcome(
            found,
            result.first_failure or result.examples,
            time.perf_counter() - started,
            exhausted=False,
        )
    rest = battery_search(
        target,
        max(budget_seconds - (time.perf_counter() - started), 1e-3),
        world_sizes=world_sizes,
        deadline=deadline,
    )
    rest.examples += result.examples
    rest.seconds = time.perf_counter() - started
    return rest
