"""A smaller counterexample for a battery failure: the first verdict ``ddpcheck check`` shows.

A battery scenario is representative, not minimal (``sample-branch-accumulate``: a model with a
sample-gated branch, three micro-batches, nesterov momentum, one-parameter buckets), and
Hypothesis cannot shrink an example it did not draw itself. So, once one fails at W, Hypothesis
draws scenarios at W (and at the world size it resumed in, if another: :func:`searched_sizes`)
from ``strategies.exercising`` for each feature the failing scenario exercises (plain scenarios
first: its shrinking leans towards the first branch), stops at the first failure and shrinks it,
within :data:`EXAMPLES` and :data:`SECONDS`; the smallest failure (:func:`size`) is run once more
before it may replace the battery's. :func:`first_verdict`
is that verdict as ``check`` prints it; :func:`with_features` ends every verdict of ``check``
with the features its counterexample exercises.

Invariant: nothing here becomes a verdict unless it failed twice with an equivalence error that
is not a timeout, and is smaller than the battery scenario. A search that cannot go on (a slow
machine, a world that cannot start, its own error) leaves the battery's verdict standing, and so
does a failure that passes when run again. A Ctrl-C is never caught.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Callable, Mapping

from hypothesis import strategies as st

from ddpcheck._base.errors import EquivalenceError
from ddpcheck._language import features
from ddpcheck._language import strategies as dst
from ddpcheck._language.messages import exception_text, scenario_line
from ddpcheck._language.scenario import Scenario, build_model
from ddpcheck._oracle.consumed import FOREIGN, STEPS_DIFFER
from ddpcheck._oracle.sample_weights import DROPPED, DUPLICATED
from ddpcheck._runs.engine import Draws, Example, Plan, outcome_of, search
from ddpcheck._runs.example import check_example
from ddpcheck._runs.replay import possibly_racy
from ddpcheck._runs.settings import DEFAULT_SETTINGS, Settings
from ddpcheck.targets import support
from ddpcheck.targets.known_bugs import known_bug_line
from ddpcheck.targets.protocol import Target

__all__ = [
    "DATA_PATH_KINDS",
    "EXAMPLES",
    "MIN_DEADLINE",
    "SECONDS",
    "Search",
    "first_verdict",
    "searched_sizes",
    "size",
    "smaller",
    "with_features",
]

#: What a framework's own data path fed wrong (``_oracle.consumed``): the batch plan of an epoch.
DATA_PATH_KINDS = frozenset((FOREIGN, STEPS_DIFFER, DROPPED, DUPLICATED))
#: Examples Hypothesis may draw before its first failure (shrinking steps not counted).
EXAMPLES = 60
#: Seconds the search may take, shrinking included; a shrink cut short keeps the smallest
#: failure so far. The confirming run and an example in flight come on top.
SECONDS = 15.0
#: Seconds one example of the search may always take (a hang is waited for this long at least,
#: however little of the budget is left; a working rank is never called hung: ``_world.progress``).
MIN_DEADLINE = 15.0


@dataclasses.dataclass
class Search:
    """How the search for a smaller counterexample ended."""

    #: the smaller counterexample, failed twice; None: the battery's verdict stands
    error: EquivalenceError | None
    examples: int  # examples run, shrinking and the confirming run included
    seconds: float
    why: str = ""  # error None: why the battery's verdict stands
    #: a failure of the search passed when run again: the battery's verdict may be a race too
    raced: bool = False


def size(scenario: Scenario, world_size: int) -> int:
    """How much a reader holds in mind to follow an example: its parameter tensors, samples,
    steps, micro-batches per step and the features it exercises at ``world_size``."""
    tensors = len(list(build_model(scenario, scenario.seed).parameters()))
    return (
        tensors
        + scenario.global_batch
        + scenario.steps
        + scenario.accumulation
        + len(features.of(scenario, world_size))
    )


def searched_sizes(found: EquivalenceError) -> tuple[int, ...]:
    """Where the search draws: the failing example's world size, then the one its checkpoint
    resumed in, if another (``checkpoint-resume`` at W=1 fails in the resumed world of 2)."""
    resumed = found.scenario.resume_world_size
    return (found.world_size,) + (() if resumed in (None, found.world_size) else (resumed,))


def smaller(
    target: Target,
    found: EquivalenceError,
    *,
    world_sizes: tuple[int, ...],
    without: frozenset[str] = frozenset(),
    seed: int | None = None,
    run: Settings = DEFAULT_SETTINGS,
    examples: int = EXAMPLES,
    seconds: float = SECONDS,
    degrees: Mapping[int, tuple[int, ...]] | None = None,
) -> Search:
    """Look for a counterexample smaller than ``found`` (a battery failure) at its world size
    (:func:`searched_sizes`), with the engine (``_runs.engine.search``): a hang is passed over,
    anything not the target's fault stops the search, and the budget counts from its start.

    ``world_sizes``: those the run allows (a drawn checkpoint may resume at one of them);
    ``without``: the features the user excluded; ``seed``: as ``ddpcheck check --seed`` (None:
    the same search every run); ``degrees``: ``{W: tensor-parallel degrees}`` the run allows
    (``--mesh``). Whatever goes wrong in the search leaves ``found`` standing
    (``Search.why`` says what); a Ctrl-C is raised."""
    searching = _Searching(target, run, seconds)
    try:
        return searching.run(found, world_sizes, without, seed, examples, degrees)
    except Exception as exc:  # the search's own failure: no verdict of its own
        return searching.ended(None, f"the search failed: {exception_text(exc)}")


@dataclasses.dataclass
class _Searching:
    """One search under way: what it runs, its budget, and what it has run."""

    target: Target
    settings: Settings
    seconds: float
    started: float = dataclasses.field(default_factory=time.perf_counter)
    examples: int = 0

    def ended(self, error: EquivalenceError | None, why: str = "", raced: bool = False) -> Search:
        return Search(error, self.examples, time.perf_counter() - self.started, why, raced)

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.started)

    def check(self, example: Example) -> tuple[str, ...]:
        """One example; a hang is waited for :data:`MIN_DEADLINE` at least, and no longer than
        the user's deadline."""
        self.examples += 1
        deadline = min(self.settings.deadline, max(MIN_DEADLINE, self.left()))
        return check_example(
            example.target,
            example.scenario,
            example.world_size,
            dataclasses.replace(self.settings, deadline=deadline),
        )

    def run(
        self,
        found: EquivalenceError,
        world_sizes: tuple[int, ...],
        without: frozenset[str],
        seed: int | None,
        examples: int,
        degrees: Mapping[int, tuple[int, ...]] | None = None,
    ) -> Search:
        battery, sizes = found.scenario, searched_sizes(found)
        unsupported = support.unsupported(self.target, without)
        draws = Draws(
            self.target,
            {
                w: _strategy(
                    battery,
                    found.world_size,
                    w,
                    unsupported,
                    world_sizes,
                    None if degrees is None else degrees.get(w),
                    data_path=_fed_wrong(found),
                )
                for w in sizes
            },
        )
        plan = Plan(
            examples=examples,
            seed=zlib.crc32(f"{seed}:{battery!r}:{sizes}".encode()),
            check=self.check,
            accept=lambda e: support.declines(e.target, e.scenario, e.world_size, without),
            seconds=self.seconds,
            hangs=False,  # a hang once is no verdict: the search looks elsewhere
            crash="stop",  # slow machine, a world that cannot start, ddpcheck's own
        )
        searched = search(draws, plan)
        if searched.stopped is not None:
            return self.ended(None, f"the search stopped: {searched.stopped}")
        if searched.flaky:
            return self.ended(
                None,
                "a failure of the search passed when Hypothesis ran it again (a race?)",
                raced=True,
            )
        if not searched.failures:
            return self.ended(None, "no example drawn failed")
        candidate = min(
            searched.failures.values(),
            key=lambda e: (size(e.scenario, e.world_size), e.world_size, len(repr(e.scenario))),
        )
        if size(candidate.scenario, candidate.world_size) >= size(battery, found.world_size):
            return self.ended(
                None,
                f"the smallest failure found ({scenario_line(candidate.scenario)}) is no smaller",
            )
        return self.confirmed(candidate)

    def confirmed(self, candidate: EquivalenceError) -> Search:
        """``candidate`` run once more: its error if it fails again (not by a timeout)."""
        outcome, why = None, ""
        try:
            outcome = outcome_of(
                self.check, Example(self.target, candidate.world_size, candidate.scenario)
            )
        except Exception as exc:  # slow machine, a world that cannot start, ddpcheck's own
            why = f"running it again stopped: {exception_text(exc)}"
        if outcome is None:
            pass
        elif outcome.error is not None and "rank timed out" not in outcome.error.kinds:
            return self.ended(outcome.error)
        elif outcome.error is not None:
            why = "it hung when run again"
        elif outcome.skipped is not None:  # not expected: it ran once
            why = f"it could not run again: {outcome.skipped}"
        else:
            why = "it passed when run again (a race?)"
        return self.ended(
            None,
            f"a smaller example failed ({scenario_line(candidate.scenario)}), but {why}",
            raced=why.endswith("(a race?)"),
        )


def first_verdict(
    target: Target,
    found: EquivalenceError,
    *,
    world_sizes: tuple[int, ...],
    without: frozenset[str],
    seed: int | None,
    say: Callable[[str], object],
    run: Settings,
    degrees: Mapping[int, tuple[int, ...]] | None = None,
) -> tuple[EquivalenceError, str]:
    """``ddpcheck check``'s verdict on a battery failure: the smaller counterexample
    :func:`smaller` confirmed, else ``found``; and what to call it. ``say`` prints each line of
    the way (``run``: the deadline, device and backend). A battery scenario that hung is not
    searched: a hang in the search is no verdict, and each would cost it a deadline."""
    where = f"{found.name} failed at world size {found.world_size} ({found.kinds[0]})"
    if set(found.kinds) == {"rank timed out"}:
        say(f"battery: {where}; a hang, so no smaller one is searched for\n")
        return found, "the battery scenario (not shrunk)"
    sizes = searched_sizes(found)
    say(
        f"battery: {where}; searching for a smaller counterexample at world size"
        f"{'s' if len(sizes) > 1 else ''} {','.join(map(str, sizes))} (at most {EXAMPLES} "
        f"examples, {SECONDS:g} s)"
    )
    search = smaller(
        target,
        found,
        world_sizes=world_sizes,
        without=without,
        seed=seed,
        run=run,
        examples=EXAMPLES,
        seconds=SECONDS,
        degrees=degrees,
    )
    ran = f"{search.examples} example{'' if search.examples == 1 else 's'}"
    if search.error is None:
        say(
            f"none found ({ran}, {search.seconds:.1f} s): {search.why}; the battery scenario "
            "stands\n"
        )
        if search.raced:  # its replay line repeats the example: a race may pass it once
            found = possibly_racy(found)
        return found, "the battery scenario (not shrunk)"
    say(
        f"smaller counterexample found and confirmed ({ran}, {search.seconds:.1f} s): "
        f"{scenario_line(search.error.scenario)} at W={search.error.world_size}, where "
        f"{found.name} is {scenario_line(found.scenario)} at W={found.world_size}\n"
    )
    return search.error, "the shrunk counterexample"


def with_features(error: EquivalenceError, what: str, survey: str) -> EquivalenceError:
    """``error``, its verdict ending with the features ``what`` exercises (what the bug needs
    is among them) and, where more than its dtype and the broadcast every example has are
    named, the ``survey`` command that says which of them fail at which world sizes; then, on a
    release known to carry an upstream bug that can explain it, one line naming that bug and
    the release that fixed it (``targets.known_bugs``)."""
    try:
        found = features.named(features.of(error.scenario, error.world_size))
    except Exception:  # read once already; the verdict stands without the line
        return error
    lines = [f"{what} exercises: {', '.join(found)} (what the bug needs is among them)"]
    if set(found) - {error.scenario.dtype, "broadcast"}:
        lines.append(f"which of them fail, at which world sizes: {survey}")
    known = known_bug_line(error.target, set(found), error.scenario)  # an upstream bug
    if known is not None:
        lines.append(known)
    error.args = (f"{error.args[0]}\n\n" + "\n".join(lines),)
    return error


def _fed_wrong(found: EquivalenceError) -> bool:
    """Whether a framework's own data path fed ``found``'s scenario other samples or steps than
    its epochs make: a failure only scenarios with epochs can show."""
    return found.scenario.epochs is not None and found.divergences[0].kind in DATA_PATH_KINDS


def _strategy(
    battery: Scenario,
    failed_at: int,
    world_size: int,
    unsupported: frozenset[str],
    world_sizes: tuple[int, ...],
    degrees: tuple[int, ...] | None = None,
    *,
    data_path: bool = False,
) -> st.SearchStrategy:
    """Scenarios at ``world_size`` in the battery scenario's dtype: plain ones first, then ones
    made to exercise each feature the battery scenario exercises at ``failed_at`` -- but its
    dtype and ``broadcast`` (every scenario has them), and at W=1 what one rank cannot. A
    ``data_path`` failure (:func:`_fed_wrong`) is searched among scenarios with epochs alone:
    elsewhere the search would shrink to another face of the bug (accelerate's ignored
    ``split_batches`` keyword also steps the LR schedule W times), not the batch plan it broke."""
    dtype = battery.dtype
    if data_path and "epochs" not in unsupported and dst.can_exercise("epochs", world_size):
        return dst.exercising(
            "epochs",
            world_size=world_size,
            dtypes=(dtype,),
            without=unsupported,
            resume_world_sizes=world_sizes,
            opt_in=frozenset(features.OPT_IN) - unsupported,
            tp_degrees=degrees,
        )
    found = features.of(battery, failed_at)
    rows = [
        f
        for f in features.FEATURES
        if f in found
        and f not in (dtype, "broadcast")
        and f not in unsupported
        and (f not in dst.FLOAT32_ONLY or dtype == "float32")
        and dst.can_exercise(f, world_size)
    ]
    opt_in = frozenset(features.OPT_IN) - unsupported
    return st.one_of(
        [
            dst.exercising(
                f,
                world_size=world_size,
                dtypes=(dtype,),
                without=unsupported,
                resume_world_sizes=world_sizes,
                opt_in=opt_in,
                tp_degrees=degrees,
            )
            for f in (dtype, *rows)
        ]
    )
