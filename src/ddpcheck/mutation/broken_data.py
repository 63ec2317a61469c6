"""Seeded bugs of the data path: torch's DDP target (``TorchDDPTarget``) driving its own
``DistributedSampler`` and ``DataLoader`` (``ddpcheck.targets.data_path``), each subclass
overriding one method of :class:`~ddpcheck.targets.data_path.SamplerDataPath` with a copy that
carries one bug of the data split, the epoch's last window or the per-device batch (classes C1,
F1, F2, F4, F5 of docs/bug-catalogue.md). Killed only by scenarios with epochs
(``Scenario.epochs``); the unmutated ``torch_ddp`` is their control.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from ddpcheck._language.training import EpochRun, OptimizerLike
from ddpcheck.targets.builtin import TorchDDPTarget

__all__ = [
    "DividesBatchTwiceTarget",
    "IgnoresSplitTarget",
    "LastMicroBatchUnreducedTarget",
    "PadsCountedTarget",
    "SeedPerRankTarget",
    "ShortWindowAsFullTarget",
]


@dataclasses.dataclass(frozen=True)
class PadsCountedTarget(TorchDDPTarget):
    """F2: the dataset is not checked against W, so ``DistributedSampler``'s padding (samples
    repeated to even out the ranks) trains as real samples (pytorch/pytorch #25162)."""

    def sampler_cannot_run(self, micro: int, samples: int, world_size: int) -> str | None:
        if micro % world_size:  # only the batch-size check is left
            return f"a micro-batch of {micro} samples over {world_size} ranks (no per-device size)"
        return None


@dataclasses.dataclass(frozen=True)
class SeedPerRankTarget(TorchDDPTarget):
    """F1: each rank shuffles with its own seed (``seed=rank``), so ranks overlap and miss
    samples (Lightning-AI/pytorch-lightning #17713)."""

    def fit_epochs(self, module: nn.Module, run: EpochRun) -> None:
        world_size, rank = dist.get_world_size(), dist.get_rank()
        self.check_epochs(run, world_size)
        sampler: DistributedSampler[Any] = DistributedSampler(
            run.dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=rank
        )  # the bug: a seed per rank (and a shuffle the reference's order does not follow)
        loader = DataLoader(
            run.dataset, batch_size=self.per_device_batch(run, world_size), sampler=sampler
        )
        model, optimizer = self.setup(module, run.params, run.optimizer, **run.optimizer_kwargs)
        scheduler = None if run.gamma is None else self.make_scheduler(optimizer, run.gamma)
        run.started(model, optimizer)
        for epoch in range(run.epochs):
            sampler.set_epoch(epoch)
            for window in self.windows(iter(loader), run.accumulation):
                self.train_window(model, optimizer, run, window)
                self.step(model, optimizer, scheduler, run)


@dataclasses.dataclass(frozen=True)
class ShortWindowAsFullTarget(TorchDDPTarget):
    """F4: every window is normalised as if it held ``accumulation`` full micro-batches, so an
    epoch's short last window steps with a gradient too small (huggingface/transformers #38837,
    Lightning-AI/pytorch-lightning #19987)."""

    def window_total(self, window: list[Sequence[torch.Tensor]], run: EpochRun) -> int:
        # the bug: a full window's terms, the first micro-batch's times W and the accumulation
        return run.terms_of(window[0]) * run.world_size * run.accumulation


@dataclasses.dataclass(frozen=True)
class IgnoresSplitTarget(TorchDDPTarget):
    """F5: a batch size meant to be split across the ranks is loaded whole by each of them (the
    split option ignored: accelerate's ``split_batches`` keyword since 1.0), so every step
    trains W times the global batch and an epoch takes W times fewer steps."""

    def per_device_batch(self, run: EpochRun, world_size: int) -> int:
        return run.global_batch // run.accumulation  # the bug: not divided by W


@dataclasses.dataclass(frozen=True)
class DividesBatchTwiceTarget(TorchDDPTarget):
    """F5: the per-device batch derived from the global one twice (divided by W again where a
    launcher had already divided it), so each step trains too few samples and an epoch takes
    more steps."""

    def per_device_batch(self, run: EpochRun, world_size: int) -> int:
        return max(1, run.global_batch // run.accumulation // world_size // world_size)


@dataclasses.dataclass(frozen=True)
class LastMicroBatchUnreducedTarget(TorchDDPTarget):
    """C1: an epoch's last micro-batch runs under ``no_sync`` like the window's others (the
    loop only syncs on ``(i + 1) % accumulation == 0``), so the epoch's last step is taken on
    unreduced gradients and the replicas drift apart (timoschick/pet #36 in reverse)."""

    def train_window(
        self,
        model: nn.Module,
        optimizer: OptimizerLike,
        run: EpochRun,
        window: list[Sequence[torch.Tensor]],
    ) -> None:
        self.before_step(model, optimizer)
        total = self.window_total(window, run)
        for i, batch in enumerate(window):
            synced = i == run.accumulation - 1  # the bug: an epoch's short window never syncs
            with contextlib.nullcontext() if synced else self.no_sync(model):
                self.backward_scaled(model, run, batch, total)
        self.after_backward(model, optimizer)
