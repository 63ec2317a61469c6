"""The search engine: draw, decline or run, judge, shrink -- written once for every search.

``ddpcheck check``'s random examples (``_runs.fuzz``), every cell of a survey
(``_runs.survey``) and of the option survey (``_runs.option_survey``), and the search for a
smaller counterexample after a battery failure (``_runs.smaller``) are configurations of it: they
differ in what is drawn (:class:`Draws`: a configuration of the target, a world size, a
scenario), which drawn examples are run (:attr:`Plan.accept`), how an example runs
(:attr:`Plan.check`) and when to stop (:class:`Plan`'s budgets). What an outcome means during a
search is decided here, once (:func:`outcome_of`, :func:`search`):

- an :class:`~ddpcheck.EquivalenceError` is a failure, shrunk by Hypothesis;
- a :class:`~ddpcheck.ScenarioError` (the oracle cannot judge the example) and a
  :class:`~ddpcheck.NothingChecked` (the target declined it once running) are nobody's bug: the
  example is not counted, its reason is tallied (``unjudgeable: ...`` for the first);
- a drawn example the target declines (:attr:`Plan.accept`) costs no example of the budget;
- a hang is a failure, or (``Plan.hangs=False``) an example passed over: a hang once is no
  verdict for a search that must confirm what it reports;
- anything else is the harness's or the world's, never the target's: the search stops and it is
  raised (``Plan.crash="raise"``) or recorded (``"stop"``: :attr:`Found.stopped`);
- a Ctrl-C is never caught.

Two drivers share it. :func:`search` runs one Hypothesis search that draws, runs and shrinks
(the survey cells, the smaller counterexample). :func:`search_pipelined` (``ddpcheck check``)
draws in a thread of its own while the examples run one behind the other (``_runs.pipeline``),
then shrinks the first failure by a second Hypothesis run that draws the same examples and runs
from the failing one on (:class:`_Replay`) -- reported as intermittent if it passes there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Literal

from hypothesis import HealthCheck, Phase, Verbosity, assume, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import FlakyFailure, Unsatisfiable

from ddpcheck._base.errors import EquivalenceError, NothingChecked, ScenarioError
from ddpcheck._language import features
from ddpcheck._language.messages import exception_text
from ddpcheck._runs.example import check_example
from ddpcheck._runs.pipeline import Outcome, one_behind_the_other
from ddpcheck._runs.settings import Settings
from ddpcheck._world.lending import lending_waits, released
from ddpcheck.targets.protocol import Target

if TYPE_CHECKING:
    from ddpcheck._language.scenario import Scenario

__all__ = [
    "Draws",
    "Example",
    "Found",
    "Plan",
    "hypothesis_run",
    "outcome_of",
    "search",
    "search_pipelined",
    "skipped_reason",
]


@dataclasses.dataclass(frozen=True)
class Example:
    """One drawn example: the target it runs (a configuration drawn, or the one given), its
    world size and its scenario."""

    target: Target
    world_size: int
    scenario: Scenario

    @property
    def key(self) -> str:
        """What tells two drawn examples apart (shrinking draws the same one many times)."""
        return f"{id(self.target)}:{self.world_size}:{self.scenario!r}"


@dataclasses.dataclass(frozen=True)
class Draws:
    """What a search draws, in this order: a configuration of the target (``configurations``,
    ``--fuzz-config``: drawn first, so shrinking leaves out options before it simplifies the
    scenario), a world size, then a scenario for it. Strategies are built once by the caller:
    Hypothesis validates a strategy the first time it draws from it (17 ms an example when built
    inside the test)."""

    target: Target
    scenarios: Mapping[int, st.SearchStrategy[Scenario]]
    #: an option set drawn -> the target it configures (``option_space.vary``), or None
    configurations: st.SearchStrategy[Mapping[str, object]] | None = None
    configure: Callable[[Mapping[str, object]], Target] | None = None

    @property
    def world_sizes(self) -> tuple[int, ...]:
        return tuple(self.scenarios)

    def draw(self, data: st.DataObject) -> Example:
        target = self.target
        if self.configurations is not None and self.configure is not None:
            target = self.configure(data.draw(self.configurations, label="configuration"))
        # one world size draws nothing (sampled_from of one value is just(value))
        world_size = data.draw(st.sampled_from(self.world_sizes), label="world_size")
        return Example(target, world_size, data.draw(self.scenarios[world_size], label="scenario"))


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a search runs and when it stops."""

    #: examples Hypothesis may run before its first failure (shrinking steps not counted)
    examples: int
    #: Hypothesis's seed; None: :data:`UNSEEDED` (the same examples every run)
    seed: int | None
    #: runs one example; returns what it left in the rank processes (``World.notes``)
    check: Callable[[Example], tuple[str, ...]]
    #: why a drawn example is not run (the target declines it...), or None to run it
    accept: Callable[[Example], str | None]
    #: declined draws, with no failure yet, after which the search gives up (None: never)
    give_up_after: int | None = None
    #: seconds shrinking may take from the first failure (None: until Hypothesis is done)
    shrink_seconds: float | None = None
    #: seconds the whole search may take (None: no limit)
    seconds: float | None = None
    #: a hang is a failure (False: passed over, as an example that cannot run)
    hangs: bool = True
    #: anything that is not the target's fault: raised, or recorded in ``Found.stopped``
    crash: Literal["raise", "stop"] = "raise"


@dataclasses.dataclass
class Found:
    """How a search ended."""

    examples: int = 0  # examples run, shrinking included
    first_failure: int | None = None  # examples run until the first failure (1-based), if any
    #: the failure Hypothesis ended with (shrunk), or the smallest so far if a budget ran out
    error: EquivalenceError | None = None
    #: every failure seen, by example key (the smaller-counterexample search picks among them)
    failures: dict[str, EquivalenceError] = dataclasses.field(default_factory=dict)
    #: a failure that passed when Hypothesis ran it again (a race or other nondeterminism)
    flaky: bool = False
    #: examples not run, by reason: declined by the target, or ``unjudgeable: ...``
    declined: dict[str, int] = dataclasses.field(default_factory=dict)
    #: the features (``ddpcheck.features``) the examples that ran exercised
    features: set[str] = dataclasses.field(default_factory=set)
    #: what examples left in the rank processes and ddpcheck put right (never a verdict)
    notes: dict[str, None] = dataclasses.field(default_factory=dict)
    #: the search stopped on something not the target's fault (``Plan.crash="stop"``): what
    stopped: str | None = None
    seconds: float = 0.0

    def decline(self, why: str) -> None:
        self.declined[why] = self.declined.get(why, 0) + 1


def outcome_of(check: Callable[[Example], tuple[str, ...]], example: Example) -> Outcome:
    """``example`` run by ``check``, its outcome as the pipeline reports one: notes, the target's
    error, or why it could not be checked. Anything else propagates: not the target's fault."""
    try:
        return Outcome(notes=check(example))
    except EquivalenceError as error:
        return Outcome(error=error)
    except (ScenarioError, NothingChecked) as exc:
        return Outcome(skipped=str(exc), unjudgeable=isinstance(exc, ScenarioError))


def skipped_reason(outcome: Outcome) -> str:
    """How a search tallies an example that could not be checked."""
    return f"unjudgeable: {outcome.skipped}" if outcome.unjudgeable else str(outcome.skipped)


#: The Hypothesis seed of a search given none (``ddpcheck check`` without ``--seed``). Any seed
#: is as good as another for finding a bug; this one shrank the mutants' counterexamples to their
#: minimum where seed 0 left one at a local minimum (``tests/mutation/test_mutants.py``).
UNSEEDED = 1


def hypothesis_run(
    test: Callable[[st.DataObject], None],
    *,
    examples: int,
    seed: int | None,
    phases: tuple[Phase, ...] = (Phase.generate, Phase.shrink),
) -> None:
    """The one place a Hypothesis search runs: ``test`` on up to ``examples`` draws. The user's
    Hypothesis profile is left alone (every setting that matters is given here). ``seed`` None
    is :data:`UNSEEDED`: the same examples every run -- not Hypothesis's ``derandomize``, whose
    seed is a digest of the test function's source, so that rewording this module would change
    which examples every unseeded ``ddpcheck check`` draws."""

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        print_blob=False,
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
        phases=list(phases),
        verbosity=Verbosity.quiet,
    )
    @given(data=st.data())
    def one(data: st.DataObject) -> None:
        test(data)

    one = hypothesis_seed(UNSEEDED if seed is None else seed)(one)
    one()


class _Abort(BaseException):
    """Ends a Hypothesis run from inside (a budget is spent, or the harness failed): not an
    Exception, so Hypothesis neither shrinks nor replays it."""


# ---------------------------------------------------------------------------------------------
# One Hypothesis run that draws, runs and shrinks


def search(draws: Draws, plan: Plan) -> Found:
    """Draw, run and shrink in one Hypothesis run, under ``plan``; see the module's docstring."""
    run = _Inline(draws, plan)
    try:
        hypothesis_run(run.test, examples=plan.examples, seed=plan.seed)
    except _Abort:
        if run.crash is not None and plan.crash == "raise":
            raise run.crash from None
        if run.found.failures:  # a budget ran out: the smallest failure so far
            run.found.error = min(run.found.failures.values(), key=lambda e: len(repr(e.scenario)))
    except EquivalenceError as error:
        run.found.error = error
    except FlakyFailure as flaky:  # failed, then passed when replayed: still a counterexample
        raced = next((e for e in flaky.exceptions if isinstance(e, EquivalenceError)), None)
        if raced is None:
            raise
        run.found.error, run.found.flaky = raced, True
    except Unsatisfiable:  # every example drawn was declined: nothing checked
        pass
    run.found.seconds = time.perf_counter() - run.started
    return run.found


class _Inline:
    """The test function of :func:`search`, and what it has seen."""

    def __init__(self, draws: Draws, plan: Plan):
        self.draws, self.plan = draws, plan
        self.found = Found()
        self.started = time.perf_counter()
        self.shrinking_since: float | None = None
        self.passed: set[str] = set()
        self.crash: BaseException | None = None

    def test(self, data: st.DataObject) -> None:
        example = self.draws.draw(data)
        self.run(example)

    def run(self, example: Example) -> None:
        """Decline, run and judge one drawn example (raising its failure for Hypothesis)."""
        found, plan, key = self.found, self.plan, example.key
        if key in found.failures:  # drawn again while shrinking: its error, not run again
            raise found.failures[key]
        if self._out_of_time():
            raise _Abort()  # keep the smallest failure so far
        if key in self.passed:
            return
        why = plan.accept(example)
        if why is not None:
            found.decline(why)
            give_up = None if self.shrinking_since is not None else plan.give_up_after
            if give_up is not None and sum(found.declined.values()) >= give_up:
                raise _Abort()  # Hypothesis would draw 1,000 before giving up
            assume(False)  # costs no example of the budget
        found.examples += 1
        try:
            outcome = outcome_of(plan.check, example)
        except Exception as exc:  # the harness or the world, not the target: stop
            self.crash = exc
            found.stopped = exception_text(exc)
            raise _Abort() from exc
        self._judge(example, outcome)

    def _judge(self, example: Example, outcome: Outcome) -> None:
        found = self.found
        if outcome.skipped is not None:  # nobody's bug: not a failure, not counted
            found.examples -= 1
            found.decline(skipped_reason(outcome))
            assume(False)
        exercised = features.of(example.scenario, example.world_size)
        error = outcome.error
        if error is None:
            self.passed.add(example.key)
            found.features |= exercised
            found.notes.update(dict.fromkeys(outcome.notes))
            return
        if not self.plan.hangs and "rank timed out" in error.kinds:
            assume(False)  # a hang once is no verdict: the search looks elsewhere
        found.features |= exercised
        found.failures[example.key] = error
        if self.shrinking_since is None:
            self.shrinking_since = time.perf_counter()
            found.first_failure = found.examples
        raise error

    def _out_of_time(self) -> bool:
        now, plan = time.perf_counter(), self.plan
        if plan.seconds is not None and now - self.started > plan.seconds:
            return True
        return (
            plan.shrink_seconds is not None
            and self.shrinking_since is not None
            and now - self.shrinking_since > plan.shrink_seconds
        )


# ---------------------------------------------------------------------------------------------
# Draws in a thread, examples one behind the other, then the first failure shrunk


def search_pipelined(
    draws: Draws,
    plan: Plan,
    settings_: Settings,
    *,
    progress: Callable[[int, float], None] | None = None,
    time_budget: float | None = None,
    shrink: bool = True,
) -> Found:
    """The search ``ddpcheck check`` runs (see the module's docstring): ``plan.examples``
    examples drawn ahead and run one behind the other until the first failure, which is then
    shrunk (``shrink=False``: reported as drawn). ``time_budget`` (seconds) stops generating new
    examples once spent; shrinking still runs. ``progress(done, seconds)`` after every example
    run."""
    started = time.perf_counter()
    found = Found()
    generation = _Generation(draws, plan, started, time_budget)
    failing = _first_failure(generation, found, settings_, progress, started)
    if failing is None or not shrink:
        found.seconds = time.perf_counter() - started
        return found
    return _shrunk(draws, plan, found, failing, started)


def _first_failure(
    generation: _Generation,
    found: Found,
    settings_: Settings,
    progress: Callable[[int, float], None] | None,
    started: float,
) -> tuple[int, Example] | None:
    """Run the drawn examples one behind the other until the first failure: its index among the
    draws and the example (``found.error`` its error), or None."""
    failing = None
    try:
        # closing: a failure stops it (what is still queued is let finish and dropped)
        with (
            lending_waits(generation.lock),
            contextlib.closing(
                one_behind_the_other(
                    (
                        ((index, example), example.world_size, example.scenario)
                        for index, example in generation.items()
                    ),
                    settings_,
                    target_of=lambda key: key[1].target,
                )
            ) as examples_run,
        ):
            for ((index, example), _, _), outcome in examples_run:
                if outcome.skipped is not None:  # unjudgeable, or declined in the ranks
                    found.decline(skipped_reason(outcome))  # counted: the closing line does
                    continue
                found.examples += 1
                if progress is not None:
                    progress(found.examples, time.perf_counter() - started)
                if outcome.error is not None:
                    found.first_failure, found.error = found.examples, outcome.error
                    failing = (index, example)
                    break
                found.features |= features.of(example.scenario, example.world_size)
                found.notes.update(dict.fromkeys(outcome.notes))
    finally:
        generation.stop()
    for why, n in generation.declined.items():
        found.declined[why] = found.declined.get(why, 0) + n
    return failing


def _shrunk(
    draws: Draws, plan: Plan, found: Found, failing: tuple[int, Example], started: float
) -> Found:
    """The first failure shrunk: Hypothesis draws again, the same examples in the same order (the
    same seed, and every example before the failing one passes as it did while drawn), now
    running the failing one and every shrinking step."""
    index, example = failing
    replay = _Replay(index, example, draws, plan, found)  # shrinking steps counted in ``found``
    try:
        hypothesis_run(
            replay.test,
            examples=plan.examples,
            seed=plan.seed,
            phases=(Phase.generate, Phase.target, Phase.shrink),
        )
    except EquivalenceError as shrunk:
        found.error = shrunk
    except FlakyFailure as flaky:
        # A shrinking step failed, then passed when Hypothesis replayed it: a race (e.g. a
        # gradient read before its all-reduce finished). Still a counterexample -- unless only a
        # shrinking step hung once while the example as drawn failed twice: that one stands.
        raced = next((e for e in flaky.exceptions if isinstance(e, EquivalenceError)), None)
        if raced is None:
            raise
        if not (replay.reproduced and set(raced.kinds) == {"rank timed out"}):
            found.error, found.flaky = raced, True
    except Unsatisfiable:
        pass
    else:  # the failing example passed when run again (or Hypothesis drew otherwise)
        found.flaky = replay.failing_passed
    found.seconds = time.perf_counter() - started
    return found


class _Generation:
    """Hypothesis drawing examples in a thread of its own, a draw or two ahead of the caller
    (declined draws do not count), so drawing and deciding the next example overlaps with the
    ranks running this one. Its test function only draws: what Hypothesis draws next depends on
    nothing an example does when run, so a second run with the same seed draws the same examples
    (:class:`_Replay`)."""

    def __init__(self, draws: Draws, plan: Plan, started: float, time_budget: float | None):
        #: held by the caller except while it waits (``lending.lending_waits``), taken here for
        #: each draw: drawing builds models from torch's global random generator (and asks the
        #: target's ``supports``), which must not interleave with the caller's own
        self.lock = threading.Lock()
        self.drawn = 0
        self.declined: dict[str, int] = {}
        self._draws, self._plan, self._started, self._budget = draws, plan, started, time_budget
        self._queue: queue.Queue[object] = queue.Queue(maxsize=1)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="ddpcheck-draws", daemon=True)

    def items(self) -> Iterator[tuple[int, Example]]:
        """``(index, example)``, index counting from 1, until Hypothesis is done."""
        self._thread.start()
        while True:
            with released():
                item = self._queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, tuple)
            yield item

    def stop(self) -> None:
        """Draw no more; wait for the thread (it draws nothing more once stopped)."""
        self._stopped.set()
        if self._thread.ident is None:  # never started: the caller stopped before any draw
            return
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.05)  # unblocks a put
            except queue.Empty:
                pass
        self._thread.join()

    def drawn_next(self, data: st.DataObject) -> Example | None:
        """The next example Hypothesis draws, or None where it passes unrun: nothing the target
        runs is being drawn, or the time is out. A declined draw is rejected (``assume``): it
        costs no example of the budget."""
        example = self._draws.draw(data)
        give_up = self._plan.give_up_after
        if self.drawn == 0 and give_up is not None and sum(self.declined.values()) >= give_up:
            return None  # nothing this target runs is being drawn: the rest pass unjudged
        if self._budget is not None and time.perf_counter() - self._started > self._budget:
            return None  # out of time: remaining examples pass without running
        why = self._plan.accept(example)
        if why is not None:
            self.declined[why] = self.declined.get(why, 0) + 1
            assume(False)  # not generated, in effect
        self.drawn += 1
        return example

    def _produce(self) -> None:
        try:
            try:
                hypothesis_run(
                    self._test,
                    examples=self._plan.examples,
                    seed=self._plan.seed,
                    phases=(Phase.generate, Phase.target),
                )
            except Unsatisfiable:  # every example drawn was declined: nothing checked
                pass
            self._put(_DONE)
        except BaseException as exc:  # the caller raises it
            self._put(exc)

    def _test(self, data: st.DataObject) -> None:
        with self.lock:
            if self._stopped.is_set():
                return
            example = self.drawn_next(data)
        if example is not None:
            self._put((self.drawn, example))

    def _put(self, item: object) -> None:
        while not self._stopped.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return
            except queue.Full:
                pass


_DONE = object()


class _Replay:
    """The second Hypothesis run: where the failing example is (its index among the examples
    drawn), and how far the run has got."""

    def __init__(self, index: int, failing: Example, draws: Draws, plan: Plan, found: Found):
        self.index, self.failing = index, failing
        self.draws, self.plan, self.found = draws, plan, found
        self.drawn = 0
        self.reached = False  # the failing example's index was drawn again
        self.drew_otherwise = False  # ... but not the failing example (not expected to happen)
        self.reproduced = False  # ... and it failed again
        self.done = False  # nothing more to run: drew otherwise, or it did not reproduce

    @property
    def failing_passed(self) -> bool:
        """The failing example ran again and passed: intermittent."""
        return self.reached and self.done and not self.reproduced and not self.drew_otherwise

    def test(self, data: st.DataObject) -> None:
        example = self.draws.draw(data)  # drawn even when done: a choice sequence draws the same
        if self.reached:  # a shrinking step
            if not self.done:
                self._step(example)
            return
        if self._before_the_failing_one(example):
            return
        self.reached = True
        if example != self.failing:  # Hypothesis drew otherwise: keep the failure as found
            self.done = self.drew_otherwise = True
            return
        try:
            self._step(example, accepted=True)
        except EquivalenceError:
            self.reproduced = True
            raise
        self.done = True  # it passed when run again (or could not run): intermittent

    def _before_the_failing_one(self, example: Example) -> bool:
        """Decided as it was while drawn: declined, or passed (it ran, or before the index)."""
        if self.plan.accept(example) is not None:
            assume(False)
        self.drawn += 1
        return self.drawn < self.index

    def _step(self, example: Example, accepted: bool = False) -> None:
        if not accepted and self.plan.accept(example) is not None:
            assume(False)
        self.found.examples += 1
        outcome = outcome_of(self.plan.check, example)
        if outcome.skipped is not None:  # nobody's bug, not a failure
            self.found.examples -= 1
            return
        if outcome.error is not None:
            raise outcome.error
        self.found.notes.update(dict.fromkeys(outcome.notes))


def settings_check(run: Settings) -> Callable[[Example], tuple[str, ...]]:
    """A :attr:`Plan.check` running every example under the run's settings."""

    def check(example: Example) -> tuple[str, ...]:
        return check_example(example.target, example.scenario, example.world_size, run)

    return check
