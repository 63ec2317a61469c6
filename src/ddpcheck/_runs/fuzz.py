"""Fuzzing a target: Hypothesis draws scenarios and world sizes, the oracle judges, and a failure
is shrunk to a minimal counterexample with its divergence table and replay line.

This is what ``ddpcheck check`` runs after the built-in battery, and what ``ddpcheck mutants``
uses to hunt each mutant (``ddpcheck.mutation.search.shrinking_search``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

from ddpcheck._base.errors import EquivalenceError, InvalidArgument, NothingChecked
from ddpcheck._base.options import DEFAULT_DEADLINE, DEFAULT_WORLD_SIZES, check_positive_number
from ddpcheck._runs.admission import Request, admit
from ddpcheck._runs.engine import Draws, Plan, search_pipelined, settings_check
from ddpcheck._runs.example import refuse_unconfirmed_hang
from ddpcheck._runs.replay import possibly_racy, target_spec
from ddpcheck._world.interrupts import interruptible
from ddpcheck.targets import support
from ddpcheck.targets.option_space import described, space_of, vary
from ddpcheck.targets.protocol import Target

__all__ = ["FuzzResult", "fuzz", "fuzz_admitted", "undrawable"]


@dataclasses.dataclass
class FuzzResult:
    """How a fuzzing run ended."""

    examples: int  # examples run, shrinking included
    first_failure: int | None  # examples run until the first failure (1-based), if any
    seconds: float
    error: EquivalenceError | None = None  # the shrunk counterexample, if any
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


@interruptible
def fuzz(
    target: Target,
    *,
    examples: int = 100,
    world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
    seed: int | None = None,
    deadline: float = DEFAULT_DEADLINE,
    dtypes: Iterable[str] | None = None,
    progress: Callable[[int, float], None] | None = None,
    time_budget: float | None = None,
    without: Iterable[str] = (),
    device: str = "cpu",
    backend: str | None = None,
    shrink: bool = True,
    only: Iterable[str] = (),
    fuzz_config: bool = False,
    meshes: Iterable[object] | None = None,
) -> FuzzResult:
    """Run up to ``examples`` random examples of ``target``; shrink the first failure.

    ``seed`` makes the run reproducible (default: the same examples every time);
    ``time_budget`` (seconds) stops generating new examples once spent (shrinking still runs).
    ``dtypes``: the dtypes drawn (default float64, as on the command line: ``_runs.admission``);
    ``only``: every example exercises one of these features. Features the target does not support
    (``Target.supported_features``) or ``without`` excludes are not generated; the rare drawn
    example that still needs one is rejected (``assume``), so it costs no example of the budget --
    until :data:`GIVE_UP_AFTER_DECLINED` (or twice ``examples``) were, with none run.
    ``device``/``backend``: where the ranks compute (as for ``ddpcheck.assert_equivalent``).
    ``shrink=False`` reports the first failure as drawn, without running it again, for a caller that
    needs the verdict, not a minimal counterexample: a failure that kills the world (a rank raised,
    hung or mismatched collectives) costs a new world and, for a mismatch, the seconds that prove it
    per shrinking step -- ~30 steps for a collective mismatch at W=2.
    ``fuzz_config=True``: every example draws a configuration of the target too
    (``Target.config_space``, ``ddpcheck.targets.option_space``), in the same Hypothesis draw, so
    a failure shrinks to the fewest options, then the simplest scenario; its verdict names the
    options and its replay line builds the configured target. Refused for a target with none.
    ``meshes``: ``(dp, pp, tp)`` mesh shapes -- ``(dp, tp)`` pairs, triples, or text as ``--mesh``
    spells them (``"tp=2"``, ``"dp=2xtp=2"``, ``"pp=2xtp=2"``) -- every example drawn on one of
    them, at world size ``dp * pp * tp``: for a target that applies tensor-parallel plans
    (``Target.parallelizes``) or runs pipelines (``Target.pipelines``); refused beside
    ``world_sizes``.

    How (``_runs.engine.search_pipelined``): the examples run one behind the other while
    Hypothesis draws in a thread of its own (``_runs.pipeline``); the first failure is shrunk by
    a second Hypothesis run, which draws the same examples and runs from the failing one on -- it is
    reported as intermittent if it passes there.
    """
    request = admit(
        target,
        world_sizes=world_sizes,
        deadline=deadline,
        without=without,
        dtypes=dtypes,
        device=device,
        backend=backend,
        only=only,
        fuzz_config=fuzz_config,
        meshes=meshes,
    )
    return fuzz_admitted(
        request,
        examples=examples,
        seed=seed,
        progress=progress,
        time_budget=time_budget,
        shrink=shrink,
    )


def fuzz_admitted(
    request: Request,
    *,
    examples: int = 100,
    seed: int | None = None,
    progress: Callable[[int, float], None] | None = None,
    time_budget: float | None = None,
    shrink: bool = True,
) -> FuzzResult:
    """:func:`fuzz` of an admitted request (``_runs.admission``): the command line's path. The
    search is the engine's pipelined one (``_runs.engine.search_pipelined``): what is drawn is a
    world size and a scenario for it (after a configuration of the target, ``fuzz_config``)."""
    if isinstance(examples, bool) or not isinstance(examples, int) or examples < 1:
        raise InvalidArgument(f"examples={examples!r} must be a positive integer")
    if time_budget is not None:
        check_positive_number("time_budget", time_budget)
    target, without, dtypes = request.target, request.without, request.random_dtypes
    why = undrawable(target, dtypes, without)
    if why is not None:
        raise NothingChecked(f"no random example can be drawn: {why}")
    # What the target runs, drawn as ddpcheck.strategies.examples draws it (declined draws are
    # tallied by the engine, not filtered).
    focus = request.only
    sizes, scenarios, excluded = support.example_strategies(
        target, request.world_sizes, dtypes, without, focus, request.degrees, request.layouts
    )
    space = space_of(target) if request.fuzz_config else None
    draws = Draws(
        target,
        {w: scenarios[w] for w in sizes},
        configurations=space,
        configure=_Variants(target) if space is not None else None,
    )
    plan = Plan(
        examples=examples,
        seed=seed,
        check=settings_check(request.run),
        accept=lambda e: support.declines(e.target, e.scenario, e.world_size, excluded, focus),
        give_up_after=max(GIVE_UP_AFTER_DECLINED, 2 * examples),
    )
    found = search_pipelined(
        draws, plan, request.run, progress=progress, time_budget=time_budget, shrink=shrink
    )
    error = found.error
    if error is not None and found.flaky:
        error = _intermittent(error)
    if error is not None and space is not None:
        error = _with_configuration(error, target)
    return FuzzResult(
        found.examples,
        found.first_failure,
        found.seconds,
        error,
        found.declined,
        found.features,
        found.notes,
    )


class _Variants:
    """A drawn option set -> the target it configures, built once per option set: its replay
    line must build it, refused now (``target_spec``), not on failure."""

    def __init__(self, target: Target):
        self._target = target
        self._built: dict[str, Target] = {}

    def __call__(self, chosen: Mapping[str, object]) -> Target:
        key = repr(chosen)
        if key not in self._built:
            variant = vary(self._target, chosen)
            target_spec(variant)
            self._built[key] = variant
        return self._built[key]


def undrawable(
    target: Target, dtypes: Iterable[str], without: frozenset[str] = frozenset()
) -> str | None:
    """Why no random example can be drawn for ``target`` -- every dtype asked for is excluded
    (``without``) or unsupported -- or None: ``ddpcheck check`` says so instead of announcing
    random examples that cannot come."""
    dtypes = tuple(dtypes)
    unsupported = support.unsupported(target, without)
    if any(d not in unsupported for d in dtypes):
        return None
    why = [
        f"{d} is excluded with --without"
        if d in without
        else f"{d} is {support.why_unsupported(target, d)}"
        for d in dtypes
    ]
    return f"every dtype asked for ({', '.join(dtypes)}) is ruled out: {'; '.join(why)}"


def _with_configuration(error: EquivalenceError, base: Target) -> EquivalenceError:
    """``error``, its verdict naming the options drawn (``fuzz_config``) against ``base``."""
    error.args = (
        f"{error.args[0]}\n\nconfiguration (drawn by fuzz_config): {described(base, error.target)}",
    )
    return error


def _intermittent(error: EquivalenceError) -> EquivalenceError:
    refuse_unconfirmed_hang(error)
    error.args = (
        f"{error.args[0]}\n\nintermittent: this example failed, then passed when "
        "replayed -- a race or other nondeterminism in the target",
    )
    return possibly_racy(error)  # its replay line repeats the example
