"""Fuzzing a target: Hypothesis draws scenarios and world sizes, the oracle judges, and a failure
is shrunk to a minimal counterexample with its divergence table and replay line.

This is what ``ddpcheck check`` runs after the built-in battery, and what ``ddpcheck mutants``
uses to hunt each mutant (``ddpcheck.mutation.search.shrinking_search``).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Callable, Iterable

from hypothesis import HealthCheck, Phase, assume, given
from hypothesis import seed as hypothesis_seed
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.errors import FlakyFailure, Unsatisfiable

from ddpcheck import features
from ddpcheck import strategies as dst
from ddpcheck._internal.devices import check_fits
from ddpcheck._internal.options import (DEFAULT_DEADLINE, DEFAULT_WORLD_SIZES,
                                        check_positive_number, check_world_sizes)
from ddpcheck._internal.runs.example import check_example
from ddpcheck.errors import EquivalenceError, InvalidArgument, NothingChecked, ScenarioError

__all__ = ["FuzzResult", "fuzz", "terminal_progress"]


@dataclasses.dataclass
class FuzzResult:
    """How a fuzzing run ended."""

    examples: int  # examples run, shrinking included
    first_failure: int | None  # examples run until the first failure (1-based), if any
    seconds: float
    error: Any = None  # the shrunk EquivalenceError, if any
    #: Examples not checked, by reason: the target declined them (``supports``), or the oracle
    #: could not judge them (``unjudgeable: ...``).
    declined: dict[str, int] = dataclasses.field(default_factory=dict)
    #: The features (``ddpcheck.features``) the examples that ran exercised.
    features: set[str] = dataclasses.field(default_factory=set)
    #: What examples left in the rank processes and ddpcheck put right (never a verdict).
    notes: dict[str, None] = dataclasses.field(default_factory=dict)

    @property
    def found(self) -> bool:
        return self.error is not None


#: Drawn scenarios declined with none run yet -- at least this many, and twice the examples
#: asked for -- after which the rest of the examples pass unjudged: the caller reports nothing
#: checked in seconds, with the reasons, where Hypothesis alone would draw 1,000 (~60 s of
#: building models) before giving up.
GIVE_UP_AFTER_DECLINED = 200


def fuzz(target: Any, *, examples: int = 100, world_sizes: Any = DEFAULT_WORLD_SIZES,
         seed: int | None = None, deadline: float = DEFAULT_DEADLINE, dtypes: tuple = ("float64",),
         progress: Callable[[int, float], None] | None = None,
         time_budget: float | None = None, without: Iterable[str] = (), device: str = "cpu",
         backend: str | None = None, shrink: bool = True) -> FuzzResult:
    """Run up to ``examples`` random examples of ``target``; shrink the first failure.

    ``seed`` makes the run reproducible (default: derandomized, the same every time);
    ``time_budget`` (seconds) stops generating new examples once spent (shrinking still runs).
    Features the target does not support (``Target.supported_features``) or ``without`` excludes
    are not generated; the rare drawn example that still needs one is rejected (``assume``), so
    it costs no example of the budget -- until :data:`GIVE_UP_AFTER_DECLINED` (or twice
    ``examples``) were, with none run.
    ``device``/``backend``: where the ranks compute (as for ``ddpcheck.assert_equivalent``).
    ``shrink=False`` reports the first failure as drawn (Hypothesis replays it once), for a
    caller that needs the verdict, not a minimal counterexample: a failure that kills the world (a
    rank raised, hung or mismatched collectives) costs a new world and, for a mismatch, the
    seconds that prove it per shrinking step -- ~30 steps for a collective mismatch at W=2.
    """
    if isinstance(examples, bool) or not isinstance(examples, int) or examples < 1:
        raise InvalidArgument(f"examples={examples!r} must be a positive integer")
    sizes = check_world_sizes("world_sizes", world_sizes)
    check_positive_number("deadline", deadline)
    check_fits(device, sizes, backend)  # before Hypothesis draws anything
    started = time.perf_counter()
    excluded = features.parse(without, "without")
    unsupported = features.unsupported(target, excluded)
    opt_in = frozenset(features.OPT_IN) - unsupported  # generated only for a target that opts in
    kept = tuple(d for d in dtypes if d not in unsupported)
    if not kept:
        raise NothingChecked(f"{type(target).__name__} supports none of the dtypes "
                             f"{', '.join(dtypes)} once --without is applied")
    dtypes = kept
    count = [0]
    give_up_after = max(GIVE_UP_AFTER_DECLINED, 2 * examples)
    first = [None]
    declined: dict[str, int] = {}
    exercised: set[str] = set()
    notes: dict[str, None] = {}

    # Built once, not per example: Hypothesis validates a strategy the first time it draws
    # from it, which cost 17 ms per example when they were built inside the test.
    scenario_strategies = {w: dst.scenarios(
        models=dst.models(mixed_dtypes=True, without=unsupported), dtypes=dtypes,
        without=unsupported, world_size=w, resume_world_sizes=sizes, opt_in=opt_in)
        for w in sizes}
    world_size_strategy = st.sampled_from(sizes)

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is None,
              suppress_health_check=list(HealthCheck), print_blob=False,
              phases=[Phase.generate, Phase.target] + ([Phase.shrink] if shrink else []))
    @given(data=st.data())
    def one(data):
        world_size = data.draw(world_size_strategy, label="world_size")
        scenario = data.draw(scenario_strategies[world_size], label="scenario")
        if count[0] == 0 and sum(declined.values()) >= give_up_after:
            return  # nothing this target runs is being drawn: the rest pass unjudged
        if time_budget is not None and first[0] is None \
                and time.perf_counter() - started > time_budget:
            return  # out of time: remaining examples pass without running
        why = features.declines(target, scenario, world_size, excluded)
        if why is not None:
            declined[why] = declined.get(why, 0) + 1
            assume(False)  # not generated, in effect: costs no example of the budget
        count[0] += 1
        if progress is not None:
            progress(count[0], time.perf_counter() - started)
        try:
            left = check_example(target, scenario, world_size, deadline=deadline,
                                 device=device, backend=backend)
        except EquivalenceError:
            if first[0] is None:
                first[0] = count[0]
            raise
        except ScenarioError as exc:  # the oracle cannot judge it: nobody's bug, not a failure
            declined[f"unjudgeable: {exc}"] = 1
            count[0] -= 1
            return
        except NothingChecked as exc:  # declined once running (a default hook cannot serve it)
            declined[str(exc)] = declined.get(str(exc), 0) + 1
            count[0] -= 1
            return
        exercised.update(features.of(scenario, world_size))
        notes.update(dict.fromkeys(left))

    if seed is not None:
        one = hypothesis_seed(seed)(one)
    try:
        one()
    except Unsatisfiable:  # every example drawn was declined: the caller reports nothing checked
        pass
    except EquivalenceError as error:
        return FuzzResult(count[0], first[0], time.perf_counter() - started, error, declined,
                          exercised, notes)
    except FlakyFailure as flaky:
        # The example failed, then passed when Hypothesis replayed it: a race (e.g. a gradient
        # read before its all-reduce finished). Still a counterexample; say it is intermittent.
        error = next((e for e in flaky.exceptions if isinstance(e, EquivalenceError)), None)
        if error is None:
            raise
        error.args = (f"{error.args[0]}\n\nintermittent: this example failed, then passed when "
                      "replayed -- a race or other nondeterminism in the target",)
        return FuzzResult(count[0], first[0], time.perf_counter() - started, error, declined,
                          exercised, notes)
    return FuzzResult(count[0], None, time.perf_counter() - started, None, declined,
                      exercised, notes)


def terminal_progress(total: int, stream: Any = None) -> Callable[[int, float], None] | None:
    """A live one-line progress report, only when ``stream`` is a terminal."""
    stream = stream or sys.stderr
    if not stream.isatty():
        return None

    def show(done: int, seconds: float) -> None:
        stream.write(f"\r  {done}/{total} examples, {seconds:.1f} s ")
        stream.flush()

    return show
