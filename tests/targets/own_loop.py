"""Targets for the loop hooks' tests (rank processes import them by name): a loop written by hand
through ``Target.fit`` (no framework needed), and ZeRO-2 with a declaration that leaves part of a
gradient unowned."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ddpcheck.features import DEFAULT_FEATURES
from ddpcheck.mutation.broken_loop import Zero2Target
from ddpcheck.targets import Target


@dataclasses.dataclass(frozen=True)
class HandLoopTarget(Target):
    """Owns its loop as a Trainer does: torch DDP, ``no_sync`` accumulation, clipping, the
    schedule; ``record_every=2`` forgets to report every other step (a broken integration)."""

    record_every: int = 1
    supported_features = DEFAULT_FEATURES - {"checkpoint"}

    def fit(self, module: Any, run: Any) -> None:
        model = DistributedDataParallel(module, find_unused_parameters=True)
        optimizer = run.optimizer(run.params, **run.optimizer_kwargs)
        scheduler = (
            None
            if run.gamma is None
            else torch.optim.lr_scheduler.ExponentialLR(optimizer, run.gamma)
        )
        run.started(model, optimizer)
        for step, micro_batches in enumerate(run.batches):
            for i, (x, y, scale) in enumerate(micro_batches):
                last = i == len(micro_batches) - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    run.loss(model, x, y, scale).backward()
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(
                    model.parameters(), run.max_grad_norm, run.grad_norm_type
                )
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            if step % self.record_every == 0:
                run.record(model, optimizer, scheduler)
            optimizer.zero_grad(set_to_none=run.set_to_none)


@dataclasses.dataclass(frozen=True)
class HalfOwnedZero2(Zero2Target):
    """Declares only the first half of each owned gradient: the rest is owned by no rank."""

    def gradient_shards(self, model: Any, optimizer: Any, params: Any) -> Any:
        return [
            (p, 0, None if piece is None else piece[: max(1, piece.numel() // 2)])
            for p, _, piece in super().gradient_shards(model, optimizer, params)
            if p.numel() > 1
        ]
