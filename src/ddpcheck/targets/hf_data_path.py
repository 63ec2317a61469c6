"""The HF Trainer's own data path over a scenario's epochs (``HfTrainerTarget.fit_epochs``): the
dataset as the Trainer reads it, the ``Trainer`` subclass that notes what each step consumed, and
what the Trainer's loader weighs otherwise than the reference, by a documented convention.

Why apart from ``hf_trainer``: the Trainer's loader is accelerate's (``get_train_dataloader``
prepares it with the Trainer's ``accelerator_config``), so whether an epoch can be judged depends
on accelerate's conventions -- ``even_batches`` pads a short last micro-batch with samples from the
dataset's start, ``dataloader_drop_last`` drops it, ``even_batches=False`` leaves the ranks with
different numbers of batches, which torch DDP cannot train unless the counts keep every collective
paired -- and this module holds those rules, each quoting its documentation. What is the
Trainer's and what is ddpcheck's is in ``docs/frameworks.md`` ("Its own data path").
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import Sampler, SequentialSampler

from ddpcheck._base.errors import InvalidArgument
from ddpcheck._language.scenario import Scenario
from ddpcheck._language.training import EpochRun, SampleDataset
from ddpcheck.targets.data_path import EVEN_BATCHES_PADS

__all__ = [
    "DROPS_LAST",
    "SAMPLE_INDEX",
    "SAMPLING",
    "UNEVEN_INPUTS",
    "Item",
    "TrainerDataset",
    "epoch_trainer",
    "epochs_cannot_run",
    "uneven_steps",
]

#: A sample of a scenario's dataset as the Trainer's loader reads it: with its index
Item = dict[str, torch.Tensor | int]

SAMPLING = "train_sampling_strategy"
#: the key under which :class:`TrainerDataset`'s items carry their index
SAMPLE_INDEX = "sample_index"


#: transformers' documentation of ``TrainingArguments(dataloader_drop_last=True)``
DROPS_LAST = (
    'dataloader_drop_last=True: "Whether to drop the last incomplete batch (if the length of '
    'the dataset is not divisible by the batch size)", samples the reference trains'
)


#: torch's documentation of ``DistributedDataParallel.join``, which the Trainer does not enter
UNEVEN_INPUTS = (
    "the Trainer does not enter torch DDP's join (\"Context manager for training with uneven "
    "inputs across processes in DDP\"): the ranks' collectives no longer pair up"
)


def epochs_cannot_run(scenario: Scenario, drop_last: bool, even_batches: bool) -> str | None:
    """Why the Trainer's own data path does not train ``scenario``'s epochs as the reference
    does, by a documented convention, whatever the world size; None when it may. A dataset the
    global micro-batch does not divide loses its tail under ``dataloader_drop_last=True``;
    otherwise accelerate, which prepares the Trainer's loader with its ``accelerator_config``,
    evens it out with samples from its start (``even_batches=True``, the default) or leaves
    the ranks' last batches unequal (:func:`uneven_steps`)."""
    epochs = scenario.epochs
    if epochs is None:
        return None
    micro = scenario.global_batch // scenario.accumulation
    if epochs.samples % micro == 0 or not (drop_last or even_batches):
        return None
    return (
        f"an epoch of {epochs.samples} samples in micro-batches of {micro} across the ranks: "
        "its last micro-batch is short, and "
        + (
            DROPS_LAST
            if drop_last
            else "accelerate prepares the Trainer's DataLoader with the Trainer's "
            f"accelerator_config {EVEN_BATCHES_PADS}"
        )
    )


def uneven_steps(
    scenario: Scenario, world_size: int, split: bool, *, every_batch: bool
) -> str | None:
    """Under ``even_batches=False``, why the ranks' epochs end in different numbers of optimizer
    steps -- or, where the Trainer gathers across the ranks after every batch
    (``every_batch``: ``include_num_input_tokens_seen``), of batches; None when they do not.
    Each rank's loader holds its own batches -- every W-th per-device batch, or its part of
    every global micro-batch under ``split_batches`` (none of a short last one that ends before
    it) -- and each rank's Trainer counts its own steps (``ceil(batches /
    gradient_accumulation_steps)``), where torch DDP needs every rank in every collective."""
    epochs = scenario.epochs
    if epochs is None:
        return None
    micro = scenario.global_batch // scenario.accumulation
    share = micro // world_size
    if split:
        batches = [
            epochs.samples // micro + (epochs.samples % micro > r * share)
            for r in range(world_size)
        ]
    else:
        batches = [
            len(range(r, math.ceil(epochs.samples / share), world_size)) for r in range(world_size)
        ]
    steps = [math.ceil(n / scenario.accumulation) for n in batches]
    held = (
        f"an epoch of {epochs.samples} samples with even_batches=False: the ranks' loaders hold "
        f"{', '.join(map(str, batches))} batches, {', '.join(map(str, steps))} optimizer "
        f"steps (gradient_accumulation_steps={scenario.accumulation})"
    )
    if len(set(steps)) > 1:
        return f"{held}, and {UNEVEN_INPUTS}"
    if every_batch and len(set(batches)) > 1:
        return (
            f"{held}; include_num_input_tokens_seen gathers every batch's token count across "
            f"the ranks, and {UNEVEN_INPUTS}"
        )
    return None


class TrainerDataset(torch.utils.data.Dataset[Item]):
    """The scenario's dataset as a Trainer's ``train_dataset``: item ``i`` is
    ``{"input_ids": x[i], "labels": y[i], "sample_index": i}``, so every batch the Trainer's
    loader yields carries the indices it holds (the Trainer's default collator stacks them)."""

    def __init__(self, samples: SampleDataset):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Item:
        x, y, i = self.samples[index]
        return {"input_ids": x, "labels": y, SAMPLE_INDEX: i}


def epoch_trainer(trainer_cls: type, run: EpochRun, sequential: bool) -> type:
    """The ``Trainer`` subclass of the data path: its ``training_step`` notes which samples each
    micro-batch the Trainer trains holds (``run.consumed``) and hands the rest on; where
    ``TrainingArguments`` has no ``train_sampling_strategy`` (not ``sequential``: older
    releases), its ``_get_train_sampler`` is a ``SequentialSampler`` -- the Trainer's default
    shuffles, where the reference walks the dataset in index order."""

    class Trainer(trainer_cls):  # type: ignore[misc]  # transformers' Trainer
        def training_step(
            self, model: nn.Module, inputs: dict, *args: object, **kwargs: object
        ) -> torch.Tensor:
            if SAMPLE_INDEX not in inputs:  # a user's loader or collator that drops it
                raise InvalidArgument(
                    f"the batches {type(self).__name__} trains carry no {SAMPLE_INDEX!r}, "
                    "which the scenario's dataset gives each sample: over a scenario's epochs "
                    "a trainer_class's get_train_dataloader or data collator must keep it "
                    "(ddpcheck judges what each step consumed by it)"
                )
            run.consumed([int(i) for i in inputs.pop(SAMPLE_INDEX)])
            loss: torch.Tensor = super().training_step(model, inputs, *args, **kwargs)
            return loss

        if not sequential:

            def _get_train_sampler(self, *args: object, **kwargs: object) -> Sampler[int]:
                return SequentialSampler(self.train_dataset)

    return Trainer
