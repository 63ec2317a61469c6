"""The search engine (``_runs.engine``) on its own: a stand-in ``check`` in this process, no
world, so what each outcome means during a search is tested in milliseconds -- the same meaning
for every configuration (fuzz, the survey cells, the option survey, the smaller counterexample)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import strategies as st

from ddpcheck._base.errors import (
    Divergence,
    EquivalenceError,
    NothingChecked,
    ScenarioError,
    WorldStartError,
)
from ddpcheck._runs import engine
from ddpcheck._runs.admission import Settings
from ddpcheck._runs.engine import Draws, Example, Plan, search, search_pipelined
from ddpcheck._runs.pipeline import Outcome
from ddpcheck.scenario import Scenario
from ddpcheck.targets import PARALLEL

#: Scenarios that differ in their number of steps, a field shrinking can lower (and their seed:
#: a space Hypothesis does not exhaust).
STEPS = st.builds(Scenario, steps=st.integers(1, 6), seed=st.integers(0, 10**6))
DRAWS = Draws(PARALLEL, {2: STEPS, 3: STEPS})


def failure(example: Example, kind: str = "reference differs (gradient)") -> EquivalenceError:
    row = Divergence(0, example.world_size, 0, "fc.weight", kind)
    return EquivalenceError(
        [row], scenario=example.scenario, world_size=example.world_size, target=PARALLEL, replay=""
    )


def plan(check, **kwargs) -> Plan:
    return Plan(**{"examples": 20, "seed": 1, "check": check, "accept": lambda e: None, **kwargs})


def fails_from(steps: int, kind: str = "reference differs (gradient)"):
    def check(example: Example) -> tuple[str, ...]:
        if example.scenario.steps >= steps:
            raise failure(example, kind)
        return ("a note",)

    return check


def test_a_failure_is_shrunk_to_the_smallest_example_that_fails():
    found = search(DRAWS, plan(fails_from(3)))
    assert found.error is not None and found.error.scenario.steps == 3
    assert found.error.world_size == 2  # sampled_from shrinks to the first world size
    assert found.first_failure is not None and found.examples > found.first_failure
    assert not found.flaky and found.notes == {"a note": None}


def test_nothing_found_counts_every_example_and_the_features_they_exercised():
    found = search(DRAWS, plan(lambda e: ()))
    assert found.error is None and found.examples == 20 and found.first_failure is None
    assert "float64" in found.features


def test_declined_and_unjudgeable_examples_are_tallied_never_run_never_counted():
    def check(example: Example) -> tuple[str, ...]:
        if example.scenario.steps == 2:
            raise ScenarioError("reference chaotic at step 0")
        if example.scenario.steps == 3:
            raise NothingChecked("declined once running")
        return ()

    found = search(
        DRAWS, plan(check, accept=lambda e: "declined" if e.scenario.steps == 1 else None)
    )
    assert found.error is None
    assert set(found.declined) == {
        "declined",
        "unjudgeable: reference chaotic at step 0",
        "declined once running",
    }
    assert found.examples == 20  # none of the above spent the budget


def test_a_search_that_draws_only_declined_examples_gives_up():
    found = search(DRAWS, plan(lambda e: (), accept=lambda e: "never", give_up_after=25))
    assert found.examples == 0 and found.declined == {"never": 25}


def test_a_hang_is_a_failure_unless_the_plan_passes_over_hangs():
    hangs = fails_from(4, kind="rank timed out")
    assert search(DRAWS, plan(hangs)).error is not None
    found = search(DRAWS, plan(hangs, hangs=False))
    assert found.error is None and not found.failures and found.examples > 0


def test_what_is_not_the_targets_fault_is_raised_or_recorded_as_the_plan_says():
    def crashes(example: Example) -> tuple[str, ...]:
        raise WorldStartError("no world today")

    with pytest.raises(WorldStartError, match="no world today"):
        search(DRAWS, plan(crashes))
    found = search(DRAWS, plan(crashes, crash="stop"))
    assert found.error is None and found.stopped is not None and "no world today" in found.stopped


def test_a_shrink_budget_keeps_the_smallest_failure_found_so_far():
    found = search(DRAWS, plan(fails_from(2), shrink_seconds=0.0))
    assert found.error is not None and found.error.scenario.steps >= 2
    assert found.examples == found.first_failure  # no shrinking step ran: the budget was spent


def test_a_failure_that_passes_when_run_again_is_flaky():
    seen: set[str] = set()

    def once(example: Example) -> tuple[str, ...]:
        if example.scenario.steps >= 2 and example.scenario.steps not in seen:
            seen.add(example.scenario.steps)
            raise failure(example)
        return ()

    # the engine remembers failures by example, so Hypothesis's replay raises it again
    found = search(DRAWS, plan(once))
    assert found.error is not None and not found.flaky


def test_configurations_are_drawn_first_and_built_by_the_caller():
    built = []

    def configure(options):
        built.append(dict(options))
        return dataclasses.replace(PARALLEL, bucket_size_mb=options["bucket_size_mb"])

    draws = dataclasses.replace(
        DRAWS,
        configurations=st.fixed_dictionaries({"bucket_size_mb": st.sampled_from([0.5, 2.0])}),
        configure=configure,
    )

    def check(example: Example) -> tuple[str, ...]:
        if example.target.bucket_size_mb == 2.0:
            raise failure(example)
        return ()

    found = search(draws, plan(check))
    assert found.error is not None and built


# ---------------------------------------------------------------------------------------------
# The pipelined driver (ddpcheck check's random examples), its pipeline stood in for


@pytest.fixture
def inline_pipeline(monkeypatch):
    """``one_behind_the_other`` running each example in this process with the plan's check."""
    checks = {}

    def pipeline(items, run, *, target_of):
        for item in items:
            (_, example), _, _ = item
            yield item, engine.outcome_of(checks["check"], example)

    monkeypatch.setattr(engine, "one_behind_the_other", pipeline)
    return checks


def test_the_pipelined_search_finds_the_first_failure_then_shrinks_it(inline_pipeline):
    inline_pipeline["check"] = check = fails_from(3)
    found = search_pipelined(DRAWS, plan(check), Settings())
    assert found.error is not None and found.error.scenario.steps == 3 and not found.flaky
    assert found.first_failure is not None and found.examples > found.first_failure


def test_the_pipelined_search_reports_a_failure_that_did_not_recur_as_flaky(inline_pipeline):
    ran = []

    def first_time_only(example: Example) -> tuple[str, ...]:
        ran.append(example)
        if len(ran) == 1:
            raise failure(example)
        return ()

    inline_pipeline["check"] = first_time_only
    found = search_pipelined(DRAWS, plan(first_time_only), Settings())
    assert found.error is not None and found.flaky and found.first_failure == 1
    assert ran[1] == ran[0]  # the second Hypothesis run drew it again, and it passed


def test_the_pipelined_search_tallies_skipped_examples_and_can_leave_shrinking_out(
    inline_pipeline,
):
    def check(example: Example) -> tuple[str, ...]:
        if example.scenario.steps == 1:
            raise ScenarioError("reference went non-finite")
        return fails_from(4)(example)

    inline_pipeline["check"] = check
    found = search_pipelined(DRAWS, plan(check), Settings(), shrink=False)
    assert found.error is not None and found.examples == found.first_failure
    assert set(found.declined) <= {"unjudgeable: reference went non-finite"}


def test_outcomes_mean_the_same_in_both_drivers():
    example = Example(PARALLEL, 2, Scenario(steps=2))
    assert engine.outcome_of(lambda e: ("n",), example) == Outcome(notes=("n",))
    declined = engine.outcome_of(lambda e: (_ for _ in ()).throw(NothingChecked("no")), example)
    assert engine.skipped_reason(declined) == "no"
    unjudgeable = engine.outcome_of(
        lambda e: (_ for _ in ()).throw(ScenarioError("chaotic")), example
    )
    assert engine.skipped_reason(unjudgeable) == "unjudgeable: chaotic"
    assert engine.outcome_of(lambda e: (_ for _ in ()).throw(failure(e)), example).error
