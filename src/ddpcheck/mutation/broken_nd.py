"""Mutants of a pipeline of tensor-parallel stages: ``torch_nd``
(``ddpcheck.targets.pipeline_nd.TorchNDTarget``) with one seeded bug each (family M of
``docs/bug-catalogue.md``), about the composition itself: which group a stage's gradients are
reduced over. The unmutated ``torch_nd`` is their control.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ddpcheck.targets.pipeline import Stage
from ddpcheck.targets.pipeline_nd import TorchNDTarget

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ENTRIES", "TPReplicatedSummedND"]


@dataclasses.dataclass(frozen=True)
class TPReplicatedSummedND(TorchNDTarget):
    """``shard_stage``: every gradient placed ``Replicate`` along ``tp`` all-reduced over the
    ``tp`` group as it accumulates -- the reduction a sequence-parallel norm's partial gradients
    need, applied to gradients every ``tp`` rank already holds whole: ``tp`` times the truth
    (Megatron's "all-reduce the layernorm gradients" on the wrong parameters). At ``dp = 1``:
    FSDP2 owns the gradients over ``dp``."""

    def shard_stage(self, part: Stage, index: int, stages: int, mesh: DeviceMesh) -> nn.Module:
        runnable = super().shard_stage(part, index, stages, mesh)
        if mesh.ndim < 3 or mesh.size(2) == 1 or mesh.size(0) > 1:
            return runnable
        from torch.distributed.tensor import DTensor, Replicate

        group = mesh.get_group("tp")

        def summed(p: torch.Tensor) -> None:
            if isinstance(p.grad, DTensor):
                dist.all_reduce(p.grad.to_local(), group=group)  # BUG: already whole

        for p in part.parameters():
            if isinstance(p, DTensor) and p.placements[-1] == Replicate():
                p.register_post_accumulate_grad_hook(summed)  # type: ignore[no-untyped-call]
        return runnable


#: The catalogue's rows of this family: ``(mutant class name, bug class, one line)``.
ENTRIES: list[tuple[str, str, str]] = [
    (
        "TPReplicatedSummedND",
        "M8",
        "a stage's tp-replicated gradients all-reduced over tp: tp times the truth",
    ),
]
