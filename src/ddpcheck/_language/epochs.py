"""A scenario with an epoch structure: a dataset of N samples passed over in optimizer steps of a
global batch, with the short last batch and the short last accumulation window real loops meet.

Without it a scenario draws a fresh global batch of exactly ``global_batch`` samples every step,
split by the harness: every accumulation window full, every rank's share decided by ddpcheck.
Training code goes wrong where a *dataset* meets a world -- a sampler that pads or drops to even
out ranks, a short last batch, an epoch's last window of fewer micro-batches than the
accumulation scaled as if it were full, a batch meant to be split across ranks that is not
(docs/scenarios.md, "Epochs").

Invariant (the reference of an epoch, docs/scenarios.md): one dataset of ``samples`` samples is
drawn once (``scenario.data(seed * 1000, samples, dtype)``); each of ``epochs`` epochs walks it in
index order in steps of ``global_batch`` samples (B; the last step of an epoch holds the
``samples % B`` left over when B does not divide N); a step of ``s`` samples is a window of
``ceil(s / (B / accumulation))`` micro-batches. The one-process reference trains each step on the
full-batch objective of exactly the samples that step consumes -- each sample weighed once per
epoch, the short last step by its own size. ``steps`` is derived: ``epochs * ceil(N / B)``.

The numbers a user reads after an epoch: with ``evaluation`` (E samples), an evaluation set of E
samples drawn once, apart from the dataset (``ddpcheck._language.scenario.evaluation_set``), is
evaluated after every epoch's last step (:func:`ends_epoch`) in per-device batches of
``evaluation_batch`` samples (None: the training micro-batch's, ``B / accumulation / W``; an
evaluation loader's batch is often its own, as ``per_device_eval_batch_size`` is) -- so E is often
no multiple of the per-device batch times W, and a loader pads, drops or leaves the ranks' last
batches uneven, as real evaluation loops meet them. Its metric is the mean of the objective's
terms over all E samples, each counted once: what the reference computes with its own model at
the same point, and what a target's evaluation must report (``EpochRun.evaluated``).
"""

from __future__ import annotations

import dataclasses
import math

from ddpcheck._base.errors import InvalidArgument
from ddpcheck._base.options import named_fields

__all__ = ["Epochs", "ends_epoch", "step_count", "step_samples", "window"]


@named_fields
@dataclasses.dataclass(frozen=True)
class Epochs:
    """``epochs`` passes over a dataset of ``samples`` samples, in index order (``Scenario.epochs``;
    the global batch and the accumulation are the scenario's), and an evaluation set of
    ``evaluation`` samples evaluated after each of them (None: no evaluation) in per-device
    batches of ``evaluation_batch`` (None: the training micro-batch's per-device size)."""

    samples: int
    epochs: int = 1
    evaluation: int | None = None
    evaluation_batch: int | None = None

    def __post_init__(self) -> None:
        counts = [("samples", self.samples), ("epochs", self.epochs)]
        optional = [("evaluation", self.evaluation), ("evaluation_batch", self.evaluation_batch)]
        for name, value in counts + [(n, v) for n, v in optional if v is not None]:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                what = "an integer >= 1" if (name, value) in counts else "None or an integer >= 1"
                raise InvalidArgument(f"Epochs({name}={value!r}) must be {what}")
        if self.evaluation is None and self.evaluation_batch is not None:
            raise InvalidArgument(
                f"Epochs(evaluation_batch={self.evaluation_batch!r}) needs an evaluation set "
                "(Epochs(evaluation=...): the samples evaluated after every epoch)"
            )

    def evaluation_batch_at(self, global_batch: int, accumulation: int, world_size: int) -> int:
        """The evaluation loader's per-device batch at ``world_size``: ``evaluation_batch``, or
        the training micro-batch's per-device size (at least 1)."""
        if self.evaluation_batch is not None:
            return self.evaluation_batch
        return max(1, global_batch // accumulation // world_size)

    def steps_per_epoch(self, global_batch: int) -> int:
        return math.ceil(self.samples / global_batch)


def step_count(epochs: Epochs, global_batch: int) -> int:
    """The optimizer steps of the whole run: ``epochs * ceil(samples / global_batch)``."""
    return epochs.epochs * epochs.steps_per_epoch(global_batch)


def step_samples(epochs: Epochs, global_batch: int, step: int) -> range:
    """The dataset indices step ``step`` consumes (the module's invariant)."""
    k = step % epochs.steps_per_epoch(global_batch)
    return range(k * global_batch, min((k + 1) * global_batch, epochs.samples))


def window(epochs: Epochs, global_batch: int, accumulation: int, step: int) -> int:
    """The micro-batches of step ``step``: ``accumulation`` for a full step, fewer for an epoch's
    short last one (each micro-batch ``global_batch / accumulation`` samples across the ranks)."""
    size = len(step_samples(epochs, global_batch, step))
    return math.ceil(size * accumulation / global_batch)


def ends_epoch(epochs: Epochs, global_batch: int, step: int) -> bool:
    """Whether step ``step`` is the last of its epoch: the point after which the evaluation set
    is evaluated (the module's invariant)."""
    per_epoch = epochs.steps_per_epoch(global_batch)
    return step % per_epoch == per_epoch - 1
