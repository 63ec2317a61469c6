"""Pipeline parallelism on a (dp, pp) mesh: torch's schedules under torch_pp match the
one-process reference; the classic pipeline bugs -- torch's default gradient scaling under
accumulation (torchtitan#1733), a stage reduced over the wrong group, a loss reported from one
pipeline -- are caught; stages and schedules are valid by construction and refused clearly."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ddpcheck
from ddpcheck import EquivalenceError, InvalidArgument, Scenario
from ddpcheck._language.batches import global_indices
from ddpcheck._language.battery import PIPELINE_BATTERY
from ddpcheck._language.objective import summed
from ddpcheck._language.pipeline_draws import pipeline_scenarios
from ddpcheck._language.pipeline_parallel import (
    PipelineParallel,
    held_modules,
    pipeline_problem,
    stages_of_rank,
)
from ddpcheck._language.sharded_models import ShardedBlock, ShardedSpec, sequence_data
from ddpcheck.targets import TORCH_PP, TorchPPTarget, support
from ddpcheck.targets.catalogue import PARALLEL, TORCH_ND
from ddpcheck.targets.pipeline import uneven_pieces

#: Two stages over two ranks, two pieces per micro-batch, two micro-batches per step.
ACCUMULATED = Scenario(
    ShardedSpec(blocks=(ShardedBlock("mlp", 3), ShardedBlock("attention", 2)), width=4),
    data=sequence_data,
    global_batch=8,
    accumulation=2,
    steps=2,
    seed=7,
    pipeline=PipelineParallel("GPipe", boundaries=(2,), microbatches=2),
)


@dataclasses.dataclass(frozen=True)
class TorchDefaultScaling(TorchPPTarget):
    """torch_pp as torch's documentation shows it: each piece's mean loss (divided by the
    accumulation, as a user's loop does) and the schedule's default ``scale_grads=True`` -- right
    for one ``step`` per optimizer step, a moving average of the micro-batches under
    accumulation (torchtitan#1733)."""

    scale_grads = True

    def piece_loss(self, run, output, target, scale):
        pieces = summed(run.scenario, output, target) / len(output)
        return pieces / run.scenario.accumulation

    def reported_loss_of(self, run, losses, mesh):  # the pieces' mean, as such a loop logs it
        return (
            torch.stack([loss.detach() for loss in losses]).sum()
            / run.scenario.pipeline.microbatches
        )


@dataclasses.dataclass(frozen=True)
class OnePipelinesLoss(TorchPPTarget):
    """torch_pp reporting the last stage's own pieces' loss, not averaged over dp."""

    def reported_loss_of(self, run, losses, mesh):
        return torch.stack([loss.detach().reshape(()) for loss in losses]).sum()


def test_the_pipeline_battery_matches_the_reference():
    ran = 0
    for name, scenario in PIPELINE_BATTERY:
        for world_size in (2, 3, 4):
            if TORCH_PP.supports_at(scenario, world_size) is None:
                assert ddpcheck.check_example(TORCH_PP, scenario, world_size) == (), name
                ran += 1
    assert ran >= 4  # each schedule family, and a dp=2 x pp=2 mesh


def test_several_stages_per_rank_over_dp_match_the_reference():
    # a looped and a V-shaped schedule over dp=2 x pp=2: FSDP2's asynchronous unshards, which
    # the pipeline runtime issues there, complete before their parameters are read (a recorded
    # collective's work must stay a Work: tests/rank/test_recorder.py)
    for schedule in ("LoopedBFS", "ZBVZeroBubble"):
        pipeline = PipelineParallel(schedule, (1, 2, 3), 2, pp=2, stages_per_rank=2)
        scenario = dataclasses.replace(ACCUMULATED, pipeline=pipeline, global_batch=8, steps=1)
        assert ddpcheck.check_example(TORCH_PP, scenario, 4) == (), schedule


def test_ddp_under_a_split_backward_schedule_leaves_stages_unreduced():
    # pytorch#144530 (open on torch 2.13; bench/pipeline_cpu.py shows it without ddpcheck): a
    # zero-bubble schedule computes weight gradients outside DDP's backward hooks, so DDP never
    # all-reduces them; GPipe under DDP is right
    ddp = TorchPPTarget(dp_wrapper="ddp")
    gpipe = dataclasses.replace(ACCUMULATED, pipeline=PipelineParallel(boundaries=(2,), pp=2))
    assert ddpcheck.check_example(ddp, gpipe, 4) == ()
    zbv = PipelineParallel("ZBVZeroBubble", (1, 2, 3), 2, pp=2, stages_per_rank=2)
    with pytest.raises(EquivalenceError) as caught:
        ddpcheck.check_example(ddp, dataclasses.replace(ACCUMULATED, pipeline=zbv), 4)
    assert caught.value.divergences[0].kind == "replicas differ (gradient)", caught.value
    with pytest.raises(InvalidArgument, match="dp_wrapper='zero'"):
        TorchPPTarget(dp_wrapper="zero")


def test_torchs_default_scaling_under_accumulation_is_caught():
    one_step = dataclasses.replace(ACCUMULATED, accumulation=1)
    assert ddpcheck.check_example(TorchDefaultScaling(), one_step, 2) == ()  # right without it
    with pytest.raises(EquivalenceError) as caught:
        ddpcheck.check_example(TorchDefaultScaling(), ACCUMULATED, 2)
    first = caught.value.divergences[0]
    assert first.kind == "reference differs (gradient)", caught.value


def test_a_loss_reported_from_one_pipeline_is_caught_on_a_mesh():
    scenario = dataclasses.replace(
        ACCUMULATED, pipeline=dataclasses.replace(ACCUMULATED.pipeline, pp=2)
    )
    assert ddpcheck.check_example(TORCH_PP, scenario, 4) == ()  # dp=2 x pp=2
    with pytest.raises(EquivalenceError) as caught:
        ddpcheck.check_example(OnePipelinesLoss(), scenario, 4)
    kinds = {d.kind for d in caught.value.divergences}
    assert kinds == {"loss differs"}, caught.value  # the gradients are right: only the loss
    assert {d.rank for d in caught.value.divergences} <= {1, 3}  # the last stage's ranks


def test_stages_follow_torchs_placement():
    looped = PipelineParallel("Interleaved1F1B", (1, 2, 3), 2, stages_per_rank=2)
    assert [stages_of_rank(looped, c, 2) for c in (0, 1)] == [[0, 2], [1, 3]]
    v = PipelineParallel("ZBVZeroBubble", (1, 2, 3), 2, stages_per_rank=2)
    assert [stages_of_rank(v, c, 2) for c in (0, 1)] == [[0, 3], [1, 2]]
    spec = ShardedSpec(blocks=(ShardedBlock(), ShardedBlock()))
    assert held_modules(v, spec, 0, 2) == ["inp", "head"]
    assert held_modules(v, spec, 1, 2) == ["blocks.0", "blocks.1"]


def test_the_data_follows_the_pipeline_mesh():
    scenario = dataclasses.replace(ACCUMULATED, pipeline=PipelineParallel(boundaries=(2,), pp=2))
    batches = [global_indices(scenario, 0, r, 4) for r in range(4)]
    assert [(b.rank, b.world_size) for b in batches] == [(0, 2), (0, 2), (1, 2), (1, 2)]


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(schedule="PipeDream"), "must be one of GPipe"),
        (dict(schedule="ZBVZeroBubble"), "exactly two stages per rank"),
        (dict(schedule="GPipe", stages_per_rank=2), "one stage per rank"),
        (dict(boundaries=(2, 1)), "increasing module indices"),
        (dict(microbatches=0), "microbatches=0"),
    ],
)
def test_bad_pipelines_are_refused_naming_the_field(fields, message):
    with pytest.raises(InvalidArgument, match=message):
        PipelineParallel(**fields)


def test_what_torch_refuses_is_declined_with_its_reason():
    assert "1F1B needs microbatches >= stages" in pipeline_problem(
        PipelineParallel("1F1B", (1,), 1), 2
    )
    assert "does not divide" in pipeline_problem(PipelineParallel(boundaries=(1,), pp=2), 3)
    uneven = dataclasses.replace(ACCUMULATED, global_batch=6)  # micro-batches of 3 over 2 pieces
    assert "pytorch#126600" in uneven_pieces(uneven, 2)
    assert "pytorch#126600" in TORCH_PP.supports_at(uneven, 2)
    # a pipeline of tensor-parallel stages (torch_nd) must say its degree: W = dp x pp x tp
    with pytest.raises(InvalidArgument, match="tensor-parallel stages names its degree"):
        dataclasses.replace(ACCUMULATED, tensor_parallel=ddpcheck.TensorParallel())


@settings(max_examples=30, deadline=None, database=None)
@given(data=st.data(), world_size=st.sampled_from((1, 2, 3, 4)))
def test_drawn_pipelines_fit_their_world(data, world_size):
    # what the engine draws for torch_pp, which applies no plan; torch_nd's draws name a tp
    plain = pipeline_scenarios(world_size=world_size, without=("tensor-parallel",))
    scenario = data.draw(plain)
    assert TORCH_PP.supports(scenario) is None
    assert TORCH_PP.supports_at(scenario, world_size) is None
    staged = data.draw(pipeline_scenarios(world_size=world_size))
    assert TORCH_ND.supports(staged) is None
    assert TORCH_ND.supports_at(staged, world_size) is None


def test_who_gets_pipeline_scenarios():
    assert support.battery_for(TORCH_PP) is PIPELINE_BATTERY
    assert "pipeline-parallel" not in support.supported_by(PARALLEL)
    assert "pipeline-parallel" in support.supported_by(TORCH_PP)
