"""The single-process full-batch reference every target is held to.

Invariant: :func:`reference_run` trains the scenario in this process through the same loop as the
ranks (``ddpcheck._internal.training``), on the whole global batch, with the plain optimizer and rank 0's
initial weights: one backward of the global objective per step (the scenario's loss and precision
policy, ``ddpcheck._internal.objective``, its ``param_dtype`` policy emulated here as a rank's
target implements it). What it records is what a correct
data-parallel target must reproduce; the budgets a target's communication is held to are derived
from the same model. A scenario with ``checkpoint_after`` trains uninterrupted, except that the
gradients are dropped after that step, as a run resumed from a checkpoint has none.
"""

from __future__ import annotations

import dataclasses

import torch

from ddpcheck._internal.objective import count, tokens
from ddpcheck._internal.records import (StepRecord, gradients, initial_state, schedule_state,
                                        snapshot)
from ddpcheck._internal.training import Loop, make_scheduler, train
from ddpcheck.scenario import Scenario, build_model, global_batch, make_param_groups

__all__ = ["Reference", "reference_run"]


@dataclasses.dataclass
class Reference:
    initial: dict[str, torch.Tensor]  # parameters and buffers before the first step
    steps: list[StepRecord]
    gradient_bytes: int  # bytes of all trainable parameters' gradients: the all-reduce budget
    gradient_numel: int  # their elements: more bytes than this in as many elements is widening
    n_dtypes: int  # parameter dtypes: the broadcast budget is W x n_dtypes
    #: the least precise dtype the model computes in -- its parameters', the scenario's autocast
    #: or param_dtype: it sets the tolerance
    compute_dtype: torch.dtype
    #: Scalars a target may all-reduce per step besides the gradients when the scenario clips: a
    #: sharded global norm (one per parameter dtype at most); 0 without clipping.
    norm_scalars: int = 0
    #: the narrowest gradient dtype: a gradient all-reduced or reduce-scattered in a narrower one
    #: was sent narrower than promised (``ddpcheck._internal.oracle.budget``)
    gradient_dtype: torch.dtype | None = None


def _drop_gradients(model: torch.nn.Module) -> None:
    """A checkpoint carries no gradients: a resumed run starts with none, even where the
    scenario keeps them (``set_to_none=False``) -- and an optimizer skips a parameter whose
    gradient is None but steps (decays, moves with momentum) one whose gradient is zero."""
    for p in model.parameters():
        p.grad = None


def reference_run(scenario: Scenario) -> Reference:
    """Train the scenario in this process on the whole batch: the plain optimizer, rank 0's
    initial weights, one backward per step of the global objective."""
    model = build_model(scenario, scenario.seed)
    names = {p: n for n, p in model.named_parameters()}
    initial = initial_state(model)
    optimizer = scenario.optimizer(make_param_groups(scenario, model), **scenario.optimizer_kwargs)
    scheduler = make_scheduler(scenario, optimizer)
    steps = []
    grads: dict = {}
    terms: dict = {}

    def whole_batch(step: int) -> list:
        x, y = global_batch(scenario, step)
        terms[step] = tokens(scenario, y)
        return [(x, y, 1.0 / count(scenario, y) if scenario.reduction == "mean" else 1.0)]

    def record(step: int) -> None:
        steps.append(snapshot(model, names, optimizer.state, grads=grads["now"],
                              schedule=schedule_state(optimizer, scheduler)))
        steps[-1].tokens = terms[step]

    train(scenario, model, optimizer, Loop(
        batches=whole_batch,
        before_optimizer_step=lambda step: grads.__setitem__("now", gradients(model)),
        after_step=record,
        end_step=lambda step: _drop_gradients(model) if step == scenario.checkpoint_after
        else None, emulates_param_dtype=True), scheduler=scheduler)
    trainable = [p for p in model.parameters() if p.requires_grad]
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    # a float64 layer fed by a float32 one inherits float32 rounding; autocast and param_dtype
    # compute in theirs
    computed = dtypes | {d for d in (scenario.autocast, scenario.param_dtype) if d is not None}
    return Reference(initial, steps,
                     gradient_bytes=sum(p.numel() * p.element_size() for p in trainable),
                     gradient_numel=sum(p.numel() for p in trainable),
                     n_dtypes=len(dtypes) or 1,
                     norm_scalars=(len(dtypes) or 1) if scenario.max_grad_norm is not None else 0,
                     compute_dtype=max(computed, key=lambda d: torch.finfo(d).eps,
                                       default=scenario.torch_dtype),
                     gradient_dtype=min((p.dtype for p in trainable if p.is_floating_point()),
                                        key=lambda d: torch.finfo(d).bits, default=None))
