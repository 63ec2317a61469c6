"""The data path a torch user writes: ``DistributedSampler`` and a ``DataLoader`` per rank, an
epoch loop, accumulation windows -- for targets whose hooks the harness otherwise drives.

For a scenario with epochs (``Scenario.epochs``) a target with this mixin trains through
:meth:`SamplerDataPath.fit_epochs` instead of the harness's loop: each rank iterates its own
``DataLoader`` over ``DistributedSampler(dataset, W, rank, shuffle=False)``, ``set_epoch`` every
epoch, in windows of ``accumulation`` micro-batches (an epoch's last window may hold fewer), all but
the window's last under the target's ``no_sync``, each loss normalised over the samples of the
whole window on every rank (their count all-reduced: the normalisation that is right whatever
the split, as ``num_items_in_batch`` is), then the target's ``after_backward``, the clipping, the
optimizer's and the schedule's step, ``zero_grad`` and ``after_step`` -- the harness's order.
After every epoch, where the scenario has an evaluation set, each rank evaluates its share of
it -- samples ``rank, rank + W, ...``, no padding, so the ranks' shares differ by a sample where W
does not divide the set and their last batches are uneven (what accelerate's
``even_batches=False`` yields) -- through the module DDP wraps (whose forward communicates
nothing: the ranks may run different numbers of batches), sums each sample's terms of the
objective and their count, all-reduces both once, and reports their ratio: every sample counted
once (``EpochRun.evaluated``).

What torch documents for a dataset W does not divide is another weighting than the reference's,
so the target declines those examples in the rank (:class:`NothingChecked`, quoting it):
``drop_last=False`` pads with repeated samples, ``drop_last=True`` drops the tail.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset

from ddpcheck._base.errors import NothingChecked
from ddpcheck._language.scenario import Scenario
from ddpcheck._language.training import EpochRun, OptimizerLike, SchedulerLike
from ddpcheck.targets.protocol import Target

__all__ = ["EVEN_BATCHES_PADS", "SAMPLER_PADS", "SamplerDataPath", "sampler_cannot_run"]

#: torch's documentation of ``DistributedSampler(drop_last=...)``, quoted by the declines.
SAMPLER_PADS = (
    'DistributedSampler(drop_last=False), its default: "the sampler will add extra indices to '
    'make the data evenly divisible across the replicas" (samples repeated); with '
    'drop_last=True it "will drop the tail of the data to make it evenly divisible"'
)
#: accelerate's documentation of ``even_batches`` (its ``DataLoaderConfiguration``, and the HF
#: Trainer's ``AcceleratorConfig``, whose loader accelerate prepares), quoted by the declines.
EVEN_BATCHES_PADS = (
    'even_batches=True, its default: "in cases where the total batch size across all processes '
    "does not exactly divide the dataset, samples at the start of the dataset will be "
    'duplicated so the batch can be divided equally among all workers"'
)


class SamplerDataPath(Target):
    """The mixin: ``fit_epochs`` over the target's own hooks (see the module docstring)."""

    #: ``DistributedSampler(drop_last=...)``: torch's default
    sampler_drop_last: bool = False
    #: it evaluates a scenario's evaluation set after every epoch (:meth:`evaluate`)
    reports_metric = True

    def fit_epochs(self, module: nn.Module, run: EpochRun) -> None:
        world_size, rank = dist.get_world_size(), dist.get_rank()
        self.check_epochs(run, world_size)
        sampler: DistributedSampler[Any] = DistributedSampler(
            run.dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=False,
            drop_last=self.sampler_drop_last,
        )
        loader = DataLoader(
            run.dataset, batch_size=self.per_device_batch(run, world_size), sampler=sampler
        )
        model, optimizer = self.setup(module, run.params, run.optimizer, **run.optimizer_kwargs)
        scheduler = None
        if run.gamma is not None:
            scheduler = self.make_scheduler(optimizer, run.gamma)
        run.started(model, optimizer)
        for epoch in range(run.epochs):
            sampler.set_epoch(epoch)
            for window in self.windows(iter(loader), run.accumulation):
                self.train_window(model, optimizer, run, window)
                self.step(model, optimizer, scheduler, run)
            self.evaluate(model, run)

    def evaluate(self, model: nn.Module, run: EpochRun) -> None:
        """After an epoch: this rank's share of the evaluation set (:meth:`evaluation_loader`)
        through :meth:`evaluation_model`, each sample's terms and count summed, both all-reduced
        once, and their ratio reported (nothing without an evaluation set)."""
        if run.evaluation is None:
            return
        world_size, rank = dist.get_world_size(), dist.get_rank()
        net = self.evaluation_model(model)
        net.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=run.evaluation.x.device)
        for batch in self.evaluation_loader(run, rank, world_size):
            totals += run.evaluation_terms(net, batch).double().sum(dim=0)
        net.train()
        dist.all_reduce(totals)
        run.evaluated(run.metric_of(totals.reshape(1, 2)))

    def evaluation_loader(
        self, run: EpochRun, rank: int, world_size: int
    ) -> DataLoader[tuple[torch.Tensor, torch.Tensor, int]]:
        """This rank's share of the evaluation set, in per-device batches
        (``run.evaluation_batch``): samples ``rank, rank + W, ...`` -- no padding, a last batch
        as short as it comes."""
        assert run.evaluation is not None
        share = Subset(run.evaluation, range(rank, len(run.evaluation), world_size))
        return DataLoader(share, batch_size=run.evaluation_batch)

    def evaluation_model(self, model: nn.Module) -> nn.Module:
        """What evaluates: the module DDP wraps, whose forward communicates nothing (DDP's
        broadcasts buffers), so that ranks may run different numbers of batches."""
        return model.module if isinstance(model, DistributedDataParallel) else model

    def supports_at(self, scenario: Scenario, world_size: int) -> str | None:
        """What the sampler weighs by its own convention, and a micro-batch no per-device batch
        size gives, at ``world_size``."""
        epochs = scenario.epochs
        if epochs is None:
            return None
        return self.sampler_cannot_run(
            scenario.global_batch // scenario.accumulation, epochs.samples, world_size
        )

    def check_epochs(self, run: EpochRun, world_size: int) -> None:
        """The same, in the rank (a target asked to run what it declines)."""
        why = self.sampler_cannot_run(
            run.global_batch // run.accumulation, len(run.dataset), world_size
        )
        if why is not None:
            raise NothingChecked(f"{type(self).__name__} declines this example: {why}")

    def sampler_cannot_run(self, micro: int, samples: int, world_size: int) -> str | None:
        """Why a micro-batch of ``micro`` samples over a dataset of ``samples`` cannot be loaded
        through the sampler at ``world_size`` as the reference weighs it; None if it can."""
        return sampler_cannot_run(micro, samples, world_size)

    def per_device_batch(self, run: EpochRun, world_size: int) -> int:
        """The ``DataLoader``'s batch size: the global micro-batch over W."""
        return run.global_batch // run.accumulation // world_size

    def windows(
        self, batches: Iterator[Sequence[torch.Tensor]], accumulation: int
    ) -> Iterator[list[Sequence[torch.Tensor]]]:
        """The epoch's accumulation windows: ``accumulation`` micro-batches, the last fewer."""
        while window := list(itertools.islice(batches, accumulation)):
            yield window

    def window_total(self, window: list[Sequence[torch.Tensor]], run: EpochRun) -> int:
        """The terms (samples, or tokens) of the whole window on every rank (all-reduced)."""
        count = torch.tensor([sum(run.terms_of(batch) for batch in window)], dtype=torch.int64)
        dist.all_reduce(count)
        return int(count.item())

    def train_window(
        self,
        model: nn.Module,
        optimizer: OptimizerLike,
        run: EpochRun,
        window: list[Sequence[torch.Tensor]],
    ) -> None:
        """Forward and backward of every micro-batch of the window, each loss normalised over the
        window's terms on every rank, or summed for a summed objective (DDP averages over W:
        hence the W)."""
        self.before_step(model, optimizer)
        total = self.window_total(window, run)
        for i, batch in enumerate(window):
            last = i == len(window) - 1
            with contextlib.nullcontext() if last else self.no_sync(model):
                self.backward_scaled(model, run, batch, total)
        self.after_backward(model, optimizer)

    def backward_scaled(
        self, model: nn.Module, run: EpochRun, batch: Sequence[torch.Tensor], total: int
    ) -> None:
        """Back-propagate ``batch``'s summed terms times W, over the window's ``total`` terms for
        a mean objective (``run.loss_of`` is their mean: a user's ``loss.mean()``), through the
        target's ``backward`` hook."""
        scale = float(run.terms_of(batch) * run.world_size)
        if run.scenario.reduction == "mean":
            scale /= max(total, 1)
        self.backward(model, run.loss_of(model, batch) * scale)  # Fabric's fabric.backward

    def step(
        self,
        model: nn.Module,
        optimizer: OptimizerLike,
        scheduler: SchedulerLike | None,
        run: EpochRun,
    ) -> None:
        """Clip, step the optimizer and the schedule, record, clear: the harness's order."""
        if run.max_grad_norm is not None:
            self.clip_grad_norm(model, optimizer, run.max_grad_norm, run.grad_norm_type)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        run.record(model, optimizer, scheduler)
        optimizer.zero_grad(set_to_none=run.set_to_none)
        self.after_step(model, optimizer)


def sampler_cannot_run(micro: int, samples: int, world_size: int) -> str | None:
    """Why a micro-batch of ``micro`` samples (across the ranks) over a dataset of ``samples``
    cannot be loaded through torch's ``DistributedSampler`` at ``world_size`` as the reference
    weighs it -- no per-device batch size gives it, or the sampler evens out the ranks by its
    documented convention (:data:`SAMPLER_PADS`); None if it can. Shared by every target whose
    data path is that sampler (``SamplerDataPath``; Lightning's ``use_distributed_sampler``)."""
    if micro % world_size:
        return f"a micro-batch of {micro} samples over {world_size} ranks (no per-device size)"
    if samples % world_size:
        return f"{samples} samples over {world_size} ranks: {SAMPLER_PADS}"
    return None
