"""Targets: how an implementation under test is driven inside each rank (public).

``protocol`` says what a target is -- every hook the runner calls, and its default (:class:`Target`,
re-exported here with :class:`WrapperTarget`); ``fsdp`` how the FSDP2 target sets torch's FSDP2 up;
``accelerate``, ``fabric``, ``lightning``, ``deepspeed``, ``hf_trainer`` drive those frameworks
(each imported only when its target runs; ``environment`` joins them to the existing process group).
This module holds the built-ins: ``parallel`` (ours), torch's DDP, ZeRO and FSDP2, a broken one, the
frameworks', each a frozen dataclass whose replay line is its fields, :data:`READY_MADE` (what
``ddpcheck targets`` lists: each one's framework, version and what it declines, and why) and
:data:`BUILTIN`, the short names the command line accepts. Imports the scenario language and
``parallel``; nothing of ddpcheck's private packages.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ddpcheck._base.errors import InvalidArgument, NothingChecked
from ddpcheck._language.features import FEATURES
from ddpcheck.targets.accelerate import AccelerateTarget
from ddpcheck.targets.configuration import load_config, reconcile
from ddpcheck.targets.deepspeed import DeepSpeedTarget
from ddpcheck.targets.environment import installed_version
from ddpcheck.targets.fabric import FabricTarget
from ddpcheck.targets.framework import install_command
from ddpcheck.targets.fsdp import (
    broadcast_from,
    config_options,
    fsdp_cannot_run,
    fsdp_config,
    fully_shard_options,
    gradient_sync_off,
    shard_leaves,
)
from ddpcheck.targets.hf_trainer import HfTrainerTarget
from ddpcheck.targets.lightning import LightningTarget
from ddpcheck.targets.protocol import CONSTRUCTOR_CALL, FitRun, Target, WrapperTarget
from parallel import DDP, ShardedOptimizer

__all__ = ["ACCELERATE", "DEEPSPEED", "DEEPSPEED_ZERO1", "DEEPSPEED_ZERO2", "FABRIC",
           "HF_TRAINER", "LIGHTNING", "LOCAL", "PARALLEL", "PARALLEL_DDP", "TORCH_DDP",
           "TORCH_FSDP", "TORCH_ZERO",
           "TORCH_ZERO_BUCKET_VIEW", "BUILTIN", "TESTED", "CONSTRUCTOR_CALL", "READY_MADE",
           "AccelerateTarget", "DeepSpeedTarget", "FabricTarget", "FitRun", "HfTrainerTarget",
           "LightningTarget", "LocalTarget",
           "ParallelDDPTarget", "ParallelTarget", "ReadyMade", "Target", "TorchDDPTarget",
           "TorchFSDPTarget", "TorchZeroTarget", "WrapperTarget", "ZERO_HARNESS_KEYS",
           "ZERO_SCENARIO_KEYS"]


@dataclasses.dataclass(frozen=True)
class _Bucketed(Target):
    """A target whose wrapper buckets gradients; takes the scenario's bucket size hint."""

    bucket_size_mb: float | None = None

    def configure(self, scenario: Any) -> Target:
        hint = getattr(scenario, "bucket_size_mb", None)
        if hint is None or self.bucket_size_mb is not None:
            return self
        return dataclasses.replace(self, bucket_size_mb=hint)


@dataclasses.dataclass(frozen=True)
class ParallelDDPTarget(_Bucketed):
    """``parallel.DDP`` with the plain optimizer."""

    # Every feature, per-rank registration orders included: parallel.DDP pairs tensors in rank
    # 0's order (parallel/handover.py), beyond torch DDP's contract.
    supported_features = frozenset(FEATURES)

    def wrap(self, module: Any) -> Any:
        return DDP(module, bucket_size_mb=self.bucket_size_mb or 25.0)

    def after_backward(self, model: Any, optimizer: Any) -> None:
        model.finish_gradient_sync()

    def no_sync(self, model: Any) -> AbstractContextManager[Any]:
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
        kwargs: dict[str, Any] = ({} if self.bucket_size_mb is None else
                                  {"bucket_cap_mb": self.bucket_size_mb})
        # Unused parameters are part of every battery; torch needs to be told to look for them.
        return DistributedDataParallel(module, find_unused_parameters=True, **kwargs)

    def no_sync(self, model: Any) -> AbstractContextManager[Any]:
        return model.no_sync()


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
    config: Any = None

    shards_optimizer_state = True

    def __post_init__(self) -> None:
        given = load_config(self.config, target="TorchZeroTarget")
        if given:
            # every keyword ZeroRedundancyOptimizer does not name goes to the optimizer class
            # (its **defaults): the scenario's optimizer_kwargs -- unless it is a typo of one
            extra = {k: "optimizer_kwargs: ZeroRedundancyOptimizer passes it to the optimizer"
                     for k in given if k not in _ZERO_OPTIONS
                     and not difflib.get_close_matches(k, _ZERO_OPTIONS, n=1, cutoff=0.6)}
            reconcile(given, target="TorchZeroTarget",
                      scenario_keys={**ZERO_SCENARIO_KEYS, **extra},
                      harness_keys=ZERO_HARNESS_KEYS, known=_ZERO_OPTIONS)
        if ("parameters_as_bucket_view" in given
                and given["parameters_as_bucket_view"] != self.parameters_as_bucket_view
                and self.parameters_as_bucket_view):
            raise InvalidArgument("TorchZeroTarget(parameters_as_bucket_view=True) and the "
                                  "config's 'parameters_as_bucket_view' disagree: give one")
        object.__setattr__(self, "_given", given)  # derived, not a field: config rebuilds it

    @property
    def bucket_view(self) -> bool:
        """ZeRO's ``parameters_as_bucket_view``: the field's, or the config's."""
        return bool(vars(self)["_given"].get("parameters_as_bucket_view",
                                             self.parameters_as_bucket_view))

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
            optimizer = ZeroRedundancyOptimizer(
                first.pop("params"), optimizer_class=optimizer_cls,
                parameters_as_bucket_view=self.bucket_view, **{**kwargs, **first})
            for group in rest:  # a later group falls back to the kwargs, not to group 0's values
                optimizer.add_param_group({**kwargs, **group})
            return optimizer
        # parameters_as_bucket_view=False by default: with torch DDP in front (torch 2.13), a
        # parameter created non-contiguous then gets wrong gradients even at W=1 -- ZeRO swaps
        # param.data for a contiguous bucket view after DDP's Reducer fixed the gradient layout
        # (found by the battery's non-contiguous scenario; ZeRO alone is fine; docs/stride-bug.md).
        # So ZeRO broadcasts one parameter at a time, and this target does not promise flattened
        # broadcasts.
        return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_cls,
                                       parameters_as_bucket_view=self.bucket_view,
                                       **kwargs)


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
    config: Any = None
    applies_param_dtype = True

    # Declined, and what supports() declines besides: see ddpcheck.targets.fsdp (found by trying).
    # Checkpoints too: FSDP2's state dicts hold DTensor shards, which resume through
    # torch.distributed.checkpoint, not the default hooks' rank-0 state_dict. And per-rank
    # registration orders: fully_shard packs each module's parameters into its all-gather buffer
    # in registration order, which torch requires to be the same on every rank (as DDP does).
    supported_features = frozenset(FEATURES) - {"non-contiguous", "unused-on-some-ranks",
                                                "checkpoint", "rank-orders"}

    def __post_init__(self) -> None:
        given = fsdp_config(self.config)  # no FSDP import without a config (the ready-made)
        for key, field, unset in (("reshard_after_forward", "reshard_after_forward", None),
                                  ("offload_policy", "cpu_offload", False)):
            if key in given and getattr(self, field) != unset:
                raise InvalidArgument(f"TorchFSDPTarget({field}={getattr(self, field)!r}) and "
                                      f"the config's {key!r} both set it: give one")
        object.__setattr__(self, "_given", given)  # derived, not a field: config rebuilds it

    def configure(self, scenario: Any) -> TorchFSDPTarget:
        change: dict[str, Any] = {}
        given = vars(self)["_given"]
        if self.reshard_after_forward is None and "reshard_after_forward" not in given:
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
        given = vars(self)["_given"]
        if ((self.cpu_offload or given.get("offload_policy") is not None)
                and next(module.parameters()).device.type == "cpu"):
            # every rank decides alike, before any collective: a decline, not a rank failure
            raise NothingChecked(
                "cpu_offload: FSDP2's CPUOffloadPolicy keeps parameters on the CPU and copies "
                "them to the accelerator for each forward; in a CPU world torch 2.13 raises "
                "'Cannot access accelerator device when none is available' (run it with "
                "--device cuda)")
        broadcast_from(module, 0)
        if given:
            return shard_leaves(module, given.get("reshard_after_forward",
                                                  self.reshard_after_forward),
                                **config_options(given, self.param_dtype, self.reduce_dtype))
        return shard_leaves(module, self.reshard_after_forward, **fully_shard_options(
            cpu_offload=self.cpu_offload, param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype))

    def no_sync(self, model: Any) -> AbstractContextManager[Any]:
        return gradient_sync_off(model)


#: ``ZeroRedundancyOptimizer``'s own keywords (torch 2.13), besides the optimizer's defaults.
_ZERO_OPTIONS = ("params", "optimizer_class", "process_group", "parameters_as_bucket_view",
                 "overlap_with_ddp")
#: ``ZeroRedundancyOptimizer`` keywords the scenario sets: refused whatever their value.
ZERO_SCENARIO_KEYS: dict[str, str] = {
    "params": "model and param_groups: ZeRO shards the model's parameters",
    "optimizer_class": "optimizer",
}
#: ``ZeroRedundancyOptimizer`` keywords ddpcheck's harness fixes: key -> (accepted, why).
ZERO_HARNESS_KEYS: dict[str, tuple[tuple[Any, ...], str]] = {
    "process_group": ((None,), "ddpcheck's world: ZeRO shards over it"),
    "overlap_with_ddp": ((False,), "not tried with this target: it needs a functional optimizer "
                                   "and ZeRO's DDP communication hook registered on the model"),
}


def _numpy_available() -> bool:
    return importlib.util.find_spec("numpy") is not None


@dataclasses.dataclass(frozen=True)
class LocalTarget(Target):
    """No synchronisation at all: every rank trains on its own shard. Fails for W > 1."""

    # Every feature: with nothing to pair across ranks, any registration order will do.
    supported_features = frozenset(FEATURES)


PARALLEL = ParallelTarget()
PARALLEL_DDP = ParallelDDPTarget()
TORCH_DDP = TorchDDPTarget()
TORCH_ZERO = TorchZeroTarget()
TORCH_ZERO_BUCKET_VIEW = TorchZeroTarget(parameters_as_bucket_view=True)
TORCH_FSDP = TorchFSDPTarget()
LOCAL = LocalTarget()
ACCELERATE = AccelerateTarget()
FABRIC = FabricTarget()
LIGHTNING = LightningTarget()
DEEPSPEED = DeepSpeedTarget()  # the stage of its config (DeepSpeedTarget(config=...)), else 2
DEEPSPEED_ZERO1 = DeepSpeedTarget(stage=1)
DEEPSPEED_ZERO2 = DeepSpeedTarget(stage=2)
HF_TRAINER = HfTrainerTarget()


@dataclasses.dataclass(frozen=True)
class ReadyMade:
    """One ready-made target, as ``ddpcheck targets`` lists it."""

    name: str  # its command-line name
    target: Target
    framework: str  # the distribution that provides what it drives
    module: str  # the module it imports (installed when importable)
    summary: str
    #: feature -> why the target declines it (every feature outside its supported_features)
    declines: dict
    #: what its ``supports()`` declines besides, scenario by scenario
    per_scenario: str = ""

    @property
    def version(self) -> str | None:
        """The framework's installed version; None when it is not installed."""
        return installed_version(self.framework, self.module)

    @property
    def minimum(self) -> str | None:
        """The oldest release of its framework it supports (``Target.requires``), if any."""
        return dict(getattr(self.target, "requires", ()) or ()).get(self.framework)

    @property
    def install(self) -> str:
        """The pip command that installs its framework at a supported release."""
        return install_command(self.framework, self.minimum)

    @property
    def tested(self) -> tuple[str, ...]:
        """The releases of its framework its targets were run against and passed."""
        return TESTED.get(self.framework, ())


#: The releases of each framework the ready-made targets were run against and passed
#: (``bench/framework_releases.py``; docs/frameworks.md, "Releases tried"): the oldest is the
#: floor ``Target.requires`` states, the newest the pin of constraints.txt.
TESTED: dict[str, tuple[str, ...]] = {
    "torch": ("2.13.0",),
    "accelerate": ("0.30.0", "0.30.1", "1.0.0", "1.15.0"),
    "lightning": ("2.0.9", "2.4.0", "2.6.6"),
    "transformers": ("5.0.0", "5.25.0"),
    "deepspeed": ("0.19.0", "0.19.8"),
}


_TORCH_DDP_ORDER = ("torch DDP requires \"the exact same parameter registration order\" on "
                    "every process")
_OWN_CHECKPOINTS = "saved through the framework's own checkpoint format, not the default hooks"
#: The opt-in precision policy (``features.OPT_IN``): declined by every target not applying it.
_NO_PARAM_DTYPE = {"param-dtype": "a param_dtype policy is the target's to apply "
                                  "(applies_param_dtype); torch_fsdp applies it through FSDP2's "
                                  "MixedPrecisionPolicy"}

#: Every ready-made target, in the order ``ddpcheck targets`` lists them.
READY_MADE: tuple[ReadyMade, ...] = (
    ReadyMade("parallel", PARALLEL, "torch", "torch",
              "parallel.DDP + parallel.ShardedOptimizer (this repository)", _NO_PARAM_DTYPE),
    ReadyMade("parallel_ddp", PARALLEL_DDP, "torch", "torch",
              "parallel.DDP + the plain optimizer", _NO_PARAM_DTYPE),
    ReadyMade("torch_ddp", TORCH_DDP, "torch", "torch",
              "torch DistributedDataParallel(find_unused_parameters=True)",
              {"rank-orders": _TORCH_DDP_ORDER, **_NO_PARAM_DTYPE}),
    ReadyMade("torch_zero", TORCH_ZERO, "torch", "torch",
              "torch DDP + ZeroRedundancyOptimizer; TorchZeroTarget(config={its keyword "
              "arguments} or 'zero.json')", {
                  "rank-orders": _TORCH_DDP_ORDER,
                  "mixed-dtypes": "ZeroRedundancyOptimizer rejects parameters of several dtypes",
                  **_NO_PARAM_DTYPE},
              "checkpoints where numpy is missing (consolidate_state_dict decodes through it)"),
    ReadyMade("torch_zero_bucket_view", TORCH_ZERO_BUCKET_VIEW, "torch", "torch",
              "torch DDP + ZeroRedundancyOptimizer(parameters_as_bucket_view=True): fails on "
              "torch 2.13 (docs/stride-bug.md)", {
                  "rank-orders": _TORCH_DDP_ORDER,
                  "mixed-dtypes": "ZeroRedundancyOptimizer rejects parameters of several dtypes",
                  **_NO_PARAM_DTYPE}),
    ReadyMade("torch_fsdp", TORCH_FSDP, "torch", "torch",
              "torch FSDP2 (fully_shard per layer); TorchFSDPTarget(reshard_after_forward=int|"
              "False, cpu_offload=True) for its options (cpu_offload needs --device cuda), "
              "TorchFSDPTarget(config={fully_shard keyword arguments} or 'fsdp.json')", {
                  "non-contiguous": "fully_shard raises on non-contiguous parameters",
                  "unused-on-some-ranks": "FSDP2 all-gathers a layer in its forward: a layer "
                                          "some ranks skip leaves the collectives unpaired",
                  "checkpoint": "FSDP2's sharded state dicts resume through "
                                "torch.distributed.checkpoint",
                  "rank-orders": "fully_shard packs parameters in registration order, which "
                                 "must be the same on every rank"},
              "a layer skipped by some ranks' micro-batches, a weight used outside its layer, "
              "infinity-norm clipping with an empty shard, a layer called twice per forward "
              "with accumulation (reduce-scattered twice: bench/fsdp_reused_module.py)"),
    ReadyMade("local", LOCAL, "torch", "torch",
              "no synchronisation at all: must fail for W > 1", _NO_PARAM_DTYPE),
    ReadyMade("accelerate", ACCELERATE, "accelerate", "accelerate",
              "Accelerator: prepare, accumulate, backward, clip_grad_norm_, the prepared "
              "scheduler", {"rank-orders": _TORCH_DDP_ORDER,
                            "checkpoint": f"{_OWN_CHECKPOINTS} (save_state/load_state)",
                            **_NO_PARAM_DTYPE}),
    ReadyMade("fabric", FABRIC, "lightning", "lightning",
              "Lightning Fabric DDP: setup, no_backward_sync, backward, clip_gradients",
              {"rank-orders": _TORCH_DDP_ORDER,
               "checkpoint": f"{_OWN_CHECKPOINTS} (fabric.save/fabric.load)", **_NO_PARAM_DTYPE}),
    ReadyMade("lightning", LIGHTNING, "lightning", "lightning",
              "Lightning Trainer.fit with DDPStrategy, automatic optimization (its own loop; "
              "LightningTarget(manual=True), LightningTarget(static_graph=True))",
              {"rank-orders": _TORCH_DDP_ORDER,
               "checkpoint": f"{_OWN_CHECKPOINTS} (the Trainer's .ckpt files)", **_NO_PARAM_DTYPE},
              "infinity-norm clipping in automatic optimization (gradient_clip_val clips the "
              "2-norm)"),
    ReadyMade("hf_trainer", HF_TRAINER, "transformers", "transformers",
              "transformers' Trainer.train over DDP, its own loop: the scenario's model as a "
              "causal LM taking num_items_in_batch; HfTrainerTarget(training_args={...} or "
              "'args.json', loss_kwargs=False)",
              {"rank-orders": _TORCH_DDP_ORDER,
               "checkpoint": f"{_OWN_CHECKPOINTS} (the Trainer's checkpoint folders)",
               "grads-kept": "the Trainer clears gradients with model.zero_grad(), which sets "
                             "them to None, after every step",
               **_NO_PARAM_DTYPE},
              "reduction='sum' (the Trainer normalises to a mean), clipping a norm other than "
              "the 2-norm, float16 autocast"),
)

_DEEPSPEED = {
    "float64": "ZeRO steps float32 master copies of the parameters",
    "clipping": "gradient_clipping clips inside engine.step(), after gradients are recorded",
    "unused-everywhere": "ZeRO's flat partitions give an unused parameter a zero gradient and "
                         "step it (torch leaves it untouched)",
    "unused-on-some-ranks": "DeepSpeed's bug (bench/deepspeed_unused_parameter.py): each rank "
                            "all-reduces only the gradients it produced and gloo aborts, though "
                            "ignore_unused_parameters is documented to ignore them",
    "non-contiguous": "deepspeed.initialize raises broadcasting a non-contiguous parameter "
                      "('self.stride(-1) must be 1 to view Float as Byte')",
    "param-groups": "safe_get_full_optimizer_state raises 'exp_avg not found in optimizer "
                    "state fragment' for a second group's parameter: its state cannot be read",
    "buffers": "the engine broadcasts parameters only (_broadcast_model walks "
               "named_parameters()): buffers initialised differently per rank stay different",
    "mixed-dtypes": "ddpcheck's mixed dtypes are float32 layers in a float64 model, and float64 "
                    "is declined",
    "checkpoint": f"{_OWN_CHECKPOINTS} (engine.save_checkpoint)",
    "rank-orders": "ZeRO partitions parameters in registration order, which must be the same "
                   "on every rank",
    "param-dtype": "DeepSpeed's bf16 mode reduces and accumulates gradients in bfloat16 unless "
                   "the config sets communication_data_type and data_types.grad_accum_dtype to "
                   "'fp32' (DeepSpeedTarget(config=...)); with both, it applies the policy"}
READY_MADE += (
    ReadyMade("deepspeed", DEEPSPEED, "deepspeed", "deepspeed",
              "DeepSpeed's engine at the ZeRO stage of your config (default 2): "
              "DeepSpeedTarget(config={...} or 'ds_config.json')", _DEEPSPEED),
    ReadyMade("deepspeed_zero1", DEEPSPEED_ZERO1, "deepspeed", "deepspeed",
              "DeepSpeed's engine, ZeRO stage 1, CPU accelerator over gloo (float32: "
              "ddpcheck check deepspeed_zero1 --dtypes float32)", _DEEPSPEED),
    ReadyMade("deepspeed_zero2", DEEPSPEED_ZERO2, "deepspeed", "deepspeed",
              "DeepSpeed's engine, ZeRO stage 2: gradients partitioned, reduced every "
              "micro-batch (float32: --dtypes float32)", _DEEPSPEED),
)

#: Built-in targets by the short names the command line accepts: a framework's only where it is
#: installed.
BUILTIN = {entry.name: entry.target for entry in READY_MADE
           if entry.framework == "torch" or entry.version is not None}
