"""One equivalence example, executed inside every rank of a world.

Invariant: :func:`run_example` is deterministic given (target, scenario, rank, world size): every
rank builds the same model (from a rank-dependent seed when ``scenario.rank_seeds``, so the
target's broadcast from rank 0 is exercised), takes its own shard of each global batch (see
``scenario``'s batch rule), and records after every step what the oracle compares -- gradients
(after the optimizer step, before ``zero_grad``), parameters, buffers, the optimizer state this
rank holds, and every collective it issued through ``torch.distributed``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import torch

from ddpcheck._internal import recorder as comm
from ddpcheck.scenario import (Scenario, build_model, local_micro_batches, loss_scale,
                               make_param_groups, per_sample_loss)

__all__ = ["RankRecord", "StepRecord", "rank_seed", "run_example", "run_example_packed",
           "snapshot"]

#: Seed offset between ranks when each rank initialises its own weights differently.
_RANK_SEED_STRIDE = 7919


@dataclasses.dataclass
class StepRecord:
    """What one rank (or the reference) holds right after one optimizer step."""

    grads: dict[str, torch.Tensor | None]
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    state: dict[str, dict[str, Any]]  # optimizer state held here, by parameter name
    collectives: list[comm.Collective] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RankRecord:
    rank: int
    initial: dict[str, torch.Tensor]  # parameters and buffers right after wrapping
    steps: list[StepRecord]
    seconds: float


def rank_seed(scenario: Scenario, rank: int) -> int:
    return scenario.seed + (_RANK_SEED_STRIDE * rank if scenario.rank_seeds else 0)


def snapshot(model: torch.nn.Module, names: dict[Any, str], state: Any,
             collectives: list | None = None) -> StepRecord:
    """Copies of everything the oracle compares; ``state`` maps parameter -> state dict."""
    with torch.no_grad():
        grads = {n: None if p.grad is None else p.grad.detach().clone()
                 for n, p in model.named_parameters()}
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        held = {}
        for p, entries in state.items():
            if entries:
                held[names.get(p, "?")] = {k: v.detach().clone() if torch.is_tensor(v) else v
                                           for k, v in entries.items()}
    return StepRecord(grads, params, buffers, held, collectives or [])


def run_example(target: Any, scenario: Scenario) -> RankRecord:
    """Train ``scenario`` under ``target`` on this rank. Collective: runs on every rank."""
    import torch.distributed as dist

    started = time.perf_counter()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    target = target.configure(scenario)
    module = build_model(scenario, rank_seed(scenario, rank))
    names = {p: n for n, p in module.named_parameters()}
    model = target.wrap(module)
    initial = {**{n: p.detach().clone() for n, p in module.named_parameters()},
               **{n: b.detach().clone() for n, b in module.named_buffers()}}
    optimizer = target.make_optimizer(make_param_groups(scenario, module), scenario.optimizer,
                                      **scenario.optimizer_kwargs)
    scheduler = (torch.optim.lr_scheduler.ExponentialLR(optimizer, scenario.lr_decay)
                 if scenario.lr_decay is not None else None)
    scale = loss_scale(scenario, world_size)
    steps = []
    for step in range(scenario.steps):
        comm.reset()
        micro_batches = local_micro_batches(scenario, step, rank, world_size)
        for i, (x, y) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last else target.no_sync(model):
                loss = per_sample_loss(model(x), y).sum() * scale
                loss.backward()
        target.after_backward(model, optimizer)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        steps.append(snapshot(module, names, target.optimizer_state(optimizer), comm.records()))
        optimizer.zero_grad(set_to_none=scenario.set_to_none)
    return RankRecord(rank, initial, steps, time.perf_counter() - started)


def run_example_packed(target: Any, scenario: Scenario) -> Any:
    """:func:`run_example`, its tensors packed for a fast trip to the parent
    (``ddpcheck._internal.transport.unpack`` restores the record)."""
    from ddpcheck._internal.transport import pack

    return pack(run_example(target, scenario))
