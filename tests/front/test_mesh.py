"""``--mesh`` (``meshes=``, ``--ddpcheck-mesh``): the ``(dp, pp, tp)`` mesh shapes every example
runs on. Refused with one line, before any process starts, where it cannot mean anything; where
it is admitted, every drawn scenario is on one of the shapes, and a failure's replay line fixes
its shape (``--world-size W`` and the scenario's ``TensorParallel(tp=...)``).
"""

from __future__ import annotations

import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ddpcheck
from ddpcheck import cli
from ddpcheck._base.options import check_meshes, mesh_text, parse_meshes
from ddpcheck._front import lines
from ddpcheck._language.plans import largest_degree, tensor_parallel_scenarios
from ddpcheck._language.scenario import mesh_of
from ddpcheck._language.tensor_parallel import mesh_shape
from ddpcheck._runs import admission
from ddpcheck._runs.replay import from_repr
from ddpcheck.targets import support
from ddpcheck.targets.catalogue import (
    PARALLEL,
    PARALLEL_TP,
    TORCH_2D,
    TORCH_ND,
    TORCH_PP,
    TORCH_TP,
)
from tests.processes import none_started

ASKED = "tp=2,tp=3,dp=2xtp=2"


def _cli_error(argv: list[str], capsys) -> str:
    capsys.readouterr()
    with none_started():
        assert cli.main(argv) == ddpcheck.ExitCode.SETUP
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one clear line
    return lines[0]


def test_shapes_are_read_as_dp_by_pp_by_tp_smallest_world_first():
    assert parse_meshes(ASKED) == ((1, 1, 2), (1, 1, 3), (2, 1, 2))
    assert parse_meshes(" dp=2 x tp=2 , tp=4,tp=2") == ((1, 1, 2), (2, 1, 2), (1, 1, 4))
    assert parse_meshes("dp=3") == ((3, 1, 1),)  # tp not named: 1
    # (dp, tp) pairs as before a pp axis, and (dp, pp, tp) triples
    assert check_meshes("meshes", [(2, 2), "tp=2", (2, 1, 2)]) == ((1, 1, 2), (2, 1, 2))
    assert [mesh_text(s) for s in parse_meshes(ASKED)] == ASKED.split(",")
    piped = "pp=2,dp=2xpp=2,pp=2xtp=2,dp=2xpp=2xtp=2"
    assert parse_meshes(piped) == ((1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 2, 2))
    assert [mesh_text(s) for s in parse_meshes(piped)] == piped.split(",")
    assert parse_meshes("tp=2xpp=2") == ((1, 2, 2),)  # the order written is free


def test_a_request_with_meshes_has_their_world_sizes_and_degrees():
    request = admission.admit(TORCH_2D, meshes=ASKED)
    assert request.meshes == ((1, 1, 2), (1, 1, 3), (2, 1, 2))
    assert request.world_sizes == (2, 3, 4)
    assert request.degrees == {2: (2,), 3: (3,), 4: (2,)}
    both = admission.admit(TORCH_2D, meshes="tp=4,dp=2xtp=2")
    assert both.world_sizes == (4,) and both.degrees == {4: (2, 4)}


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["check", "torch_tp", "--mesh", "tp=2", "--world-sizes", "2"],
            "--mesh and --world-sizes together: each mesh shape fixes its world size "
            "(dp x pp x tp); give --mesh alone",
        ),
        (
            ["check", "parallel", "--mesh", "tp=2"],
            "--mesh: parallel (ParallelTarget) opts into neither tensor nor pipeline "
            "parallelism (ParallelTarget.parallelizes and ParallelTarget.pipelines are not set)",
        ),
        (
            ["survey", "torch_ddp", "--mesh", "dp=2"],
            "--mesh: torch_ddp (TorchDDPTarget) opts into neither tensor nor pipeline",
        ),
        (
            ["survey", "torch_pp", "--mesh", "pp=2"],
            "a mesh with a pp axis (--mesh, meshes=) in a survey: its feature cells do not "
            "draw pipelines on meshes yet",
        ),
        (["check", "torch_tp", "--mesh", "tp=two"], "--mesh='tp=two': tp='two' is not an integer"),
        (["check", "torch_tp", "--mesh", "tp=2xtp=3"], "'tp=2xtp=3' names tp twice"),
        (["check", "torch_tp", "--mesh", "dp=2xtp=-1"], "tp=-1 must be at least 1"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_a_mesh_that_cannot_mean_anything_exits_2_in_one_line(argv, message, capsys):
    assert message in _cli_error(argv, capsys)


def test_a_tp_no_drawn_model_can_use_is_refused(capsys, monkeypatch):
    # tp=19 ranks would fit a machine of 2 cores (16 ranks each); say it has 4, wherever we run
    monkeypatch.setattr("ddpcheck._base.options.os.cpu_count", lambda: 4)
    too_many = largest_degree() + 1
    assert largest_degree() >= 4  # every degree the default world sizes draw is usable
    line = _cli_error(["check", "torch_tp", "--mesh", f"tp=2,tp={too_many}"], capsys)
    assert f"--mesh='tp=2,tp={too_many}': tp={too_many} is more ranks than any drawn" in line
    assert f"(the drawn models use tp up to {largest_degree()})" in line


def test_the_api_and_the_plugin_refuse_alike():
    with none_started(), pytest.raises(ddpcheck.InvalidArgument, match=r"^meshes and world_sizes"):
        ddpcheck.fuzz(TORCH_TP, meshes=["tp=2"], world_sizes=(2,))
    with none_started(), pytest.raises(ddpcheck.InvalidArgument, match=r"^meshes: ParallelTarget"):
        ddpcheck.assert_equivalent(PARALLEL, meshes=[(1, 2)])
    with pytest.raises(ddpcheck.InvalidArgument, match="with --ddpcheck-mesh"):
        admission.admit_target(
            admission.admit(meshes="tp=2", spelling=admission.PYTEST),
            TORCH_TP,
            world_sizes=(2,),
            spelling=admission.PYTEST,
        )
    from ddpcheck import pytest_plugin
    from tests.front.test_admission import _Config

    with pytest.raises(pytest.UsageError, match=r"^--ddpcheck-mesh and --ddpcheck-world-sizes"):
        pytest_plugin.resolve_options(_Config(mesh="tp=2", world_sizes="2"))
    session = pytest_plugin.resolve_options(_Config(mesh="dp=2xtp=2"))
    assert session.world_sizes == (4,) and "meshes dp=2xtp=2" in session.header()


def test_under_torchrun_a_mesh_is_refused(monkeypatch, capsys):
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    assert "--mesh under torchrun" in _cli_error(["check", "torch_tp", "--mesh", "tp=2"], capsys)


@pytest.mark.parametrize(
    "target", [TORCH_TP, TORCH_2D, PARALLEL_TP], ids=lambda t: type(t).__name__
)
@settings(max_examples=40, deadline=None, database=None)
@given(data=st.data())
def test_every_drawn_example_is_on_a_mesh_asked_for(target, data):
    request = admission.admit(target, meshes=ASKED)
    sizes, per_size, _ = support.example_strategies(
        target, request.world_sizes, ("float64",), (), degrees=request.degrees
    )
    assert sizes == (2, 3, 4)
    world_size = data.draw(st.sampled_from(sizes))
    scenario = data.draw(per_size[world_size])
    shape = mesh_of(scenario, world_size)
    assert shape in request.meshes
    # the replay line carries --world-size and the scenario's repr: together they fix the mesh
    assert mesh_of(from_repr(repr(scenario)), world_size) == shape


@settings(max_examples=20, deadline=None, database=None)
@given(data=st.data())
def test_survey_cells_and_the_smaller_search_draw_only_the_degrees_asked_for(data):
    feature = data.draw(st.sampled_from(("tensor-parallel", "accumulation", "clipping")))
    scenario = data.draw(
        ddpcheck.strategies.exercising(
            feature, world_size=4, opt_in=("tensor-parallel",), tp_degrees=(2,)
        )
    )
    assert mesh_shape(scenario.tensor_parallel, 4) == (2, 2)
    drawn = data.draw(tensor_parallel_scenarios(world_size=4, degrees=(4,)))
    assert mesh_shape(drawn.tensor_parallel, 4) == (1, 4)


def test_degrees_that_do_not_divide_the_world_are_refused():
    with pytest.raises(ddpcheck.InvalidArgument, match="must be degrees that divide world_size=4"):
        tensor_parallel_scenarios(world_size=4, degrees=(3,))
    with pytest.raises(ddpcheck.InvalidArgument, match="not both"):
        tensor_parallel_scenarios(world_size=4, tp=2, degrees=(2,))


def test_battery_scenarios_off_the_meshes_are_skipped_naming_why():
    from ddpcheck._language.battery import TENSOR_PARALLEL_BATTERY

    request = admission.admit(TORCH_2D, meshes="dp=2xtp=2")
    named = dict(TENSOR_PARALLEL_BATTERY)
    why = request.off_mesh(named["tp-attention-mlp"], 4)  # tp=None: tp=4 at W=4
    assert why == "its mesh tp=4 is not among the meshes asked for (dp=2xtp=2)"
    assert request.off_mesh(named["tp2-mesh-accumulate"], 4) is None
    assert admission.admit(TORCH_2D).off_mesh(named["tp-attention-mlp"], 4) is None


def test_a_mesh_the_target_never_runs_is_named_before_the_run():
    assert support.declined_mesh(TORCH_TP, (2, 1, 2)) == (
        "dp=2: TorchTPTarget shards over tp only (torch_2d adds FSDP2 over dp)"
    )
    assert support.declined_mesh(TORCH_TP, (1, 1, 2)) is None
    assert support.declined_mesh(TORCH_2D, (2, 1, 2)) is None
    assert support.declined_mesh(PARALLEL_TP, (2, 1, 2)) is None


@pytest.mark.slow
def test_a_failure_on_a_mesh_replays_on_that_mesh(capsys):
    """A seeded tensor-parallel bug found with --mesh dp=2xtp=2: its replay line runs the same
    mesh (world size 4, tp=2) and exits 1; the survey it points to carries --mesh, not
    --world-sizes."""
    from ddpcheck.mutation import broken_tp
    from tests.patience import patience

    result = ddpcheck.fuzz(
        broken_tp.RowBiasOnEveryRankTP(),
        meshes="dp=2xtp=2",
        examples=40,
        shrink=False,
        deadline=patience(60),
    )
    assert result.error is not None, result
    error = result.error
    assert error.world_size == 4 and mesh_of(error.scenario, 4) == (2, 1, 2)
    argv = shlex.split(error.replay)
    assert argv[:4] == ["python", "-m", "ddpcheck", "replay"], error.replay
    capsys.readouterr()
    assert cli.main(argv[3:]) == ddpcheck.ExitCode.FOUND
    assert "--world-size 4" in error.replay


def test_the_survey_a_verdict_points_to_carries_the_mesh():
    import argparse

    args = argparse.Namespace(config=None, without="", device="cpu", backend=None)
    request = admission.admit(TORCH_2D, meshes=ASKED)
    call = cli.Invocation(args, None, request, target_word="torch_2d")  # type: ignore[arg-type]
    assert cli._survey_command(call) == f"ddpcheck survey torch_2d --mesh {ASKED}"


@settings(max_examples=25, deadline=None, database=None)
@given(pair=ddpcheck.strategies.examples(TORCH_2D, meshes=["tp=3", (2, 2)]))
def test_the_public_examples_strategy_draws_on_the_meshes_too(pair):
    scenario, world_size = pair
    assert mesh_of(scenario, world_size) in ((1, 1, 3), (2, 1, 2))


def test_the_public_examples_strategy_refuses_as_the_doors_do():
    with pytest.raises(ddpcheck.InvalidArgument, match="meshes and world_sizes together"):
        ddpcheck.strategies.examples(TORCH_2D, meshes=["tp=2"], world_sizes=(2,))
    with pytest.raises(ddpcheck.InvalidArgument, match="ParallelTarget opts into neither"):
        ddpcheck.strategies.examples(PARALLEL, meshes=["tp=2"])
    with pytest.raises(ddpcheck.InvalidArgument, match="tp=99 is more ranks"):
        ddpcheck.strategies.examples(TORCH_2D, meshes=["tp=99"])


PIPED = "pp=2,dp=2xpp=2,pp=2xtp=2,dp=2xpp=2xtp=2"


def test_a_pipeline_request_has_the_layouts_of_its_meshes():
    request = admission.admit(TORCH_ND, meshes=PIPED)
    assert request.world_sizes == (2, 4, 8)
    assert request.layouts == {2: ((2, 1),), 4: ((2, 1), (2, 2)), 8: ((2, 2),)}
    assert request.degrees == {}  # no shape without pp: nothing for a target of plans alone


@pytest.mark.parametrize(
    "target, meshes",
    [(TORCH_PP, "dp=2,pp=2,dp=2xpp=2,pp=4"), (TORCH_ND, "tp=2,pp=2xtp=2,pp=3,dp=2xpp=2")],
    ids=["torch_pp", "torch_nd"],
)
@settings(max_examples=30, deadline=None, database=None)
@given(data=st.data())
def test_every_drawn_pipeline_is_on_a_mesh_asked_for(target, meshes, data):
    request = admission.admit(target, meshes=meshes)
    sizes, per_size, _ = support.example_strategies(
        target, request.world_sizes, ("float64",), (), (), request.degrees, request.layouts
    )
    assert sizes == request.world_sizes
    world_size = data.draw(st.sampled_from(sizes))
    scenario = data.draw(per_size[world_size])
    shape = mesh_of(scenario, world_size)
    assert shape in request.meshes, (shape, scenario)
    assert mesh_of(from_repr(repr(scenario)), world_size) == shape  # the replay line's mesh


def test_a_mesh_a_pipeline_target_cannot_run_is_named_with_why():
    # torch_pp's stages take no plans; torch_2d runs no pipeline
    assert support.declined_mesh(TORCH_PP, (1, 2, 2)) == (
        "needs tensor-parallel (opt-in: TorchPPTarget.parallelizes is not set)"
    )
    assert support.declined_mesh(TORCH_2D, (1, 2, 1)) == (
        "needs pipeline-parallel (opt-in: Torch2DTarget.pipelines is not set)"
    )
    for shape in ((1, 2, 1), (2, 2, 1), (2, 1, 1), (1, 4, 1)):
        assert support.declined_mesh(TORCH_PP, shape) is None
    for shape in ((1, 2, 2), (2, 2, 2), (1, 1, 2), (1, 3, 1)):
        assert support.declined_mesh(TORCH_ND, shape) is None
    request = admission.admit(TORCH_PP, meshes="pp=2,pp=2xtp=2")
    assert lines.mesh_notes(request, "torch_pp") == [
        "torch_pp runs nothing on the mesh pp=2xtp=2 (--mesh): needs tensor-parallel (opt-in: "
        "TorchPPTarget.parallelizes is not set)"
    ]


def test_no_mesh_a_target_can_take_is_nothing_checked():
    request = admission.admit(TORCH_2D, meshes="pp=2")
    with pytest.raises(ddpcheck.NothingChecked, match=r"no mesh asked for .* is one Torch2DTarget"):
        support.example_strategies(
            TORCH_2D, request.world_sizes, ("float64",), (), (), request.degrees, request.layouts
        )
    request = admission.admit(TORCH_PP, meshes="pp=2xtp=2")
    with pytest.raises(ddpcheck.NothingChecked, match="TorchPPTarget's scenarios are drawn on"):
        support.example_strategies(
            TORCH_PP, request.world_sizes, ("float64",), (), (), request.degrees, request.layouts
        )


def test_pipeline_battery_scenarios_off_the_meshes_are_skipped_naming_why():
    from ddpcheck._language.battery import PIPELINE_BATTERY

    request = admission.admit(TORCH_ND, meshes="dp=2xpp=2")
    off = {name: request.off_mesh(sc, 4) for name, sc in PIPELINE_BATTERY}
    assert off["pp-gpipe"] is None  # the battery's dp=2 x pp=2 scenario runs
    why = "its mesh dp=4 is not among the meshes asked for (dp=2xpp=2)"
    assert off["pp-one-stage-dp"] == why


# varies test_every_drawn_pipeline_is_on_a_mesh_asked_for (the draws on the meshes, no world)
# and tests/targets/test_pipeline_nd.py::test_loss_parallel_on_a_pipeline_matches_the_reference
# (a pipeline run in CI): here the command line's whole path, battery and one random example
@pytest.mark.thorough
def test_a_pipeline_mesh_runs_and_says_where(capsys):
    """``ddpcheck check torch_pp --mesh pp=2``: the battery's W=2 pipelines and one random
    example, every one on pp=2, exit 0; the report names the mesh."""
    capsys.readouterr()
    argv = ["check", "torch_pp", "--mesh", "pp=2", "--examples", "1", "--seed", "1"]
    assert cli.main(argv) == ddpcheck.ExitCode.OK
    assert "meshes pp=2" in capsys.readouterr().out
