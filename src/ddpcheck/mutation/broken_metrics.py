"""Family L's metrics: torch's DDP target evaluating a scenario's evaluation set after every epoch
(``ddpcheck.targets.data_path.SamplerDataPath.evaluate``), each subclass overriding the method
that loads a rank's share of it with one bug of an evaluation loop (classes L6, L7 of
docs/bug-catalogue.md). Every parameter and gradient stays right: only the evaluation metric a
user reads is wrong, so only the oracle's metric check (``ddpcheck._oracle.metrics``) can kill
them, and only on scenarios with an evaluation set (``Epochs.evaluation``); the unmutated
``torch_ddp`` is their control.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.utils.data import DataLoader, DistributedSampler, Subset

from ddpcheck._language.training import EpochRun
from ddpcheck.targets.builtin import TorchDDPTarget

__all__ = ["DropsUnevenLastBatchTarget", "PaddingCountedTarget"]


@dataclasses.dataclass(frozen=True)
class PaddingCountedTarget(TorchDDPTarget):
    """L6: the evaluation set loaded through ``DistributedSampler(shuffle=False)``, whose padding
    (samples repeated so that every rank holds as many) is counted in the metric: what
    ``accelerator.gather`` in place of ``gather_for_metrics`` does, and what Lightning warns its
    multi-device validation does ("replicates some samples"); torchvision's reference scripts
    warn of it too."""

    def evaluation_loader(
        self, run: EpochRun, rank: int, world_size: int
    ) -> DataLoader[tuple[torch.Tensor, torch.Tensor, int]]:
        assert run.evaluation is not None
        sampler: DistributedSampler[tuple[torch.Tensor, torch.Tensor, int]] = DistributedSampler(
            run.evaluation, num_replicas=world_size, rank=rank, shuffle=False
        )  # the bug: drop_last=False pads the ranks' shares with repeated samples
        return DataLoader(run.evaluation, batch_size=run.evaluation_batch, sampler=sampler)


@dataclasses.dataclass(frozen=True)
class DropsUnevenLastBatchTarget(TorchDDPTarget):
    """L7: each rank's evaluation loader built with ``drop_last=True``, as the training loader
    was: a rank whose share ends in a short batch never evaluates it, the others evaluate all of
    theirs -- the uneven end of an evaluation set, dropped on some ranks only."""

    def evaluation_loader(
        self, run: EpochRun, rank: int, world_size: int
    ) -> DataLoader[tuple[torch.Tensor, torch.Tensor, int]]:
        assert run.evaluation is not None
        share = Subset(run.evaluation, range(rank, len(run.evaluation), world_size))
        # the bug: the last, short batch of a rank's share is dropped
        return DataLoader(share, batch_size=run.evaluation_batch, drop_last=True)
