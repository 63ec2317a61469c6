"""``hf_tp``: transformers' own tensor parallelism (``transformers.distributed.tensor_parallel``)
with the scenario's plan written in transformers' vocabulary, over ``mesh["tp"]``, trained by
the harness's plain loop -- or, for a scenario whose model is one of transformers' own
architectures (``hf_models.HfCausalLM``, half of the examples drawn), with the model's own plans,
as ``tp_plan="auto"`` distributes it (:mod:`ddpcheck.targets.hf_auto`).

transformers ships its own style classes, registered by name in ``ALL_PARALLEL_STYLES``
(``"colwise"``, ``"rowwise"``, ``"colwise_rep"``, ``"rowwise_rep"``, ``"unit_colwise"``, ...):
re-implementations of torch's ``ParallelStyle`` on DTensor, with their own input and output
hooks (a column-wise output built with the module's declared width, so uneven shards need no
DTensor output; a row-wise bias kept replicated and added once after the all-reduce). A model's
plan is a dict of *generic* names (``"layers.*.mlp.up_proj": "colwise"``): transformers expands
it per layer (``DistributedMixin._expand_parallel_plan``, a number between dots matches ``*``
only) and shards with ``apply_tensor_parallelism(model, tp_mesh, plan)`` -- exactly what
``from_pretrained(distributed_config=DistributedConfig(tp_size=..., tp_plan=...))`` runs
(``maybe_distribute_model``) before it loads the weights into the shards.

With ``dp > 1`` the glue composes as transformers composes ``DistributedConfig(tp_size=tp,
fsdp_size=dp)`` (:func:`distribute`): the plan over ``tp``, then transformers' own FSDP2
(``apply_fully_sharded_data_parallelism``) over ``dp`` with an FSDP plan of generic names
(:data:`FSDP_PLANS`: each block ``"free_full_weight"``, the rest by the root ``fully_shard``).
accelerate's own FSDP2 x TP path (1.10-1.16) does not run with transformers 5.1 and later
(``accelerate_nd``'s docstring says why), which is why transformers shards and accelerate only
drives the loop.

What the glue does per rank and example: rank 0's weights broadcast (the scenarios initialise
ranks differently; ``shard_param`` slices each rank's own tensor, ``src_data_rank=None``), the
scenario's plan translated (:data:`HF_STYLES`) and written with generic names
(:func:`hf_plan`), the module given the two attributes ``apply_tensor_parallelism`` reads of a
``PreTrainedModel`` (``config``, whose text config the styles may ask for a head width, and
``_mesh_manager``: a ``TransformersDeviceMesh`` over the harness's mesh), then transformers'
expansion and ``apply_tensor_parallelism``. The layers the plan leaves alone stay plain tensors,
as transformers leaves them; clipping over both takes the Trainer's own mixed-mesh norm
(:meth:`HfTPTarget.clip_grad_norm`), which torch's ``clip_grad_norm_`` cannot span.

Not driven: ``from_pretrained`` (the drawn model is no checkpoint; it builds the same styles on
meta tensors and loads into them), ``DistributedConfig``'s own mesh (the harness's is the same
layout, ``tp`` innermost), the Trainer's TP path (it needs a model loaded that way:
``is_distributed_loading_by_transformers``; its loss scaling by ``tp_size`` and the broadcast of
plain parameters are not exercised), and the styles the drawn plans have no use for
(``unit_colwise``/``unit_rowwise`` for heads ``tp`` does not divide, embeddings, packed and
expert styles).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from ddpcheck._language.scenario import Scenario
from ddpcheck._language.sharded_models import ShardedSpec
from ddpcheck._language.tensor_parallel import mesh_problem, mesh_shape
from ddpcheck._language.training import OptimizerLike
from ddpcheck.targets.fsdp import broadcast_from
from ddpcheck.targets.hf_auto import architectures, distribute_auto, heads_problem
from ddpcheck.targets.hf_models import HfLogits
from ddpcheck.targets.option_space import options
from ddpcheck.targets.tensor_parallel import (
    TP_FLOOR,
    TorchTPTarget,
    empty_micro_batch,
    empty_sequence,
    empty_shard,
)

if TYPE_CHECKING:
    from hypothesis import strategies as st
    from torch.distributed.device_mesh import DeviceMesh

    from ddpcheck.targets.hf_models import HfCausalLM
    from ddpcheck.targets.protocol import ConfigSpace

__all__ = [
    "FSDP_PLANS",
    "HF_STYLES",
    "REPLICATED_SPELLINGS",
    "HF_TP_FLOOR",
    "HfTPTarget",
    "distribute",
    "fsdp_problem",
    "generic_name",
    "hf_plan",
    "noncontiguous_rowwise",
    "uniform_plan",
]

#: The oldest transformers the glue works with: 5.25.0 (5.20.0, tried with the floor lowered and
#: the plan handed unexpanded, as its ``apply_tensor_parallelism`` takes it, refuses an uneven
#: ``"colwise_rep"`` output -- a ValueError in the rank, which the checks would report as a
#: failing rank; 5.0.0 keeps its tensor parallelism in ``integrations.tensor_parallel``).
HF_TP_FLOOR = "5.25.0"

#: A scenario's style -> the transformers style that does the same to an ``nn.Linear``.
#: ``colwise-dtensor`` exists only because torch's ``ColwiseParallel()`` cannot hand an uneven
#: shard on as a local tensor; transformers' ``"colwise"`` builds its output with the layer's
#: declared ``out_features`` and its ``"rowwise"`` its input with ``in_features``, so both
#: torch spellings are transformers' one ``"colwise"``.
HF_STYLES: Mapping[str, str] = {
    "colwise": "colwise",
    "colwise-dtensor": "colwise",
    "rowwise": "rowwise",
    "colwise-replicate": "colwise_rep",
    "rowwise-replicate": "rowwise_rep",
    # a q/k norm of attention split over its heads: Qwen3's plan for q_norm and k_norm
    "heads-norm": "replicated_with_grad_allreduce",
}

#: transformers' other names for the styles whose input and output are both replicated (the same
#: ``ColwiseParallel``/``RowwiseParallel`` layouts, registered twice): what a user may write
#: instead, drawn by ``--fuzz-config`` (``HfTPTarget(spelling="split")``).
REPLICATED_SPELLINGS: Mapping[str, str] = {
    "colwise_rep": "colwise_gather_output",
    "rowwise_rep": "rowwise_split_input",
}

#: FSDP plans a user writes for the drawn models (transformers' ``fsdp_plan``: generic module
#: names to ``"free_full_weight"`` -- resharded after forward -- or ``"keep_full_weight"``), by
#: name; what no plan names goes to the root ``fully_shard``.
FSDP_PLANS: Mapping[str, Mapping[str, str]] = {
    "blocks": {"blocks.*": "free_full_weight"},
    "blocks-kept": {"blocks.*": "keep_full_weight"},
    "blocks-head-kept": {"blocks.*": "free_full_weight", "head": "keep_full_weight"},
    "root": {},
}


def generic_name(name: str) -> str:
    """``name`` as transformers' plans spell it: a layer number between dots is ``*``
    (``blocks.0.up`` -> ``blocks.*.up``; transformers' ``replace_layer_number_by_wildcard``)."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def hf_plan(plan: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """The transformers plan (generic names, transformers' styles) of a scenario's plan; the
    plan must be uniform (:func:`uniform_plan`)."""
    return {generic_name(name): HF_STYLES[style] for name, style in plan}


def uniform_plan(scenario: Scenario) -> str | None:
    """Why the scenario's plan cannot be written as a transformers plan (None: it can): each
    style must have a transformers equivalent, and every layer one generic name covers must get
    the same style (transformers matches ``blocks.*.up``, never ``blocks.0.up``), the layers the
    plan leaves alone included. The model is built on the meta device (no memory, no random
    numbers)."""
    tensor_parallel = scenario.tensor_parallel
    if tensor_parallel is None or not tensor_parallel.plan:
        return None
    spec = scenario.model
    if isinstance(spec, ShardedSpec) and spec.tied and "head" in dict(tensor_parallel.plan):
        return (
            "head: tied to the embedding; transformers re-ties weights when from_pretrained "
            "loads them (tie_weights), which the glue does not drive"
        )
    for name, style in tensor_parallel.plan:
        if style not in HF_STYLES:
            return f"{name}: the style {style!r} has no transformers equivalent"
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = scenario.model()
    except Exception:  # the example itself reports a model that does not build
        return None
    given = dict(tensor_parallel.plan)
    styles: dict[str, dict[str | None, str]] = {}
    for name, _ in model.named_modules():
        styles.setdefault(generic_name(name), {}).setdefault(
            HF_STYLES.get(given.get(name, ""), None), name
        )
    for generic, found in styles.items():
        if len(found) > 1:
            shown = ", ".join(f"{at} {style or 'left alone'}" for style, at in found.items())
            return (
                f"transformers' plans name layers by a generic name ({generic}), but the plan "
                f"treats them differently ({shown}): no transformers plan says that"
            )
    return None


def noncontiguous_rowwise(scenario: Scenario, world_size: int) -> str | None:
    """Why transformers' ``"rowwise"`` would fail on the scenario's model (None: it would not):
    an attention block of one feature per head split over ``tp`` hands its ``out`` projection
    a non-contiguous view (``reshape`` merges a size-1 dimension without copying), and
    transformers 5.25.0's ``RowwiseParallel`` declares its input contiguous
    (``_from_local_last_dim_shard``), so the linear's ``view`` fails where torch's
    ``RowwiseParallel`` trains (bench/hf_tp_noncontiguous.py confirms it without ddpcheck)."""
    tensor_parallel, spec = scenario.tensor_parallel, scenario.model
    if tensor_parallel is None or not isinstance(spec, ShardedSpec) or spec.head_dim != 1:
        return None
    _, tp = mesh_shape(tensor_parallel, world_size)
    plan = dict(tensor_parallel.plan)
    for i, block in enumerate(spec.blocks):
        if plan.get(f"blocks.{i}.out") == "rowwise" and block.size // tp > 1:
            return (
                f"blocks.{i}.out: rowwise on an attention block of one feature per head, whose "
                "input is a non-contiguous view that transformers' RowwiseParallel declares "
                "contiguous, so its linear fails (bench/hf_tp_noncontiguous.py)"
            )
    return None


def fsdp_problem(scenario: Scenario, world_size: int) -> str | None:
    """Why FSDP2 over ``dp`` cannot judge the scenario at this world size (None: it can, or
    ``dp = 1``): a layer some ranks skip (FSDP2 all-gathers it in its forward, so the collectives
    go unpaired), or a row-wise shard left empty (torch's FSDP2 hang, ``empty_shard``)."""
    from ddpcheck._language import features

    if scenario.tensor_parallel is None or mesh_problem(scenario.tensor_parallel, world_size):
        return None
    dp, _ = mesh_shape(scenario.tensor_parallel, world_size)
    if dp == 1:
        return None
    if "unused-on-some-ranks" in features.of(scenario, world_size):
        return (
            f"dp={dp}: FSDP2 all-gathers a layer in its forward, and a layer some ranks skip "
            "leaves the collectives unpaired"
        )
    return empty_shard(scenario, world_size)


def distribute(
    module: nn.Module,
    mesh: DeviceMesh,
    names: Mapping[str, str],
    plan: Mapping[str, str],
    fsdp_plan: Mapping[str, str],
) -> nn.Module:
    """``module`` distributed as transformers' ``maybe_distribute_model`` distributes a model
    loaded with ``DistributedConfig(tp_size=tp, fsdp_size=dp)``: the attributes it sets (the
    config's ``distributed_config``, the mesh manager, ``_tp_size``, ...), the generic ``plan``
    expanded and applied over the ``tp`` axis, then with ``dp > 1`` transformers' FSDP2 over the
    ``dp`` axis with ``fsdp_plan`` expanded. ``mesh``: a mesh whose axes ``names`` maps from
    transformers' names (``{"fsdp": "dp", "tp": "tp"}`` for the harness's, ``{"fsdp":
    "dp_shard", ...}`` for accelerate's): the same ranks, no new process group."""
    from transformers import PretrainedConfig
    from transformers.distributed.configuration_utils import DistributedConfig
    from transformers.distributed.fsdp import apply_fully_sharded_data_parallelism
    from transformers.distributed.mixin import DistributedMixin
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    from transformers.distributed.utils import TransformersDeviceMesh

    class Renamed(TransformersDeviceMesh):
        """transformers' mesh manager over a mesh whose axes are named otherwise."""

        def get_mesh(self, dims: str | tuple[str, ...]) -> DeviceMesh:
            dims = (dims,) if isinstance(dims, str) else dims
            return mesh[tuple(names.get(d, d) for d in dims)]

    axes = mesh.mesh_dim_names or ()
    dp = mesh[names["fsdp"]].size() if names["fsdp"] in axes else 1  # accelerate's: no axis
    tp = mesh[names["tp"]].size() if names["tp"] in axes else 1
    config = PretrainedConfig()
    config.distributed_config = DistributedConfig(tp_size=tp, fsdp_size=dp)
    manager = Renamed(mesh, mesh)
    # what maybe_distribute_model sets on a PreTrainedModel (plain attributes here)
    for name, value in (
        ("config", config),
        ("_mesh_manager", manager),
        ("_tp_size", tp),
        ("_fsdp_size", dp),
        ("_is_distributed_loading_by_transformers", True),
    ):
        setattr(module, name, value)
    expand = DistributedMixin._expand_parallel_plan
    if plan and tp > 1:
        apply_tensor_parallelism(module, manager.get_mesh("tp"), expand(module, dict(plan)))  # type: ignore[arg-type]
    if dp > 1:
        expanded = expand(module, dict(fsdp_plan))  # type: ignore[arg-type]
        # deepest first, as _resolve_parallel_plans orders it
        ordered = dict(sorted(expanded.items(), key=lambda kv: kv[0].count("."), reverse=True))
        apply_fully_sharded_data_parallelism(module, manager, ordered, {})
    return module


@dataclasses.dataclass(frozen=True)
class HfTPTarget(TorchTPTarget):
    """transformers' tensor parallelism (``apply_tensor_parallelism`` with the scenario's plan
    in transformers' vocabulary) over ``tp``, and with ``dp > 1`` transformers' FSDP2 over
    ``dp`` (:func:`distribute`): the module docstring says what is driven and what is not.
    ``fsdp_plan``: a name of :data:`FSDP_PLANS`; ``spelling="split"``: the replicated styles
    written with transformers' other names (:data:`REPLICATED_SPELLINGS`)."""

    # PlanTarget's is torch's alone (a one-pair tuple to mypy): this one adds transformers
    requires = (("torch", TP_FLOOR), ("transformers", HF_TP_FLOOR))  # type: ignore[assignment]

    fsdp_plan: str = "blocks"
    spelling: str = "rep"

    def warm_up(self) -> None:
        import transformers.distributed.tensor_parallel  # noqa: F401  (seconds: once per rank)

    def supports_at(self, scenario: Scenario, world_size: int) -> str | None:
        return (
            mesh_problem(scenario.tensor_parallel, world_size)
            or empty_micro_batch(scenario, world_size)
            or empty_sequence(scenario, world_size)
            or uniform_plan(scenario)
            or noncontiguous_rowwise(scenario, world_size)
            or fsdp_problem(scenario, world_size)
            or heads_problem(scenario, world_size)
        )

    def own_plan_models(self) -> Callable[[int], st.SearchStrategy[HfCausalLM]] | None:
        """transformers' architectures, each sharded with its own plan (``tp_plan="auto"``,
        :mod:`ddpcheck.targets.hf_auto`), drawn beside the plans drawn for ddpcheck's models."""
        return architectures

    def config_space(self) -> ConfigSpace:
        """What a user of transformers' distribution writes beside the plan: the replicated
        styles' other names (``"colwise_gather_output"``, ``"rowwise_split_input"``), and with
        ``dp > 1`` the FSDP plan (each block resharded or kept, the head kept, or the root
        alone)."""
        return options(
            fields={
                "spelling": ("split",),
                "fsdp_plan": tuple(name for name in FSDP_PLANS if name != self.fsdp_plan),
            }
        )

    def supports(self, scenario: Scenario) -> str | None:
        if scenario.max_grad_norm is not None and scenario.grad_norm_type != 2.0:
            return (
                f"clipping the {scenario.grad_norm_type}-norm: transformers' Trainer clips a "
                "tensor-parallel model's gradients by their 2-norm (_mixed_mesh_grad_norm)"
            )
        return super().supports(scenario)

    def clip_grad_norm(
        self, model: nn.Module, optimizer: OptimizerLike, max_norm: float, norm_type: float
    ) -> object:
        """As transformers' Trainer clips a tensor-parallel model: where the gradients live on
        different meshes (DTensor shards beside the plain tensors of the layers the plan leaves
        alone, which torch's ``clip_grad_norm_`` refuses together) its own mixed-mesh norm --
        one norm per mesh, combined, then ``clip_grads_with_norm_`` -- else torch's."""
        from transformers import Trainer
        from transformers.trainer_optimizer import has_mixed_dtensor

        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if has_mixed_dtensor(grads):
            # the Trainer's method reads nothing of the Trainer: called with no instance
            return Trainer._mixed_mesh_grad_norm(None, model, max_norm)
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)

    def transformers_plan(self) -> dict[str, str]:
        """The plan handed to transformers (a seeded bug overrides it)."""
        plan = hf_plan(self.plan)
        if self.spelling == "split":
            return {name: REPLICATED_SPELLINGS.get(s, s) for name, s in plan.items()}
        return plan

    def parallelize(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        broadcast_from(module, 0)
        if isinstance(module, HfLogits):  # a transformers architecture: its own plans
            distribute_auto(module.lm, mesh)
            return module
        fsdp = FSDP_PLANS[self.fsdp_plan]
        return distribute(module, mesh, {"fsdp": "dp", "tp": "tp"}, self.transformers_plan(), fsdp)
