"""``accelerate_nd``: accelerate's ``ParallelismConfig`` (``dp_shard`` x ``tp``) over a model that
transformers distributed, driven by accelerate's loop -- the composition transformers' own Trainer
uses for a model loaded with ``DistributedConfig(tp_size=..., fsdp_size=...)``.

Per example and rank: rank 0's weights broadcast; an ``Accelerator(parallelism_config=
ParallelismConfig(dp_shard_size=dp, tp_size=tp), gradient_accumulation_steps=A, ...)`` joins the
existing process group and builds its own device mesh; the scenario's plan, written as a
transformers plan (``hf_tp``), is applied over the ``tp`` axis of the same layout and, with
``dp > 1``, transformers' own FSDP2 over ``dp_shard`` (``hf_tp.distribute``); then
``accelerator.prepare(model, optimizer)`` -- which, for a tensor-parallel model, checks the
model's ``tp_size`` against the config's and wraps nothing -- and accelerate's loop idiom:
``accumulate``, ``backward``, ``clip_grad_norm_``, the gated ``step``, ``reduce`` of the loss.

What accelerate does not run, declined with its reason (``bench/accelerate_nd_cpu.py`` shows
each without ddpcheck, per release: every one with a ``ParallelismConfig``, 1.10.0 to 1.16.0,
exit 1):

* **anything on the CPU**, in every release: a CPU world is ``DistributedType.MULTI_CPU``
  (1.13 and later: ``NO`` unless ``cpu=True``, a world of one per process), which accelerate's
  state never turns into FSDP (neither an ``fsdp_plugin`` nor ``ACCELERATE_USE_FSDP`` is read
  there) and which ``ParallelismConfig`` refuses ("is only compatible DistributedType.FSDP
  (version 2) or DistributedType.Multi{Device} or DistributedType.DEEPSPEED, but got
  DistributedType.MULTI_CPU"): a hard check, no environment variable or field lifts it. So on
  this project's machines (no GPU) the target declines every example; on CUDA it is not tried
  yet;
* **accelerate's own FSDP2 x TP** (``fsdp_plugin``): ``_prepare_tp`` imports
  ``ReplicateParallel`` from ``transformers.integrations.tensor_parallel``, which transformers
  defines from 4.52.2 to 5.0.0 only (an ``ImportError`` in ``prepare`` with the 5.25 this target
  needs); the config key is refused, and transformers shards over ``dp_shard`` itself, as its
  Trainer expects. accelerate 1.10-1.12 make that import for every tensor-parallel model (no
  release of them runs with transformers 5.25, on any device), and 1.13-1.14 look for a
  ``tp_size`` attribute, which transformers' ``PreTrainedModel`` has as a property and this
  target's model does not ("Model should undergo tensor parallel"; 1.15 reads the
  ``distributed_config`` too): the floor is 1.15.0;
* ``tp = 1``: a model transformers sharded over ``dp`` holds DTensors, which accelerate's DDP
  wrapping refuses (the ``accelerate`` target checks accelerate's data parallelism).

transformers' own composition of tensor parallelism with FSDP2 runs on the CPU: ``hf_tp`` at
``dp > 1`` checks it.

**Your own configuration** (``config``: ``Accelerator(**config)``'s keyword arguments, a dict or
a JSON file's path). ``parallelism_config``: a ``ParallelismConfig`` or the dict of its keyword
arguments; its sizes fix the mesh, so an example on another mesh is declined, and what
accelerate refuses (``dp_replicate_size > 1`` with ``tp_size > 1`` and no ``dp_shard``) is
refused when the target is built. The scenario's keys (accumulation, precision) are refused as
for ``accelerate``; ``gradient_accumulation_plugin`` (its ``num_steps`` the scenario's) and the
other keys reach the ``Accelerator``::

    AccelerateNDTarget(config={"parallelism_config": {"dp_shard_size": 2, "tp_size": 2},
                               "gradient_accumulation_plugin": {"sync_each_batch": True}})
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from ddpcheck._base.errors import InvalidArgument, NothingChecked
from ddpcheck._language.scenario import Scenario
from ddpcheck._language.tensor_parallel import mesh_problem, mesh_shape
from ddpcheck._language.training import OptimizerLike, Params
from ddpcheck.targets.accelerate import SCENARIO_KEYS, AcceleratorLoop
from ddpcheck.targets.configuration import (
    Config,
    build,
    construct,
    described,
    keywords_of,
    load_config,
    reconcile,
)
from ddpcheck.targets.environment import join_existing_group
from ddpcheck.targets.hf_tp import FSDP_PLANS, HfTPTarget
from ddpcheck.targets.option_space import options
from ddpcheck.targets.protocol import Target
from ddpcheck.targets.reasons import OWN_CHECKPOINTS
from ddpcheck.targets.tensor_parallel import AUTOCAST_ON_A_MESH, TP_FLOOR

if TYPE_CHECKING:
    from accelerate import Accelerator

    from ddpcheck.targets.protocol import ConfigSpace

__all__ = [
    "ACCELERATE_ND_FLOOR",
    "CPU_REFUSED",
    "FSDP2_TP_IMPORT",
    "ND_HARNESS_KEYS",
    "AccelerateNDTarget",
]

#: The oldest accelerate whose ``prepare`` takes this target's model: 1.10-1.12 import
#: ``ReplicateParallel`` for every tensor-parallel model, 1.13-1.14 look for a ``tp_size``
#: attribute the model lacks (1.15 reads ``config.distributed_config`` too); 1.10.0 to 1.16.0
#: tried (bench/accelerate_nd_cpu.py; the glue by bench/accelerate_nd_whatif.py).
ACCELERATE_ND_FLOOR = "1.15.0"

#: Why every example is declined on the CPU (the module docstring).
CPU_REFUSED = (
    "accelerate runs a ParallelismConfig only over FSDP2, DeepSpeed or a multi-device type, and "
    "a CPU world is DistributedType.MULTI_CPU, which it never turns into FSDP (no plugin, "
    "environment variable or field changes that): Accelerator raises ValueError in every "
    "release with a ParallelismConfig, 1.10.0 to 1.16.0 (bench/accelerate_nd_cpu.py); hf_tp "
    "checks transformers' TP x FSDP2 on the CPU"
)
#: Why an ``fsdp_plugin`` is refused (the module docstring).
FSDP2_TP_IMPORT = (
    "accelerate's FSDP2 x TP path (_prepare_tp, 1.10.0 to 1.16.0) imports ReplicateParallel "
    "from transformers.integrations.tensor_parallel, which transformers has only from 4.52.2 "
    "to 5.0.0: prepare raises ImportError with 5.25 (bench/accelerate_nd_cpu.py); transformers "
    "shards over dp_shard itself"
)

_WORLD = "ddpcheck's world: the process group exists, on the world's device"
#: ``Accelerator`` keys ddpcheck's harness fixes: key -> (the values accepted, why).
ND_HARNESS_KEYS: dict[str, tuple[tuple[object, ...], str]] = {
    "cpu": ((), _WORLD),
    "kwargs_handlers.InitProcessGroupKwargs": ((), _WORLD),
    "step_scheduler_with_optimizer": ((True,), "the scheduler steps once per optimizer step"),
    "deepspeed_plugin": ((None,), "DeepSpeed has targets of its own"),
    "deepspeed_plugins": ((None,), "DeepSpeed has targets of its own"),
    "megatron_lm_plugin": ((None,), "Megatron-LM is not tried"),
    "torch_tp_plugin": ((None,), "deprecated: parallelism_config's tp_size says it"),
    "dynamo_backend": ((None, "no", "NO"), "torch.compile is not tried with this target"),
    "dynamo_plugin": ((None,), "torch.compile is not tried with this target"),
    "log_with": ((None, []), "the target starts no tracker"),
    "fsdp_plugin": ((None,), FSDP2_TP_IMPORT),
}


@dataclasses.dataclass(frozen=True)
class AccelerateNDTarget(AcceleratorLoop, HfTPTarget):
    """accelerate's ``ParallelismConfig`` over a model transformers distributed (the module
    docstring)."""

    requires = (  # type: ignore[assignment]
        ("torch", TP_FLOOR),
        ("transformers", "5.25.0"),
        ("accelerate", ACCELERATE_ND_FLOOR),
    )
    config: Config = None
    accumulation: int = 1  # the scenario's micro-batches per step, set by configure()

    steps_every_micro_batch = True
    declined_features: ClassVar[Mapping[str, str]] = {
        "checkpoint": f"{OWN_CHECKPOINTS} (save_state/load_state, its own directory format)",
        "rank-orders": "the initial broadcast pairs parameters by registration order",
        "autocast": AUTOCAST_ON_A_MESH,
    }

    def __post_init__(self) -> None:
        where = described("AccelerateNDTarget", self.config)
        given = load_config(self.config, target=where)
        sizes = _check(given, where) if given else None
        object.__setattr__(self, "_given", given)
        object.__setattr__(self, "_sizes", sizes)

    def config_space(self) -> ConfigSpace:
        """``hf_tp``'s (the replicated styles' other names; transformers' FSDP plan at
        ``dp > 1``) and accelerate's accumulation syncing every micro-batch
        (``sync_each_batch``). The sizes are the mesh's."""
        return options(
            fields={
                "spelling": ("split",),
                "fsdp_plan": tuple(name for name in FSDP_PLANS if name != self.fsdp_plan),
            },
            config={"gradient_accumulation_plugin": ({"sync_each_batch": True},)},
        )

    def own_plan_models(self) -> None:
        """None: transformers' architectures with their own plans are hf_tp's alone (here the
        model is distributed through accelerate's mesh with the drawn plan)."""
        return None

    def supports(self, scenario: Scenario) -> str | None:
        if not torch.cuda.is_available():  # first: it holds whatever the scenario
            return CPU_REFUSED
        if scenario.epochs is not None:
            return "epochs: accelerate_nd runs the harness's loop, not accelerate's data path"
        return super().supports(scenario)

    def supports_at(self, scenario: Scenario, world_size: int) -> str | None:
        problem = mesh_problem(scenario.tensor_parallel, world_size)
        if problem is not None:
            return problem
        dp, tp = mesh_shape(scenario.tensor_parallel, world_size)
        if tp == 1:
            return (
                "tp=1: accelerate wraps a model without tensor parallelism in DDP, which "
                "refuses the DTensor parameters transformers' FSDP2 leaves"
            )
        wanted = vars(self)["_sizes"]
        if wanted is not None and wanted != (dp, tp):
            return (
                f"the config's ParallelismConfig(dp_shard_size={wanted[0]}, tp_size="
                f"{wanted[1]}) fixes the mesh; this example's is dp={dp} x tp={tp}"
            )
        return super().supports_at(scenario, world_size)

    def warm_up(self) -> None:
        import accelerate  # noqa: F401  (seconds in a rank: once per process)
        import transformers.distributed.tensor_parallel  # noqa: F401

    def configure(self, scenario: Scenario) -> Target:
        # a copy, not dataclasses.replace: the config was read and checked when the target was
        # built, and is not read again in the rank (its file may be elsewhere)
        configured = copy.copy(self)
        plan = () if scenario.tensor_parallel is None else scenario.tensor_parallel.plan
        object.__setattr__(configured, "plan", plan)
        object.__setattr__(configured, "accumulation", scenario.accumulation)
        object.__setattr__(configured, "_tensor_parallel", scenario.tensor_parallel)
        return configured

    def setup(
        self,
        module: nn.Module,
        params: Params,
        optimizer_cls: type[torch.optim.Optimizer],
        **kwargs: object,  # the scenario's options, for its optimizer class
    ) -> tuple[nn.Module, OptimizerLike]:
        """The model transformers distributed (:meth:`parallelize`, ``hf_tp``'s, over the
        harness's mesh: the layout of accelerate's, ``dp_shard`` outer and ``tp`` inner, whose
        groups outlive the example -- a mesh built per example and torn down after it leaves
        torch's value-keyed submesh caches pointing at destroyed groups), prepared by this
        example's ``Accelerator`` with the optimizer."""
        accelerator = self.accelerator(module)
        model, optimizer = accelerator.prepare(module, optimizer_cls(params, **kwargs))  # type: ignore[arg-type]
        self.hold(accelerator, model, optimizer)
        return model, optimizer

    def accelerator(self, module: nn.Module) -> Accelerator:
        """This example's ``Accelerator``: the user's config, its objects built afresh, the
        scenario's accumulation and the mesh's sizes."""
        import torch.distributed as dist
        from accelerate import Accelerator, ParallelismConfig
        from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin

        join_existing_group()
        given = vars(self)["_given"]
        where = described("AccelerateNDTarget", self.config)
        kwargs = dict(given, cpu=next(module.parameters()).device.type == "cpu")
        if kwargs["cpu"]:  # asked to run what supports declines (a CPU world on a CUDA host)
            raise NothingChecked(f"AccelerateNDTarget declines this example: {CPU_REFUSED}")
        dp, tp = mesh_shape(vars(self)["_tensor_parallel"], dist.get_world_size())
        kwargs["parallelism_config"] = ParallelismConfig(dp_shard_size=dp, tp_size=tp)
        plugin = given.get("gradient_accumulation_plugin")
        if plugin is None:
            kwargs["gradient_accumulation_steps"] = self.accumulation
        else:
            plugin = build(plugin, GradientAccumulationPlugin, target=where, key="plugin")
            kwargs["gradient_accumulation_plugin"] = dataclasses.replace(
                plugin, num_steps=self.accumulation
            )
        loader = given.get("dataloader_config") or {}
        if isinstance(loader, Mapping):  # the harness splits the global batch across ranks
            loader = DataLoaderConfiguration(**{"split_batches": True, **loader})
        kwargs["dataloader_config"] = loader
        return construct(Accelerator, kwargs, target=where)


def _check(given: dict[str, object], where: str) -> tuple[int, int] | None:
    """Refuse what the rule refuses, and a ``parallelism_config`` accelerate refuses or this
    target cannot run (``cp``, ``sp``, ``dp_replicate``); its ``(dp_shard_size, tp_size)``, or
    None without one. Skipped without accelerate (``requires`` refuses
    the target first)."""
    try:
        from accelerate import Accelerator, ParallelismConfig
    except ImportError:
        return None
    view = {k: v for k, v in given.items() if k != "kwargs_handlers"}
    for handler in _listed(given.get("kwargs_handlers")):
        view[f"kwargs_handlers.{type(handler).__name__}"] = handler
    reconcile(
        view,
        target=where,
        scenario_keys=SCENARIO_KEYS,
        harness_keys=ND_HARNESS_KEYS,
        known=keywords_of(Accelerator),
        known_as="Accelerator keyword argument",
    )
    pc = given.get("parallelism_config")
    if pc is None:
        return None
    try:
        built = build(copy.deepcopy(pc), ParallelismConfig, target=where, key="parallelism_config")
    except ValueError as error:  # accelerate's own refusal, in its words
        raise InvalidArgument(f"{where}: parallelism_config: {error}") from None
    if built.cp_size > 1 or built.sp_size > 1 or built.dp_replicate_size > 1:
        raise InvalidArgument(
            f"{where}: parallelism_config: cp_size, sp_size and dp_replicate_size > 1 are not "
            "checked by accelerate_nd (context and sequence parallelism are out of ddpcheck's "
            "scope; dp_replicate x dp_shard x tp needs 8 ranks)"
        )
    return built.dp_shard_size, built.tp_size


def _listed(value: object) -> Sequence[object]:
    return value if isinstance(value, (list, tuple)) else ()
