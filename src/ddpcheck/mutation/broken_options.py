"""Seeded bugs behind an option: each wrong only in a configuration the default never reaches.

Why: a framework's data-parallel bug often lives in the code path one option selects -- accelerate
#2790 stepped inside the accumulation window only with ``sync_each_batch``, DeepSpeed #7985
leaked the last micro-batch's gradient only in its bf16 optimizer. A check of the default
configuration passes such a framework; ``--fuzz-config`` (``Target.config_space``,
``ddpcheck.targets.option_space``) must find it, with no target written by hand. Each mutant here
is a ready-made framework target (or, where the option exists on none yet, ``parallel``'s DDP)
whose bug is gated on options its ``config_space`` draws, and each has the unmutated target as its
control -- which ``fuzz_config=True`` must pass. ``tests/mutation/test_option_mutants.py`` shows
every one missed by a check of the default configuration and killed with ``fuzz_config=True``.

* :class:`StepsInsideWindowUnlessSplit` -- accelerate, ``split_batches=False``: the prepared
  optimizer steps inside the accumulation window (C2; accelerate #2790's ``sync_each_batch``).
* :class:`SkipsFirstReduceStaticManual` -- Lightning, ``manual=True`` with
  ``static_graph=True``: the first iteration's gradient all-reduce is skipped (B12, a "static
  graph is recorded on the first iteration" guard in the wrong branch).
* :class:`PerMicroBatchLossCountingTokens` -- transformers' Trainer, with
  ``include_num_input_tokens_seen``: the loss is normalised per micro-batch, not per token
  (J1; huggingface/transformers #34191 in the path that counts tokens).
* :class:`LastMicroBatchAfterReduceBf16` -- ``parallel``'s DDP with a ``bf16`` option (its
  fp32-accumulator path): the last micro-batch's gradient is added after the reduction (J4;
  DeepSpeed #7985). Its control, :class:`Bf16PathTarget`, is ``parallel_ddp`` with the option.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpcheck._language.training import FitRun, OptimizerLike, Params
from ddpcheck.mutation.broken_ddp import LastMicroBatchAfterReduceDDP
from ddpcheck.targets import (
    AccelerateTarget,
    HfTrainerTarget,
    LightningTarget,
    ParallelDDPTarget,
)
from ddpcheck.targets.builtin import BUCKET_SIZES
from ddpcheck.targets.option_space import options
from parallel import DDP

if TYPE_CHECKING:
    import torch.distributed as dist
    from accelerate.optimizer import AcceleratedOptimizer

    from ddpcheck.targets.protocol import ConfigSpace

__all__ = [
    "Bf16PathTarget",
    "LastMicroBatchAfterReduceBf16",
    "PerMicroBatchLossCountingTokens",
    "SkipsFirstReduceStaticManual",
    "StepsInsideWindowUnlessSplit",
]


@dataclasses.dataclass(frozen=True)
class StepsInsideWindowUnlessSplit(AccelerateTarget):
    """C2 behind ``split_batches=False``: the prepared optimizer's ``step()`` also steps the inner
    optimizer while ``sync_gradients`` is False -- inside the accumulation window, on a partial
    gradient (accelerate #2790: with ``sync_each_batch`` every batch became a step)."""

    def setup(
        self,
        module: nn.Module,
        params: Params,
        optimizer_cls: type[torch.optim.Optimizer],
        **kwargs: Any,  # the scenario's options, for its optimizer class
    ) -> tuple[nn.Module, OptimizerLike]:
        model, optimizer = super().setup(module, params, optimizer_cls, **kwargs)
        if not self.split_batches:
            prepared: AcceleratedOptimizer = optimizer
            accelerator, inner, gated = (
                prepared.ddpcheck_accelerator,
                prepared.optimizer,
                prepared.step,
            )

            def step(*args: object, **kwargs: object) -> object:
                if not accelerator.sync_gradients:
                    inner.step()  # BUG: the gate is ignored inside the window
                return gated(*args, **kwargs)

            prepared.step = step
        return model, optimizer


def _skips_first_reduce(run: FitRun) -> FitRun:
    """``run``, whose ``started`` registers, on the DDP model the Trainer built, a communication
    hook returning the first iteration's buckets unreduced: each rank steps on its own gradient
    once, then the replicas drift apart."""

    def started(model: nn.Module, optimizer: OptimizerLike) -> None:
        ddp = cast(DistributedDataParallel, model)  # what Lightning's DDP strategy built
        ddp.register_comm_hook({"first": True}, _skips_first_iteration)
        run.started(model, optimizer)

    return dataclasses.replace(run, started=started)


def _skips_first_iteration(
    state: dict, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP's communication hook: torch's all-reduce (averaged), but not in the first iteration."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if state["first"]:  # BUG: the first iteration's buckets are returned as they are
        state["first"] = not bucket.is_last()
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
    # None: the default group (the hook's annotation asks for a group)
    return default_hooks.allreduce_hook(cast("dist.ProcessGroup", None), bucket)


# DDP refuses a hook whose annotations are not its own classes, and this module's are strings
_skips_first_iteration.__annotations__ = {}


@dataclasses.dataclass(frozen=True)
class SkipsFirstReduceStaticManual(LightningTarget):
    """B12 behind ``manual=True`` with ``static_graph=True``: the first iteration's gradient
    all-reduce is skipped (a guard for "the static graph is being recorded" that switches the
    reduction off instead)."""

    def fit(self, module: nn.Module, run: FitRun) -> None:
        super().fit(module, _skips_first_reduce(run) if self.manual and self.static_graph else run)


@functools.cache
def _per_micro_batch_trainer() -> type:
    """transformers' ``Trainer`` whose ``compute_loss`` drops ``num_items_in_batch`` when it
    counts the input tokens seen (made here: transformers is imported only in the ranks)."""
    from transformers import Trainer

    # mypy reads Trainer untyped (pyproject.toml skips transformers)
    class PerMicroBatchWhenCounting(Trainer):  # type: ignore[misc]
        def compute_loss(
            self,
            model: nn.Module,
            inputs: dict[str, torch.Tensor],
            return_outputs: bool = False,
            num_items_in_batch: torch.Tensor | int | None = None,
        ) -> torch.Tensor | tuple[torch.Tensor, object]:
            if self.args.include_num_input_tokens_seen in (False, "no", None):  # the default
                return super().compute_loss(
                    model, inputs, return_outputs, num_items_in_batch=num_items_in_batch
                )
            # BUG: each micro-batch's mean over its own tokens, over the accumulation steps
            loss: torch.Tensor = super().compute_loss(
                model, inputs, return_outputs, num_items_in_batch=None
            )
            return loss / self.args.gradient_accumulation_steps

    return PerMicroBatchWhenCounting


@dataclasses.dataclass(frozen=True)
class PerMicroBatchLossCountingTokens(HfTrainerTarget):
    """J1 behind ``config={"include_num_input_tokens_seen": True}``: the Trainer's loss is
    each micro-batch's token mean divided by the accumulation steps, not the sum over the step's
    token count (huggingface/transformers #34191, in the path that counts tokens)."""

    def fit(self, module: nn.Module, run: FitRun) -> None:
        HfTrainerTarget.fit(
            dataclasses.replace(self, trainer_class=_per_micro_batch_trainer()), module, run
        )


@dataclasses.dataclass(frozen=True)
class Bf16PathTarget(ParallelDDPTarget):
    """``parallel_ddp`` with a ``bf16`` option, as a framework's bf16 optimizer path (DeepSpeed's
    ``BF16_Optimizer``): gradients accumulated and reduced in an fp32 accumulator -- here
    ``parallel.DDP`` itself, whose buckets hold the gradients' own dtype, so the option changes
    nothing it computes. The control of :class:`LastMicroBatchAfterReduceBf16`."""

    bf16: bool = False

    def config_space(self) -> ConfigSpace:
        return options(fields={"bucket_size_mb": BUCKET_SIZES, "bf16": (True,)})

    def wrap(self, module: nn.Module) -> DDP:
        ddp = self.bf16_ddp_class if self.bf16 else DDP
        return ddp(module, bucket_size_mb=self.bucket_size_mb or 25.0)

    @property
    def bf16_ddp_class(self) -> type[DDP]:
        return DDP


@dataclasses.dataclass(frozen=True)
class LastMicroBatchAfterReduceBf16(Bf16PathTarget):
    """J4 behind ``bf16=True``: the fp32 accumulator is all-reduced before the last micro-batch's
    gradient is added to it, which stays local (DeepSpeed #7985)."""

    @property
    def bf16_ddp_class(self) -> type[DDP]:
        return LastMicroBatchAfterReduceDDP
