"""The ``deepspeed_zero1`` / ``deepspeed_zero2`` targets: DeepSpeed's engine with ZeRO stage 1 or 2.

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
``safe_get_full_optimizer_state`` (both collective, outside the recorded collectives). ``teardown``
drops DeepSpeed's cached process groups (ddpcheck destroys the groups an example created, and the
next example's engine must build its own). ``warm_up`` imports DeepSpeed and builds the C++ op its
CPU comm backend loads (minutes the first time), once per rank process, outside any example's
deadline, after removing a lock a killed build left (``extensions``). Supports DeepSpeed 0.19.0
and later (``requires``; 0.19.0 and 0.19.8 tried); the glue adapts to what 0.19.0 lacks.

Declined, with DeepSpeed's documented behaviour where it applies: float64 (ZeRO steps float32
master copies of the parameters), clipping (``gradient_clipping`` clips inside ``engine.step()``,
after the point where gradients are recorded -- and its default is 1.0, so the target sets 0.0),
parameters no rank uses (ZeRO's flat partitions give them a zero gradient and step them),
parameters some ranks do not use (the ranks' gradient all-reduces stop pairing: ranks issue
buckets of different sizes, though ``ignore_unused_parameters`` is documented as "unused
parameters are ignored and training continues"), non-contiguous parameters (``initialize``
raises broadcasting them: "self.stride(-1) must be 1 to view Float as Byte"), several param
groups (``safe_get_full_optimizer_state`` raises "exp_avg not found in optimizer state
fragment" for a parameter of the second group, ZeRO-1 at W=2: its state cannot be read per
parameter), buffers (the engine broadcasts parameters only: ``_broadcast_model`` walks
``module.named_parameters()``, so buffers initialised differently per rank stay different, where
torch DDP broadcasts them), mixed dtypes, checkpoints (``engine.save_checkpoint`` is DeepSpeed's own
format), per-rank registration orders.

Imports DeepSpeed only inside the hooks. Unverified on GPUs (none here): the accelerator is chosen
from the parameters' device, so it should run unchanged under ``--device cuda``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
from contextlib import AbstractContextManager
from typing import Any

import torch

from ddpcheck._base.devices import this_rank
from ddpcheck._language.features import FEATURES
from ddpcheck.targets.environment import join_existing_group
from ddpcheck.targets.extensions import build_directory, remove_stale_lock
from ddpcheck.targets.framework import FrameworkTarget
from ddpcheck.targets.protocol import Target

__all__ = ["DeepSpeedTarget"]


class _Engine:
    """What the loop steps: ``step()`` is ``engine.step()`` (gated at DeepSpeed's boundary),
    ``zero_grad()`` nothing (the engine zeroes at the boundary). Holds the unwrapped ``module``
    for the hooks: nothing is set on the engine, whose ``__getattr__`` recursed without end on
    an attribute set there (0.19.0: it re-enters ``getattr`` for any name ``dir()`` lists)."""

    def __init__(self, engine: Any, module: Any):
        self.engine = engine
        self.module = module

    @property
    def param_groups(self) -> Any:
        return self.engine.optimizer.param_groups

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


class _Schedule:
    """The engine's LR scheduler: DeepSpeed steps it at the boundary, inside ``engine.step()``."""

    def __init__(self, engine: Any):
        self.engine = engine

    def step(self) -> None:
        pass

    def state_dict(self) -> Any:
        return self.engine.lr_scheduler.state_dict()


@dataclasses.dataclass(frozen=True)
class DeepSpeedTarget(FrameworkTarget):
    """DeepSpeed's engine with ZeRO ``stage`` 1 or 2 (see the module docstring)."""

    stage: int = 2
    accumulation: int = 1  # set by configure()
    gamma: float | None = None  # the scenario's lr_decay, set by configure()

    # 0.18.9 raises in engine.step() under torch 2.13, with or without ddpcheck
    # (bench/deepspeed_step_018.py); 0.19.0 and 0.19.8 were tried and pass
    requires = (("deepspeed", "0.19.0"),)
    steps_every_micro_batch = True
    sharded_gradients = True
    supported_features = frozenset(FEATURES) - {"float64", "clipping", "unused-everywhere",
                                                "unused-on-some-ranks", "non-contiguous",
                                                "param-groups", "buffers", "mixed-dtypes",
                                                "checkpoint", "rank-orders"}

    @property
    def reduces_every_micro_batch(self) -> bool:  # type: ignore[override]
        # ZeRO-2 reduces each micro-batch's gradients into the partitions (it has no no_sync)
        return self.stage == 2

    def configure(self, scenario: Any) -> Target:
        return dataclasses.replace(self, accumulation=scenario.accumulation,
                                   gamma=scenario.lr_decay)

    def warm_up(self) -> None:
        # Importing DeepSpeed (3-13 s here) and building the C++ op its comm backend loads on
        # CPU (``build_shm_op``: 100-285 s the first time after an install on 2 loaded cores,
        # under a second once built; bench/deepspeed_op_build.py): both once per process, here.
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

    def setup(self, module: Any, params: Any, optimizer_cls: type,
              **kwargs: Any) -> tuple[Any, Any]:
        join_existing_group()
        _choose_accelerator(next(module.parameters()).device.type)
        import deepspeed

        optimizer = optimizer_cls(params, **kwargs)
        schedule = (None if self.gamma is None else
                    torch.optim.lr_scheduler.ExponentialLR(optimizer, self.gamma))
        config = {"train_micro_batch_size_per_gpu": 1,
                  "gradient_accumulation_steps": self.accumulation,
                  "zero_optimization": {"stage": self.stage},
                  "zero_allow_untested_optimizer": True,
                  "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0
                  "steps_per_print": 2**31}
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer,
                                               lr_scheduler=schedule, config=config,
                                               dist_init_required=False)
        return engine, _Engine(engine, module)

    def make_scheduler(self, optimizer: Any, gamma: float) -> Any:
        return _Schedule(optimizer.engine)

    def micro_batch(self, model: Any, optimizer: Any, index: int,
                    count: int) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def backward(self, model: Any, loss: Any) -> None:
        model.backward(loss, scale_wrt_gas=False)

    def gradient_shards(self, model: Any, optimizer: Any, params: Any) -> Any:
        from deepspeed.utils import safe_get_full_grad

        return [(p, 0, None if (g := safe_get_full_grad(p)) is None else g.reshape(-1))
                for p in params if p.requires_grad]

    def optimizer_state(self, optimizer: Any) -> Any:
        from deepspeed.utils import safe_get_full_optimizer_state

        inner = optimizer.engine.optimizer.optimizer  # the client optimizer, on flat partitions
        keys = sorted({k for state in inner.state.values() for k, v in state.items()
                       if torch.is_tensor(v) and v.dim() > 0})
        steps = {k: v for state in inner.state.values() for k, v in state.items()
                 if not (torch.is_tensor(v) and v.dim() > 0)}
        module = optimizer.module
        held = {}
        for _, p in module.named_parameters():  # one order on every rank: these are collective
            if not p.requires_grad:
                continue
            state = {k: safe_get_full_optimizer_state(p, k) for k in keys}
            state = {k: v for k, v in state.items() if v is not None}
            if state:
                held[p] = {**{k: v.clone() if torch.is_tensor(v) else v
                              for k, v in steps.items()}, **state}
        return held

    def teardown(self, model: Any, optimizer: Any) -> None:
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
_CACHED_GROUPS = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS",
                  "_EXPERT_DATA_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP_RANKS",
                  "_ALL_TO_ALL_GROUP", "_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP",
                  "_TENSOR_MODEL_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP",
                  "mesh_device", "mpu")


def _choose_accelerator(device_type: str) -> None:
    """DeepSpeed's CPU accelerator for a CPU world (before DeepSpeed is imported: it chooses
    once)."""
    if device_type == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
