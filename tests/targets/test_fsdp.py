"""The torch_fsdp target (FSDP2) and the local-shard check: sharded parameters are judged whole,
and each rank's shard must be its slice of the whole."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ddpcheck
from ddpcheck import features, zoo
from ddpcheck._language.records import RankRecord, StepRecord
from ddpcheck._oracle.shards import LOCAL_SHARD_DIFFERS, compare_shards, shard_bounds
from ddpcheck.models import Layer, ModelSpec, SpecData
from ddpcheck.targets import TORCH_FSDP, TorchFSDPTarget


@dataclasses.dataclass(frozen=True)
class CorruptShardOnRank1(TorchFSDPTarget):
    """Reports rank 1's local shard of every parameter with 1 added: the gathered parameters
    stay right, so only the local-shard check can see it."""

    def local_shard(self, tensor):
        import torch.distributed as dist

        found = super().local_shard(tensor)
        if found is None or dist.get_rank() != 1:
            return found
        return found[0], found[1] + 1


@pytest.mark.parametrize("world_size, model, reshard", [(2, zoo.MLP, False), (3, zoo.Tied, True)])
def test_torch_fsdp_matches_the_reference_with_accumulation_and_clipping(
    world_size, model, reshard
):
    scenario = ddpcheck.Scenario(
        model=model,
        global_batch=7,
        steps=2,
        accumulation=2,
        max_grad_norm=0.05,
        optimizer=torch.optim.AdamW,
        optimizer_kwargs={"lr": 0.01},
    )
    target = TorchFSDPTarget(reshard_after_forward=reshard)
    assert features.declines(target, scenario, world_size) is None
    ddpcheck.check_example(target, scenario, world_size)  # raises EquivalenceError on a bug


def test_a_local_shard_that_is_not_its_slice_is_reported_by_rank_parameter_and_slice():
    scenario = ddpcheck.Scenario(model=zoo.MLP, steps=1)
    with pytest.raises(ddpcheck.EquivalenceError) as caught:
        ddpcheck.check_example(CorruptShardOnRank1(), scenario, 2)
    text = str(caught.value)
    assert LOCAL_SHARD_DIFFERS in text, text
    # fc1.weight is (8, IN): rank 1 holds rows [4:8]
    assert "rank 1's local shard is not slice [4:8] along dim 0 of (8, " in text, text


@dataclasses.dataclass(frozen=True)
class GathersWithAllReduce(TorchFSDPTarget):
    """Gathers as FSDP2 does, then also all-reduces a copy through torch.distributed (as a
    hand-written ZeRO-3 gather would issue visible collectives): the harness's gathers must not
    count against the step's communication budget."""

    def full_tensor(self, tensor):
        import torch.distributed as dist

        whole = super().full_tensor(tensor)
        if whole.is_floating_point():  # twice: the gradient gathers alone then cost 2x budget
            dist.all_reduce(whole.clone())
            dist.all_reduce(whole.clone())
        return whole


def test_the_harness_gathers_are_not_counted_as_the_targets_communication():
    scenario = ddpcheck.Scenario(model=zoo.MLP, steps=1)
    ddpcheck.check_example(GathersWithAllReduce(), scenario, 2)  # over budget if counted


def _record(rank, whole, local, dim=0):
    step = StepRecord({}, {"w": whole}, {}, {}, [], shards={"w": (dim, local)})
    return RankRecord(rank, {}, [step], 0.0)


def test_compare_shards_follows_torch_chunk_and_names_the_slice():
    whole = torch.arange(10.0).reshape(5, 2)
    assert [shard_bounds(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    good = [
        _record(r, whole, whole[s:e])
        for r, (s, e) in enumerate(shard_bounds(5, 4, r) for r in range(4))
    ]
    assert compare_shards(0, 4, good) == []
    bad = list(good)
    bad[2] = _record(2, whole, whole[2:3])  # rank 2 stepped rank 1's last row
    (row,) = compare_shards(0, 4, bad)
    assert (row.rank, row.name, row.kind) == (2, "w", LOCAL_SHARD_DIFFERS)
    assert "[4:5] along dim 0 of (5, 2)" in row.detail
    swapped = list(good)
    swapped[0] = _record(0, whole, whole[2:4])  # right shape, another rank's slice
    (row,) = compare_shards(0, 4, swapped)
    assert row.rank == 0 and "slice [0:2] along dim 0" in row.detail


def test_fsdp_declines_name_their_reasons():
    branch = ddpcheck.Scenario(model=zoo.SampleBranch, global_batch=11, accumulation=3, seed=3)
    assert "layer 'extra' runs in micro-batch" in TORCH_FSDP.supports(branch)
    transposed = ddpcheck.Scenario(model=zoo.NonContiguous)
    assert "non-contiguous" in features.declines(TORCH_FSDP, transposed, 2)
    tied_head = ddpcheck.Scenario(
        model=ModelSpec(layers=(Layer(kind="embedding"),), width=2, tie_head=True),
        data=SpecData(width=2),
        global_batch=1,
        steps=1,
        seed=1,
    )
    assert "'l0.table.weight' is used outside its layer's forward" in TORCH_FSDP.supports(tied_head)
    assert TORCH_FSDP.supports(ddpcheck.Scenario(model=zoo.Tied)) is None  # tied within layers


def test_a_scenario_asked_again_is_not_judged_again(monkeypatch):
    # asked at the draw, again at admission, and at every world size of the battery
    from ddpcheck.targets import fsdp

    judged = []
    real = fsdp._cannot_run
    monkeypatch.setattr(fsdp, "_cannot_run", lambda *a: judged.append(a) or real(*a))
    branch = ddpcheck.Scenario(model=zoo.SampleBranch, global_batch=11, accumulation=3, seed=3)
    why = TORCH_FSDP.supports(branch)
    assert TORCH_FSDP.supports(branch) == why and len(judged) == 1
    equal = dataclasses.replace(branch)  # an equal scenario, another object: judged afresh
    assert TORCH_FSDP.supports(equal) == why and len(judged) == 2
    for seed in range(40):  # the oldest answers are let go
        TORCH_FSDP.supports(ddpcheck.Scenario(seed=seed))
    assert len(fsdp._ANSWERS) == fsdp._KEPT_ANSWERS
    TORCH_FSDP.supports(branch)
    assert len(judged) == 43


# ---------------------------------------------------------------------------------------------
# Mixed precision: FSDP2's MixedPrecisionPolicy from the scenario's param_dtype


BF16_PARAMS = ddpcheck.Scenario(
    zoo.TinyGPT,
    data=zoo.token_data,
    loss="token_cross_entropy",
    optimizer=torch.optim.AdamW,
    optimizer_kwargs={"lr": 0.01, "eps": 0.1},
    global_batch=7,
    steps=2,
    accumulation=2,
    dtype="float32",
    seed=3,
    param_dtype=torch.bfloat16,
)


def test_fsdp2_applies_the_scenarios_param_dtype_and_matches_the_emulated_reference():
    configured = TORCH_FSDP.configure(BF16_PARAMS)
    assert (configured.param_dtype, configured.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert TORCH_FSDP.configure(ddpcheck.Scenario(seed=3)).param_dtype is None  # no policy
    ddpcheck.check_example(TORCH_FSDP, BF16_PARAMS, 2)  # raises EquivalenceError on a bug


def test_a_reduction_in_bfloat16_under_a_float32_promise_is_a_narrower_dtype():
    with pytest.raises(ddpcheck.EquivalenceError) as caught:
        ddpcheck.check_example(TorchFSDPTarget(reduce_dtype=torch.bfloat16), BF16_PARAMS, 2)
    error = caught.value
    assert error.kinds[0] == "communication in a narrower dtype", str(error)
    assert "reduce_scatter_single" in error.divergences[0].detail
    assert "reduce_dtype=torch.bfloat16" in error.replay  # the replay line rebuilds the target
