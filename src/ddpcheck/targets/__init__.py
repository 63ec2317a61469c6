"""Targets: how an implementation under test is driven inside each rank (public).

``protocol`` says what a target is -- every hook the runner calls, and its default
(:class:`Target`, re-exported here with :class:`WrapperTarget`); ``fsdp`` how the FSDP2 target
sets torch's FSDP2 up. This module holds the built-ins: ``parallel`` (ours), torch's DDP, ZeRO
and FSDP2, and a broken one, each a frozen dataclass whose replay line is its fields, and
:data:`BUILTIN`, the short names the command line accepts. Imports the scenario language and
``parallel``; nothing of ddpcheck's private packages.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, ContextManager

import torch
from torch.nn.parallel import DistributedDataParallel

from ddpcheck.features import FEATURES
from ddpcheck.targets.fsdp import (broadcast_from, fsdp_cannot_run, gradient_sync_off, precision,
                                   shard_leaves)
from ddpcheck.targets.protocol import CONSTRUCTOR_CALL, Target, WrapperTarget
from parallel import DDP, ShardedOptimizer

__all__ = ["LOCAL", "PARALLEL", "PARALLEL_DDP", "TORCH_DDP", "TORCH_FSDP", "TORCH_ZERO", "BUILTIN",
           "CONSTRUCTOR_CALL", "LocalTarget", "ParallelDDPTarget", "ParallelTarget", "Target",
           "TorchDDPTarget", "TorchFSDPTarget", "TorchZeroTarget", "WrapperTarget"]


@dataclasses.dataclass(frozen=True)
class _Bucketed(Target):
    """A target whose wrapper buckets gradients; takes the scenario's bucket size hint."""

    bucket_size_mb: float | None = None

    def configure(self, scenario: Any) -> "Target":
        hint = getattr(scenario, "bucket_size_mb", None)
        if hint is None or self.bucket_size_mb is not None:
            return self
        return dataclasses.replace(self, bucket_size_mb=hint)


@dataclasses.dataclass(frozen=True)
class ParallelDDPTarget(_Bucketed):
    """``parallel.DDP`` with the plain optimizer."""

    def wrap(self, module: Any) -> Any:
        return DDP(module, bucket_size_mb=self.bucket_size_mb or 25.0)

    def after_backward(self, model: Any, optimizer: Any) -> None:
        model.finish_gradient_sync()

    def no_sync(self, model: Any) -> ContextManager[Any]:
        return model.no_sync()

    def clip_grad_norm(self, model: Any, optimizer: Any, max_norm: float,
                       norm_type: float) -> Any:
        # in name order, not this rank's registration order: the norm sums per-parameter norms
        # in list order, and ranks that registered differently would round it differently
        params = [p for _, p in sorted(model.module.named_parameters())]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)


@dataclasses.dataclass(frozen=True)
class ParallelTarget(ParallelDDPTarget):
    """``parallel.DDP`` with ``parallel.ShardedOptimizer`` (the built-in ``parallel`` target)."""

    sharding_rule: Any = None  # None: the ShardedOptimizer's default (sharding.modulo)
    shards_optimizer_state = True
    flattened_broadcasts = True

    def make_optimizer(self, params: Any, optimizer_cls: type, **kwargs: Any) -> Any:
        if self.sharding_rule is not None:
            kwargs["sharding_rule"] = self.sharding_rule
        return ShardedOptimizer(params, optimizer_cls, **kwargs)

    def clip_grad_norm(self, model: Any, optimizer: Any, max_norm: float,
                       norm_type: float) -> Any:
        # the global norm from each rank's owned shard: one scalar all-reduced, not W full norms
        return optimizer.clip_grad_norm_(max_norm, norm_type)


@dataclasses.dataclass(frozen=True)
class TorchDDPTarget(_Bucketed):
    """torch's ``DistributedDataParallel`` with the plain optimizer."""

    # Not rank-orders: torch DDP pairs parameters and buffers by registration position, and its
    # docstring requires "the exact same parameter registration order" on every process. With
    # per-rank orders (torch 2.13, W=2) its construction check raises "params[0] in this process
    # with sizes [8] appears not to match sizes of the same param in process 0" -- and where
    # the shapes happen to line up, nothing would stop it pairing different tensors.
    supported_features = frozenset(FEATURES) - {"rank-orders"}

    def wrap(self, module: Any) -> Any:
        kwargs = {} if self.bucket_size_mb is None else {"bucket_cap_mb": self.bucket_size_mb}
        # Unused parameters are part of every battery; torch needs to be told to look for them.
        return DistributedDataParallel(module, find_unused_parameters=True, **kwargs)

    def no_sync(self, model: Any) -> ContextManager[Any]:
        return model.no_sync()


@dataclasses.dataclass(frozen=True)
class TorchZeroTarget(TorchDDPTarget):
    """torch DDP with ``ZeroRedundancyOptimizer``."""

    shards_optimizer_state = True

    # ZeroRedundancyOptimizer rejects parameters of several dtypes. Not rank-orders either: torch
    # DDP in front refuses them (above), and ZeRO's own partition (largest first, ties in list
    # order) would give equal-sized parameters different owners on different ranks.
    supported_features = frozenset(FEATURES) - {"mixed-dtypes", "rank-orders"}

    def supports(self, scenario: Any) -> str | None:
        if getattr(scenario, "checkpoint_after", None) is not None and not _numpy_available():
            return ("checkpoint: ZeroRedundancyOptimizer.consolidate_state_dict decodes every "
                    "rank's shard through numpy (torch 2.13), which is not installed here")
        return None

    def make_optimizer(self, params: Any, optimizer_cls: type, **kwargs: Any) -> Any:
        # here: importing torch.distributed.optim costs 0.6 s after torch, for ZeRO targets only
        from torch.distributed.optim import ZeroRedundancyOptimizer

        params = list(params)
        if params and isinstance(params[0], dict):
            first, *rest = params
            first = dict(first)
            optimizer = ZeroRedundancyOptimizer(first.pop("params"), optimizer_class=optimizer_cls,
                                                **{**kwargs, **first})
            for group in rest:  # a later group falls back to the kwargs, not to group 0's values
                optimizer.add_param_group({**kwargs, **group})
            return optimizer
        # Not parameters_as_bucket_view=True: with torch DDP in front (torch 2.13), a parameter
        # created non-contiguous then gets wrong gradients even at W=1 -- ZeRO swaps param.data
        # for a contiguous bucket view after DDP's Reducer fixed the gradient layout (found by
        # the battery's non-contiguous scenario; ZeRO alone is fine). So ZeRO broadcasts one
        # parameter at a time, and this target does not promise flattened broadcasts.
        return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_cls, **kwargs)


@dataclasses.dataclass(frozen=True)
class TorchFSDPTarget(Target):
    """torch's FSDP2 with the plain optimizer over the sharded (DTensor) parameters.

    ``reshard_after_forward``: FSDP2's option of that name; None (the default) takes it from the
    scenario's seed -- True for odd seeds, False for even ones -- so random examples exercise
    both the re-gather in backward and the unsharded parameters kept from forward to backward.
    Optimizer state, gathered, is held whole by every rank (not ``shards_optimizer_state``).

    ``param_dtype`` / ``reduce_dtype``: FSDP2's ``MixedPrecisionPolicy`` fields; None (the
    default) takes them from the scenario's ``param_dtype`` policy (the target opts in,
    ``applies_param_dtype``): ``MixedPrecisionPolicy(param_dtype=scenario.param_dtype,
    reduce_dtype=torch.float32)`` -- float32 sharded parameters are the master weights, forward
    and backward run on gathered copies in ``param_dtype``, gradients accumulate (under
    ``set_requires_gradient_sync(False)``) and are reduce-scattered in float32. A field set here
    overrides the scenario: ``reduce_dtype=torch.bfloat16`` reduces gradients in bfloat16 where
    the scenario promises float32, which the oracle reports (``communication in a narrower
    dtype``).
    """

    reshard_after_forward: bool | None = None
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    applies_param_dtype = True

    # Declined, and what supports() declines besides: see ddpcheck.targets.fsdp (found by trying).
    # Checkpoints too: FSDP2's state dicts hold DTensor shards, which resume through
    # torch.distributed.checkpoint, not the default hooks' rank-0 state_dict. And per-rank
    # registration orders: fully_shard packs each module's parameters into its all-gather buffer
    # in registration order, which torch requires to be the same on every rank (as DDP does).
    supported_features = frozenset(FEATURES) - {"non-contiguous", "unused-on-some-ranks",
                                                "checkpoint", "rank-orders"}

    def configure(self, scenario: Any) -> "Target":
        change: dict[str, Any] = {}
        if self.reshard_after_forward is None:
            change["reshard_after_forward"] = bool(scenario.seed % 2)
        policy = getattr(scenario, "param_dtype", None)
        if policy is not None and self.param_dtype is None:
            change["param_dtype"] = policy
        if policy is not None and self.reduce_dtype is None:
            change["reduce_dtype"] = torch.float32
        return dataclasses.replace(self, **change) if change else self

    def supports(self, scenario: Any) -> str | None:
        return fsdp_cannot_run(scenario)

    def wrap(self, module: Any) -> Any:
        broadcast_from(module, 0)
        return shard_leaves(module, bool(self.reshard_after_forward),
                            precision(self.param_dtype, self.reduce_dtype))

    def no_sync(self, model: Any) -> ContextManager[Any]:
        return gradient_sync_off(model)


def _numpy_available() -> bool:
    return importlib.util.find_spec("numpy") is not None


@dataclasses.dataclass(frozen=True)
class LocalTarget(Target):
    """No synchronisation at all: every rank trains on its own shard. Fails for W > 1."""


PARALLEL = ParallelTarget()
PARALLEL_DDP = ParallelDDPTarget()
TORCH_DDP = TorchDDPTarget()
TORCH_ZERO = TorchZeroTarget()
TORCH_FSDP = TorchFSDPTarget()
LOCAL = LocalTarget()

#: Built-in targets by the short names the command line accepts.
BUILTIN = {"parallel": PARALLEL, "parallel_ddp": PARALLEL_DDP, "torch_ddp": TORCH_DDP,
           "torch_zero": TORCH_ZERO, "torch_fsdp": TORCH_FSDP, "local": LOCAL}
