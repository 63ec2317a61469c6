"""Sequence parallelism beside the tensor-parallel layer pair: a norm on each rank's share of
the sequence, and where the sequence is cut and gathered.

Between a row layer and the next column layer the activations are whole on every rank of the
``tp`` group, and a norm there computes the same thing ``tp`` times. Megatron's "sequence
parallelism" (torch's ``SequenceParallel``) cuts the sequence (dim 1 of ``(batch, sequence,
features)``) over the group instead: each rank normalises its own tokens. The norm's weights stay
replicated, so each rank's weight gradient sums its own tokens only: **the gradients must be
all-reduced over the group** (what :class:`SequenceParallelNorm` does through ``copy_to_group``:
identity forward, all-reduce backward), or the replicas train on a part of the sequence each.

What moves, and when (the sequence is split as ``torch.chunk`` splits it: 3 tokens over 2 ranks
are 2 and 1):

1. into a region: a replicated input is *cut* (``scatter_to_sequence``: each rank its
   tokens, no communication; backward: the gradient's shares all-gathered), or a row layer's
   partial outputs are *reduce-scattered* (``RowParallelLinear(sequence_output=True)``: summed,
   then cut -- gloo has no reduce-scatter, so an all-reduce and a slice);
2. out of it: the shares are *all-gathered* (``gather_from_sequence``; backward: each rank
   keeps its tokens' gradient), by a norm block's end or by a column layer's input
   (``ColumnParallelLinear(sequence_input=True)``, whose input gradient is then summed over the
   group and cut: a reduce-scatter, backward).

Invariant: as for the layer pair (``parallel.tensor_parallel``), the module computes the function
the unparallelized module computes, and every replicated parameter and its gradient are bitwise
identical on every rank of the group.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from parallel._checks import InvalidArgument
from parallel.tensor_parallel import (
    REGION_STYLES,
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_group,
    gather_from_sequence,
    scatter_to_sequence,
)
from parallel.tensor_parallel import parallelize as parallelize_linears

__all__ = ["SequenceParallelNorm", "apply_regions", "parallelize"]


class SequenceParallelNorm(nn.Module):
    """A norm (``nn.LayerNorm``, ``nn.RMSNorm``) run on this rank's tokens, its parameters the
    norm's own (replicated, same names) and their gradients all-reduced over ``group``: each
    rank's part holds only its tokens' sum. Seam: ``_share``."""

    def __init__(self, norm: nn.Module, group: dist.ProcessGroup):
        super().__init__()
        self.group = group
        for name, param in norm.named_parameters(recurse=False):
            self.register_parameter(name, param)
        object.__setattr__(self, "_norm", norm)  # its function; its parameters are ours

    def _share(self, param: torch.Tensor) -> torch.Tensor:
        return copy_to_group(param, self.group)  # backward: the tokens' partial sums all-reduced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = {name: self._share(p) for name, p in self.named_parameters(recurse=False)}
        norm: nn.Module = vars(self)["_norm"]
        out: torch.Tensor = functional_call(norm, params, (x,))
        return out


def apply_regions(
    module: nn.Module,
    group: dist.ProcessGroup,
    plan: Iterable[tuple[str, str]],
    *,
    norm: type[SequenceParallelNorm] = SequenceParallelNorm,
) -> nn.Module:
    """The plan's region styles applied to ``module`` in place: each ``"sequence"`` norm replaced
    by a ``norm`` over ``group``; each block with a region's end cuts its input
    (``scatter_to_sequence``) or gathers its output (``gather_from_sequence``), by
    forward hooks (its parameters keep their names)."""
    for name, style in plan:
        if style not in REGION_STYLES:
            continue
        target = module.get_submodule(name)
        if style == "sequence":
            if not isinstance(target, (nn.LayerNorm, nn.RMSNorm)):
                raise InvalidArgument(f"plan names {name!r} sequence-parallel: not a norm")
            parent, _, child = name.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, child, norm(target, group))
            continue
        cut, gathered = REGION_STYLES[style]
        if cut:
            target.register_forward_pre_hook(
                lambda _, args: (scatter_to_sequence(args[0], group), *args[1:])
            )
        if gathered:
            target.register_forward_hook(lambda _, __, out: gather_from_sequence(out, group))
    return module


def parallelize(
    module: nn.Module,
    group: dist.ProcessGroup,
    plan: Iterable[tuple[str, str]],
    *,
    column: type[ColumnParallelLinear] = ColumnParallelLinear,
    row: type[RowParallelLinear] = RowParallelLinear,
    norm: type[SequenceParallelNorm] = SequenceParallelNorm,
) -> nn.Module:
    """The whole plan: its linears (``parallel.tensor_parallel.parallelize``), then its
    sequence-parallel regions (:func:`apply_regions`). Collective over the group."""
    plan = list(plan)
    parallelize_linears(module, group, plan, column=column, row=row)
    return apply_regions(module, group, plan, norm=norm)
