"""One equivalence example, executed inside every rank of a world.

Invariant: :func:`run_example` is deterministic given (target, scenario, rank, world size): every
rank builds the same model (from a rank-dependent seed when ``scenario.rank_seeds``, so the
target's broadcast from rank 0 is exercised; registered in a rank-dependent order when
``scenario.rank_orders``, so pairing tensors by position is caught), takes the micro-batches of
each global batch that its target's ``shard_batch`` plans (``ddpcheck.batches``; by default
``scenario``'s batch rule), trains through the one loop (``ddpcheck._internal.training``) and records after
every step what the oracle compares -- gradients as ``optimizer.step()`` receives them (after
``after_backward``; after the step instead for a target whose optimizer synchronises gradients
itself, ``Target.gradients_synchronized_in_step``), parameters, buffers and the optimizer state this
rank holds after the step, every collective it issued through ``torch.distributed``, and the
step's batch plan (the oracle checks that the plans weigh every sample as the reference does).

The target's hooks run where a real training loop runs them: ``before_step`` before the step's
first forward, ``no_sync`` around every micro-batch but the last, ``after_backward`` after the last
backward, ``clip_grad_norm`` when the scenario clips, then ``optimizer.step()``,
``optimizer.zero_grad()`` (the target's optimizer's own) and ``after_step``.

A scenario with ``checkpoint_after`` runs in two parts (``run_example``'s ``part``): the steps up
to it, then ``save_checkpoint`` (collective; rank 0's answer leaves as ``torch.save`` bytes); and,
in a fresh run -- possibly at another world size -- everything built anew, ``load_checkpoint``,
and the remaining steps, with the LR scheduler loaded rather than restarted.
"""

from __future__ import annotations

import functools
import inspect
import io
import time
from typing import Any

import torch
import torch.distributed as dist

from ddpcheck._internal.devices import to_rank_device
from ddpcheck._internal.rank import recorder
from ddpcheck._internal.rank.orders import ORDER_SEED_STRIDE, permute_registration
from ddpcheck._internal.rank.transport import pack
from ddpcheck._internal.records import (RankRecord, gradients, initial_state, schedule_state,
                                        snapshot)
from ddpcheck._internal.training import Loop, make_scheduler, train
from ddpcheck.batches import BatchPlan, contiguous, global_indices, plan_for
from ddpcheck.scenario import Scenario, build_model, global_batch, make_param_groups

__all__ = ["checkpoint_from_bytes", "checkpoint_to_bytes", "make_optimizer", "rank_seed",
           "run_example", "run_example_packed", "target_loop"]

#: Seed offset between ranks when each rank initialises its own weights differently.
_RANK_SEED_STRIDE = 7919


def rank_seed(scenario: Scenario, rank: int) -> int:
    return scenario.seed + (_RANK_SEED_STRIDE * rank if scenario.rank_seeds else 0)


def run_example(target: Any, scenario: Scenario, *, part: str = "whole",
                checkpoint: Any = None) -> Any:
    """Train ``scenario`` under ``target`` on this rank. Collective: runs on every rank.

    ``part``: ``"whole"`` (the record), ``"until checkpoint"`` (steps ``0..checkpoint_after``;
    ``(record, checkpoint)``, the checkpoint as ``torch.save`` bytes on rank 0, None elsewhere)
    or ``"resumed"`` (a fresh run that loads ``checkpoint`` and trains the steps after it)."""
    if part not in ("whole", "until checkpoint", "resumed"):
        raise ValueError(f"part={part!r} must be 'whole', 'until checkpoint' or 'resumed'")
    started = time.perf_counter()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    target = target.configure(scenario)
    # on the rank's device (a CUDA world's), parameters and buffers, before the target wraps it
    module = to_rank_device(build_model(scenario, rank_seed(scenario, rank)))
    if scenario.rank_orders:  # the reference keeps the canonical order; the oracle pairs by name
        permute_registration(module, scenario.seed + ORDER_SEED_STRIDE * (rank + 1))
    model = target.wrap(module)
    names = {p: n for n, p in module.named_parameters()}  # after wrap: FSDP2 replaces them
    if part != "resumed":  # (a resumed run records what it loaded instead, below)
        with recorder.paused():  # the harness's own gathers of sharded tensors aren't the target's
            initial = initial_state(module, target.full_tensor)
    optimizer = make_optimizer(target, model, make_param_groups(scenario, module), scenario)
    scheduler = make_scheduler(scenario, optimizer)
    steps_run = range(scenario.steps)
    if part == "until checkpoint":
        steps_run = range(scenario.checkpoint_after + 1)
    elif part == "resumed":
        target.load_checkpoint(checkpoint_from_bytes(checkpoint), module, model, optimizer,
                               scheduler)
        with recorder.paused():  # what the resumed run starts from
            initial = initial_state(module, target.full_tensor)
        steps_run = range(scenario.checkpoint_after + 1, scenario.steps)
    steps = []
    in_step = getattr(target, "gradients_synchronized_in_step", False)
    grads: dict = {}
    plans: dict[int, BatchPlan] = {}

    def start(step: int) -> None:
        recorder.reset()

    def record(step: int) -> None:
        collectives = recorder.records()
        with recorder.paused():
            steps.append(snapshot(module, names, target.optimizer_state(optimizer), collectives,
                                  grads=None if in_step else grads["now"],
                                  gather=target.full_tensor, local_shard=target.local_shard,
                                  schedule=schedule_state(optimizer, scheduler)))
        steps[-1].batch_plan = plans[step]

    def record_gradients(step: int) -> None:
        with recorder.paused():
            grads["now"] = gradients(module, target.full_tensor)

    train(scenario, model, optimizer, target_loop(
        target, model, optimizer, scenario, rank, world_size, plans=plans, before_step=start,
        before_optimizer_step=record_gradients, after_step=record), scheduler=scheduler,
        steps=steps_run)
    result = RankRecord(rank, initial, steps, time.perf_counter() - started)
    if part != "until checkpoint":
        return result
    saved = target.save_checkpoint(module, model, optimizer, scheduler)
    return result, checkpoint_to_bytes(saved, type(target).__name__) if rank == 0 else None


def checkpoint_to_bytes(checkpoint: Any, who: str) -> bytes:
    """Rank 0's checkpoint as bytes: a copy taken now (a state dict aliases live tensors), and
    what a real checkpoint goes through on its way to a file."""
    if checkpoint is None:
        raise TypeError(f"{who}.save_checkpoint(module, model, optimizer, scheduler) returned "
                        "None on rank 0; it must return the checkpoint there")
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return buffer.getvalue()


def checkpoint_from_bytes(data: bytes) -> Any:
    # weights_only=False: the bytes are rank 0's own checkpoint of this example, which may hold
    # more than tensors and numbers (whatever the target's save_checkpoint returned)
    return torch.load(io.BytesIO(data), weights_only=False)


def target_loop(target: Any, model: Any, optimizer: Any, scenario: Scenario, rank: int,
                world_size: int, plans: dict | None = None, **hooks: Any) -> Loop:
    """The loop of one rank: the micro-batches its target plans, the target's hooks where a real
    training loop calls them (``hooks`` add to them: ``before_step`` runs before the target's
    own); each step's plan is stored in ``plans`` when given."""
    first = hooks.pop("before_step", None)
    who = f"{type(target).__name__}.shard_batch"
    hook = getattr(target, "shard_batch", contiguous)  # a duck-typed target: the batch rule

    def batches(step: int) -> list:
        x, y = global_batch(scenario, step)
        plan = plan_for(hook, global_indices(scenario, step, rank, world_size, y), who)
        if plans is not None:
            plans[step] = plan
        return to_rank_device([(*_select(x, y, indices), scale)
                               for indices, scale in zip(plan.micro_batches, plan.scales)])

    def before_step(step: int) -> None:
        if first is not None:
            first(step)
        target.before_step(model, optimizer)

    return Loop(
        batches=batches,
        no_sync=lambda: target.no_sync(model),
        after_backward=lambda: target.after_backward(model, optimizer),
        clip_grad_norm=lambda max_norm, norm_type: target.clip_grad_norm(model, optimizer,
                                                                         max_norm, norm_type),
        before_step=before_step,
        end_step=lambda step: target.after_step(model, optimizer), **hooks)


def _select(x: Any, y: Any, indices: tuple[int, ...]) -> tuple[Any, Any]:
    """The samples ``indices`` of ``(x, y)``: a view for a contiguous run (what ``tensor_split``
    gives, so the default plan computes bit for bit as before), else a gathered copy."""
    start = indices[0] if indices else 0
    if indices == tuple(range(start, start + len(indices))):
        return x[start:start + len(indices)], y[start:start + len(indices)]
    at = torch.tensor(indices, dtype=torch.long)
    return x.index_select(0, at), y.index_select(0, at)


def make_optimizer(target: Any, model: Any, params: list, scenario: Scenario) -> Any:
    """``target.make_optimizer``, given the wrapped model when it takes a ``model`` keyword (a
    sharded optimizer that must know its DDP); older targets' signatures are left as they are."""
    kwargs = dict(scenario.optimizer_kwargs)
    if _takes_model(type(target).make_optimizer):
        kwargs["model"] = model
    return target.make_optimizer(params, scenario.optimizer, **kwargs)


@functools.lru_cache(maxsize=256)
def _takes_model(method: Any) -> bool:
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return "model" in parameters


def run_example_packed(target: Any, scenario: Scenario, part: str = "whole",
                       checkpoint: Any = None) -> Any:
    """:func:`run_example`, its tensors packed for a fast trip to the parent
    (``ddpcheck._internal.rank.transport.unpack`` restores the record)."""
    return pack(run_example(target, scenario, part=part, checkpoint=checkpoint))
