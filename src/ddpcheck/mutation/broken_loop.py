"""Seeded bugs in the loop hooks: a backward wrapper, a gated optimizer and scheduler, ZeRO-2.

Two unmutated targets, each the control of its mutants, and the broken pieces:

* :class:`EngineTarget` is DeepSpeed's engine in miniature, driven the way accelerate and
  DeepSpeed are (``Target.steps_every_micro_batch``): its ``backward`` reduces the gradients at
  the end of the accumulation window, and the loop calls ``optimizer.step()``, the scheduler and
  ``zero_grad()`` after every micro-batch, which :class:`GatedOptimizer` / :class:`GatedScheduler`
  -- accelerate's ``AcceleratedOptimizer`` and ``AcceleratedScheduler`` in miniature -- let act
  only at the window's end (``micro_batch`` opens the gate on its last micro-batch). Mutants: a
  backward wrapper that skips the all-reduce of the step's first micro-batch
  (:class:`SkipsFirstReduceTarget`), a framework that steps inside the window
  (:class:`StepsEarlyOptimizer`, as accelerate #2790's ``sync_each_batch`` did), a scheduler
  that steps per micro-batch (:class:`StepsPerMicroBatchScheduler`).
* :class:`Zero2Target` is ZeRO-2 in miniature (``Target.sharded_gradients``): no DDP in front;
  :class:`Zero2Optimizer.step` reduces each gradient to its owner only, the owner steps it and
  broadcasts the parameter. Mutant: :class:`ReducesTwiceZero2Optimizer`, which all-reduces the
  gradient before the reduce -- the same numbers, twice the bytes (ColossalAI #247: "ZeRO plus
  accumulation reduced grads several times"); only the communication budget, which counts every
  reduction whatever its shape, sees it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ddpcheck._language.features import FEATURES
from ddpcheck._language.training import OptimizerLike, Params, SchedulerLike
from ddpcheck.targets import Target
from ddpcheck.targets.fsdp import broadcast_from

__all__ = [
    "EngineTarget",
    "Gate",
    "GatedOptimizer",
    "GatedScheduler",
    "ReducesTwiceZero2Optimizer",
    "ReducesTwiceZero2Target",
    "SchedulerPerMicroBatchTarget",
    "SkipsFirstReduceTarget",
    "StepsEarlyOptimizer",
    "StepsInsideWindowTarget",
    "StepsPerMicroBatchScheduler",
    "Zero2Optimizer",
    "Zero2Target",
    "average_gradients",
]


# ---------------------------------------------------------------------------------------------
# A framework that gates the optimizer (accelerate's idiom)


class Gate:
    """Whether this micro-batch ends the accumulation window (accelerate's ``sync_gradients``)."""

    def __init__(self) -> None:
        self.open = True


class GatedOptimizer:
    """``step()`` and ``zero_grad()`` act only when the gate is open (``AcceleratedOptimizer``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, gate: Gate):
        self.optimizer, self.gate = optimizer, gate

    @property
    def param_groups(self) -> Sequence[Mapping[str, object]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Mapping[torch.Tensor, Mapping[str, object]]:
        return self.optimizer.state

    def step(self) -> None:
        if self.gate.open:
            self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gate.open:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Mapping[str, object]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.optimizer.load_state_dict(state)


class GatedScheduler:
    """``step()`` acts only when the gate is open (``AcceleratedScheduler``)."""

    def __init__(self, scheduler: SchedulerLike, gate: Gate):
        self.scheduler, self.gate = scheduler, gate

    def step(self) -> None:
        if self.gate.open:
            self.scheduler.step()

    def state_dict(self) -> Mapping[str, object]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.scheduler.load_state_dict(state)


class StepsEarlyOptimizer(GatedOptimizer):
    """C2: ``step()`` ignores the gate (as accelerate #2790's ``sync_each_batch`` made every
    batch a step): the parameters move on a partial gradient inside the window."""

    def step(self) -> None:
        self.optimizer.step()


class StepsPerMicroBatchScheduler(GatedScheduler):
    """C2: the scheduler ignores the gate and steps after every micro-batch: the learning rate
    decays ``accumulation`` times per optimizer step."""

    def step(self) -> None:
        self.scheduler.step()


def average_gradients(model: nn.Module) -> None:
    """All-reduce and average every trainable gradient (zeros where this rank has none; None
    kept where no rank has one: a flag per tensor first, integers)."""
    params = [p for p in model.parameters() if p.requires_grad]
    used = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
    dist.all_reduce(used)
    for p, anywhere in zip(params, used.tolist()):
        if not anywhere:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        gradient = p.grad.contiguous()
        dist.all_reduce(gradient)
        gradient /= dist.get_world_size()
        if gradient is not p.grad:
            p.grad.copy_(gradient)


@dataclasses.dataclass(frozen=True)
class EngineTarget(Target):
    """DeepSpeed's engine in miniature (the unmutated control of the loop-hook mutants): no
    wrapper; ``backward`` reduces the accumulated gradients at the end of the window
    (``engine.backward`` at a gradient-accumulation boundary); ``step()``, the scheduler and
    ``zero_grad()`` are called after every micro-batch and gated (``engine.step()``)."""

    steps_every_micro_batch = True
    optimizer_class = GatedOptimizer
    scheduler_class = GatedScheduler

    def wrap(self, module: nn.Module) -> nn.Module:
        broadcast_from(module, 0)
        return module

    def make_optimizer(
        self,
        params: Params,
        optimizer_cls: type[torch.optim.Optimizer],
        **kwargs: Any,  # the scenario's options, for its optimizer class
    ) -> GatedOptimizer:
        return self.optimizer_class(optimizer_cls(params, **kwargs), Gate())

    def make_scheduler(self, optimizer: OptimizerLike, gamma: float) -> GatedScheduler:
        gated = cast(GatedOptimizer, optimizer)  # the optimizer make_optimizer returned
        return self.scheduler_class(
            torch.optim.lr_scheduler.ExponentialLR(gated.optimizer, gamma), gated.gate
        )

    def micro_batch(
        self, model: nn.Module, optimizer: OptimizerLike, index: int, count: int
    ) -> AbstractContextManager[object]:
        # the window ends with its last micro-batch
        cast(GatedOptimizer, optimizer).gate.open = index == count - 1
        setattr(model, _WINDOW, (index, count))
        return contextlib.nullcontext()

    def reduces_after(self, index: int, count: int) -> bool:
        """Whether the backward of micro-batch ``index`` of ``count`` ends the window."""
        return index == count - 1

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        loss.backward()
        index, count = getattr(model, _WINDOW)
        if self.reduces_after(index, count):
            average_gradients(model)


#: The attribute of the model holding ``(index, count)`` of the micro-batch being trained.
_WINDOW = "ddpcheck_window"


@dataclasses.dataclass(frozen=True)
class SkipsFirstReduceTarget(EngineTarget):
    """B12: the backward wrapper skips the reduction after the step's first micro-batch (a guard
    for "nothing accumulated yet"): a window of one micro-batch is never reduced, and each rank
    steps on its own gradient."""

    def reduces_after(self, index: int, count: int) -> bool:
        return index > 0 and index == count - 1


# ---------------------------------------------------------------------------------------------
# ZeRO-2: each gradient reduced to its owner only


class Zero2Optimizer:
    """ZeRO-2 in miniature: parameter ``i`` (in the optimizer's order) is owned by rank
    ``i % W``; ``step()`` reduces each trainable gradient to its owner (averaged there), steps
    the owned parameters with the inner optimizer -- the only rank with their state -- and
    broadcasts each parameter from its owner. The other ranks keep their local gradients."""

    def __init__(
        self,
        params: Params,
        optimizer_cls: type[torch.optim.Optimizer],
        **kwargs: Any,  # the scenario's options, for its optimizer class
    ):
        self.optimizer = optimizer_cls(params, **kwargs)
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        world_size = dist.get_world_size()
        self.owners = {p: i % world_size for i, p in enumerate(self.params)}

    @property
    def param_groups(self) -> Sequence[Mapping[str, object]]:
        return self.optimizer.param_groups

    def owner_of(self, param: torch.Tensor) -> int:
        return self.owners[param]

    def reduce(self, gradient: torch.Tensor, owner: int) -> None:
        """Sum ``gradient`` into the owner's copy (the seam the mutant overrides)."""
        dist.reduce(gradient, dst=owner)

    def step(self) -> None:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        trainable = [p for p in self.params if p.requires_grad]
        # which gradients exist anywhere (integers: control, not gradient traffic)
        used = torch.tensor([p.grad is not None for p in trainable], dtype=torch.int32)
        dist.all_reduce(used)
        kept = {}
        for p, anywhere in zip(trainable, used.tolist()):
            if not anywhere:
                continue
            gradient = (torch.zeros_like(p) if p.grad is None else p.grad).contiguous().clone()
            self.reduce(gradient, self.owners[p])
            if self.owners[p] == rank:
                p.grad = gradient / world_size
            else:  # a non-owner keeps its local gradient, and does not step the parameter
                kept[p], p.grad = p.grad, None
        self.optimizer.step()
        for p, grad in kept.items():
            p.grad = grad
        with torch.no_grad():
            for p in self.params:
                buffer = p.detach().contiguous()
                dist.broadcast(buffer, src=self.owners[p])
                p.copy_(buffer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Mapping[str, object]:
        raise NotImplementedError("Zero2Target declines checkpoints")

    def load_state_dict(self, state: dict[str, object]) -> None:
        raise NotImplementedError("Zero2Target declines checkpoints")


class ReducesTwiceZero2Optimizer(Zero2Optimizer):
    """C3: each gradient is all-reduced (averaged on every rank) and then reduced to its owner
    again: the owner divides W equal averages back to the same numbers, but every gradient
    crossed the wire twice."""

    def reduce(self, gradient: torch.Tensor, owner: int) -> None:
        dist.all_reduce(gradient)
        gradient /= dist.get_world_size()
        dist.reduce(gradient, dst=owner)


@dataclasses.dataclass(frozen=True)
class Zero2Target(Target):
    """:class:`Zero2Optimizer` with no wrapper in front (the unmutated control of
    ``ReducesTwiceZero2``): rank 0's state broadcast at wrap, gradients sharded by owner."""

    optimizer_class = Zero2Optimizer
    gradients_synchronized_in_step = True
    sharded_gradients = True
    shards_optimizer_state = True
    # Clipping would need the norm from the owners; checkpoints a consolidate_state_dict; and the
    # owners follow the optimizer's order, so every rank must register in one order.
    supported_features = frozenset(FEATURES) - {"clipping", "checkpoint", "rank-orders"}

    def wrap(self, module: nn.Module) -> nn.Module:
        broadcast_from(module, 0)
        return module

    def make_optimizer(
        self,
        params: Params,
        optimizer_cls: type[torch.optim.Optimizer],
        **kwargs: Any,  # the scenario's options, for its optimizer class
    ) -> Zero2Optimizer:
        return self.optimizer_class(params, optimizer_cls, **kwargs)


# ---------------------------------------------------------------------------------------------
# The mutants' targets: the controls with one broken piece each


@dataclasses.dataclass(frozen=True)
class StepsInsideWindowTarget(EngineTarget):
    """:class:`EngineTarget` whose optimizer steps inside the window
    (:class:`StepsEarlyOptimizer`)."""

    optimizer_class = StepsEarlyOptimizer


@dataclasses.dataclass(frozen=True)
class SchedulerPerMicroBatchTarget(EngineTarget):
    """:class:`EngineTarget` whose scheduler steps per micro-batch
    (:class:`StepsPerMicroBatchScheduler`)."""

    scheduler_class = StepsPerMicroBatchScheduler


@dataclasses.dataclass(frozen=True)
class ReducesTwiceZero2Target(Zero2Target):
    """:class:`Zero2Target` whose optimizer reduces every gradient twice
    (:class:`ReducesTwiceZero2Optimizer`)."""

    optimizer_class = ReducesTwiceZero2Optimizer
