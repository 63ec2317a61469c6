"""Targets that own the batch: ``Target.shard_batch``, its checks, and the DistributedSampler hook.

The default plan is the scenario's batch rule bit for bit; a target's own plan runs and passes when
it weighs every sample as the full batch does; the oracle names dropped, duplicated and misweighted
samples (the target's bug); a malformed answer is an InvalidArgument naming the rank and the step.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import parallel
from ddpcheck import Scenario, check_example, zoo
from ddpcheck._oracle.sample_weights import check_sample_weights
from ddpcheck._rank.runner import target_loop
from ddpcheck.batches import BatchPlan, DistributedSamplerBatches, GlobalBatch, contiguous, split
from ddpcheck.errors import EquivalenceError, InvalidArgument
from ddpcheck.scenario import local_micro_batches
from ddpcheck.targets import PARALLEL, Target

# ---------------------------------------------------------------------------------------------
# Module-level hooks and targets: they travel to every rank by pickle, and replay by name.


@dataclasses.dataclass(frozen=True)
class StridedTwice:
    """A correct plan unlike the default: every sample on two ranks (strided), half weight each."""

    def __call__(self, batch: GlobalBatch) -> BatchPlan:
        w = batch.world_size
        mine = batch.indices[batch.rank :: w] + batch.indices[(batch.rank + 1) % w :: w]
        scale = (w / batch.size if batch.reduction == "mean" else float(w)) / 2
        return BatchPlan.uniform(split(mine, batch.accumulation), scale)


def _with(hook):
    return Target.from_wrappers(ddp=parallel.DDP, finish="finish_gradient_sync", shard_batch=hook)


STRIDED_TWICE = _with(StridedTwice())
SAMPLER = _with(DistributedSamplerBatches())
SAMPLER_DROP_LAST = _with(DistributedSamplerBatches(drop_last=True, normalize="global"))
SAMPLER_SHUFFLED = _with(DistributedSamplerBatches(shuffle=True, seed=3, normalize="global"))


@dataclasses.dataclass(frozen=True)
class Answers:
    """A hook answering every batch with ``BatchPlan(micro_batches, scales)``, or with
    ``micro_batches`` itself when ``plan`` is False."""

    micro_batches: tuple
    scales: tuple = (1.0,)
    plan: bool = True

    def __call__(self, batch: GlobalBatch):
        return BatchPlan(self.micro_batches, self.scales) if self.plan else self.micro_batches


def _raises_on_rank_1_step_1(batch):
    if (batch.rank, batch.step) == (1, 1):
        raise IndexError("list index out of range")
    return contiguous(batch)


def _nan_on_rank_1(batch):
    plan = contiguous(batch)
    return plan if batch.rank == 0 else BatchPlan.uniform(plan.micro_batches, math.nan)


MALFORMED = {
    "a list": (
        _with(Answers(([0, 1],), plan=False)),
        r"returned tuple .* not a ddpcheck\.batches\.BatchPlan",
    ),
    "out of range": (
        _with(Answers(((0, 7),))),
        r"micro-batch 0 holds sample index 7, outside the global batch's 0\.\.6",
    ),
    "a float index": (_with(Answers(((0, 1.5),))), r"holds 1\.5 \(float\)"),
    "a NaN scale": (
        _with(_nan_on_rank_1),
        r"step 0 for rank 1 .*scale of micro-batch 0 is nan; it must be a finite",
    ),
    "too few scales": (_with(Answers(((0,), (1,)))), r"2 micro-batches but 1 scales"),
    "a crash": (
        _with(_raises_on_rank_1_step_1),
        r"at step 1 for rank 1 .*raised IndexError: list index out of range",
    ),
}
for _name, (_target, _) in MALFORMED.items():
    globals()["MALFORMED_" + _name.replace(" ", "_").upper()] = _target


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_default_plan_is_the_scenario_batch_rule_bit_for_bit(reduction):
    for size in range(1, 14):
        for world_size in range(1, 6):
            for accumulation in (1, 2, 3):
                scenario = Scenario(
                    zoo.MLP,
                    global_batch=size,
                    accumulation=accumulation,
                    reduction=reduction,
                    steps=1,
                )
                for rank in range(world_size):
                    loop = target_loop(PARALLEL, None, None, scenario, rank, world_size)
                    got = loop.batches(0)
                    want = local_micro_batches(scenario, 0, rank, world_size)
                    assert len(got) == len(want)
                    for (x, y, scale), (wx, wy) in zip(got, want):
                        # each rank's summed losses times W/B average over the global batch
                        assert scale == (world_size if reduction == "sum" else world_size / size)
                        # the same views of the same storage: the same numbers, bit for bit
                        assert x.shape == wx.shape and torch.equal(x, wx) and torch.equal(y, wy)
                        assert x.stride() == wx.stride()


def test_the_default_plan_weighs_every_sample_as_the_full_batch():
    for size, world_size, accumulation in [(7, 2, 1), (3, 4, 2), (11, 3, 3), (8, 4, 1)]:
        for reduction in ("mean", "sum"):
            plans = [
                contiguous(
                    GlobalBatch(tuple(range(size)), 0, r, world_size, accumulation, reduction)
                )
                for r in range(world_size)
            ]
            assert check_sample_weights(0, world_size, plans, size, reduction) == []


def test_the_oracle_names_dropped_duplicated_and_misweighted_samples():
    # B=5, W=2: rank 0 takes 0, 1, 1 (twice), rank 1 takes 3, 4 at the wrong scale; 2 is dropped
    plans = [BatchPlan([[0, 1], [1]], [0.4, 0.4]), BatchPlan([[3, 4]], [0.5])]
    rows = check_sample_weights(2, 2, plans, 5, "mean")
    assert [(r.kind, r.name, r.rank) for r in rows] == [
        ("sample duplicated", "sample 1", None),
        ("sample dropped", "sample 2", None),
        ("sample misweighted", "sample 3", 1),
        ("sample misweighted", "sample 4", 1),
    ]
    assert "rank 0 micro-batch 0 (scale 0.4), rank 0 micro-batch 1 (scale 0.4)" in rows[0].detail
    assert "gives it 1/5 = 0.2" in rows[1].detail
    assert "rank 1 scales micro-batch 0 (sample 3's) by 0.5: weight 0.25" in rows[2].detail
    assert all(r.step == 2 and r.world_size == 2 and r.target_fault for r in rows)


def test_a_target_with_its_own_plan_runs_it_and_passes():
    # every sample on two ranks at half weight: right, though no sample is used once
    for scenario in (
        Scenario(zoo.MLP, global_batch=7, accumulation=2, steps=2),
        Scenario(zoo.MLP, global_batch=5, reduction="sum", steps=1),
    ):
        for world_size in (2, 3):
            check_example(STRIDED_TWICE, scenario, world_size)
    # the sampler on batches it divides evenly: no padding, nothing dropped, local means right
    check_example(SAMPLER, Scenario(zoo.MLP, global_batch=8, accumulation=2, steps=2), 2)
    check_example(SAMPLER_SHUFFLED, Scenario(zoo.MLP, global_batch=6, steps=2), 3)


def _rows(target, scenario, world_size):
    with pytest.raises(EquivalenceError) as caught:
        check_example(target, scenario, world_size)
    return caught.value


def test_distributed_sampler_padding_duplicates_a_sample_and_the_oracle_names_it():
    # B=7 over W=2: the sampler pads to 8 by repeating sample 0; rank 1 trains on it again, and
    # loss.mean() over the padded shards of 4 weighs every other sample 1/8 instead of 1/7
    error = _rows(SAMPLER, Scenario(zoo.MLP, global_batch=7, steps=1), 2)
    rows = error.divergences
    assert (rows[0].kind, rows[0].name, rows[0].step) == ("sample duplicated", "sample 0", 0)
    assert "rank 0 micro-batch 0 (scale 0.25), rank 1 micro-batch 0 (scale 0.25)" in rows[0].detail
    assert {r.kind for r in rows[1:]} == {"sample misweighted"}
    assert [r.name for r in rows[1:]] == [f"sample {i}" for i in range(1, 7)]
    assert "diverged at world size 2: sample duplicated" in str(error)
    assert "replay: python -m ddpcheck replay tests.language.test_batches:SAMPLER " in str(error)


def test_distributed_sampler_drop_last_drops_the_tail_and_the_oracle_names_it():
    error = _rows(SAMPLER_DROP_LAST, Scenario(zoo.MLP, global_batch=7, steps=1), 2)
    # normalised by W/B, only the dropped sample is wrong -- and no number is blamed for it
    assert [(r.kind, r.name) for r in error.divergences] == [("sample dropped", "sample 6")]


def test_a_shuffled_sampler_pads_with_a_shuffled_sample_and_the_oracle_names_it():
    # B=5 over W=2, normalised by W/B: the one repeated sample is the only wrong weight
    error = _rows(SAMPLER_SHUFFLED, Scenario(zoo.MLP, global_batch=5, steps=2), 2)
    assert [(r.step, r.kind) for r in error.divergences] == [(0, "sample duplicated")]


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_plan_is_an_invalid_argument_naming_rank_and_step(case):
    target, message = MALFORMED[case]
    with pytest.raises(InvalidArgument, match=message) as caught:
        check_example(target, Scenario(zoo.MLP, global_batch=7, steps=2), 2)
    assert not isinstance(caught.value, EquivalenceError)
    assert "WrapperTarget.shard_batch at step " in str(caught.value)


def test_from_wrappers_refuses_a_shard_batch_that_is_not_callable():
    with pytest.raises(InvalidArgument, match=r"shard_batch=3\) must be a callable"):
        Target.from_wrappers(shard_batch=3)


def test_the_sampler_hook_refuses_an_unknown_normalisation():
    with pytest.raises(InvalidArgument, match="normalize='batch' must be 'local' or 'global'"):
        DistributedSamplerBatches(normalize="batch")
