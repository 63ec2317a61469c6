"""The ``accelerate`` target: Hugging Face accelerate's ``Accelerator`` driven as its docs show.

Per example and rank: an ``Accelerator(cpu=..., gradient_accumulation_steps=A)`` joins the
existing process group (``environment``), ``prepare(model, optimizer)`` wraps the model in torch
DDP (``find_unused_parameters=True``, through ``DistributedDataParallelKwargs``) and the
optimizer in its gated ``AcceleratedOptimizer``, ``prepare_scheduler`` the ``ExponentialLR``; every
micro-batch runs inside ``accelerator.accumulate(model)``, back-propagates through
``accelerator.backward`` and is followed by ``optimizer.step()``, ``scheduler.step()`` and
``optimizer.zero_grad()`` -- accelerate's loop idiom, in which accelerate decides which of those
act (``Target.steps_every_micro_batch``); clipping is ``accelerator.clip_grad_norm_``.
``teardown`` resets accelerate's singletons (``AcceleratorState``, ``PartialState``,
``GradientState``) so the next example builds its own.

Two documented behaviours the target meets the way a user must:

* ``accelerator.backward`` divides the loss by ``gradient_accumulation_steps`` ("Scales the
  gradients in accordance to the GradientAccumulationPlugin"), for losses averaged per
  micro-batch; ddpcheck's micro-batch losses are already scaled to the whole step's objective, so
  the target multiplies them back first.
* ``AcceleratedScheduler`` steps the scheduler ``num_processes`` times per optimizer step unless
  batches are split ("the training dataloader batch size was multiplied by num_processes, so we
  need to do num_processes steps per training step"); ddpcheck's batch is the global batch split
  across ranks, so the target sets ``split_batches=True`` (``split_batches=False`` is kept as an
  option: it fails the LR schedule at W > 1, as documented).

Imports accelerate only inside the hooks: listing or pickling the target needs no accelerate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch

from ddpcheck.targets.environment import join_existing_group
from ddpcheck.targets.framework import FrameworkTarget
from ddpcheck.targets.protocol import Target
from ddpcheck.targets.reasons import NO_PARAM_DTYPE, OWN_CHECKPOINTS, TORCH_DDP_ORDER

__all__ = ["AccelerateTarget"]


@dataclasses.dataclass(frozen=True)
class AccelerateTarget(FrameworkTarget):
    """accelerate's ``Accelerator`` over torch DDP (see the module docstring)."""

    requires = (("accelerate", "0.30.0"),)  # the oldest release tried (docs/frameworks.md)

    split_batches: bool = True
    accumulation: int = 1  # the scenario's micro-batches per step, set by configure()

    steps_every_micro_batch = True
    declined_features: ClassVar[Mapping[str, str]] = {
        "rank-orders": TORCH_DDP_ORDER,
        "checkpoint": f"{OWN_CHECKPOINTS} (save_state/load_state, its own directory format)",
        "param-dtype": NO_PARAM_DTYPE}

    def warm_up(self) -> None:
        import accelerate  # noqa: F401  (seconds in a rank: once per process, here)

    def configure(self, scenario: Any) -> Target:
        return dataclasses.replace(self, accumulation=scenario.accumulation)

    def setup(self, module: Any, params: Any, optimizer_cls: type,
              **kwargs: Any) -> tuple[Any, Any]:
        from accelerate import Accelerator
        from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs

        join_existing_group()
        accelerator = Accelerator(
            cpu=next(module.parameters()).device.type == "cpu",
            gradient_accumulation_steps=self.accumulation,
            dataloader_config=DataLoaderConfiguration(split_batches=self.split_batches),
            kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
        model, optimizer = accelerator.prepare(module, optimizer_cls(params, **kwargs))
        # the hooks below get the model or the optimizer: both carry this example's Accelerator
        model.ddpcheck_accelerator = optimizer.ddpcheck_accelerator = accelerator
        return model, optimizer

    def make_scheduler(self, optimizer: Any, gamma: float) -> Any:
        inner = torch.optim.lr_scheduler.ExponentialLR(optimizer.optimizer, gamma)
        return optimizer.ddpcheck_accelerator.prepare_scheduler(inner)

    def micro_batch(self, model: Any, optimizer: Any, index: int,
                    count: int) -> AbstractContextManager[Any]:
        return model.ddpcheck_accelerator.accumulate(model)

    def backward(self, model: Any, loss: Any) -> None:
        accelerator = model.ddpcheck_accelerator
        # accelerate divides by gradient_accumulation_steps; ddpcheck's loss is already scaled
        accelerator.backward(loss * accelerator.gradient_accumulation_steps)

    def clip_grad_norm(self, model: Any, optimizer: Any, max_norm: float,
                       norm_type: float) -> Any:
        return model.ddpcheck_accelerator.clip_grad_norm_(model.parameters(), max_norm,
                                                          norm_type)

    def teardown(self, model: Any, optimizer: Any) -> None:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

