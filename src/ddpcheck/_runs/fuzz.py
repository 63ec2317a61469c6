"""Fuzzing a target: Hypothesis draws scenarios and world sizes, the oracle judges, and a failure
is shrunk to a minimal counterexample with its divergence table and replay line.

This is what ``ddpcheck check`` runs after the built-in battery, and what ``ddpcheck mutants``
uses to hunt each mutant (``ddpcheck.mutation.search.shrinking_search``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import FlakyFailure, Unsatisfiable

from ddpcheck._base.errors import EquivalenceError, InvalidArgument, NothingChecked, ScenarioError
from ddpcheck._base.options import DEFAULT_DEADLINE, DEFAULT_WORLD_SIZES, check_positive_number
from ddpcheck._language import features
from ddpcheck._language import strategies as dst
from ddpcheck._runs.admission import Request, admit
from ddpcheck._runs.example import check_example, refuse_unconfirmed_hang
from ddpcheck._runs.pipeline import one_behind_the_other
from ddpcheck._runs.replay import target_spec
from ddpcheck._world.interrupts import interruptible
from ddpcheck._world.lending import lending_waits, released
from ddpcheck.targets.option_space import described, space_of, vary
from ddpcheck.targets.protocol import Target

__all__ = ["FuzzResult", "fuzz", "fuzz_admitted", "undrawable"]


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


@interruptible
def fuzz(
    target: Target,
    *,
    examples: int = 100,
    world_sizes: Any = DEFAULT_WORLD_SIZES,
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
) -> FuzzResult:
    """Run up to ``examples`` random examples of ``target``; shrink the first failure.

    ``seed`` makes the run reproducible (default: derandomized, the same every time);
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

    How (``docs/architecture.md``): the examples run one behind the other while Hypothesis
    draws in a thread of its own (``_runs.pipeline``); the first failure is shrunk by a second
    Hypothesis run, which draws the same examples and runs from the failing one on -- it is
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
    """:func:`fuzz` of an admitted request (``_runs.admission``): the command line's path."""
    if isinstance(examples, bool) or not isinstance(examples, int) or examples < 1:
        raise InvalidArgument(f"examples={examples!r} must be a positive integer")
    if time_budget is not None:
        check_positive_number("time_budget", time_budget)
    target, sizes, deadline = request.target, request.world_sizes, request.deadline
    device, backend, without = request.device, request.backend, request.without
    dtypes = request.random_dtypes
    started = time.perf_counter()
    why = undrawable(target, dtypes, without)
    if why is not None:
        raise NothingChecked(f"no random example can be drawn: {why}")
    # What the target runs, drawn as ddpcheck.strategies.examples draws it (declined draws are
    # tallied here, not filtered). Built once, not per example: Hypothesis validates a strategy
    # the first time it draws from it, which cost 17 ms per example when built inside the test.
    focus = request.only
    sizes, scenario_strategies, excluded = dst._for_target(target, sizes, dtypes, without, focus)
    give_up_after = max(GIVE_UP_AFTER_DECLINED, 2 * examples)
    declined: dict[str, int] = {}
    exercised: set[str] = set()
    notes: dict[str, None] = {}

    world_size_strategy = st.sampled_from(sizes)
    space = space_of(target) if request.fuzz_config else None
    variants: dict[str, Any] = {}  # repr of the options drawn -> the target they configure

    def configured(data: Any) -> Any:
        """The target of the next example: a configuration drawn (``fuzz_config``), first,
        so shrinking leaves out options before it simplifies the scenario."""
        if space is None:
            return target
        chosen = data.draw(space, label="configuration")
        key = repr(chosen)
        if key not in variants:
            variant = vary(target, chosen)
            target_spec(variant)  # its replay line must build it: refused now, not on failure
            variants[key] = variant
        return variants[key]

    def drawn(data: Any, tally: _Tally, budget: bool) -> tuple[int, Any, Any] | None:
        """The next example Hypothesis draws, or None where it passes unrun: nothing this
        target runs is being drawn, or (``budget``) the time is out. A declined draw is
        rejected (``assume``): it costs no example of the budget."""
        variant = configured(data)
        world_size = data.draw(world_size_strategy, label="world_size")
        scenario = data.draw(scenario_strategies[world_size], label="scenario")
        if tally.drawn == 0 and sum(tally.declined.values()) >= give_up_after:
            return None  # nothing this target runs is being drawn: the rest pass unjudged
        if budget and time_budget is not None and time.perf_counter() - started > time_budget:
            return None  # out of time: remaining examples pass without running
        why = features.declines(variant, scenario, world_size, excluded, focus)
        if why is not None:
            tally.declined[why] = tally.declined.get(why, 0) + 1
            assume(False)  # not generated, in effect
        tally.drawn += 1
        return world_size, scenario, variant

    def run_hypothesis(test: Callable[[Any], None], phases: list) -> None:
        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=seed is None,
            suppress_health_check=list(HealthCheck),
            print_blob=False,
            phases=phases,
        )
        @given(data=st.data())
        def one(data: st.DataObject) -> None:
            test(data)

        if seed is not None:
            one = hypothesis_seed(seed)(one)
        try:
            one()
        except Unsatisfiable:  # every example drawn was declined: nothing checked
            pass

    # 1. Hypothesis draws in a thread of its own, a little ahead; the examples run one behind
    # the other (_runs.pipeline) until the first failure.
    generation = _Generation(
        lambda test: run_hypothesis(test, [Phase.generate, Phase.target]), drawn
    )
    count, first, failing = 0, None, None
    try:
        # closing: a failure stops it (what is still queued is let finish and dropped)
        items = (((index, variant), w, sc) for index, w, sc, variant in generation.items())
        with (
            lending_waits(generation.lock),
            contextlib.closing(
                one_behind_the_other(
                    target,
                    items,
                    deadline=deadline,
                    device=device,
                    backend=backend,
                    target_of=lambda key: key[1],
                )
            ) as examples_run,
        ):
            for ((index, variant), world_size, scenario), outcome in examples_run:
                if outcome.skipped is not None:  # unjudgeable, or declined in the ranks
                    why = (
                        f"unjudgeable: {outcome.skipped}"
                        if outcome.unjudgeable
                        else outcome.skipped
                    )
                    declined[why] = declined.get(why, 0) + 1  # counted: the closing line does
                    continue
                count += 1
                if progress is not None:
                    progress(count, time.perf_counter() - started)
                if outcome.error is not None:
                    first = count
                    failing = (index, world_size, scenario, variant, outcome.error)
                    break
                exercised.update(features.of(scenario, world_size))
                notes.update(dict.fromkeys(outcome.notes))
    finally:
        generation.stop()
    for why, n in generation.tally.declined.items():
        declined[why] = declined.get(why, 0) + n
    if failing is None:
        return FuzzResult(
            count, None, time.perf_counter() - started, None, declined, exercised, notes
        )
    index, world_size, scenario, variant, error = failing

    def named(found: EquivalenceError) -> EquivalenceError:
        return found if space is None else _with_configuration(found, target)

    if not shrink:
        return FuzzResult(
            count, first, time.perf_counter() - started, named(error), declined, exercised, notes
        )

    # 2. The failure shrunk: Hypothesis draws again, the same examples in the same order (the
    # same seed, and every example before the failing one passes as it did while drawn above),
    # now running the failing one and every shrinking step.
    replay = _Replay(index, (world_size, scenario, variant))

    def shrinking(data: Any) -> None:
        nonlocal count
        the_failing_one = not replay.reached
        if the_failing_one:
            item = drawn(data, replay.tally, budget=False)
            if item is None or replay.tally.drawn < index:
                return  # before the failing example: drawn and decided as it was above
            replay.reached = True
            if item != replay.failing:  # Hypothesis drew otherwise: keep the failure as found
                replay.done = replay.drew_otherwise = True
                return
            world_size, scenario, variant = item
        else:  # a shrinking step (drawn even when done: a choice sequence draws the same)
            variant = configured(data)
            world_size = data.draw(world_size_strategy, label="world_size")
            scenario = data.draw(scenario_strategies[world_size], label="scenario")
            if replay.done:
                return
            if features.declines(variant, scenario, world_size, excluded, focus) is not None:
                assume(False)
        count += 1
        try:
            left = check_example(
                variant, scenario, world_size, deadline=deadline, device=device, backend=backend
            )
        except EquivalenceError:
            replay.reproduced = replay.reproduced or the_failing_one
            raise
        except (ScenarioError, NothingChecked):  # nobody's bug, not a failure
            count -= 1
            replay.done = replay.done or the_failing_one
            return
        if the_failing_one:  # it passed when run again: intermittent, reported as found
            replay.done = True
        notes.update(dict.fromkeys(left))

    try:
        run_hypothesis(shrinking, [Phase.generate, Phase.target, Phase.shrink])
    except EquivalenceError as shrunk:
        return FuzzResult(
            count, first, time.perf_counter() - started, named(shrunk), declined, exercised, notes
        )
    except FlakyFailure as flaky:
        # A shrinking step failed, then passed when Hypothesis replayed it: a race (e.g. a
        # gradient read before its all-reduce finished). Still a counterexample.
        raced = next((e for e in flaky.exceptions if isinstance(e, EquivalenceError)), None)
        if raced is None:
            raise
        if replay.reproduced and set(raced.kinds) == {"rank timed out"}:
            # a shrinking step hung once; the example as drawn failed twice: that one stands
            return FuzzResult(
                count,
                first,
                time.perf_counter() - started,
                named(error),
                declined,
                exercised,
                notes,
            )
        return FuzzResult(
            count,
            first,
            time.perf_counter() - started,
            named(_intermittent(raced)),
            declined,
            exercised,
            notes,
        )
    # The failing example passed when run again (or Hypothesis drew otherwise): report it as
    # found, unshrunk.
    if replay.reached and replay.failing_passed:
        error = _intermittent(error)
    return FuzzResult(
        count, first, time.perf_counter() - started, named(error), declined, exercised, notes
    )


def undrawable(
    target: Target, dtypes: Iterable[str], without: frozenset[str] = frozenset()
) -> str | None:
    """Why no random example can be drawn for ``target`` -- every dtype asked for is excluded
    (``without``) or unsupported -- or None: ``ddpcheck check`` says so instead of announcing
    random examples that cannot come."""
    dtypes = tuple(dtypes)
    unsupported = features.unsupported(target, without)
    if any(d not in unsupported for d in dtypes):
        return None
    why = [
        f"{d} is excluded with --without"
        if d in without
        else f"{d} is {features.why_unsupported(target, d)}"
        for d in dtypes
    ]
    return f"every dtype asked for ({', '.join(dtypes)}) is ruled out: {'; '.join(why)}"


def _with_configuration(error: EquivalenceError, base: Any) -> EquivalenceError:
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
    return error


@dataclasses.dataclass
class _Tally:
    """What a Hypothesis run drew: scenarios accepted, and declined ones by reason."""

    drawn: int = 0
    declined: dict[str, int] = dataclasses.field(default_factory=dict)


class _Generation:
    """Hypothesis drawing examples in a thread of its own, a draw or two ahead of the caller
    (declined draws do not count), so drawing and deciding the next example overlaps with the
    ranks running this one. Its test
    function only draws (``drawn``): what Hypothesis draws next depends on nothing an example
    does when run, so a second run with the same seed draws the same examples (``_Replay``)."""

    def __init__(
        self,
        run: Callable[[Callable[[Any], None]], None],
        drawn: Callable[[Any, _Tally, bool], Any],
    ):
        #: held by the caller except while it waits (``lending.lending_waits``), taken here for
        #: each draw: drawing builds models from torch's global random generator (and asks the
        #: target's ``supports``), which must not interleave with the caller's own
        self.lock = threading.Lock()
        self.tally = _Tally()
        self._run, self._drawn = run, drawn
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="ddpcheck-draws", daemon=True)

    def items(self) -> Iterator[tuple[int, int, Any, Any]]:
        """``(index, world_size, scenario, target)``, index counting from 1, until Hypothesis
        is done (the target: a configuration drawn, or the one given)."""
        self._thread.start()
        while True:
            with released():
                item = self._queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def stop(self) -> None:
        """Draw no more; wait for the thread (it draws nothing more once stopped)."""
        self._stopped.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.05)  # unblocks a put
            except queue.Empty:
                pass
        self._thread.join()

    def _produce(self) -> None:
        try:
            self._run(self._test)
            self._put(_DONE)
        except BaseException as exc:  # the caller raises it
            self._put(exc)

    def _test(self, data: Any) -> None:
        with self.lock:
            if self._stopped.is_set():
                return
            item = self._drawn(data, self.tally, True)
        if item is not None:
            self._put((self.tally.drawn, *item))

    def _put(self, item: Any) -> None:
        while not self._stopped.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return
            except queue.Full:
                pass


_DONE = object()


@dataclasses.dataclass
class _Replay:
    """The second Hypothesis run: where the failing example is (its index among the examples
    drawn) and how far the run has got."""

    index: int
    failing: tuple[int, Any, Any]
    tally: _Tally = dataclasses.field(default_factory=_Tally)
    reached: bool = False  # the failing example's index was drawn again
    drew_otherwise: bool = False  # ... but not the failing example (not expected to happen)
    reproduced: bool = False  # ... and it failed again
    done: bool = False  # nothing more to run: drew otherwise, or the failure did not reproduce

    @property
    def failing_passed(self) -> bool:
        """The failing example ran again and passed: intermittent."""
        return self.reached and self.done and not self.reproduced and not self.drew_otherwise
