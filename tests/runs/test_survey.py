"""``ddpcheck survey``: every cell runs, a failure stops only its own cell, the matrix and the JSON
agree, declined features are never generated, and the exit status says what happened.

Everything runs in this process (``cli.main``), so the persistent worlds are shared by the tests;
the examples counts are small to keep the file near 30 s on a loaded 2-core machine.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ddpcheck
from ddpcheck import features, targets
from ddpcheck import strategies as dst
from ddpcheck._runs.survey import Survey
from ddpcheck.battery import BATTERY
from ddpcheck.cli import main


@dataclasses.dataclass(frozen=True)
class NoAccumulation(targets.ParallelTarget):
    """The parallel target, declaring that it does not support gradient accumulation."""

    supported_features = frozenset(features.FEATURES) - {"accumulation"}


NO_ACCUMULATION = NoAccumulation()
#: A DDP that gives globally unused parameters zero gradients instead of None.
MUTANT = "ddpcheck.mutation.catalogue:ZeroFillsUnused()"


class DeclinesEverything(targets.ParallelTarget):
    def supports(self, scenario):
        return "this target only runs on Tuesdays"


DECLINES_EVERYTHING = DeclinesEverything()


def _survey(capsys, tmp_path, *args):
    path = tmp_path / "survey.json"
    status = main(["survey", *args, "--json", str(path)])
    captured = capsys.readouterr()
    return status, captured.out + captured.err, Survey.from_dict(json.loads(path.read_text()))


@pytest.mark.slow
def test_parallel_passes_every_cell_and_the_json_matches_the_printed_matrix(capsys, tmp_path):
    status, out, survey = _survey(
        capsys, tmp_path, "parallel", "--world-sizes", "1,2", "--examples", "2"
    )
    assert status == 0, out
    assert survey.exit_code == 0 and survey.world_sizes == (1, 2) and not survey.failures
    rows = survey.section("feature")
    assert [c.row for c in rows] == [f for f in features.FEATURES for _ in (1, 2)]
    for c in rows:
        if c.world_size == 1 and c.row in ("unused-on-some-ranks", "uneven-batches"):
            assert c.status == "n/a" and c.label == "-", c  # one rank: not "declined"
        elif c.row in features.OPT_IN:  # beyond torch's contract: parallel does not opt in
            flag = features.OPT_IN[c.row]
            assert c.status == "declined" and f"{flag} is not set" in c.reason, c
        else:
            assert c.status == "ok" and 1 <= c.examples <= 2 and c.label == f"ok {c.examples}", c
    battery = survey.section("battery")
    assert len(battery) == 2 * len(BATTERY)
    declined = [c for c in battery if c.status == "declined"]
    assert {c.row for c in declined} == {"tokens-param-dtype-bf16"}, declined
    assert all(c.label == "passes" for c in battery if c.status != "declined")
    assert survey.features == set(features.FEATURES) - set(features.OPT_IN)
    # the JSON is the printed survey: same matrix, battery table, summary counts
    assert survey.matrix() in out and survey.battery_table() in out
    n, opt_in = len(features.FEATURES), len(features.OPT_IN)
    assert (
        f"features {2 * (n - opt_in) - 2} ok, 0 FAIL, {2 * opt_in} declined, 2 n/a; "
        f"battery {2 * len(BATTERY) - 2} pass, 0 FAIL"
    ) in out
    assert f"{n - opt_in}/{n} features" in out and "failures: none" in out


@pytest.mark.slow
def test_a_mutant_fails_its_rows_without_stopping_the_survey(capsys, tmp_path):
    status, out, survey = _survey(
        capsys, tmp_path, MUTANT, "--world-sizes", "2", "--examples", "2", "--shrink-seconds", "0.5"
    )
    assert status == 1, out
    cell = survey.cell("unused-everywhere", 2)
    assert cell.status == "fail" and cell.kind == "reference differs (gradient)", cell
    assert cell.label == "FAIL reference differs (gradient)" and cell.label in out
    # shrunk (to "linear(unused) SGD B=1 steps=1" given time; a loaded machine may stop earlier)
    assert "(unused" in cell.summary and "unused-everywhere" in cell.exercises, cell
    assert cell.replay.startswith(
        "python -m ddpcheck replay 'ddpcheck.mutation.catalogue:"
        "ZeroFillsUnused()' --world-size 2 --scenario "
    )
    assert cell.replay in out
    # every cell ran to a verdict: the first failure did not stop the survey (but the opt-in
    # features -- the param_dtype policy, tensor-parallel plans -- which the mutant's parallel
    # does not opt in to)
    assert all(
        c.status in ("ok", "fail")
        for c in survey.cells
        if c.row not in (*features.OPT_IN, "tokens-param-dtype-bf16")
    ), out
    assert len(survey.cells) == len(features.FEATURES) + len(BATTERY)
    assert survey.cell("unused-frozen-adamw", 2).label.startswith("FAILS reference differs")
    assert survey.cell("mlp-sgd", 2).label == "passes"
    # other rows fail when their examples happen to hold a never-used layer too; every shrunk
    # counterexample has one, and the report says so
    assert "unused-everywhere" in survey.common
    assert "every shrunk counterexample exercises: " in out
    failing = sorted(c.row for c in survey.section("feature") if c.status == "fail")
    print("failing feature rows:", failing)


@pytest.mark.slow
def test_a_declined_feature_is_declined_and_never_generated(capsys, tmp_path):
    status, out, survey = _survey(
        capsys,
        tmp_path,
        "tests.runs.test_survey:NO_ACCUMULATION",
        "--world-sizes",
        "2",
        "--examples",
        "2",
    )
    assert status == 0, out
    cell = survey.cell("accumulation", 2)
    assert cell.status == "declined" and cell.label == "declined" and cell.examples == 0
    assert "not in NoAccumulation.supported_features" in cell.reason
    assert survey.cell("sample-branch-accumulate", 2).status == "declined"
    assert "accumulation" not in survey.features  # no example that ran had it
    assert "declined: accumulation at W=2: not in NoAccumulation.supported_features" in out


@settings(
    max_examples=10,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
@given(data=st.data())
def test_exercising_draws_the_feature_and_nothing_declined(data):
    feature = data.draw(st.sampled_from([f for f in features.FEATURES if f != "accumulation"]))
    world_size = data.draw(st.integers(2, 4))
    scenario = data.draw(dst.exercising(feature, world_size=world_size, without={"accumulation"}))
    found = features.of(scenario, world_size)
    assert scenario.accumulation == 1 and "accumulation" not in found
    if feature != "unused-on-some-ranks":  # the one that depends on the data drawn
        assert feature in found, (feature, scenario)


def test_nothing_ran_is_exit_3_and_the_help_states_the_exit_codes(capsys, tmp_path):
    status, out, survey = _survey(
        capsys,
        tmp_path,
        "tests.runs.test_survey:DECLINES_EVERYTHING",
        "--world-sizes",
        "2",
        "--examples",
        "1",
    )
    assert status == 3 and survey.exit_code == 3, out
    assert {c.status for c in survey.cells} == {"declined"}
    assert "only runs on Tuesdays" in out
    assert "ddpcheck survey: nothing was checked" in out
    with pytest.raises(SystemExit):
        main(["survey", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "0 every cell that ran passed; 1 some cell failed" in text and "3 no cell ran" in text
    assert ddpcheck.survey.__module__ == "ddpcheck._runs.survey"
