"""DeepSpeed's own data path over a scenario's epochs (``DeepSpeedTarget.fit_epochs``): the loader
DeepSpeed's engine builds, and the loop DeepSpeed's tutorials write, with what that loop weighs
otherwise than the reference, by DeepSpeed's documented design, declined.

The loop (:func:`train_epochs`)::

    loader = engine.deepspeed_io(dataset, data_sampler=DistributedSampler(dataset, W, rank,
                                                                          shuffle=False))
    for epoch in range(E):
        loader.data_sampler.set_epoch(epoch)
        for batch in loader:
            loss = loss_of(engine, batch)       # the batch's mean loss
            engine.backward(loss)               # divides it by gradient_accumulation_steps
            engine.step()                       # steps at DeepSpeed's accumulation boundary

``engine.deepspeed_io`` is the loader ``deepspeed.initialize(training_data=...)`` builds -- the
engine's ``DeepSpeedDataLoader`` (its torch ``DataLoader``, the per-device batch
``train_micro_batch_size_per_gpu``, the config's ``dataloader_drop_last``) -- with the one
argument ``initialize`` does not take: the sampler. ``initialize``'s is
``DistributedSampler(dataset, num_replicas, rank)`` with torch's defaults, which shuffles, where
the reference walks the dataset in index order; so, as Lightning's docs say to where its own
sampler must not shuffle, ours is the same sampler with ``shuffle=False``.
``num_local_io_workers=0``: the same batches, without the two worker processes per rank and epoch
that are DeepSpeed's default on CPU.

Declined, quoting DeepSpeed (:func:`epochs_cannot_run`, :func:`loader_cannot_run`): an epoch whose
last window is short under accumulation -- the engine counts its windows over the whole run and
does not end one at an epoch's end, and divides every loss by ``gradient_accumulation_steps``
(:data:`COUNTS_OVER_THE_RUN`); a summed or token objective (the loop's loss is each batch's mean);
the sampler's padding (``data_path.SAMPLER_PADS``); a last batch ``dataloader_drop_last`` drops
(:data:`LOADER_DROPS_LAST`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.utils.data import DistributedSampler, Sampler

from ddpcheck._language.scenario import Scenario
from ddpcheck._language.training import EpochRun, OptimizerLike, SchedulerLike
from ddpcheck.targets.data_path import sampler_cannot_run

if TYPE_CHECKING:  # DeepSpeed ships no type information: mypy reads these names untyped
    from deepspeed import DeepSpeedEngine

__all__ = [
    "COUNTS_OVER_THE_RUN",
    "LOADER_DROPS_LAST",
    "MEAN_PER_BATCH",
    "epochs_cannot_run",
    "index_order",
    "loader_cannot_run",
    "train_epochs",
]

#: DeepSpeed's design of the accumulation window, quoted by the decline of a short last window:
#: its docstrings (0.19.8, ``runtime/engine.py``) and its maintainer's answer.
COUNTS_OVER_THE_RUN = (
    "DeepSpeed's engine counts its windows over the whole run "
    '(is_gradient_accumulation_boundary: "In managed gradient accumulation (default), the '
    'result is driven by the internal micro-step counter"; deepspeedai/DeepSpeed#7439: "DS will '
    "not automatically handle incomplete gradient accumulation steps\"), so the epoch's short "
    "last window is finished by the next epoch's first batches; and engine.backward scales "
    'every loss "by gradient accumulation steps" (scale_wrt_gas, default true), a short '
    "batch's as a full one's"
)
#: torch's documentation of ``DataLoader(drop_last=True)``, which DeepSpeed's loader is given
#: from the config's ``dataloader_drop_last`` (``DeepSpeedDataLoader._create_dataloader``)
LOADER_DROPS_LAST = (
    "dataloader_drop_last=true, which DeepSpeed's loader passes to torch's DataLoader: \"set to "
    "True to drop the last incomplete batch, if the dataset size is not divisible by the batch "
    'size", samples the reference trains'
)
#: why a summed or token objective is declined
MEAN_PER_BATCH = (
    "the loop's loss is each batch's mean (a user's loss.mean()), which engine.backward "
    "divides by gradient_accumulation_steps and the engine averages over the ranks: every "
    "batch weighs alike, whatever the terms it holds"
)


def epochs_cannot_run(scenario: Scenario) -> str | None:
    """Why DeepSpeed's own data path does not train ``scenario``'s epochs as the reference does,
    whatever the world size, by its documented design; None when it must."""
    epochs = scenario.epochs
    if epochs is None:
        return None
    if scenario.reduction != "mean" or scenario.loss != "squared_error":
        return f"epochs with a summed or token objective: {MEAN_PER_BATCH}"
    if scenario.accumulation > 1 and epochs.samples % scenario.global_batch:
        return (
            f"an epoch of {epochs.samples} samples in steps of {scenario.global_batch}: its "
            f"last window holds fewer samples than accumulation={scenario.accumulation} full "
            f"micro-batches, and {COUNTS_OVER_THE_RUN}"
        )
    return None


def loader_cannot_run(scenario: Scenario, world_size: int, drop_last: bool) -> str | None:
    """Why DeepSpeed's loader does not load ``scenario``'s epochs at ``world_size`` as the
    reference weighs them -- no per-device batch size, the sampler's padding, or a last batch
    ``dataloader_drop_last`` (``drop_last``) drops; None when it does."""
    epochs = scenario.epochs
    if epochs is None:
        return None
    micro = scenario.global_batch // scenario.accumulation
    cannot = sampler_cannot_run(micro, epochs.samples, world_size)
    if cannot is not None or not drop_last:
        return cannot
    per_device, share = micro // world_size, epochs.samples // world_size
    if share % per_device == 0:
        return None
    return (
        f"{share} samples per rank in batches of {per_device}: the last holds "
        f"{share % per_device}, and {LOADER_DROPS_LAST}"
    )


def index_order(run: EpochRun) -> Sampler[int]:
    """The sampler of DeepSpeed's loader: ``initialize``'s, ``DistributedSampler(dataset,
    num_replicas, rank)``, without its shuffling (the reference walks the dataset in order)."""
    return DistributedSampler(
        run.dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank(), shuffle=False
    )


def train_epochs(
    engine: DeepSpeedEngine,
    optimizer: OptimizerLike,
    scheduler: SchedulerLike | None,
    run: EpochRun,
    sampler: Sampler[int],
) -> None:
    """The loop of the module docstring over ``run``'s dataset, the engine's loader drawing from
    ``sampler``: every micro-batch through ``engine.backward`` and ``engine.step``, the engine
    deciding where a window ends; each step it takes is recorded, its gradients read before
    ``engine.step()`` clears them."""
    loader = engine.deepspeed_io(run.dataset, data_sampler=sampler, num_local_io_workers=0)
    run.started(engine, optimizer)
    for epoch in range(run.epochs):
        if hasattr(loader.data_sampler, "set_epoch"):  # DistributedSampler's: its epoch's order
            loader.data_sampler.set_epoch(epoch)
        for batch in loader:
            engine.backward(run.loss_of(engine, batch))
            boundary = engine.is_gradient_accumulation_boundary()
            if boundary:
                run.gradients_ready(engine, optimizer)
            engine.step()
            if boundary:
                run.record(engine, optimizer, scheduler)
