"""Target hooks with one seeded checkpoint bug each (``save_checkpoint`` / ``load_checkpoint``).

Checkpointing belongs to the training loop, not to ``parallel.DDP`` or ``ShardedOptimizer``: these
mixins override the hooks of ``ddpcheck.targets.Target`` (both, named in each docstring) and
``ddpcheck.mutation.catalogue`` puts each in front of the ``parallel`` target.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from ddpcheck._language.training import OptimizerLike, SchedulerLike
from parallel import ShardedOptimizer

#: What these hooks save on rank 0: each part's state dict (the scheduler's None without one).
Saved = Mapping[str, dict[str, object]]


class SavesWrappedModelHooks:
    """Saves the *wrapper's* ``nn.Module`` state dict -- keys ``module.x``, what torch DDP's
    ``state_dict`` returns -- and loads it into the unwrapped module with ``strict=False``, so no
    key matches and nothing loads, silently: the common "Unexpected key(s) in state_dict:
    module.x" error silenced with ``strict=False`` instead of saving ``model.module``.
    Overrides ``save_checkpoint`` and ``load_checkpoint``."""

    def save_checkpoint(
        self,
        module: nn.Module,
        model: nn.Module,
        optimizer: OptimizerLike,
        scheduler: SchedulerLike | None,
    ) -> object:
        cast(ShardedOptimizer, optimizer).consolidate_state_dict(to=0)  # the parallel target's
        if dist.get_rank() != 0:
            return None
        return {
            "model": torch.nn.Module.state_dict(model),  # BUG: the wrapper's keys
            "optimizer": optimizer.state_dict(),
            "scheduler": None if scheduler is None else scheduler.state_dict(),
        }

    def load_checkpoint(
        self,
        checkpoint: Saved,
        module: nn.Module,
        model: nn.Module,
        optimizer: OptimizerLike,
        scheduler: SchedulerLike | None,
    ) -> None:
        module.load_state_dict(checkpoint["model"], strict=False)  # BUG: every key ignored
        optimizer.load_state_dict(checkpoint["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(checkpoint["scheduler"])


class ForgetsSchedulerHooks:
    """Saves and loads the model and the optimizer but not the LR scheduler: the resumed run's
    fresh ``ExponentialLR`` continues from the optimizer's lr, yet its step count restarts at 0 --
    a closed-form schedule (StepLR, cosine, warm-up) would jump back (TrenTorch/TrenTorch #187
    dropped Adam's step from checkpoints the same way). Overrides ``save_checkpoint`` and
    ``load_checkpoint``."""

    def save_checkpoint(
        self,
        module: nn.Module,
        model: nn.Module,
        optimizer: OptimizerLike,
        scheduler: SchedulerLike | None,
    ) -> object:
        cast(ShardedOptimizer, optimizer).consolidate_state_dict(to=0)  # the parallel target's
        if dist.get_rank() != 0:
            return None
        return {"model": module.state_dict(), "optimizer": optimizer.state_dict()}  # BUG

    def load_checkpoint(
        self,
        checkpoint: Saved,
        module: nn.Module,
        model: nn.Module,
        optimizer: OptimizerLike,
        scheduler: SchedulerLike | None,
    ) -> None:
        module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])  # BUG: the scheduler keeps count 0
