"""The ``deepspeed``, ``deepspeed_zero1`` and ``deepspeed_zero2`` targets: DeepSpeed's engine with
ZeRO stage 1 or 2 -- ``deepspeed`` at the stage of your config (2 where it names none), the others
at theirs -- and your own DeepSpeed config::

    from ddpcheck.targets import DeepSpeedTarget
    target = DeepSpeedTarget(config="ds_config.json")  # or the dict deepspeed.initialize takes
    # command line: ddpcheck check deepspeed --config ds_config.json --dtypes float32
    # or: ddpcheck check 'ddpcheck.targets.deepspeed:DeepSpeedTarget(config="ds_config.json")'

Runs on CPU worlds: DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``) falls back to gloo when
oneCCL's bindings are absent, and ``deepspeed.initialize(..., dist_init_required=False)`` finds the
group ddpcheck's world built (``environment``). Per example and rank: the scenario's optimizer
(DeepSpeed's "client optimizer", ``zero_allow_untested_optimizer``) and ``ExponentialLR`` go to
``deepspeed.initialize`` with ``gradient_accumulation_steps=A``; every micro-batch back-propagates
through ``engine.backward(loss, scale_wrt_gas=False)`` (ddpcheck's losses are already scaled to the
step) and is followed by ``engine.step()`` -- DeepSpeed's loop idiom, in which the engine steps
the optimizer and the schedule and zeroes the gradients only at the accumulation boundary;
ZeRO-2 reduces every micro-batch's gradients (it cannot accumulate locally; DeepSpeed refuses
``no_sync`` under it), declared as ``reduces_every_micro_batch``
(``Target.steps_every_micro_batch``; the loop's ``zero_grad`` is a no-op, as DeepSpeed's users
never call it). ZeRO keeps each gradient in its owner's flat partition: the harness reads them
whole with ``deepspeed.utils.safe_get_full_grad`` and the optimizer state with
``safe_get_full_optimizer_state`` (both collective, outside the recorded collectives). Under
``zero_optimization.round_robin_gradients`` those two and ``safe_get_full_fp32_param`` read the
wrong piece of the partitions -- DeepSpeed's bug, confirmed without ddpcheck by
``bench/deepspeed_round_robin_gradients.py``; training itself is right, bitwise the weights of
the same run without the option -- so there the hooks read the flat partitions by the layout
DeepSpeed really flattened them in (:class:`_Layout`): each rank its own pieces of the gradients,
the masters and optimizer state assembled as DeepSpeed's own reads do. ``teardown``
drops DeepSpeed's cached process groups (ddpcheck destroys the groups an example created, and the
next example's engine must build its own). ``warm_up`` imports DeepSpeed and builds the C++ op its
CPU comm backend loads (minutes the first time), once per rank process, outside any example's
deadline, after removing a lock a killed build left (``extensions``). Supports DeepSpeed 0.19.0
and later (``requires``; 0.19.0 and 0.19.8 tried); the glue adapts to what 0.19.0 lacks.

**Who sets what** (:data:`SCENARIO_KEYS`, :data:`HARNESS_KEYS`; docs/frameworks.md, "Your own
configuration"): the scenario owns the batch (``train_batch_size``,
``train_micro_batch_size_per_gpu``), ``gradient_accumulation_steps``, ``gradient_clipping``,
``optimizer``, ``scheduler`` and the precision (``bf16.enabled``, ``fp16``, ``torch_autocast``,
``data_types.param_dtype``): refused whatever their value. The harness fixes
``zero_allow_untested_optimizer`` (true: the scenario's optimizer is the client optimizer),
``communication_data_type`` and ``data_types.grad_accum_dtype`` ("fp32" or absent: ddpcheck promises
float32 reductions), ``bf16.bf16_master_weights_and_grads`` and ``bf16_optimizer_states`` (false),
no ZeRO-Offload, and ``zero_optimization.stage`` (1 or 2, the target's). Every other key reaches
the engine as given (``contiguous_gradients``, ``overlap_comm``, ``reduce_bucket_size``,
``allgather_bucket_size``, ``reduce_scatter``, ``round_robin_gradients``, ``prescale_gradients``,
...); a config DeepSpeed's own parser rejects is exit 2 as well, from the ranks.

**bf16** is the scenario's ``param_dtype=torch.bfloat16`` policy: float32 master weights, forward
and backward on bfloat16 copies. ``configure`` enables ``bf16`` for such a scenario, casting the
inputs of every module holding parameters (bf16 mode casts none), and the harness reads the float32
masters (``safe_get_full_fp32_param``) as the parameters. DeepSpeed's own default under bf16 is to
reduce (``DeepSpeedEngine.communication_data_type``) and accumulate (``get_data_types``) gradients
in bfloat16, which the policy does not promise: the target applies the policy
(``applies_param_dtype``) only where the config sets ``communication_data_type`` and
``data_types.grad_accum_dtype`` to "fp32", and declines it otherwise, naming both keys
(:func:`precision_decline`). float16 is declined (fp16 mode's loss scaler skips steps). Its
masters start from the bfloat16 cast of the weights, not from the weights
(bench/deepspeed_bf16_masters.py): the reference's noise includes that start
(``PARAM_DTYPE_VARIANTS``), which an ill-conditioned scenario turns into more than rounding.

**Epochs** (``fit_epochs``: a scenario with a dataset, docs/scenarios.md): DeepSpeed's own data
path -- the engine's loader (``engine.deepspeed_io``, what ``initialize(training_data=...)``
builds, with its sampler in index order) and the loop of DeepSpeed's tutorials, the engine
deciding where its windows end; what it weighs otherwise than the reference by its design is
declined, quoting it (``ddpcheck.targets.deepspeed_data_path``).

Declined, with DeepSpeed's documented behaviour where it applies (:attr:`declined_features`, each
with its reason; docs/frameworks.md): float64, clipping, parameters no rank or some ranks use (the
latter DeepSpeed's bug, ``bench/deepspeed_unused_parameter.py``), non-contiguous parameters,
several param groups, buffers, mixed dtypes, checkpoints, per-rank registration orders.

Imports DeepSpeed only inside the hooks. Unverified on GPUs (none here): the accelerator is chosen
from the parameters' device, so it should run unchanged under ``--device cuda``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Sampler

from ddpcheck._base.devices import this_rank
from ddpcheck._base.errors import InvalidArgument, NothingChecked
from ddpcheck._language.scenario import Scenario
from ddpcheck._language.training import EpochRun, OptimizerLike, Params, SchedulerLike
from ddpcheck.targets.configuration import Config, load_config, reconcile
from ddpcheck.targets.deepspeed_data_path import (
    epochs_cannot_run,
    index_order,
    loader_cannot_run,
    train_epochs,
)
from ddpcheck.targets.environment import join_existing_group
from ddpcheck.targets.extensions import build_directory, remove_stale_lock
from ddpcheck.targets.framework import FrameworkTarget
from ddpcheck.targets.option_space import nested, options
from ddpcheck.targets.protocol import Target
from ddpcheck.targets.reasons import OWN_CHECKPOINTS

if TYPE_CHECKING:  # DeepSpeed ships no type information: mypy reads these names untyped
    from deepspeed import DeepSpeedEngine
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from ddpcheck.targets.option_space import Values
    from ddpcheck.targets.protocol import ConfigSpace

__all__ = ["HARNESS_KEYS", "SCENARIO_KEYS", "DeepSpeedTarget", "engine_config", "precision_decline"]

_BATCH = "global_batch: each rank trains its own micro-batches of it, as ddpcheck cuts them"
_PARAM_DTYPE = "param_dtype: bf16 is enabled where it is torch.bfloat16"

#: ds_config keys the scenario sets, example by example: key (dotted: nested) -> the scenario
#: field that sets it. Given in the config, any value is refused (docs/frameworks.md, "Your own
#: configuration").
SCENARIO_KEYS: dict[str, str] = {
    "train_batch_size": _BATCH,
    "train_micro_batch_size_per_gpu": _BATCH,
    "gradient_accumulation_steps": "accumulation",
    "gradient_clipping": "max_grad_norm: clipping is declined, and the target sets 0.0",
    "optimizer": "optimizer and optimizer_kwargs: the engine's client optimizer",
    "scheduler": "lr_decay: the engine gets an ExponentialLR",
    "bf16.enabled": _PARAM_DTYPE,
    "bfloat16": _PARAM_DTYPE + " (bfloat16 is bf16's older name)",
    "fp16": "param_dtype: float16 is declined, DeepSpeed's fp16 mode skips steps that overflow",
    "data_types.param_dtype": _PARAM_DTYPE,
    "torch_autocast": "autocast: the loop runs every forward under torch.autocast",
    "amp": "autocast",
}

_FLOAT32 = (
    "ddpcheck promises gradients reduced and accumulated in float32 (the param_dtype "
    "policy's promise, and float32's)"
)
_MASTER = "the param_dtype policy keeps float32 master weights and gradients"

#: ds_config keys ddpcheck's harness fixes: key -> (the values accepted, why); ``()``: none.
HARNESS_KEYS: dict[str, tuple[tuple[object, ...], str]] = {
    "zero_allow_untested_optimizer": (
        (True,),
        "the scenario's optimizer is the engine's client optimizer",
    ),
    "communication_data_type": ((None, "fp32"), _FLOAT32),
    "data_types.grad_accum_dtype": ((None, "fp32"), _FLOAT32),
    "bf16.bf16_master_weights_and_grads": ((False,), _MASTER),
    "bf16.bf16_optimizer_states": ((False,), _MASTER),
    "zero_optimization.offload_optimizer": (
        (None,),
        "ZeRO-Offload steps DeepSpeed's CPU optimizer, not the scenario's",
    ),
    "zero_optimization.cpu_offload": (
        (None, False),
        "ZeRO-Offload steps DeepSpeed's CPU optimizer, not the scenario's",
    ),
}

#: The float32 keys DeepSpeed's bf16 mode needs to honour the param_dtype policy: key -> what
#: DeepSpeed does without it (0.19.8: ``DeepSpeedEngine.communication_data_type`` falls back to
#: bfloat16 under bf16, ``get_data_types`` accumulates in the model's dtype).
_BF16_NEEDS = {
    "communication_data_type": "reduces gradients in bfloat16",
    "data_types.grad_accum_dtype": "accumulates gradients in bfloat16",
}


class _Engine:
    """What the loop steps: ``step()`` is ``engine.step()`` (gated at DeepSpeed's boundary),
    ``zero_grad()`` nothing (the engine zeroes at the boundary). Holds the unwrapped ``module``
    for the hooks: nothing is set on the engine, whose ``__getattr__`` recursed without end on
    an attribute set there (0.19.0: it re-enters ``getattr`` for any name ``dir()`` lists)."""

    def __init__(self, engine: DeepSpeedEngine, module: nn.Module):
        self.engine = engine
        self.module = module

    @property
    def param_groups(self) -> Sequence[Mapping[str, object]]:
        groups: Sequence[Mapping[str, object]] = self.engine.optimizer.param_groups
        return groups

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> Mapping[str, object]:
        raise NotImplementedError(f"DeepSpeedTarget: {OWN_CHECKPOINTS} (engine.save_checkpoint)")

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        raise NotImplementedError(f"DeepSpeedTarget: {OWN_CHECKPOINTS} (engine.load_checkpoint)")


class _Schedule:
    """The engine's LR scheduler: DeepSpeed steps it at the boundary, inside ``engine.step()``."""

    def __init__(self, engine: DeepSpeedEngine):
        self.engine = engine

    def step(self) -> None:
        pass

    def state_dict(self) -> Mapping[str, object]:
        state: Mapping[str, object] = self.engine.lr_scheduler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        raise NotImplementedError(f"DeepSpeedTarget: {OWN_CHECKPOINTS} (engine.load_checkpoint)")


@dataclasses.dataclass(frozen=True)
class DeepSpeedTarget(FrameworkTarget):
    """DeepSpeed's engine with ZeRO ``stage`` 1 or 2 (see the module docstring).

    ``stage``: 1 or 2 (``deepspeed_zero1``, ``deepspeed_zero2``); None (``deepspeed``): the
    config's ``zero_optimization.stage``, 2 where it names none. ``config``: your DeepSpeed
    configuration -- the dict ``deepspeed.initialize(config=...)`` takes, or the path of your
    ds_config.json -- with the keys the scenario or ddpcheck sets refused (:data:`SCENARIO_KEYS`,
    :data:`HARNESS_KEYS`) and every other reaching the engine as given.
    """

    stage: int | None = None
    accumulation: int = 1  # set by configure()
    gamma: float | None = None  # the scenario's lr_decay, set by configure()
    config: Config = None
    bf16: bool = False  # the scenario's param_dtype is bfloat16: set by configure()

    # 0.18.9 raises in engine.step() under torch 2.13, with or without ddpcheck
    # (bench/deepspeed_step_018.py); 0.19.0 and 0.19.8 were tried and pass
    requires = (("deepspeed", "0.19.0"),)
    steps_every_micro_batch = True
    sharded_gradients = True
    declined_features: ClassVar[Mapping[str, str]] = {
        "float64": "ZeRO steps float32 master copies of the parameters",
        "clipping": "gradient_clipping clips inside engine.step(), after gradients are recorded",
        "unused-everywhere": "ZeRO's flat partitions give an unused parameter a zero gradient "
        "and step it (torch leaves it untouched)",
        "unused-on-some-ranks": "DeepSpeed's bug (bench/deepspeed_unused_parameter.py): each "
        "rank all-reduces only the gradients it produced and gloo "
        "aborts, though ignore_unused_parameters is documented to "
        "ignore them",
        "non-contiguous": "deepspeed.initialize raises broadcasting a non-contiguous parameter "
        "('self.stride(-1) must be 1 to view Float as Byte')",
        "param-groups": "safe_get_full_optimizer_state raises 'exp_avg not found in optimizer "
        "state fragment' for a second group's parameter: its state cannot be "
        "read",
        "buffers": "the engine broadcasts parameters only (_broadcast_model walks "
        "named_parameters()): buffers initialised differently per rank stay "
        "different",
        "mixed-dtypes": "ddpcheck's mixed dtypes are float32 layers in a float64 model, and "
        "float64 is declined",
        "checkpoint": f"{OWN_CHECKPOINTS} (engine.save_checkpoint)",
        "rank-orders": "ZeRO partitions parameters in registration order, which must be the "
        "same on every rank",
        "param-dtype": "DeepSpeed's bf16 mode reduces and accumulates gradients in bfloat16 "
        "unless the config sets communication_data_type and "
        "data_types.grad_accum_dtype to 'fp32' (DeepSpeedTarget(config=...)); "
        "with both, it applies the policy",
    }

    def __post_init__(self) -> None:
        given = load_config(self.config, target="DeepSpeedTarget")
        zero = given.get("zero_optimization", {})
        if not isinstance(zero, Mapping):
            raise InvalidArgument(
                f"DeepSpeedTarget: the config's 'zero_optimization'={zero!r} "
                'must be an object ({"stage": 1 or 2, ...})'
            )
        reconcile(
            given, target="DeepSpeedTarget", scenario_keys=SCENARIO_KEYS, harness_keys=HARNESS_KEYS
        )
        stage = zero.get("stage", 2 if self.stage is None else self.stage)
        if self.stage is not None and stage != self.stage:
            raise InvalidArgument(
                f"DeepSpeedTarget(stage={self.stage}): the config's "
                f"'zero_optimization.stage'={stage!r} contradicts it; leave "
                "the key out, or use the 'deepspeed' target, whose stage is "
                "the config's"
            )
        if isinstance(stage, bool) or stage not in (1, 2):
            raise InvalidArgument(
                f"DeepSpeedTarget: 'zero_optimization.stage'={stage!r}: this "
                "target checks ZeRO stages 1 and 2 (stage 0 and ZeRO-3 are "
                "not tried)"
            )
        # derived, not fields: not in the replay line, which rebuilds them from config
        object.__setattr__(self, "_given", given)
        object.__setattr__(self, "_stage", stage)

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage the engine runs: ``stage``, else the config's, else 2."""
        return int(vars(self)["_stage"])

    @property
    def reduces_every_micro_batch(self) -> bool:  # type: ignore[override]
        # ZeRO-2 reduces each micro-batch's gradients into the partitions (it has no no_sync)
        return self.zero_stage == 2

    @property
    def applies_param_dtype(self) -> bool:  # type: ignore[override]
        # bf16 mode with float32 reductions and accumulation is the param_dtype policy
        return not _float32_gaps(vars(self)["_given"])

    def config_space(self) -> ConfigSpace:
        """``zero_optimization`` keys as one ``config=`` key (``ddpcheck.targets.option_space``):
        communication overlapped with backward, gradients not copied into a contiguous buffer,
        an all-reduce instead of the reduce-scatter, and reduce and all-gather buckets of 64 or
        4096 elements -- several buckets, where the default 5e8 holds every parameter of
        ddpcheck's models in one -- and ``round_robin_gradients`` (meant for CPU offload), under
        which the target reads the partitions itself (see the module docstring); and
        ``dataloader_drop_last``, which the engine's own loader honours over a scenario's epochs.
        Not the stage: the target's (``deepspeed_zero1``, ``deepspeed_zero2``); not offload:
        declined (the harness's). A key of the user's config is kept as given, not drawn."""
        given = vars(self)["_given"]
        buckets = (64, 4096)
        space: dict[str, Values] = {
            "zero_optimization": nested(
                {
                    "overlap_comm": (True,),
                    "contiguous_gradients": (False,),
                    "round_robin_gradients": (True,),
                    "reduce_scatter": (False,),
                    "reduce_bucket_size": buckets,
                    "allgather_bucket_size": buckets,
                }
            ),
            "dataloader_drop_last": (True,),
        }
        drawn = {key: values for key, values in space.items() if key not in given}
        return options(config=drawn) if drawn else None

    def supports(self, scenario: Scenario) -> str | None:
        return precision_decline(vars(self)["_given"], scenario) or epochs_cannot_run(scenario)

    def supports_at(self, scenario: Scenario, world_size: int) -> str | None:
        """Epochs DeepSpeed's loader cannot load at ``world_size`` as the reference weighs
        them (``deepspeed_data_path.loader_cannot_run``)."""
        drop_last = bool(vars(self)["_given"].get("dataloader_drop_last", False))
        return loader_cannot_run(scenario, world_size, drop_last)

    def fit_epochs(self, module: nn.Module, run: EpochRun) -> None:
        """DeepSpeed's own data path over the scenario's epochs
        (``ddpcheck.targets.deepspeed_data_path``): the engine's loader
        (``engine.deepspeed_io``) with a sampler in index order, every batch through
        ``engine.backward`` and ``engine.step``, the engine deciding where its windows end."""
        why = self.supports(run.scenario) or self.supports_at(run.scenario, run.world_size)
        if why is not None:  # asked to run what supports and supports_at decline
            raise NothingChecked(f"DeepSpeedTarget declines this example: {why}")
        micro = run.global_batch // run.accumulation // run.world_size
        optimizer = run.optimizer(run.params, **run.optimizer_kwargs)
        engine, wrapped = self._initialize(module, optimizer, micro)
        scheduler = None if run.gamma is None else self.make_scheduler(wrapped, run.gamma)
        train_epochs(engine, wrapped, scheduler, run, self.data_sampler(run))

    def data_sampler(self, run: EpochRun) -> Sampler[int]:
        """The sampler of the engine's loader (``engine.deepspeed_io(data_sampler=...)``) over
        ``run.dataset``: DeepSpeed's own, in index order."""
        return index_order(run)

    def configure(self, scenario: Scenario) -> Target:
        return dataclasses.replace(
            self,
            accumulation=scenario.accumulation,
            gamma=scenario.lr_decay,
            bf16=getattr(scenario, "param_dtype", None) is torch.bfloat16,
        )

    def warm_up(self) -> None:
        warm_up_deepspeed()

    def setup(
        self,
        module: nn.Module,
        params: Params,
        optimizer_cls: type[torch.optim.Optimizer],
        **kwargs: Any,  # the scenario's options, for its optimizer class
    ) -> tuple[nn.Module, OptimizerLike]:
        return self._initialize(module, optimizer_cls(params, **kwargs), 1)

    def _initialize(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, micro: int
    ) -> tuple[DeepSpeedEngine, _Engine]:
        """``deepspeed.initialize`` with the scenario's optimizer and schedule: ``micro`` is
        ``train_micro_batch_size_per_gpu``, the batch of the engine's loader (1, a placeholder,
        where the harness feeds the ranks)."""
        join_existing_group()
        _choose_accelerator(next(module.parameters()).device.type)
        import deepspeed

        schedule = (
            None
            if self.gamma is None
            else torch.optim.lr_scheduler.ExponentialLR(optimizer, self.gamma)
        )
        given = vars(self)["_given"]
        config = engine_config(given, self.zero_stage, self.accumulation, self.bf16, micro)
        if given:  # the user's keys: ddpcheck's own config needs no parsing first
            _check_parses(config)
        if self.bf16:
            cast_inputs(module, torch.bfloat16)
        engine, _, _, _ = deepspeed.initialize(
            model=module,
            optimizer=optimizer,
            lr_scheduler=schedule,
            config=config,
            dist_init_required=False,
        )
        if self.bf16:
            _MASTERS.update({_address(p): p for p in module.parameters()})
        _LAYOUT.clear()  # this example's engine only
        if getattr(engine.optimizer, "round_robin_gradients", False):  # ZeRO's, not BF16_Optimizer
            _LAYOUT.append(_Layout(engine.optimizer))
        return engine, _Engine(engine, module)

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        # bf16 mode: the module holds bfloat16 copies; the float32 master weights are the
        # parameters the param_dtype policy trains (collective, as the harness calls it)
        param = _MASTERS.get(_address(tensor)) if _MASTERS else None
        if param is None:
            return super().full_tensor(tensor)
        from deepspeed.utils import safe_get_full_fp32_param

        if _LAYOUT and _LAYOUT[0].holds(param):
            layout = _LAYOUT[0]
            master = layout.whole(param, lambda i: layout.zero.single_partition_of_fp32_groups[i])
        else:
            master = safe_get_full_fp32_param(param)
        # a frozen parameter has no master (no optimizer holds it): its bfloat16 copy, widened
        return tensor.float() if master is None else master

    def make_scheduler(self, optimizer: OptimizerLike, gamma: float) -> SchedulerLike:
        return _Schedule(cast(_Engine, optimizer).engine)  # the optimizer setup returned

    def micro_batch(
        self, model: nn.Module, optimizer: OptimizerLike, index: int, count: int
    ) -> AbstractContextManager[object]:
        return contextlib.nullcontext()

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        engine: DeepSpeedEngine = model  # the model setup returned
        engine.backward(loss, scale_wrt_gas=False)

    def gradient_shards(
        self, model: nn.Module, optimizer: OptimizerLike, params: list[torch.Tensor]
    ) -> list[tuple[torch.Tensor, int, torch.Tensor | None]]:
        from deepspeed.utils import safe_get_full_grad

        layout = _LAYOUT[0] if _LAYOUT else None
        if layout is not None:  # round_robin_gradients: this rank's pieces, by the real layout
            trained = [p for p in params if p.requires_grad]
            pieces: list[tuple[torch.Tensor, int, torch.Tensor | None]] = [
                *layout.gradient_pieces([p for p in trained if layout.holds(p)])
            ]
            return pieces + [
                (p, 0, None if (g := safe_get_full_grad(p)) is None else g.reshape(-1))
                for p in trained
                if not layout.holds(p)  # no optimizer holds it: its .grad, or None
            ]
        return [
            (p, 0, None if (g := safe_get_full_grad(p)) is None else g.reshape(-1))
            for p in params
            if p.requires_grad
        ]

    def optimizer_state(
        self, optimizer: OptimizerLike
    ) -> Mapping[torch.Tensor, Mapping[str, object]]:
        from deepspeed.utils import safe_get_full_optimizer_state

        engine = cast(_Engine, optimizer)  # the optimizer setup returned
        inner = engine.engine.optimizer.optimizer  # the client optimizer, on flat partitions
        keys = sorted(
            {
                k
                for state in inner.state.values()
                for k, v in state.items()
                if torch.is_tensor(v) and v.dim() > 0
            }
        )
        steps = {
            k: v
            for state in inner.state.values()
            for k, v in state.items()
            if not (torch.is_tensor(v) and v.dim() > 0)
        }
        module = engine.module
        held: dict[torch.Tensor, dict[str, object]] = {}
        for _, p in module.named_parameters():  # one order on every rank: these are collective
            if not p.requires_grad:
                continue
            if _LAYOUT and _LAYOUT[0].holds(p):  # round_robin_gradients: by the real layout
                state = {k: _LAYOUT[0].whole(p, _flat_state(inner, _LAYOUT[0], k)) for k in keys}
            else:
                state = {k: safe_get_full_optimizer_state(p, k) for k in keys}
            state = {k: v for k, v in state.items() if v is not None}
            if state:
                held[p] = {
                    **{k: v.clone() if torch.is_tensor(v) else v for k, v in steps.items()},
                    **state,
                }
        return held

    def teardown(self, model: nn.Module, optimizer: OptimizerLike) -> None:
        _MASTERS.clear()
        _LAYOUT.clear()
        release_groups()


def warm_up_deepspeed() -> None:
    """Import DeepSpeed (3-13 s here) and build the C++ op its comm backend loads on CPU
    (``build_shm_op``: 100-285 s the first time after an install on 2 loaded cores, under a
    second once built; bench/deepspeed_op_build.py): once per rank process, outside any
    example's deadline (``Target.warm_up``)."""
    _choose_accelerator(this_rank().type)
    from deepspeed.accelerator import get_accelerator

    # by its full name: ``deepspeed.comm`` has an attribute ``torch``, the torch module
    comm = importlib.import_module("deepspeed.comm.torch")
    build = getattr(comm, "build_shm_op", None)  # what TorchBackend() calls (0.19.0-0.19.8)
    if build is None:
        return
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    folder = None if builder is None else build_directory(builder.NAME)
    if folder is not None:
        remove_stale_lock(folder)  # a killed build's: the build would wait for it forever
    build()


def release_groups() -> None:
    """Drop the process groups DeepSpeed caches at module level (ddpcheck destroys the groups
    an example created, and the next example's engine must build its own)."""
    from deepspeed.utils import groups

    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:  # 0.19.8
        release(None)
        return
    # 0.19.0 has no such function: the caches it resets, those this release has
    for name in _CACHED_GROUPS:
        if isinstance(getattr(groups, name, None), dict):
            getattr(groups, name).clear()
        elif hasattr(groups, name):
            setattr(groups, name, None)


#: What ``deepspeed.utils.groups._release_process_group_references(None)`` resets (0.19.8): the
#: groups ZeRO caches at module level, every one of which ddpcheck destroys after an example.
_CACHED_GROUPS = (
    "_EXPERT_PARALLEL_GROUP",
    "_EXPERT_PARALLEL_GROUP_RANKS",
    "_EXPERT_DATA_PARALLEL_GROUP",
    "_EXPERT_DATA_PARALLEL_GROUP_RANKS",
    "_ALL_TO_ALL_GROUP",
    "_WORLD_GROUP",
    "_ZERO_PARAM_INTRA_PARALLEL_GROUP",
    "_TENSOR_MODEL_PARALLEL_GROUP",
    "_MODEL_PARALLEL_GROUP",
    "_DATA_PARALLEL_GROUP",
    "mesh_device",
    "mpu",
)


def _float32_gaps(given: Mapping[str, object]) -> list[str]:
    """The keys of :data:`_BF16_NEEDS` the config does not set to "fp32"."""
    missing = []
    for key in _BF16_NEEDS:
        node: object = given
        for part in key.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if node != "fp32":
            missing.append(key)
    return missing


def precision_decline(given: Mapping[str, object], scenario: Scenario) -> str | None:
    """Why the engine cannot run the scenario's precision policy with this config (None: it
    can). A ``param_dtype`` policy is DeepSpeed's bf16 mode: float32 master weights, forward and
    backward on bfloat16 copies -- and gradients reduced and accumulated in float32 only where
    the config says so; DeepSpeed's own default is bfloat16 for both. float16 is declined."""
    policy = getattr(scenario, "param_dtype", None)
    if policy is None:
        return None
    if policy is not torch.bfloat16:
        return (
            f"param_dtype={policy}: DeepSpeed's fp16 mode scales the loss and skips steps "
            "that overflow (its loss scaler), which the reference does not"
        )
    gaps = _float32_gaps(given)
    if not gaps:
        return None
    return (
        "param_dtype=torch.bfloat16 is DeepSpeed's bf16 mode, which "
        + " and ".join(f'{_BF16_NEEDS[k]} unless the config sets {k!r} to "fp32"' for k in gaps)
        + "; ddpcheck's param_dtype policy promises float32 for both: add "
        + ", ".join(repr(k) for k in gaps)
        + ' = "fp32" to the config to check it'
    )


def engine_config(
    given: Mapping[str, object], stage: int, accumulation: int, bf16: bool, micro: int = 1
) -> dict[str, object]:
    """The config ``deepspeed.initialize`` gets: the user's ``given`` keys, and what the scenario
    and ddpcheck's harness set (see :data:`SCENARIO_KEYS`, :data:`HARNESS_KEYS`). ``micro``: the
    per-device batch of the engine's own loader (1, a placeholder, where it loads no data)."""
    config: dict[str, object] = {
        "steps_per_print": 2**31,
        **given,
        # the scenario's
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0
        # the harness's
        "zero_optimization": {**_section(given, "zero_optimization"), "stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    if bf16:
        config["bf16"] = {**_section(given, "bf16"), "enabled": True}
    return config


def _section(given: Mapping[str, object], key: str) -> Mapping[str, object]:
    """The config's object ``key`` (``{}`` where it has none)."""
    value = given.get(key, {})
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"DeepSpeedTarget: the config's {key!r}={value!r} must be an object")
    return value


def _check_parses(config: dict[str, object]) -> None:
    """Refuse a config DeepSpeed's own parser rejects (a mistyped ``zero_optimization`` key, a
    value of the wrong type) as the user's error, exit 2 -- before ``initialize``, whose
    failures stay DeepSpeed's."""
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        DeepSpeedConfig(dict(config))
    except (ValueError, TypeError, KeyError, AssertionError) as exc:
        lines = [
            line.strip()
            for line in str(exc).splitlines()
            if line.strip() and not line.strip().startswith("For further information")
        ]
        raise InvalidArgument(
            f"DeepSpeed rejects the config as ddpcheck completed it: "
            f"{type(exc).__name__}: {'; '.join(lines)}"
        ) from None


def cast_inputs(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating-point inputs of ``module`` and of every module holding parameters of
    its own to ``dtype``: bf16 mode holds the parameters in bfloat16 and casts no input
    (``fp16.auto_cast`` is fp16's), so a real model takes bfloat16 activations; the reference's
    ``param_dtype`` policy casts the same inputs (``ddpcheck._language.objective``)."""

    def cast(_: nn.Module, args: tuple) -> tuple:
        return tuple(
            a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args
        )

    for m in module.modules():
        if m is module or any(True for _ in m.parameters(recurse=False)):
            m.register_forward_pre_hook(cast)


#: This rank's bfloat16 parameters by address, in bf16 mode: their float32 masters are read
#: through ``safe_get_full_fp32_param`` (``DeepSpeedTarget.full_tensor``); cleared by teardown.
_MASTERS: dict[tuple, torch.Tensor] = {}


#: The ZeRO optimizer's layout, where ``round_robin_gradients`` is on (set by ``setup``, cleared
#: by teardown): DeepSpeed's ``safe_get_full_*`` read the wrong pieces there (see
#: :class:`_Layout`), so the hooks read the flat partitions themselves.
_LAYOUT: list[_Layout] = []


class _Layout:
    """Where ZeRO-1/2 keeps each parameter in its group's flat buffer, as the buffer really holds
    them: ``round_robin_gradients`` flattens each group reordered (``round_robin_bit16_groups``,
    with ``round_robin_bit16_offsets`` where alignment pads it), while the ``_hp_mapping`` behind
    ``safe_get_full_grad``, ``safe_get_full_fp32_param`` and ``safe_get_full_optimizer_state``
    places parameters in their original order when nothing is padded (0.19.8:
    ``_link_all_hp_params`` passes no offsets then): those raise a size mismatch or return
    another parameter's values (bench/deepspeed_round_robin_gradients.py). Rank ``r`` owns
    elements ``[r * partition_size, (r + 1) * partition_size)`` of each flat group: its
    gradients (``averaged_gradients``), fp32 masters (``single_partition_of_fp32_groups``) and
    the optimizer's state on them."""

    def __init__(self, zero: DeepSpeedZeroOptimizer):
        self.zero = zero
        self.places: dict[int, tuple[int, int]] = {}  # id(param) -> (group, offset in its flat)
        offsets = getattr(zero, "round_robin_bit16_offsets", None)
        for i, group in enumerate(zero.round_robin_bit16_groups):
            place = 0
            for index, param in enumerate(group):
                place = place if offsets is None else int(offsets[i][index])
                self.places[id(param)] = (i, place)
                place += param.numel()

    def holds(self, param: torch.Tensor) -> bool:
        return id(param) in self.places

    def _owned(self, param: torch.Tensor) -> tuple[int, int, int] | None:
        """This rank's piece of ``param``: (offset in the parameter, offset in this rank's
        partition, length), or None."""
        i, place = self.places[id(param)]
        size = int(self.zero.partition_size[i])
        start = dist.get_rank(group=self.zero.real_dp_process_group[i]) * size
        low, high = max(place, start), min(place + param.numel(), start + size)
        return None if low >= high else (low - place, low - start, high - low)

    def _partition(self, i: int, flat: torch.Tensor | None) -> torch.Tensor:
        if flat is None or flat.numel() != int(self.zero.partition_size[i]):
            raise RuntimeError(
                f"DeepSpeed's ZeRO partition of param group {i} holds "
                f"{None if flat is None else flat.numel()} elements, not the "
                f"{int(self.zero.partition_size[i])} of its partition_size"
            )
        return flat

    def gradient_pieces(
        self, params: list[torch.Tensor]
    ) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
        """This rank's ``(parameter, offset, flat piece)`` of each gradient (no collective)."""
        flats: dict[int, torch.Tensor] = {}
        pieces = []
        for param in params:
            owned = self._owned(param)
            if owned is None:
                continue
            i = self.places[id(param)][0]
            if i not in flats:
                grads = self.zero.averaged_gradients.get(i)
                if grads is None:  # DeepSpeed's own message, as safe_get_full_grad raises it
                    raise ValueError(
                        "Gradients are only available immediately after backward and before "
                        "engine step"
                    )
                flats[i] = self._partition(i, torch.cat([g.reshape(-1) for g in grads]))
            offset, start, length = owned
            pieces.append((param, offset, flats[i][start : start + length]))
        return pieces

    def whole(
        self, param: torch.Tensor, flat_of: Callable[[int], torch.Tensor | None]
    ) -> torch.Tensor | None:
        """``param``'s float32 values in the flat partitions ``flat_of(group)`` (None: nothing
        held there) on every rank, as DeepSpeed's ``get_full_hp_param`` assembles them: each
        rank puts its piece into zeros and the group all-reduces (collective)."""
        i = self.places[id(param)][0]
        flat = flat_of(i)
        if flat is None:
            return None
        buffer = torch.zeros(param.numel(), dtype=torch.float32, device=flat.device)
        owned = self._owned(param)
        if owned is not None:
            offset, start, length = owned
            buffer[offset : offset + length] = self._partition(i, flat)[start : start + length]
        dist.all_reduce(buffer, group=self.zero.real_dp_process_group[i])
        return buffer.reshape(param.shape)


def _flat_state(
    inner: torch.optim.Optimizer, layout: _Layout, key: str
) -> Callable[[int], torch.Tensor | None]:
    """Group -> the optimizer's ``key`` state on this rank's flat fp32 partition, or None."""

    def flat_of(i: int) -> torch.Tensor | None:
        state = inner.state.get(layout.zero.single_partition_of_fp32_groups[i], {})
        value = state.get(key)
        return value if torch.is_tensor(value) and value.dim() > 0 else None

    return flat_of


def _address(tensor: torch.Tensor) -> tuple:
    # a parameter and its .detach() share storage, offset, shape and strides
    return (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))


def _choose_accelerator(device_type: str) -> None:
    """DeepSpeed's CPU accelerator for a CPU world (before DeepSpeed is imported: it chooses
    once)."""
    if device_type == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
