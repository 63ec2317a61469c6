"""``--fuzz-config``: every random example draws the target's options with its scenario.

What it must do: draw every option a target's ``config_space()`` holds, shrinking a failure to the
fewest options that differ from the target as given (then the scenario); name them in the verdict
and build them in the replay line, which reproduces the failure; refuse, with exit 2 and before
any process starts, a target with no options; and print the option x feature matrix for
``survey --fuzz-config``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
import sys
import textwrap

import pytest
from hypothesis import settings
from hypothesis import strategies as st

import ddpcheck
from ddpcheck import cli, targets
from ddpcheck._runs.fuzz import fuzz
from ddpcheck._runs.option_survey import AS_GIVEN
from ddpcheck._runs.replay import evaluate, from_repr, target_spec
from ddpcheck._runs.survey import survey
from ddpcheck.errors import ExitCode, InvalidArgument
from ddpcheck.mutation.broken_options import Bf16PathTarget, LastMicroBatchAfterReduceBf16
from ddpcheck.targets.option_space import (
    described,
    differences,
    drawn_options,
    label,
    nested,
    options,
    space_of,
    vary,
)
from parallel import sharding
from tests.patience import patience
from tests.shrink import find


def test_the_draw_covers_every_option_and_shrinks_them_away():
    space = space_of(targets.PARALLEL)
    assert [label(o) for o in drawn_options(space)] == [
        "bucket_size_mb=1e-06",
        "bucket_size_mb=0.0002",
        "bucket_size_mb=1000000.0",
        "sharding_rule=contiguous",
        "sharding_rule=greedy",
    ]
    # a failure needing one option shrinks to that option alone, whatever else was drawn with it
    needs_greedy = find(
        st.tuples(space, st.integers(0, 9)),
        lambda t: t[0].get("sharding_rule") is sharding.greedy and t[1] > 2,
        settings=settings(database=None),
    )
    assert needs_greedy == ({"sharding_rule": sharding.greedy}, 3)
    # a dict-valued field: each of its keys is one option, merged over the target's own
    space = options(fields={"manual": (True,)}, training_args={"a": (1,), "b": (2,)})
    assert [label(o) for o in drawn_options(space)] == [
        "manual=True",
        "training_args.a=1",
        "training_args.b=2",
    ]
    given = targets.HfTrainerTarget(training_args={"seed": 3})
    variant = vary(given, {"training_args": {"ddp_bucket_cap_mb": 1, "seed": 4}})
    assert variant.training_args == {"ddp_bucket_cap_mb": 1, "seed": 3}  # the user's key stays
    assert differences(given, variant) == [("training_args.ddp_bucket_cap_mb", 1)]
    assert vary(targets.LIGHTNING, {}) is targets.LIGHTNING


def test_a_large_nested_option_is_surveyed_a_key_per_row_over_its_base():
    # DeepSpeed's six zero_optimization keys were surveyed as the 103 combinations drawn
    keys = {
        "gradient_as_bucket_view": (True,),
        "static_graph": (True,),
        "broadcast_buffers": (False,),
        "bucket_cap_mb": (1,),
    }
    large = options(config={"strategy": nested(keys, base={"name": "ddp"})})
    rows = [o["config"]["strategy"] for o in drawn_options(large)]
    assert sorted(sorted(row.items()) for row in rows) == sorted(
        sorted({"name": "ddp", key: value}.items()) for key, (value,) in keys.items()
    )
    # ... and so is a field drawn by nested() itself, each row over its base
    field = options(fields={"strategy": nested(keys, base={"name": "ddp"})})
    assert sorted(sorted(o["strategy"].items()) for o in drawn_options(field)) == sorted(
        sorted(row.items()) for row in rows
    )
    # three keys or fewer: the combinations drawn, all 7 of them
    small = options(config={"strategy": nested(dict(list(keys.items())[:3]))})
    assert len(drawn_options(small)) == 7
    # the target is handed plain dicts whatever the draw held
    drawn = find(large, lambda d: len(str(d)) > 60, settings=settings(database=None))
    variant = vary(targets.FabricTarget(), drawn)
    assert type(variant.config["strategy"]) is dict, variant.config
    # and the surveyed rows of DeepSpeed's space: one per key and value, and its loader's
    # dataloader_drop_last
    ds_rows = drawn_options(space_of(targets.DEEPSPEED_ZERO2))
    assert len(ds_rows) == 9, [label(o) for o in ds_rows]


def test_a_config_given_as_a_json_file_is_fuzzed_too(tmp_path):
    # (--config FILE with --fuzz-config refused: "merged over a dict, and this is none")
    path = tmp_path / "fabric.json"
    path.write_text('{"strategy": {"name": "ddp", "find_unused_parameters": true}}')
    given = targets.FabricTarget(config=str(path))
    variant = vary(given, {"config": {"strategy": {"name": "ddp"}, "num_nodes": 1}})
    assert variant.config == {  # the file's contents, its keys kept: no file in the replay line
        "strategy": {"name": "ddp", "find_unused_parameters": True},
        "num_nodes": 1,
    }
    assert differences(given, variant) == [("config.num_nodes", 1)]


def test_every_ready_made_option_builds_a_replayable_target():
    for entry in targets.READY_MADE:
        for single in drawn_options(space_of(entry.target)):
            variant = vary(entry.target, single)
            assert evaluate(target_spec(variant)) == variant, (entry.name, single)


@pytest.mark.slow
def test_a_shrunk_failure_holds_the_fewest_options_and_its_replay_line_reruns_it(capsys):
    # The command line's search, once (the battery, then 30 random examples each drawing a
    # configuration): its verdict names the options, its replay line re-runs the failure. The
    # target as given passing, its control passing the same option space, and fuzz()'s own
    # result shrunk to the same option: tests/mutation/test_option_mutants.py, this mutant too.
    mutant = LastMicroBatchAfterReduceBf16()
    spec = "ddpcheck.mutation.broken_options:LastMicroBatchAfterReduceBf16()"
    status = cli.main(["check", spec, "--fuzz-config", "--examples", "30", "--world-sizes", "2"])
    out = capsys.readouterr()
    assert status == ExitCode.FOUND, out
    text = out.out + out.err
    assert "each with a configuration of its options drawn (--fuzz-config)" in text
    # bucket_size_mb is drawn as often as bf16, and shrunk away: only the option the bug needs
    assert "configuration (drawn by fuzz_config): with bf16=True" in text
    assert "survey" in text and "--fuzz-config" in text  # the survey it suggests keeps the flag
    replay = next(line for line in text.splitlines() if line.startswith("replay: "))
    assert "LastMicroBatchAfterReduceBf16(bf16=True)" in replay
    # the replay line re-runs the failure: the configured target, the scenario, the world size
    argv = shlex.split(replay.removeprefix("replay: "))
    assert argv[:4] == ["python", "-m", "ddpcheck", "replay"], replay
    assert argv[5] == "--world-size" and argv[7] == "--scenario", replay
    configured, world_size, scenario = evaluate(argv[4]), int(argv[6]), from_repr(argv[8])
    assert differences(mutant, configured) == [("bf16", True)]
    assert cli.main(argv[3:]) == ExitCode.FOUND, capsys.readouterr()
    with pytest.raises(ddpcheck.EquivalenceError):
        ddpcheck.check_example(configured, scenario, world_size)


def test_a_target_with_no_options_is_refused_before_any_process(no_process_started, capsys):
    assert cli.main(["check", "local", "--fuzz-config", "--world-sizes", "2"]) == 2
    err = capsys.readouterr().err
    assert "--fuzz-config: LocalTarget has no options to fuzz" in err, err
    with pytest.raises(InvalidArgument, match=r"fuzz_config=True: LocalTarget has no options"):
        fuzz(targets.LOCAL, examples=1, world_sizes=(2,), fuzz_config=True)
    with pytest.raises(InvalidArgument, match=r"fuzz_config=True: LocalTarget"):
        ddpcheck.assert_equivalent(targets.LOCAL, world_sizes=(2,), fuzz_config=True)


@dataclasses.dataclass(frozen=True)
class DrawsAField(targets.ParallelDDPTarget):
    """A space naming a field the target does not have: refused, naming it."""

    def config_space(self):
        return options(fields={"no_such_field": (1,)})


DRAWS_A_FIELD = DrawsAField()


def test_a_space_drawing_what_the_target_lacks_is_refused_naming_it():
    with pytest.raises(InvalidArgument, match=r"drew 'no_such_field', which is no field"):
        fuzz(DRAWS_A_FIELD, examples=2, world_sizes=(1,), fuzz_config=True)


@pytest.mark.slow
def test_survey_prints_the_option_by_feature_matrix(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "SURVEY_HEARTBEAT", 0.0)
    path = tmp_path / "survey.json"
    status = cli.main(
        [
            "survey",
            "ddpcheck.mutation.broken_options:LastMicroBatchAfterReduceBf16()",
            "--fuzz-config",
            "--world-sizes",
            "2",
            "--examples",
            "3",
            "--only",
            "accumulation,frozen",
            "--json",
            str(path),
        ]
    )
    captured = capsys.readouterr()
    out = captured.out
    assert status == ExitCode.FOUND, out
    # off a terminal, a progress line at most every SURVEY_HEARTBEAT seconds (0 here: each cell)
    assert f"ddpcheck survey: cell 2/10: {AS_GIVEN} x frozen (" in captured.err, captured.err
    assert "ddpcheck survey: cell 4/10: bf16=True x frozen (" in captured.err
    matrix = out.split("\n\nfailures")[0].splitlines()
    assert re.split(r"\s{2,}", matrix[2]) == ["option", "accumulation", "frozen"], out
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line) for line in matrix[4:])}
    assert rows[AS_GIVEN] == ["ok 3", "ok 3"], out
    assert rows["bf16=True"] == ["FAIL", "FAIL"], out
    assert rows["bucket_size_mb=1e-06"] == ["ok 3", "ok 3"], out
    assert "bf16=True x accumulation: replicas differ" in out, out
    data = json.loads(path.read_text())
    assert data["options"][0] == AS_GIVEN and data["exit_code"] == 1
    result = survey(
        Bf16PathTarget(), world_sizes=(2,), examples=2, only=("frozen",), fuzz_config=True
    )
    assert result.exit_code == 0 and {c.status for c in result.cells} == {"ok"}, result


@pytest.mark.slow
def test_assert_equivalent_runs_the_battery_under_each_option():
    report = ddpcheck.assert_equivalent(
        targets.TORCH_FSDP, world_sizes=(2,), only=("frozen",), fuzz_config=True
    )
    names = {name for name, _, _ in report.examples}
    assert any(name.endswith("[reshard_after_forward=True]") for name in names), names
    assert any("[" not in name for name in names), names
    with pytest.raises(ddpcheck.EquivalenceError, match="with bf16=True"):
        ddpcheck.assert_equivalent(
            LastMicroBatchAfterReduceBf16(), world_sizes=(2,), only=("frozen",), fuzz_config=True
        )
    assert (
        described(targets.LIGHTNING, targets.LightningTarget(static_graph=True, manual=True))
        == "with manual=True, static_graph=True"
    )


@pytest.mark.slow
def test_the_pytest_plugin_flag_reaches_ddpcheck_run(tmp_path):
    (tmp_path / "test_user.py").write_text(
        textwrap.dedent("""
        from ddpcheck import targets
        from ddpcheck.mutation.broken_options import LastMicroBatchAfterReduceBf16

        def test_behind_an_option(ddpcheck_run):
            ddpcheck_run(LastMicroBatchAfterReduceBf16())

        def test_no_options(ddpcheck_run):
            ddpcheck_run(targets.LOCAL)
    """)
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "test_user.py",
            "--ddpcheck-fuzz-config",
            "--ddpcheck-world-sizes",
            "2",
            "--ddpcheck-only",
            "frozen",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=patience(300),
    )
    out = done.stdout
    assert done.returncode == 1, out
    assert "configuration (fuzz_config): with bf16=True" in out, out
    assert "fuzz_config=True: LocalTarget has no options to fuzz" in out, out
    assert "1 FOUND" in out and "1 SETUP" in out, out


def test_a_feature_declined_under_every_row_says_so_once():
    from ddpcheck._runs.option_survey import OptionCell, OptionSurvey

    rows = [AS_GIVEN, "manual=True", "static_graph=True"]
    cells = [OptionCell(row, "checkpoint", "declined", reason="its own format") for row in rows]
    cells += [OptionCell(row, "frozen", "ok", examples=2) for row in rows[:2]]
    cells.append(OptionCell(rows[2], "frozen", "declined", reason="the graph"))
    matrix = OptionSurvey("T", (2,), 2, rows, cells, 1.0).matrix()
    assert "declined checkpoint under every row: its own format" in matrix, matrix
    assert "declined frozen under static_graph=True: the graph" in matrix, matrix
