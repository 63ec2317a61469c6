"""Family L: the loss a training loop reports, each mixin with one seeded bug.

Each mixin overrides ``Target.reported_loss`` of the ``parallel`` target, whose own
(``ParallelDDPTarget.reported_loss``) averages the step's losses over the ranks exactly as
``parallel.DDP`` averages the gradients (``DDP.reduce_loss``). Every gradient stays right: only the
number a user reads is wrong, so only the oracle's loss check (``ddpcheck._oracle.losses``) can
kill them. Each docstring says which loop idiom it mirrors; the classes are in
``docs/bug-catalogue.md`` (family L).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ddpcheck._language.training import MicroBatchLoss, OptimizerLike

__all__ = [
    "LastMicroBatchLossHooks",
    "MicroBatchMeanLossHooks",
    "RankMeanLossHooks",
    "RankZeroLossHooks",
    "SummedLossHooks",
]


def _own_mean(losses: Sequence[MicroBatchLoss]) -> torch.Tensor:
    """This rank's mean over its own terms: what ``criterion(output, target)`` of its whole
    share would have returned."""
    summed = torch.stack([m.summed for m in losses]).sum()
    return summed / max(sum(m.terms for m in losses), 1)


class RankZeroLossHooks:
    """L1: rank 0 logs its own loss as the step's -- the mean over its W-th of the batch
    (``if rank == 0: print(loss.item())``, every logger that skips the reduction); the other
    ranks report nothing."""

    def reported_loss(
        self, model: nn.Module, optimizer: OptimizerLike, losses: Sequence[MicroBatchLoss]
    ) -> torch.Tensor | None:
        return _own_mean(losses) if dist.get_rank() == 0 else None


class SummedLossHooks:
    """L2: the step's losses all-reduced with SUM for logging and never divided by W: the
    logged loss is W times the objective (a gloo SUM, or NCCL's AVG swapped for SUM)."""

    def reported_loss(
        self, model: nn.Module, optimizer: OptimizerLike, losses: Sequence[MicroBatchLoss]
    ) -> torch.Tensor:
        total = MicroBatchLoss.total(losses).reshape(1)
        dist.all_reduce(total)
        return total[0]


class MicroBatchMeanLossHooks:
    """L3: the logged loss is the mean of the micro-batches' means, over the accumulation
    window and the ranks -- where the objective weighs every term (token, sample) alike, a
    micro-batch with fewer of them counts as much as a full one (transformers' Trainer before
    4.46 logged the loss so; ragged token counts, a short micro-batch of an uneven batch)."""

    def reported_loss(
        self, model: nn.Module, optimizer: OptimizerLike, losses: Sequence[MicroBatchLoss]
    ) -> torch.Tensor:
        means = torch.stack([m.mean for m in losses]).sum().reshape(1)
        count = torch.tensor([float(len(losses))], dtype=means.dtype, device=means.device)
        both = torch.cat([means, count])
        dist.all_reduce(both)
        return both[0] / both[1]


class LastMicroBatchLossHooks:
    """L4: the logged loss is the last micro-batch's, times the number of micro-batches
    (``loss.item() * gradient_accumulation_steps``, printed after the window's last backward),
    averaged over the ranks: the window's other micro-batches are never seen."""

    def reported_loss(
        self, model: nn.Module, optimizer: OptimizerLike, losses: Sequence[MicroBatchLoss]
    ) -> torch.Tensor:
        last = (losses[-1].loss * len(losses)).reshape(1)
        dist.all_reduce(last)
        return last[0] / dist.get_world_size()


class RankMeanLossHooks:
    """L5: each rank logs the mean over its own terms, and the ranks' means are averaged: where
    the ranks hold different numbers of terms (a batch W does not divide, ragged tokens) the
    terms of a smaller share weigh more -- the per-rank normalisation of J2, in the logged
    number only."""

    def reported_loss(
        self, model: nn.Module, optimizer: OptimizerLike, losses: Sequence[MicroBatchLoss]
    ) -> torch.Tensor:
        mean = _own_mean(losses).reshape(1)
        dist.all_reduce(mean)
        return mean[0] / dist.get_world_size()
