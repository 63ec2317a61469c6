"""The built-in targets: ``parallel`` (this repository's DDP and ZeRO-1), torch's DDP, ZeRO and
FSDP2, and ``local`` (no synchronisation: a target that must fail). Each a frozen dataclass whose
fields are its replay line; the frameworks' targets live in modules of their own.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpcheck._base.errors import InvalidArgument, NothingChecked, SetupError
from ddpcheck._language.scenario import Scenario
from ddpcheck._language.training import MicroBatchLoss, OptimizerLike, Params
from ddpcheck.targets.configuration import Config, load_config, reconcile
from ddpcheck.targets.data_path import SamplerDataPath
from ddpcheck.targets.fsdp import (
    CPU_FLOOR,
    CUDA_FLOOR,
    broadcast_from,
    config_options,
    fsdp_cannot_run,
    fsdp_config,
    fully_shard_options,
    gradient_sync_off,
    shard_leaves,
)
from ddpcheck.targets.option_space import options
from ddpcheck.targets.protocol import Target
from ddpcheck.targets.reasons import NO_PARAM_DTYPE, TORCH_DDP_ORDER

try:
    from parallel import DDP, ShardedOptimizer, sharding
except ImportError as exc:  # another `parallel` first on sys.path: say so (docs/parallel.md)
    found = getattr(sys.modules.get("parallel"), "__file__", None) or "another module"
    raise SetupError(
        "ddpcheck's built-in implementations are the top-level package `parallel`, but "
        f"`import parallel` found {found} first on sys.path ({exc}); rename your `parallel`, "
        "or run ddpcheck from another folder (docs/parallel.md#the-name-parallel)"
    ) from None

if TYPE_CHECKING:
    from ddpcheck.targets.protocol import ConfigSpace

__all__ = [
    "LocalTarget",
    "ParallelDDPTarget",
    "ParallelTarget",
    "TorchDDPTarget",
    "TorchFSDPTarget",
    "TorchZeroTarget",
    "ZERO_HARNESS_KEYS",
    "ZERO_SCENARIO_KEYS",
]


#: The oldest torch the built-in targets run on (pyproject.toml's ``torch>=2.1``:
#: ``Tensor.register_post_accumulate_grad_hook``); FSDP2's is later (``TorchFSDPTarget``).
TORCH_FLOOR = "2.1"

#: The bucket sizes (MB) drawn for a bucketing wrapper's option (``strategies.BUCKET_SIZES``).
BUCKET_SIZES = (1e-6, 2e-4, 1e6)


@dataclasses.dataclass(frozen=True)
class _Bucketed(Target):
    """A target whose wrapper buckets gradients; takes the scenario's bucket size hint."""

    bucket_size_mb: float | None = None
    requires = (("torch", TORCH_FLOOR),)

    def config_space(self) -> ConfigSpace:
        """The bucket size: one parameter per bucket, a few, one bucket for everything
        (``ddpcheck.strategies.BUCKET_SIZES``)."""
        return options(fields={"bucket_size_mb": BUCKET_SIZES})

    def configure(self, scenario: Scenario) -> Target:
        hint = getattr(scenario, "bucket_size_mb", None)
        if hint is None or self.bucket_size_mb is not None:
            return self
        return dataclasses.replace(self, bucket_size_mb=hint)


@dataclasses.dataclass(frozen=True)
class ParallelDDPTarget(_Bucketed):
    """``parallel.DDP`` with the plain optimizer."""

    # Every feature, per-rank registration orders included: parallel.DDP pairs tensors in rank
    # 0's order (parallel/handover.py), beyond torch DDP's contract; the opt-in precision policy
    # is not applied.
    declined_features: ClassVar[Mapping[str, str]] = {"param-dtype": NO_PARAM_DTYPE}

    def wrap(self, module: nn.Module) -> nn.Module:
        return DDP(module, bucket_size_mb=self.bucket_size_mb or 25.0)

    def after_backward(self, model: nn.Module, optimizer: OptimizerLike) -> None:
        cast(DDP, model).finish_gradient_sync()  # the model wrap returned

    def no_sync(self, model: nn.Module) -> AbstractContextManager[object]:
        return cast(DDP, model).no_sync()

    def reported_loss(
        self, model: nn.Module, optimizer: OptimizerLike, losses: Sequence[MicroBatchLoss]
    ) -> torch.Tensor | None:
        # what a loop over parallel.DDP prints: its step's losses averaged as its gradients are
        if not isinstance(model, DDP):  # (a mutant's ShardedOptimizer without DDP in front)
            return None
        return model.reduce_loss(MicroBatchLoss.total(losses))

    def clip_grad_norm(
        self, model: nn.Module, optimizer: OptimizerLike, max_norm: float, norm_type: float
    ) -> object:
        # in name order, not this rank's registration order: the norm sums per-parameter norms
        # in list order, and ranks that registered differently would round it differently
        params = [p for _, p in sorted(cast(DDP, model).module.named_parameters())]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)


@dataclasses.dataclass(frozen=True)
class ParallelTarget(ParallelDDPTarget):
    """``parallel.DDP`` with ``parallel.ShardedOptimizer`` (the built-in ``parallel`` target)."""

    #: None: the ShardedOptimizer's default (sharding.modulo)
    sharding_rule: Callable[..., object] | None = None  # the optimizer checks what it answers
    shards_optimizer_state = True
    flattened_broadcasts = True

    def config_space(self) -> ConfigSpace:
        """The bucket size and the rule that assigns each parameter its owner."""
        return options(
            fields={
                "bucket_size_mb": BUCKET_SIZES,
                "sharding_rule": (sharding.greedy, sharding.contiguous),
            }
        )

    def make_optimizer(
        self, params: Params, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any
    ) -> ShardedOptimizer:
        if self.sharding_rule is not None:
            kwargs["sharding_rule"] = self.sharding_rule
        return ShardedOptimizer(params, optimizer_cls, **kwargs)

    def clip_grad_norm(
        self, model: nn.Module, optimizer: OptimizerLike, max_norm: float, norm_type: float
    ) -> object:
        # the global norm from each rank's owned shard: one scalar all-reduced, not W full norms
        return cast(ShardedOptimizer, optimizer).clip_grad_norm_(max_norm, norm_type)


@dataclasses.dataclass(frozen=True)
class TorchDDPTarget(_Bucketed, SamplerDataPath):
    """torch's ``DistributedDataParallel`` with the plain optimizer; a scenario with epochs runs
    through ``DistributedSampler`` and a ``DataLoader`` per rank (``targets.data_path``)."""

    # torch DDP pairs parameters and buffers by registration position: with per-rank orders (torch
    # 2.13, W=2) its construction check raises "params[0] in this process with sizes [8] appears
    # not to match sizes of the same param in process 0" -- and where the shapes happen to line
    # up, nothing would stop it pairing different tensors.
    declined_features: ClassVar[Mapping[str, str]] = {
        "rank-orders": TORCH_DDP_ORDER,
        "param-dtype": NO_PARAM_DTYPE,
    }

    def wrap(self, module: nn.Module) -> nn.Module:
        # Unused parameters are part of every battery; torch needs to be told to look for them.
        if self.bucket_size_mb is None:
            return DistributedDataParallel(module, find_unused_parameters=True)
        return DistributedDataParallel(
            module, find_unused_parameters=True, bucket_cap_mb=self.bucket_size_mb
        )

    def no_sync(self, model: nn.Module) -> AbstractContextManager[object]:
        return cast(DistributedDataParallel, model).no_sync()  # the model wrap returned


@dataclasses.dataclass(frozen=True)
class TorchZeroTarget(TorchDDPTarget):
    """torch DDP with ``ZeroRedundancyOptimizer``, built in the order torch's ZeRO documentation
    shows (DDP first, ZeRO over ``ddp.parameters()``).

    ``config``: your ``ZeroRedundancyOptimizer`` keyword arguments, a dict or a JSON file
    (``TorchZeroTarget(config={"parameters_as_bucket_view": True})``; docs/frameworks.md, "Your
    own configuration").

    ``parameters_as_bucket_view``: ZeRO's option of that name (``torch_zero_bucket_view``). With
    it, torch 2.13 computes wrong gradients for a parameter whose strides change after DDP
    wrapped it -- a non-contiguous or ``channels_last`` weight -- and this target fails, as it
    must (docs/stride-bug.md)."""

    parameters_as_bucket_view: bool = False
    #: your ``ZeroRedundancyOptimizer`` keyword arguments (a dict, or the path of a JSON file
    #: holding one): ``parameters_as_bucket_view``; the scenario's and the harness's refused
    #: (:data:`ZERO_SCENARIO_KEYS`, :data:`ZERO_HARNESS_KEYS`)
    config: Config = None

    shards_optimizer_state = True

    def __post_init__(self) -> None:
        given = load_config(self.config, target="TorchZeroTarget")
        if given:
            # every keyword ZeroRedundancyOptimizer does not name goes to the optimizer class
            # (its **defaults): the scenario's optimizer_kwargs -- unless it is a typo of one
            extra = {
                k: "optimizer_kwargs: ZeroRedundancyOptimizer passes it to the optimizer"
                for k in given
                if k not in _ZERO_OPTIONS
                and not difflib.get_close_matches(k, _ZERO_OPTIONS, n=1, cutoff=0.6)
            }
            reconcile(
                given,
                target="TorchZeroTarget",
                scenario_keys={**ZERO_SCENARIO_KEYS, **extra},
                harness_keys=ZERO_HARNESS_KEYS,
                known=_ZERO_OPTIONS,
            )
        if (
            "parameters_as_bucket_view" in given
            and given["parameters_as_bucket_view"] != self.parameters_as_bucket_view
            and self.parameters_as_bucket_view
        ):
            raise InvalidArgument(
                "TorchZeroTarget(parameters_as_bucket_view=True) and the "
                "config's 'parameters_as_bucket_view' disagree: give one"
            )
        object.__setattr__(self, "_given", given)  # derived, not a field: config rebuilds it

    @property
    def bucket_view(self) -> bool:
        """ZeRO's ``parameters_as_bucket_view``: the field's, or the config's."""
        return bool(
            vars(self)["_given"].get("parameters_as_bucket_view", self.parameters_as_bucket_view)
        )

    declined_features: ClassVar[Mapping[str, str]] = {
        "mixed-dtypes": "ZeroRedundancyOptimizer rejects parameters of several dtypes",
        # torch DDP in front refuses them, and ZeRO's own partition (largest first, ties in list
        # order) would give equal-sized parameters different owners on different ranks
        "rank-orders": TORCH_DDP_ORDER,
        "param-dtype": NO_PARAM_DTYPE,
    }

    def supports(self, scenario: Scenario) -> str | None:
        if getattr(scenario, "checkpoint_after", None) is not None and not _numpy_available():
            return (
                "checkpoint: ZeroRedundancyOptimizer.consolidate_state_dict decodes every "
                "rank's shard through numpy (torch 2.13), which is not installed here"
            )
        return None

    def make_optimizer(
        self, params: Params, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any
    ) -> OptimizerLike:
        # here: importing torch.distributed.optim costs 0.6 s after torch, for ZeRO targets only
        from torch.distributed.optim import ZeroRedundancyOptimizer

        groups = [group for group in params if isinstance(group, dict)]
        if groups:
            first, *rest = groups
            first = dict(first)
            optimizer = ZeroRedundancyOptimizer(
                first.pop("params"),
                optimizer_class=optimizer_cls,
                parameters_as_bucket_view=self.bucket_view,
                **{**kwargs, **first},
            )
            for group in rest:  # a later group falls back to the kwargs, not to group 0's values
                optimizer.add_param_group({**kwargs, **group})
            return optimizer
        # parameters_as_bucket_view=False by default: with torch DDP in front (torch 2.13), a
        # parameter created non-contiguous then gets wrong gradients even at W=1 -- ZeRO swaps
        # param.data for a contiguous bucket view after DDP's Reducer fixed the gradient layout
        # (found by the battery's non-contiguous scenario; ZeRO alone is fine; docs/stride-bug.md).
        # So ZeRO broadcasts one parameter at a time, and this target does not promise flattened
        # broadcasts.
        return ZeroRedundancyOptimizer(
            params,
            optimizer_class=optimizer_cls,
            parameters_as_bucket_view=self.bucket_view,
            **kwargs,
        )


@dataclasses.dataclass(frozen=True)
class TorchFSDPTarget(Target):
    """torch's FSDP2 with the plain optimizer over the sharded (DTensor) parameters.

    ``config``: your ``fully_shard`` keyword arguments, a dict or a JSON file
    (``TorchFSDPTarget(config={"reshard_after_forward": False})``; docs/frameworks.md, "Your own
    configuration"); the scenario's and the harness's keys refused (``ddpcheck.targets.fsdp``).

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

    reshard_after_forward: bool | int | None = None
    #: ``fully_shard(offload_policy=CPUOffloadPolicy())``: parameters, gradients and optimizer
    #: state kept on the CPU, the step run there (needs an accelerator: declined in CPU worlds)
    cpu_offload: bool = False
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    #: your ``fully_shard`` keyword arguments (a dict, or the path of a JSON file holding one):
    #: ``reshard_after_forward``, ``shard_placement_fn``, ``offload_policy`` as a dict of
    #: ``CPUOffloadPolicy``'s keyword arguments; ``mp_policy``'s fields are the scenario's
    #: (``param_dtype``) or the harness's, refused like every such key
    #: (``ddpcheck.targets.fsdp.FSDP_SCENARIO_KEYS``, ``FSDP_HARNESS_KEYS``)
    config: Config = None
    applies_param_dtype = True
    requires = (("torch", CPU_FLOOR),)  # the CPU's, as `ddpcheck targets` lists it

    def requirements(self, device: str) -> tuple[tuple[str, str], ...]:
        """The torch whose FSDP2 runs on ``device``: CUDA from 2.4 (its older import path), the
        CPU only later (``ddpcheck.targets.fsdp.CPU_FLOOR``, measured)."""
        return (("torch", CUDA_FLOOR if device == "cuda" else CPU_FLOOR),)

    # Found by trying; what supports() declines besides: see ddpcheck.targets.fsdp.
    declined_features: ClassVar[Mapping[str, str]] = {
        "non-contiguous": "fully_shard raises on non-contiguous parameters",
        "unused-on-some-ranks": "FSDP2 all-gathers a layer in its forward: a layer some ranks "
        "skip leaves the collectives unpaired",
        "checkpoint": "FSDP2's sharded state dicts (DTensor shards) resume through "
        "torch.distributed.checkpoint, not the default hooks' rank-0 state_dict",
        "rank-orders": "fully_shard packs each module's parameters into its all-gather buffer in "
        "registration order, which must be the same on every rank",
    }

    def __post_init__(self) -> None:
        given = fsdp_config(self.config)  # no FSDP import without a config (the ready-made)
        for key, field, unset in (
            ("reshard_after_forward", "reshard_after_forward", None),
            ("offload_policy", "cpu_offload", False),
        ):
            if key in given and getattr(self, field) != unset:
                raise InvalidArgument(
                    f"TorchFSDPTarget({field}={getattr(self, field)!r}) and "
                    f"the config's {key!r} both set it: give one"
                )
        object.__setattr__(self, "_given", given)  # derived, not a field: config rebuilds it

    def config_space(self) -> ConfigSpace:
        """``reshard_after_forward`` set (None takes it from the seed): re-gather in backward,
        or keep the unsharded parameters from forward to backward. Not the dtypes:
        a ``param_dtype`` or ``reduce_dtype`` set here overrides the scenario's precision, which
        the oracle reports as it must; not ``cpu_offload``: declined in CPU worlds. And
        ``config.shard_placement_fn``: each parameter sharded along its last dimension."""
        from ddpcheck.targets.fsdp import shard_last_dim

        return options(
            fields={"reshard_after_forward": (True, False)},
            config={"shard_placement_fn": (shard_last_dim,)},
        )

    def configure(self, scenario: Scenario) -> TorchFSDPTarget:
        given = vars(self)["_given"]
        reshard, param_dtype, reduce_dtype = (
            self.reshard_after_forward,
            self.param_dtype,
            self.reduce_dtype,
        )
        if reshard is None and "reshard_after_forward" not in given:
            reshard = bool(scenario.seed % 2)
        policy = getattr(scenario, "param_dtype", None)
        if policy is not None and param_dtype is None:
            param_dtype = policy
        if policy is not None and reduce_dtype is None:
            reduce_dtype = torch.float32
        if (reshard, param_dtype, reduce_dtype) == (
            self.reshard_after_forward,
            self.param_dtype,
            self.reduce_dtype,
        ):
            return self
        return dataclasses.replace(
            self,
            reshard_after_forward=reshard,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
        )

    def supports(self, scenario: Scenario) -> str | None:
        return fsdp_cannot_run(scenario)

    def wrap(self, module: nn.Module) -> nn.Module:
        given = vars(self)["_given"]
        if (self.cpu_offload or given.get("offload_policy") is not None) and next(
            module.parameters()
        ).device.type == "cpu":
            # every rank decides alike, before any collective: a decline, not a rank failure
            raise NothingChecked(
                "cpu_offload: FSDP2's CPUOffloadPolicy keeps parameters on the CPU and copies "
                "them to the accelerator for each forward; in a CPU world torch 2.13 raises "
                "'Cannot access accelerator device when none is available' (run it with "
                "--device cuda)"
            )
        broadcast_from(module, 0)
        if given:
            return shard_leaves(
                module,
                given.get("reshard_after_forward", self.reshard_after_forward),
                **config_options(given, self.param_dtype, self.reduce_dtype),
            )
        return shard_leaves(
            module,
            self.reshard_after_forward,
            **fully_shard_options(
                cpu_offload=self.cpu_offload,
                param_dtype=self.param_dtype,
                reduce_dtype=self.reduce_dtype,
            ),
        )

    def no_sync(self, model: nn.Module) -> AbstractContextManager[object]:
        return gradient_sync_off(model)


#: ``ZeroRedundancyOptimizer``'s own keywords (torch 2.13), besides the optimizer's defaults.
_ZERO_OPTIONS = (
    "params",
    "optimizer_class",
    "process_group",
    "parameters_as_bucket_view",
    "overlap_with_ddp",
)
#: ``ZeroRedundancyOptimizer`` keywords the scenario sets: refused whatever their value.
ZERO_SCENARIO_KEYS: dict[str, str] = {
    "params": "model and param_groups: ZeRO shards the model's parameters",
    "optimizer_class": "optimizer",
}
#: ``ZeroRedundancyOptimizer`` keywords ddpcheck's harness fixes: key -> (accepted, why).
ZERO_HARNESS_KEYS: dict[str, tuple[tuple[object, ...], str]] = {
    "process_group": ((None,), "ddpcheck's world: ZeRO shards over it"),
    "overlap_with_ddp": (
        (False,),
        "not tried with this target: it needs a functional optimizer "
        "and ZeRO's DDP communication hook registered on the model",
    ),
}


def _numpy_available() -> bool:
    return importlib.util.find_spec("numpy") is not None


@dataclasses.dataclass(frozen=True)
class LocalTarget(Target):
    """No synchronisation at all: every rank trains on its own shard. Fails for W > 1."""

    # Every feature: with nothing to pair across ranks, any registration order will do.
    declined_features: ClassVar[Mapping[str, str]] = {"param-dtype": NO_PARAM_DTYPE}
    requires = (("torch", TORCH_FLOOR),)


# Replay lines and pickles name these by the package users import them from (ddpcheck.targets:
# PARALLEL, as before the built-ins had a module of their own).
for _cls in (
    ParallelDDPTarget,
    ParallelTarget,
    TorchDDPTarget,
    TorchZeroTarget,
    TorchFSDPTarget,
    LocalTarget,
):
    _cls.__module__ = "ddpcheck.targets"
