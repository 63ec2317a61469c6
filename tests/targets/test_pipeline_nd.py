"""A pipeline of tensor-parallel stages on a (dp, pp, tp) mesh (torch_nd): the data follows the
mesh as init_device_mesh lays it out, drawn scenarios fit their world, a pp=2 x tp=2 example
matches the one-process reference, and a stage's tp-replicated gradients summed over tp (the
composition's mutant) is caught."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ddpcheck
from ddpcheck import EquivalenceError, InvalidArgument, Scenario
from ddpcheck._language.pipeline_draws import CROSSING_STYLES, pipeline_scenarios
from ddpcheck._language.pipeline_parallel import PipelineParallel
from ddpcheck._language.scenario import data_rank
from ddpcheck._language.sharded_models import (
    ShardedBlock,
    ShardedSpec,
    sequence_data,
    sequence_tokens,
)
from ddpcheck._language.tensor_parallel import TensorParallel
from ddpcheck._oracle.mesh_axes import differing_axes
from ddpcheck.mutation.broken_nd import TPReplicatedSummedND
from ddpcheck.targets import TORCH_ND, TORCH_PP, support
from ddpcheck.targets.pipeline_nd import fresh_output

#: pp=2 x tp=2: an MLP pair and whole heads sharded in the first stage, the head gathered in the
#: second, Adam and clipping (the norm made whole over tp, combined over pp).
ND = Scenario(
    ShardedSpec(blocks=(ShardedBlock("mlp", 4), ShardedBlock("attention", 2)), width=4, head_dim=2),
    data=sequence_data,
    global_batch=4,
    steps=2,
    dtype="float32",
    optimizer=torch.optim.Adam,
    optimizer_kwargs={"lr": 0.01, "eps": 1e-3},
    max_grad_norm=0.5,
    tensor_parallel=TensorParallel(
        (
            ("blocks.0.up", "colwise"),
            ("blocks.0.down", "rowwise"),
            ("blocks.1.q", "colwise"),
            ("blocks.1.k", "colwise"),
            ("blocks.1.v", "colwise"),
            ("blocks.1.out", "rowwise"),
            ("head", "colwise-replicate"),
        ),
        tp=2,
    ),
    pipeline=PipelineParallel("1F1B", boundaries=(2,), microbatches=2, pp=2),
)


# varies tests/targets/test_pipeline.py::test_a_loss_reported_from_one_pipeline_is_caught_on_a_mesh
# (a W=4 mesh, the control passing and a mutant caught): dp=2 x pp=2 there, pp=2 x tp=2 here
@pytest.mark.thorough
def test_a_pipeline_of_tensor_parallel_stages_matches_the_reference_and_kills_its_mutant():
    assert ddpcheck.check_example(TORCH_ND, ND, 4) == ()
    plain = dataclasses.replace(
        ND, max_grad_norm=None, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, steps=1
    )
    with pytest.raises(EquivalenceError) as caught:
        ddpcheck.check_example(TPReplicatedSummedND(), plain, 4)
    assert caught.value.divergences[0].kind == "reference differs (gradient)", caught.value


#: pp=2 x tp=2 under ZBVZeroBubble: every stage's output a DTensor module's local view (the
#: input projection replicated, a sequence-parallel norm, an MLP pair), which torch 2.13's split
#: backward refuses (bench/pp_split_backward_view.py) unless the stage hands on a clone.
ZBV_OVER_TP = Scenario(
    ShardedSpec(blocks=(ShardedBlock("norm"), ShardedBlock("mlp", 2), ShardedBlock("norm"))),
    data=sequence_data,
    global_batch=4,
    tensor_parallel=TensorParallel(
        (
            ("inp", "colwise-replicate"),
            ("blocks.0.norm", "sequence"),
            ("blocks.0", "sequence-in-out"),
            ("blocks.1.up", "colwise"),
            ("blocks.1.down", "rowwise"),
        ),
        tp=2,
    ),
    pipeline=PipelineParallel("ZBVZeroBubble", (1, 2, 3), 2, pp=2, stages_per_rank=2),
)


def test_a_stage_hands_on_a_view_as_a_tensor_of_its_own():
    # what lets the zero-bubble schedules run over tensor-parallel stages (pytorch#142229)
    base = torch.arange(6.0, requires_grad=True)
    view = (base * 2).view(2, 3)
    fresh = fresh_output(nn.Identity(), (), view)
    assert view._is_view() and not fresh._is_view()
    assert torch.equal(fresh, view) and fresh.requires_grad
    fresh.detach_()  # what torch's split backward does to a stage output: a view refuses it
    plain = base * 2
    assert fresh_output(nn.Identity(), (), plain) is plain
    assert fresh_output(nn.Identity(), (), (view,)) == (view,)  # not a tensor: left alone


# the cheap sibling in CI: test_a_stage_hands_on_a_view_as_a_tensor_of_its_own (the clone);
# this one runs the schedule that raised (~30 s at W=4 under load)
@pytest.mark.thorough
def test_a_zero_bubble_schedule_over_tensor_parallel_stages_matches_the_reference():
    assert ddpcheck.check_example(TORCH_ND, ZBV_OVER_TP, 4) == ()


def test_the_data_follows_the_nd_mesh():
    # rank r at dp = r // (pp tp): every rank of one pipeline, all its tp ranks, one share
    at_8 = dataclasses.replace(ND, pipeline=dataclasses.replace(ND.pipeline, pp=2))
    assert [data_rank(at_8, r, 8) for r in range(8)] == [(0, 2)] * 4 + [(1, 2)] * 4
    assert [data_rank(ND, r, 4) for r in range(4)] == [(0, 1)] * 4
    assert differing_axes(0, 5, (2, 2, 2), ("dp", "pp", "tp")) == "dp and tp"
    assert differing_axes(0, 2, (2, 2, 2), ("dp", "pp", "tp")) == "pp"
    assert differing_axes(1, 3, (2, 2), ("dp", "tp")) == "dp"


def test_what_torch_nd_cannot_serve_is_declined_with_its_reason():
    assert "pipeline scenarios" in TORCH_ND.supports(dataclasses.replace(ND, pipeline=None))
    assert "does not divide" in TORCH_ND.supports_at(ND, 3)
    ddp = dataclasses.replace(TORCH_ND, dp_wrapper="ddp")
    two_pipelines = dataclasses.replace(ND, global_batch=8)
    assert "_pre_dp_module_transform" in ddp.supports_at(two_pipelines, 8)
    zbv = PipelineParallel("ZBVZeroBubble", (1, 2, 3), 2, pp=2, stages_per_rank=2)
    assert TORCH_ND.supports_at(dataclasses.replace(ND, pipeline=zbv), 4) is None  # checked
    assert TORCH_PP.supports(ND) is None and "tensor-parallel" in support.declines(TORCH_PP, ND, 4)
    with pytest.raises(InvalidArgument, match="names its degree"):
        dataclasses.replace(ND, tensor_parallel=TensorParallel(()))


@settings(max_examples=15, deadline=None)
@given(data=st.data(), world_size=st.sampled_from((1, 2, 4, 8)))
def test_drawn_nd_scenarios_fit_their_world(data, world_size):
    without = support.unsupported(TORCH_ND)
    scenario = data.draw(pipeline_scenarios(world_size=world_size, without=without))
    assert scenario.tensor_parallel is not None
    assert TORCH_ND.supports_at(scenario, world_size) is None
    assert not {s for _, s in scenario.tensor_parallel.plan} & CROSSING_STYLES


#: pp=2 x tp=2, a token cross-entropy on logits the head leaves sharded over the vocabulary
#: (5 tokens: 3 + 2 over tp=2), computed by the schedule's loss_fn on the last stage under
#: torch's loss_parallel() (bench/pipeline_loss_parallel.py: torch carries it).
LOSS_PARALLEL_ND = Scenario(
    ShardedSpec(blocks=(ShardedBlock("mlp", 4),), width=4, tokens=True),
    data=sequence_tokens,
    loss="token_cross_entropy",
    global_batch=4,
    steps=1,
    tensor_parallel=TensorParallel(
        (("blocks.0.up", "colwise"), ("blocks.0.down", "rowwise"), ("head", "colwise-loss")),
        tp=2,
    ),
    pipeline=PipelineParallel("GPipe", boundaries=(2,), microbatches=2, pp=2),
)


def test_loss_parallel_on_a_pipeline_matches_the_reference():
    # the one W=4 example of this file in CI (the other is thorough)
    assert ddpcheck.check_example(TORCH_ND, LOSS_PARALLEL_ND, 4) == ()


def test_a_token_loss_loss_parallel_cannot_compute_is_declined_on_a_pipeline():
    smoothing = dataclasses.replace(LOSS_PARALLEL_ND, loss="label_smoothing")
    assert "only those torch's loss_parallel() computes" in TORCH_ND.supports(smoothing)
    assert "tokens" in support.declines(
        TORCH_PP, dataclasses.replace(LOSS_PARALLEL_ND, tensor_parallel=None), 4
    )
