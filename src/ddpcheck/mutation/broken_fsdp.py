"""FSDP2 mutants: ``ddpcheck.targets.TorchFSDPTarget`` with one seeded bug each (family I of
``docs/bug-catalogue.md``, and J3, a mixed-precision policy's reduction), each seeded through
FSDP2's public API or a collective of its own.

Every class overrides one method of ``TorchFSDPTarget`` (named in its docstring); the catalogue
lists them beside the ``parallel`` mutants, and ``stale_overrides`` checks that each override
still overrides a method of ``TorchFSDPTarget``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpcheck._language.scenario import Scenario
from ddpcheck._language.training import OptimizerLike, Params
from ddpcheck.targets import TorchFSDPTarget
from ddpcheck.targets.fsdp import (
    broadcast_from,
    fsdp2,
    fully_shard_options,
    shard_leaves,
    tensor_api,
)

__all__ = [
    "BroadcastsFromLastRankFSDP",
    "NoGradientDivideFSDP",
    "NeighbourGradientShardFSDP",
    "ReducesInParamDtypeFSDP",
    "StaleUnshardedParamsFSDP",
]


@dataclasses.dataclass(frozen=True)
class BroadcastsFromLastRankFSDP(TorchFSDPTarget):
    """I1 (``wrap``): the initial state is broadcast from the last rank, not rank 0, before
    sharding -- every replica agrees, on the wrong initialisation."""

    def wrap(self, module: nn.Module) -> nn.Module:
        broadcast_from(module, dist.get_world_size() - 1)
        return shard_leaves(
            module,
            self.reshard_after_forward,
            **fully_shard_options(
                cpu_offload=self.cpu_offload,
                param_dtype=self.param_dtype,
                reduce_dtype=self.reduce_dtype,
            ),
        )


@dataclasses.dataclass(frozen=True)
class NoGradientDivideFSDP(TorchFSDPTarget):
    """I2 (``wrap``): gradients reduce-scattered with SUM and no division -- a gradient divide
    factor of 1 (``FSDPModule.set_gradient_divide_factor(1.0)``) instead of W."""

    def wrap(self, module: nn.Module) -> nn.Module:
        FSDPModule = fsdp2().FSDPModule

        model = super().wrap(module)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
        return model


@dataclasses.dataclass(frozen=True)
class NeighbourGradientShardFSDP(TorchFSDPTarget):
    """I3 (``after_backward``): every rank steps its local shard with the next rank's slice of
    the gradient (its neighbour's shard, where the shapes agree), as an off-by-one in a
    hand-written reduce-scatter's output offsets would."""

    def after_backward(self, model: nn.Module, optimizer: OptimizerLike) -> None:
        DTensor = tensor_api().DTensor

        rank, world_size = dist.get_rank(), dist.get_world_size()
        with torch.no_grad():
            for p in model.parameters():
                grad = p.grad  # FSDP2's: a DTensor
                if not isinstance(grad, DTensor) or grad.dim() == 0:
                    continue
                local = grad.to_local()
                whole = grad.full_tensor()  # a collective: every rank, same order
                chunks = torch.chunk(whole, world_size, dim=0)
                neighbour = (rank + 1) % world_size
                if neighbour < len(chunks) and chunks[neighbour].shape == local.shape:
                    local.copy_(chunks[neighbour])


@dataclasses.dataclass(frozen=True)
class StaleUnshardedParamsFSDP(TorchFSDPTarget):
    """I4 (``make_optimizer``): every FSDP module is unsharded (``FSDPModule.unshard()``, say
    to prefetch the next forward) in a pre-hook of ``optimizer.step()``, so after the step the
    model holds unsharded parameters gathered *before* it, and the next forward uses those
    stale values: the updated shards are never re-gathered."""

    def make_optimizer(
        self,
        params: Params,
        optimizer_cls: type[torch.optim.Optimizer],
        model: nn.Module | None = None,
        **kwargs: Any,  # the scenario's options, for its optimizer class
    ) -> OptimizerLike:
        FSDPModule = fsdp2().FSDPModule

        if model is None:  # the harness passes it: the signature names it
            raise TypeError(f"{type(self).__name__}.make_optimizer needs the wrapped model")
        wrapped = model
        optimizer = optimizer_cls(params, **kwargs)

        def unshard_before_step(*_: object) -> None:
            for m in wrapped.modules():
                if isinstance(m, FSDPModule):
                    m.unshard()

        optimizer.register_step_pre_hook(unshard_before_step)
        return optimizer


@dataclasses.dataclass(frozen=True)
class ReducesInParamDtypeFSDP(TorchFSDPTarget):
    """J3 (``configure``): the ``MixedPrecisionPolicy`` is built from the scenario's
    ``param_dtype`` alone, without ``reduce_dtype`` -- FSDP2 then reduce-scatters the gradients in
    ``param_dtype`` (bfloat16) where the policy promises float32 (the common way to lose gradient
    precision with FSDP2; FSDP1's ``MixedPrecision(param_dtype=...)`` did the same). Numbers move
    by bfloat16 rounding only; the dtype of the reduce-scatter shows it."""

    def configure(self, scenario: Scenario) -> TorchFSDPTarget:
        configured = super().configure(scenario)
        # BUG: reduce_dtype left to FSDP2's default, param_dtype
        return dataclasses.replace(configured, reduce_dtype=configured.param_dtype)
