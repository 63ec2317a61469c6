"""Trainer subclasses the hf_trainer tests hand to ``HfTrainerTarget(trainer_class=...)``: one
that looks, inside the rank, at what the user's TrainingArguments did to the DDP model the Trainer
built; one with a seeded bug; one that writes its precision into the environment as older
releases did. Imports transformers: imported only where it is installed (the rank
processes import it by this module's name when they unpickle the target)."""

from __future__ import annotations

import os

from transformers import Trainer

#: the bucket size the observing test gives as ``TrainingArguments(ddp_bucket_cap_mb=...)``
BUCKET_MB = 3


class ObservingTrainer(Trainer):
    """Fails the rank unless the DDP model it trains buckets gradients in :data:`BUCKET_MB`
    megabytes: the user's ``ddp_bucket_cap_mb`` reached torch's DDP through the Trainer."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        got = getattr(model, "bucket_bytes_cap", None)
        assert got == BUCKET_MB * 2**20, (
            f"the Trainer's {type(model).__name__} buckets {got} bytes, not the "
            f"ddp_bucket_cap_mb={BUCKET_MB} given"
        )
        return super().training_step(model, inputs, num_items_in_batch)


class PerMicroBatchLoss(Trainer):
    """A seeded bug (huggingface/transformers #34191's): a ``compute_loss`` that drops
    ``num_items_in_batch``, so each micro-batch's loss is the mean over its own tokens, divided by
    the accumulation steps (DDP averages over the ranks) -- right only where every micro-batch on
    every rank holds as many tokens."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch=None)
        return loss / self.args.gradient_accumulation_steps


class WritesPrecisionToEnvironment(Trainer):
    """What ``TrainingArguments`` of transformers 4.45 to 4.57 does, in a release that no longer
    does it: ``bf16=True`` writes ``ACCELERATE_MIXED_PRECISION=bf16`` into ``os.environ``, where
    the next ``TrainingArguments`` of the process takes it as its own precision
    (bench/hf_mixed_precision_env.py)."""

    def __init__(self, *args, **kwargs):
        if kwargs["args"].bf16:
            os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"
        super().__init__(*args, **kwargs)


class LogsLossOverW(Trainer):
    """A seeded bug in the logged number only: ``training_step`` hands the loop its loss divided
    by the world size (undoing the Trainer's own W-fold scaling of a token-averaged loss for
    the log): every gradient is right, the logged loss W times too small."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        return loss / self.accelerator.num_processes


class GlobalBatchPerDevice(Trainer):
    """A seeded data-path bug: the training loader's batch size is the global micro-batch (the
    per-device size multiplied by the world size once more), so every rank loads what the ranks
    together should: each step trains other steps' samples."""

    def get_train_dataloader(self):
        self._train_batch_size = self.args.per_device_train_batch_size * self.args.world_size
        return super().get_train_dataloader()


class DropsTheIndex(Trainer):
    """A user's Trainer whose training loader drops every key the model does not take
    (``remove_unused_columns``' work done by hand): the sample indices never arrive."""

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        return [{k: v for k, v in batch.items() if k != "sample_index"} for batch in loader]
