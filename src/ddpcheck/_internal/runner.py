"""One equivalence example, executed inside every rank of a world.

Invariant: :func:`run_example` is deterministic given (target, scenario, rank, world size): every
rank builds the same model (from a rank-dependent seed when ``scenario.rank_seeds``, so the
target's broadcast from rank 0 is exercised), takes its own shard of each global batch (see
``scenario``'s batch rule), trains through the one loop (``_internal.train``) and records after
every step what the oracle compares -- gradients (after the optimizer step, before ``zero_grad``),
parameters, buffers, the optimizer state this rank holds, and every collective it issued through
``torch.distributed``.
"""

from __future__ import annotations

import time
from typing import Any

from ddpcheck._internal import recorder
from ddpcheck._internal.records import RankRecord, initial_state, snapshot
from ddpcheck._internal.train import Loop, train
from ddpcheck.scenario import (Scenario, build_model, local_micro_batches, loss_scale,
                               make_param_groups)

__all__ = ["rank_seed", "run_example", "run_example_packed"]

#: Seed offset between ranks when each rank initialises its own weights differently.
_RANK_SEED_STRIDE = 7919


def rank_seed(scenario: Scenario, rank: int) -> int:
    return scenario.seed + (_RANK_SEED_STRIDE * rank if scenario.rank_seeds else 0)


def run_example(target: Any, scenario: Scenario) -> RankRecord:
    """Train ``scenario`` under ``target`` on this rank. Collective: runs on every rank."""
    import torch.distributed as dist

    started = time.perf_counter()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    target = target.configure(scenario)
    module = build_model(scenario, rank_seed(scenario, rank))
    names = {p: n for n, p in module.named_parameters()}
    model = target.wrap(module)
    initial = initial_state(module)
    optimizer = target.make_optimizer(make_param_groups(scenario, module), scenario.optimizer,
                                      **scenario.optimizer_kwargs)
    steps = []

    def record(step: int) -> None:
        steps.append(snapshot(module, names, target.optimizer_state(optimizer),
                              recorder.records()))

    train(scenario, model, optimizer, Loop(
        batches=lambda step: local_micro_batches(scenario, step, rank, world_size),
        scale=loss_scale(scenario, world_size),
        no_sync=lambda: target.no_sync(model),
        after_backward=lambda: target.after_backward(model, optimizer),
        before_step=lambda step: recorder.reset(),
        after_step=record))
    return RankRecord(rank, initial, steps, time.perf_counter() - started)


def run_example_packed(target: Any, scenario: Scenario) -> Any:
    """:func:`run_example`, its tensors packed for a fast trip to the parent
    (``ddpcheck._internal.transport.unpack`` restores the record)."""
    from ddpcheck._internal.transport import pack

    return pack(run_example(target, scenario))
