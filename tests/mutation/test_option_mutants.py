"""The mutants behind an option (``ddpcheck.mutation.broken_options``): each missed by a check of
the target as given -- its default configuration -- and killed by ``fuzz_config=True`` within a
modest example count, with no target written by hand; and each one's unmutated framework target,
fuzzed over the same options, passes. Needs the frameworks (skipped, naming the install, where
one is missing)."""

from __future__ import annotations

import importlib.util

import pytest

from ddpcheck import targets
from ddpcheck._runs.fuzz import fuzz
from ddpcheck.mutation import catalogue
from ddpcheck.mutation.score import score
from ddpcheck.mutation.search import shrinking_search
from ddpcheck.targets.option_space import differences

#: Random examples the search with options may run to kill a mutant: a modest count. The mutant
#: behind two options (SkipsFirstReduceStaticManual) took 7-71 examples over seeds 0-5 (measured
#: 2026-12-07); since epochs scenarios draw an evaluation set (and Hypothesis generates
#: differently for another budget), 5-80 at a budget of 100 over seeds 0-5, and none within a
#: budget of 80 at the default seed: 100.
EXAMPLES = 100
#: Random examples of the mutant as given, and of its control with options: each passes them (a
#: framework example is among the suite's costliest; the kill above is the claim).
PASSES = 20
#: What each mutant's shrunk counterexample must hold: the options its bug is behind, no more.
NEEDS = {
    "StepsInsideWindowUnlessSplit": [("split_batches", False)],
    "SkipsFirstReduceStaticManual": [("manual", True), ("static_graph", True)],
    "PerMicroBatchLossCountingTokens": [("config.include_num_input_tokens_seen", True)],
    "LastMicroBatchAfterReduceBf16": [("bf16", True)],
}


def _needs_framework(target):
    for entry in targets.READY_MADE:
        if (
            isinstance(target, type(entry.target))
            and entry.framework != "torch"
            and importlib.util.find_spec(entry.module) is None
        ):
            pytest.skip(f"{entry.module} is not installed ({entry.install})")


def test_the_option_catalogue_covers_the_four_framework_classes_of_option_bug():
    assert [m.name for m in catalogue.OPTION_CATALOGUE] == list(NEEDS)
    for m in catalogue.OPTION_CATALOGUE:
        assert type(m.target).__module__ == "ddpcheck.mutation.broken_options"
        assert isinstance(m.target, type(m.control)) and type(m.target) is not type(m.control)
        assert m.target.config_space() is not None and type(m.target).__doc__
        assert all(m.name != other.name for other in catalogue.CATALOGUE)


#: The kills `make test` runs: the mutant under parallel_ddp (no framework). The others, each a
#: search of up to 100 framework examples (13-22 CPU-s each), are `thorough`: the same search
#: and the same assertions, run by `make test-thorough`.
QUICK = {"LastMicroBatchAfterReduceBf16"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "mutant",
    [
        pytest.param(m, marks=() if m.name in QUICK else pytest.mark.thorough)
        for m in catalogue.OPTION_CATALOGUE
    ],
    ids=lambda m: m.name,
)
def test_missed_as_given_killed_with_fuzz_config(mutant):
    _needs_framework(mutant.control)
    as_given = fuzz(mutant.target, examples=PASSES, world_sizes=(2, 3))
    assert not as_given.found, as_given.error
    fuzzed = fuzz(mutant.target, examples=EXAMPLES, world_sizes=(2, 3), fuzz_config=True)
    assert fuzzed.found, fuzzed
    assert fuzzed.first_failure <= EXAMPLES
    assert differences(mutant.target, fuzzed.error.target) == NEEDS[mutant.name], str(fuzzed.error)
    control = fuzz(mutant.control, examples=PASSES, world_sizes=(2, 3), fuzz_config=True)
    assert not control.found, control.error


@pytest.mark.slow
@pytest.mark.thorough  # make test: the shrinking search on the TP mutants; the kill above
def test_the_shrinking_search_scores_them_with_fuzz_config():
    mutant = catalogue.OPTION_CATALOGUE[-1]  # parallel_ddp underneath: no framework needed
    rows = score(
        [mutant],
        60.0,
        control=mutant.control,
        world_sizes=(2,),
        search=lambda target, budget, **kw: shrinking_search(
            target, budget, fuzz_config=True, examples=EXAMPLES, **kw
        ),
    )
    assert [(r.name, r.as_expected) for r in rows] == [
        ("(unmutated Bf16PathTarget)", True),
        (mutant.name, True),
    ], rows
