"""``parallel_tp``: this repository's tensor-parallel layers (``parallel.tensor_parallel``) over
``mesh["tp"]``, and ``parallel.DDP`` over ``mesh["dp"]`` when there are several data-parallel
groups.

The layers hold plain local shards, so the oracle's whole tensors come from this target's own
gather: :meth:`ParallelTPTarget.full_tensor` all-gathers a shard (a parameter, its gradient, or
optimizer state of its shape) over the ``tp`` group, as the layer that holds it lays its chunks
out; every other tensor is whole on every rank already. A tensor is recognised as a shard by its
storage: the harness hands the hooks detached views of the parameters, their gradients and the
optimizer's state, which share their storage.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
import torch.distributed as dist
from torch import nn

from ddpcheck._language.scenario import Scenario
from ddpcheck._language.sharded_models import (
    HEAD_NORM,
    LOSS_STYLES,
    VOCABULARY_STYLES,
    ShardedSpec,
)
from ddpcheck._language.tensor_parallel import mesh_problem
from ddpcheck._language.training import MicroBatchLoss, OptimizerLike, Params
from ddpcheck.targets.tensor_parallel import (
    AUTOCAST_ON_A_MESH,
    TP_FLOOR,
    PlanTarget,
    empty_sequence,
    first_empty_shard,
)
from parallel import DDP
from parallel import sequence_parallel as sp
from parallel import tensor_parallel as tp

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "ParallelTPTarget",
    "no_head_norm",
    "no_loss_parallel",
    "no_vocabulary_parallel",
    "shard_missing",
]


def shard_missing(scenario: Scenario, world_size: int) -> str | None:
    """Why ``parallel.tensor_parallel`` refuses the scenario's plan at this world size (a layer
    whose sharded features leave a rank none, as ``torch.chunk`` splits them, or a module no
    ``nn.Linear``: ``targets.tensor_parallel.first_empty_shard``, which ``torch_2d`` asks of
    its row-wise layers); None when it does not."""
    found = first_empty_shard(scenario, world_size)
    if found is None:
        return None
    if found.features is None:
        return f"the plan names {found.name!r}, which is not an nn.Linear"
    return (
        f"{found.name}: {found.features} features over tp={found.tp} leave the last rank none "
        "(torch.chunk); parallel.tensor_parallel needs a feature on every rank"
    )


def no_vocabulary_parallel(scenario: Scenario) -> str | None:
    """Why ``parallel.tensor_parallel`` cannot run the scenario's plan: an embedding sharded
    over the vocabulary (it has linear layers only), or a tied head the plan shards (its layers
    replace the weight they shard, which unties it); None when neither."""
    tensor_parallel, spec = scenario.tensor_parallel, scenario.model
    plan = {} if tensor_parallel is None else dict(tensor_parallel.plan)
    for name, style in plan.items():
        if style in VOCABULARY_STYLES:
            return (
                f"{name}: a vocabulary-parallel embedding, which parallel.tensor_parallel has "
                "not (torch_tp has RowwiseParallel on an nn.Embedding)"
            )
    if isinstance(spec, ShardedSpec) and spec.tied and "head" in plan:
        return "head: tied to the embedding, and parallel.tensor_parallel's layers untie it"
    return None


def no_head_norm(scenario: Scenario) -> str | None:
    """Why ``parallel.tensor_parallel`` cannot run the scenario's plan: a q/k norm over the heads
    a rank holds (its weight's gradient summed over ``tp``), which it has no layer for; None
    when the plan has none."""
    plan = () if scenario.tensor_parallel is None else scenario.tensor_parallel.plan
    found = [name for name, style in plan if style == HEAD_NORM]
    if not found:
        return None
    return (
        f"{found[0]}: a q/k norm over the heads each rank holds, which parallel.tensor_parallel "
        "has no layer for (torch_tp: SequenceParallel over the heads dimension)"
    )


def no_loss_parallel(scenario: Scenario) -> str | None:
    """Why ``parallel.tensor_parallel`` cannot run the scenario's plan: a head whose logits stay
    sharded over the vocabulary needs a vocabulary-parallel cross-entropy, which it has not
    (torch's ``loss_parallel()``: ``torch_tp``, ``torch_2d``); None when the plan has none."""
    plan = () if scenario.tensor_parallel is None else scenario.tensor_parallel.plan
    found = [name for name, style in plan if style in LOSS_STYLES]
    if not found:
        return None
    return (
        f"{found[0]}: logits sharded over the vocabulary need a vocabulary-parallel "
        "cross-entropy, which parallel.tensor_parallel has not (torch_tp has loss_parallel())"
    )


_DECLINED: Mapping[str, str] = {
    "checkpoint": "the default hooks save rank 0's state_dict, which holds only its shards",
    "rank-orders": "the initial broadcast of the replicated parameters pairs them by "
    "registration order, which must be the same on every rank",
    "autocast": AUTOCAST_ON_A_MESH,
}


@dataclasses.dataclass(frozen=True)
class ParallelTPTarget(PlanTarget):
    """``parallel.tensor_parallel.parallelize`` with the scenario's plan over ``mesh["tp"]``;
    with ``dp > 1``, ``parallel.DDP`` over ``mesh["dp"]`` averages every gradient (shards
    included: the ranks of a ``dp`` group hold the same shard). Clipping takes the global norm
    (``parallel.tensor_parallel.clip_grad_norm_``).

    Per rank and example (set in :meth:`parallelize`, on the configured copy the runner uses):
    the ``tp`` group, the ``dp`` group (None at ``dp = 1``), the sharded parameters and the
    optimizer, which :meth:`full_tensor` reads."""

    declined_features: ClassVar[Mapping[str, str]] = _DECLINED
    requires = (("torch", TP_FLOOR),)  # the only release tried so far
    #: the layer classes the plan is applied with (a mutant swaps one)
    column_class: ClassVar[type[tp.ColumnParallelLinear]] = tp.ColumnParallelLinear
    row_class: ClassVar[type[tp.RowParallelLinear]] = tp.RowParallelLinear
    norm_class: ClassVar[type[sp.SequenceParallelNorm]] = sp.SequenceParallelNorm

    def supports_at(self, scenario: Scenario, world_size: int) -> str | None:
        return (
            mesh_problem(scenario.tensor_parallel, world_size)
            or no_head_norm(scenario)
            or shard_missing(scenario, world_size)
            or empty_sequence(scenario, world_size)
            or no_loss_parallel(scenario)
            or no_vocabulary_parallel(scenario)
        )

    # -- per rank ------------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return cast(dict[str, Any], vars(self).setdefault("_rank_state", {}))

    def parallelize(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        group, dp = mesh.get_group("tp"), mesh["dp"].size()
        module = self.apply_plan(module, group)
        state = self._state()
        state.clear()
        state.update(
            tp_group=group,
            dp_group=mesh.get_group("dp") if dp > 1 else None,
            module=module,
            shards=[(p, layer, dim) for _, p, layer, dim in tp.sharded_parameters(module)],
        )
        return module

    def apply_plan(self, module: nn.Module, group: dist.ProcessGroup) -> nn.Module:
        """The plan applied over the ``tp`` group (``parallel.sequence_parallel.parallelize``:
        its linears, then its sequence-parallel regions)."""
        return sp.parallelize(
            module,
            group,
            self.plan,
            column=self.column_class,
            row=self.row_class,
            norm=self.norm_class,
        )

    def wrap(self, module: nn.Module) -> nn.Module:
        dp_group = self._state().get("dp_group")
        return module if dp_group is None else DDP(module, process_group=dp_group)

    def make_optimizer(
        self, params: Params, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any
    ) -> OptimizerLike:
        optimizer = optimizer_cls(params, **kwargs)
        self._state()["optimizer"] = optimizer
        return optimizer

    def after_backward(self, model: nn.Module, optimizer: OptimizerLike) -> None:
        if isinstance(model, DDP):
            model.finish_gradient_sync()

    def no_sync(self, model: nn.Module) -> AbstractContextManager[object]:
        return model.no_sync() if isinstance(model, DDP) else contextlib.nullcontext()

    def reported_loss(
        self, model: nn.Module, optimizer: OptimizerLike, losses: Sequence[MicroBatchLoss]
    ) -> torch.Tensor:
        # a tp group's ranks share one loss; the dp groups' are averaged, as their gradients are
        loss = MicroBatchLoss.total(losses)
        return model.reduce_loss(loss) if isinstance(model, DDP) else loss

    def clip_grad_norm(
        self, model: nn.Module, optimizer: OptimizerLike, max_norm: float, norm_type: float
    ) -> object:
        state = self._state()
        return tp.clip_grad_norm_(state["module"], state["tp_group"], max_norm, norm_type)

    # -- what the oracle reads -----------------------------------------------------------------

    def _shard_of(self, tensor: torch.Tensor) -> tuple[tp.ShardedLinear, int] | None:
        """The layer and dim of the shard ``tensor`` views (a sharded parameter, its gradient or
        its optimizer state); None for a tensor that is whole on every rank."""
        if tensor.numel() == 0:
            return None
        for param, layer, dim in self._state().get("shards", ()):
            for held in self._held(param):
                if held.data_ptr() == tensor.data_ptr() and held.shape == tensor.shape:
                    return layer, dim
        return None

    def _held(self, param: torch.Tensor) -> Iterator[torch.Tensor]:
        yield param
        if param.grad is not None:
            yield param.grad
        optimizer = self._state().get("optimizer")
        state = getattr(optimizer, "state", {}) if optimizer is not None else {}
        for value in state.get(param, {}).values():
            if torch.is_tensor(value) and value.shape == param.shape:  # not Adam's step count
                yield value

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        found = self._shard_of(tensor)
        if found is None:
            return tensor
        layer, dim = found
        return layer.full(tensor, dim)

    def local_shard(self, tensor: torch.Tensor) -> tuple[int | None, torch.Tensor] | None:
        """``(dim, tensor)`` for a shard of a parameter when the ``tp`` group is the whole world
        (``dp = 1``: chunk ``rank`` of ``torch.chunk``, what the oracle's shard check reads);
        None otherwise (with ``dp > 1`` a rank's chunk is its ``tp`` coordinate's)."""
        found = self._shard_of(tensor)
        if found is None or found[0].tp != dist.get_world_size():
            return None
        return found[1], tensor
