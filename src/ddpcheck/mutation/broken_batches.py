"""Batch plans with one seeded bug each: the data split and loss normalisation of training loops.

Each class is a ``Target.shard_batch`` hook (``ddpcheck.batches``): the default plan
(``ddpcheck.batches.contiguous``: contiguous shards, every scale ``W / B``) with one change, the
one its docstring names, drawn from docs/bug-catalogue.md (A3, F1, F2, F3, and J1, J2: a token mean
taken where the global one belongs, ``ddpcheck.batches.TokenMean`` with another ``over``). The
catalogue puts each in front of the unmutated ``parallel`` target, so the bug is in the loop, not
in DDP.
"""

from __future__ import annotations

import contextlib
import dataclasses
from contextlib import AbstractContextManager

import torch
from torch import nn

from ddpcheck._language import objective
from ddpcheck._language.batches import (
    BatchPlan,
    DistributedSamplerBatches,
    GlobalBatch,
    TokenMean,
    contiguous,
    split,
)
from ddpcheck._language.features import FEATURES
from ddpcheck._language.training import OptimizerLike

__all__ = [
    "FlooredShards",
    "MeanOfRankMeans",
    "MicroBatchTokenMean",
    "PaddingSampler",
    "RankMeanBonusHooks",
    "RankTokenMean",
    "SamplerSeededPerRank",
    "SkipsEmptyShard",
]


def _scale(batch: GlobalBatch) -> float:
    return batch.world_size / batch.total if batch.reduction == "mean" else batch.world_size


@dataclasses.dataclass(frozen=True)
class FlooredShards:
    """F2: every rank takes ``B // W`` samples (``per_rank = len(dataset) // world_size``, as in
    modelscope/ms-swift #9907): the last ``B % W`` samples are never used."""

    def __call__(self, batch: GlobalBatch) -> BatchPlan:
        per_rank = batch.size // batch.world_size  # BUG: floors away the remainder
        shard = batch.indices[batch.rank * per_rank : (batch.rank + 1) * per_rank]
        return BatchPlan.uniform(split(shard, batch.accumulation), _scale(batch))


@dataclasses.dataclass(frozen=True)
class PaddingSampler(DistributedSamplerBatches):
    """F2: shards with torch's ``DistributedSampler(drop_last=False)``, normalised right
    (``W / B``): on a batch not divisible by W the sampler pads by repeating samples
    (pytorch/pytorch #25162), which are then trained on twice."""

    normalize: str = "global"  # BUG: the sampler pads; the scale is right for unpadded shards


@dataclasses.dataclass(frozen=True)
class MeanOfRankMeans:
    """A3: each rank normalises by its own sample count (``loss.mean()`` over its shard, split
    over micro-batches), and DDP averages those means: on uneven shards a sample's weight is
    ``1 / (W * its shard's size)``, not ``1 / B`` (vllm-project/speculators #942)."""

    def __call__(self, batch: GlobalBatch) -> BatchPlan:
        shard = split(batch.indices, batch.world_size)[batch.rank]
        if batch.reduction == "mean":  # BUG: the local mean, not the global one
            scale = 1.0 / len(shard) if shard else 0.0
        else:
            scale = float(batch.world_size)
        return BatchPlan.uniform(split(shard, batch.accumulation), scale)


@dataclasses.dataclass(frozen=True)
class SamplerSeededPerRank:
    """F1: the samples are shuffled before sharding, but with a seed that differs per rank
    (``seed + rank``; Lightning-AI/pytorch-lightning #17713): ranks cut different permutations,
    so some samples are trained on twice and others never."""

    def __call__(self, batch: GlobalBatch) -> BatchPlan:
        generator = torch.Generator().manual_seed(1000 * batch.step + batch.rank)  # BUG: + rank
        order = tuple(
            batch.indices[int(i)] for i in torch.randperm(batch.size, generator=generator)
        )
        shard = split(order, batch.world_size)[batch.rank]
        return BatchPlan.uniform(split(shard, batch.accumulation), _scale(batch))


@dataclasses.dataclass(frozen=True)
class SkipsEmptyShard:
    """F3: a rank whose shard is empty (B < W) runs no micro-batch at all, as a loop whose loader
    ran dry skips the step's forward and backward while the other ranks synchronise
    (pytorch/pytorch #38174: torch DDP hangs; ``parallel.DDP`` raises in its finish)."""

    def __call__(self, batch: GlobalBatch) -> BatchPlan:
        shard = split(batch.indices, batch.world_size)[batch.rank]
        if not shard:  # BUG: no micro-batch, rather than an empty one that still synchronises
            return BatchPlan((), ())
        return BatchPlan.uniform(split(shard, batch.accumulation), _scale(batch))


@dataclasses.dataclass(frozen=True)
class MicroBatchTokenMean(TokenMean):
    """J1: each micro-batch's loss is the mean over *its own* tokens, divided by the number of
    micro-batches (``loss.mean() / gradient_accumulation_steps``): a token in a micro-batch of few
    tokens weighs more than one in a long micro-batch (huggingface/transformers #34191: years of
    gradient-accumulation runs weighted short sequences wrong). Right only when every micro-batch
    holds as many tokens."""

    over: str = "micro-batch"  # BUG: the micro-batch's token count, not the global batch's


@dataclasses.dataclass(frozen=True)
class RankTokenMean(TokenMean):
    """J2: each rank's loss is the mean over *its own* tokens, and DDP averages those means: a
    token on a rank with few tokens weighs more (vllm-project/speculators #942: a per-rank token
    mean then DDP's mean weights each token by the rank it landed on). Right only when every rank
    holds as many tokens."""

    over: str = "rank"  # BUG: the rank's token count, not the global batch's


#: ``RankMeanBonusHooks``: what this rank's step's plan found, ``T / (W * T_r)`` (1: nothing to
#: change), read by its micro-batches (the rank is a process of its own)
_RANK_BONUS = [1.0]


class RankMeanBonusHooks:
    """J5: the entropy bonus and the KL term normalised over the rank's *own* tokens (a
    ``masked_mean`` of the entropy over the rank's batch, as RL trainers compute it per rank),
    while the cross-entropy beside them is normalised over the global batch's tokens: the plan is
    the default one (``shard_batch`` only counts), and each micro-batch (``micro_batch``) weighs
    the extra term by ``T / (W * T_r)``. Right only when every rank holds as many tokens."""

    # declared with the plan, so token scenarios judge it too (ddpcheck.features.supported_by)
    supported_features = frozenset(FEATURES) - {"param-dtype"}

    def shard_batch(self, batch: GlobalBatch) -> BatchPlan:
        plan = contiguous(batch)
        mine = sum(batch.terms_of(micro) for micro in plan.micro_batches)
        if batch.tokens is not None and batch.reduction == "mean" and mine:
            _RANK_BONUS[0] = batch.total / (batch.world_size * mine)  # BUG: the rank's tokens
        else:
            _RANK_BONUS[0] = 1.0
        return plan

    def micro_batch(
        self, model: nn.Module, optimizer: OptimizerLike, index: int, count: int
    ) -> AbstractContextManager[object]:
        stack = contextlib.ExitStack()
        stack.enter_context(super().micro_batch(model, optimizer, index, count))  # type: ignore[misc]
        weights = objective.ENTROPY_WEIGHT, objective.KL_WEIGHT
        objective.ENTROPY_WEIGHT, objective.KL_WEIGHT = (w * _RANK_BONUS[0] for w in weights)

        def restore() -> None:
            objective.ENTROPY_WEIGHT, objective.KL_WEIGHT = weights

        stack.callback(restore)
        return stack
