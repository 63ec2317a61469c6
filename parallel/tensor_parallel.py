"""A small, readable Megatron-style tensor-parallel layer pair: which activations cross the wire.

Tensor parallelism splits one ``nn.Linear`` over the ``tp`` ranks of a group, which all see the
*same* samples. A :class:`ColumnParallelLinear` holds a slice of the output features (rows of the
weight, and of the bias); a :class:`RowParallelLinear` holds a slice of the input features
(columns of the weight) and the whole bias. A column layer whose output stays sharded feeds a
row layer whose input is sharded -- an MLP's up and down projections, attention's q, k, v and
output projection -- and the pair costs one all-reduce forward and one backward.

Shards follow ``torch.chunk``: ``n`` features over ``tp`` ranks in chunks of ``ceil(n / tp)``,
the last ones shorter (what DTensor's ``Shard`` and FSDP2 do). Uneven sizes are fine; every rank
must hold at least one feature (``torch.chunk`` of 5 over 4 makes 3 chunks, and such a plan is
refused: an empty shard is no plan anybody writes).

Invariant: after :func:`parallelize` and on every rank of the group, the module computes the
function the unparallelized module computes with rank 0's initial weights; each replicated
parameter and its gradient are bitwise identical on every rank of the group; the gradient of
each shard is that slice of the full gradient. Nothing is averaged over the group: its ranks see
the same samples, so there is nothing to average.

What moves, and when (each collective is a small autograd function below, called by name at
its call site):

1. :func:`parallelize`: every parameter and buffer that stays whole broadcast from the group's
   rank 0 (:func:`broadcast_replicated`), then each planned ``nn.Linear`` replaced by a layer
   holding its chunk of rank 0's weights, scattered from rank 0 (:func:`shard_linears`);
2. column forward: the input is *copied* to the group (:class:`CopyToGroup`: identity forward,
   all-reduce backward -- each rank's input gradient is the part its output features give);
   with ``gather_output`` the sharded output is all-gathered (:class:`GatherFromGroup`; backward:
   each rank keeps its slice of the output gradient);
3. row forward: with a replicated input, each rank takes its slice of the input features
   (:class:`ScatterToGroup`; backward: the slices of the input gradient all-gathered); the
   partial products are *reduced* over the group (:class:`ReduceFromGroup`: all-reduce forward,
   identity backward); the bias is added once, after the all-reduce (added on every rank before
   it, it would count ``tp`` times).

Gradient clipping needs one global norm: each shard's squares summed over the group, each
replicated gradient counted once (:func:`clip_grad_norm_`).

Sequence parallelism (norms on each rank's share of the sequence between a row layer and the
next column layer) is ``parallel.sequence_parallel``'s; the layers here give a region its ends
(``sequence_output``, ``sequence_input``: :func:`scatter_to_sequence`,
:func:`gather_from_sequence`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel._checks import InvalidArgument, check_positive_number

__all__ = [
    "REGION_STYLES",
    "SEQUENCE_LINEARS",
    "STYLES",
    "ColumnParallelLinear",
    "CopyToGroup",
    "GatherFromGroup",
    "ReduceFromGroup",
    "RowParallelLinear",
    "ScatterToGroup",
    "ShardedLinear",
    "broadcast_replicated",
    "check_plan",
    "chunk_bounds",
    "clip_grad_norm_",
    "copy_to_group",
    "gather_from_group",
    "parallelize",
    "reduce_from_group",
    "gather_from_sequence",
    "scatter_to_group",
    "scatter_to_sequence",
    "shard_linears",
    "sharded_parameters",
]

#: The styles a plan may name (ddpcheck's names, torch's meaning): ``(layer, option)``.
#: ``colwise-dtensor`` is torch's ``ColwiseParallel(use_local_output=False)``; here a local shard
#: is just a tensor, so it is ``colwise``.
STYLES: dict[str, tuple[str, bool]] = {
    "colwise": ("column", False),  # output left sharded, for the row layer that consumes it
    "colwise-dtensor": ("column", False),
    "colwise-replicate": ("column", True),  # gather_output=True
    "rowwise": ("row", True),  # input_is_parallel=True: the column layer's sharded output
    "rowwise-replicate": ("row", False),  # a replicated input, sliced here
    # the ends of a sequence-parallel region (parallel.sequence_parallel): the row layer's
    # output reduce-scattered along the sequence, the column layer's input gathered along it
    "rowwise-sequence": ("row", False),
    "colwise-sequence": ("column", True),
}
#: The styles whose linear meets a sequence-parallel region (see :data:`STYLES`).
SEQUENCE_LINEARS = frozenset({"rowwise-sequence", "colwise-sequence"})
#: The plan styles of a sequence-parallel region (``parallel.sequence_parallel``): a norm
#: itself, and its block's ends -- ``(cut the input, gather the output)``.
REGION_STYLES: dict[str, tuple[bool, bool]] = {
    "sequence": (False, False),
    "sequence-in": (True, False),
    "sequence-out": (False, True),
    "sequence-in-out": (True, True),
}


def chunk_bounds(size: int, tp: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``rank`` of ``torch.chunk`` over ``size`` features in ``tp``."""
    chunk = math.ceil(size / tp)
    start = min(rank * chunk, size)
    return start, min(start + chunk, size)


# -- the collectives, as autograd functions ---------------------------------------------------


class CopyToGroup(torch.autograd.Function):
    """Forward: the input as it is (every rank holds it whole). Backward: the input gradient
    all-reduced, since each rank's part comes from its own output features only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        # sum the partial input gradients of the group's ranks: every rank gets the whole
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromGroup(torch.autograd.Function):
    """Forward: the partial outputs all-reduced (summed). Backward: the gradient as it is --
    every rank's partial output contributed to the sum with weight one."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = partial.contiguous().clone()
        # sum the row layer's partial products over the group: the whole output on every rank
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _gather_last(
    local: torch.Tensor, bounds: list[tuple[int, int]], size: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """The chunks of the last dim held by the group's ranks -- rank ``r`` holds features
    ``bounds[r]`` -- all-gathered into ``size`` features. gloo gathers equal sizes only: each
    chunk travels padded to the longest."""
    longest = max(stop - start for start, stop in bounds)
    padded = F.pad(local.contiguous(), (0, longest - local.shape[-1]))
    chunks = [torch.empty_like(padded) for _ in bounds]
    # every rank's chunk of the features to every rank (padded to equal sizes)
    dist.all_gather(chunks, padded, group=group)
    whole = local.new_zeros(*local.shape[:-1], size)
    for chunk, (start, stop) in zip(chunks, bounds):
        whole[..., start:stop] = chunk[..., : stop - start]
    return whole


class GatherFromGroup(torch.autograd.Function):
    """Forward: the sharded output features all-gathered (a column layer's replicated output;
    rank ``r`` holds features ``bounds[r]``). Backward: each rank keeps its own slice of the
    output gradient (identical on every rank)."""

    @staticmethod
    def forward(
        ctx: Any,
        local: torch.Tensor,
        bounds: list[tuple[int, int]],
        size: int,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.mine = bounds[dist.get_rank(group)]
        return _gather_last(local, bounds, size, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        start, stop = ctx.mine
        return grad[..., start:stop].contiguous(), None, None, None


class ScatterToGroup(torch.autograd.Function):
    """Forward: this rank's slice of a replicated input's features, ``bounds[rank]`` (no
    communication). Backward: the slices of the input gradient all-gathered, so every rank
    holds it whole."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, bounds: list[tuple[int, int]], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.bounds, ctx.size, ctx.group = bounds, x.shape[-1], group
        start, stop = bounds[dist.get_rank(group)]
        return x[..., start:stop].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather_last(grad, ctx.bounds, ctx.size, ctx.group), None, None


def copy_to_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """:class:`CopyToGroup` applied: ``x`` forward, its gradient all-reduced backward."""
    out: torch.Tensor = CopyToGroup.apply(x, group)  # type: ignore[no-untyped-call]  # torch's
    return out


def reduce_from_group(partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """:class:`ReduceFromGroup` applied: ``partial`` all-reduced forward, identity backward."""
    out: torch.Tensor = ReduceFromGroup.apply(partial, group)  # type: ignore[no-untyped-call]
    return out


def gather_from_group(
    local: torch.Tensor, bounds: list[tuple[int, int]], size: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """:class:`GatherFromGroup` applied: ``size`` features all-gathered from each rank's chunk."""
    out: torch.Tensor = GatherFromGroup.apply(  # type: ignore[no-untyped-call]  # torch's
        local, bounds, size, group
    )
    return out


def scatter_to_group(
    x: torch.Tensor, bounds: list[tuple[int, int]], group: dist.ProcessGroup
) -> torch.Tensor:
    """:class:`ScatterToGroup` applied: this rank's slice forward, all-gathered backward."""
    out: torch.Tensor = ScatterToGroup.apply(x, bounds, group)  # type: ignore[no-untyped-call]
    return out


def _sequence_layout(length: int, group: dist.ProcessGroup) -> list[tuple[int, int]]:
    tp = dist.get_world_size(group)
    return [chunk_bounds(length, tp, rank) for rank in range(tp)]


def scatter_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's tokens of a replicated ``x`` (dim 1); backward: the shares all-gathered."""
    bounds = _sequence_layout(x.shape[1], group)
    return scatter_to_group(x.movedim(1, -1), bounds, group).movedim(-1, 1)


def gather_from_sequence(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's tokens (dim 1) all-gathered into the whole sequence; backward: each rank
    keeps its own tokens' gradient. The shares' lengths travel first: uneven shares are not
    known from one of them."""
    lengths = [torch.zeros((), dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    # every rank's number of tokens, so that each knows where the others' go
    dist.all_gather(lengths, torch.tensor(local.shape[1], dtype=torch.int64), group=group)
    bounds, start = [], 0
    for n in lengths:
        bounds.append((start, start + int(n)))
        start += int(n)
    return gather_from_group(local.movedim(1, -1), bounds, start, group).movedim(-1, 1)


# -- the layers --------------------------------------------------------------------------------


class ShardedLinear(nn.Module):
    """What the two layers share: the group, the full sizes, and the scatter of rank 0's weights.

    ``self.weight`` (and a column layer's ``self.bias``) hold this rank's chunk along
    ``shard_dims[name]``; :meth:`full` gathers such a tensor whole (a parameter, its gradient, or
    optimizer state of its shape), for checking. Seams: ``_bounds`` (which features a rank
    holds), ``_scatter`` (how rank 0's full tensor reaches the ranks), ``forward``.
    """

    #: name -> the dim of the parameter that is sharded (absent: replicated)
    shard_dims: dict[str, int]

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup):
        super().__init__()
        self.group = group
        self.tp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def _bounds(self, size: int, rank: int) -> tuple[int, int]:
        """``[start, stop)`` of the features rank ``rank`` of the group holds."""
        return chunk_bounds(size, self.tp, rank)

    def _check_every_rank_holds_a_feature(self, size: int, what: str) -> None:
        start, stop = self._bounds(size, self.tp - 1)
        if stop <= start:
            raise InvalidArgument(
                f"{type(self).__name__}: {size} {what} over tp={self.tp} ranks leave the last "
                "rank no feature (torch.chunk); every rank must hold at least one"
            )

    @torch.no_grad()
    def _scatter(self, full: torch.Tensor, dim: int) -> nn.Parameter:
        """This rank's chunk of rank 0's ``full`` along ``dim``, scattered from rank 0 (every
        rank passes its own ``full``; only rank 0's is read). Chunks travel padded to the
        longest: gloo scatters equal sizes only."""
        size = full.shape[dim]
        layout = self._layout(size)
        longest = max(b - a for a, b in layout)
        start, stop = layout[self.rank]
        shape = list(full.shape)
        shape[dim] = longest
        mine = torch.zeros(shape, dtype=full.dtype, device=full.device)
        pieces = None
        if self.rank == 0:
            pieces = []
            for a, b in layout:
                piece = torch.zeros_like(mine)
                piece.narrow(dim, 0, b - a).copy_(full.narrow(dim, a, b - a))
                pieces.append(piece)
        # rank 0 sends each rank its chunk of the full weight (once, at construction)
        dist.scatter(mine, pieces, src=dist.get_global_rank(self.group, 0), group=self.group)
        return nn.Parameter(mine.narrow(dim, 0, stop - start).clone())

    def _layout(self, size: int) -> list[tuple[int, int]]:
        """Every rank's ``[start, stop)`` of ``size`` features, in group rank order."""
        return [self._bounds(size, rank) for rank in range(self.tp)]

    @torch.no_grad()
    def full(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole of ``tensor`` -- this rank's chunk along ``dim`` of a sharded parameter, its
        gradient or optimizer state -- from every rank's chunk. Collective over the group."""
        size = self.out_features if dim == 0 else self.in_features
        moved = tensor.movedim(dim, -1)
        return _gather_last(moved, self._layout(size), size, self.group).movedim(-1, dim)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp}"


class ColumnParallelLinear(ShardedLinear):
    """``nn.Linear`` with its output features split over ``group``: this rank holds rows
    ``chunk_bounds(out_features, tp, rank)`` of the weight and of the bias.

    ``gather_output``: the output is all-gathered to every rank (a lone layer); otherwise it
    stays sharded, for a :class:`RowParallelLinear` with ``input_is_parallel=True``.
    ``sequence_input``: the input arrives as this rank's share of the sequence (a region's end)
    and is all-gathered first (its gradient then summed and cut: a reduce-scatter backward).
    Collective: construction scatters rank 0's weights. Seams: ``_copy_in``, ``_gather_out``.
    """

    def __init__(
        self,
        linear: nn.Linear,
        group: dist.ProcessGroup,
        gather_output: bool = False,
        sequence_input: bool = False,
    ):
        super().__init__(linear, group)
        self.sequence_input = sequence_input
        self._check_every_rank_holds_a_feature(self.out_features, "output features")
        self.gather_output = gather_output
        self.weight = self._scatter(linear.weight, 0)
        self.bias = None if linear.bias is None else self._scatter(linear.bias, 0)
        self.shard_dims = {"weight": 0, **({} if self.bias is None else {"bias": 0})}

    def _copy_in(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to_group(x, self.group)

    def _gather_out(self, y: torch.Tensor) -> torch.Tensor:
        return gather_from_group(y, self._layout(self.out_features), self.out_features, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_input:
            x = gather_from_sequence(x, self.group)
        y = F.linear(self._copy_in(x), self.weight, self.bias)
        return self._gather_out(y) if self.gather_output else y


class RowParallelLinear(ShardedLinear):
    """``nn.Linear`` with its input features split over ``group``: this rank holds columns
    ``chunk_bounds(in_features, tp, rank)`` of the weight, and the whole bias.

    ``input_is_parallel``: the input arrives sharded (a column layer's output); otherwise it is
    replicated and each rank takes its slice. The output is whole on every rank;
    ``sequence_output``: then cut along the sequence, each rank its tokens (a region's start: with
    the all-reduce before it, a reduce-scatter). Collective: construction scatters rank 0's
    weight. Seams: ``_scatter_in``, ``_reduce_out``, ``forward``.
    """

    def __init__(
        self,
        linear: nn.Linear,
        group: dist.ProcessGroup,
        input_is_parallel: bool = True,
        sequence_output: bool = False,
    ):
        super().__init__(linear, group)
        self.sequence_output = sequence_output
        self._check_every_rank_holds_a_feature(self.in_features, "input features")
        self.input_is_parallel = input_is_parallel
        self.weight = self._scatter(linear.weight, 1)
        # replicated: rank 0's, as broadcast_replicated() sent it
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        self.shard_dims = {"weight": 1}

    def _scatter_in(self, x: torch.Tensor) -> torch.Tensor:
        return scatter_to_group(x, self._layout(self.in_features), self.group)

    def _reduce_out(self, partial: torch.Tensor) -> torch.Tensor:
        return reduce_from_group(partial, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = self._scatter_in(x)
        y = self._reduce_out(F.linear(x, self.weight))
        # the bias once, after the sum: added to every partial product it would count tp times
        y = y if self.bias is None else y + self.bias
        # cut after the bias: its gradient then comes from every token (gathered back), not
        # from this rank's alone
        return scatter_to_sequence(y, self.group) if self.sequence_output else y


# -- applying a plan ---------------------------------------------------------------------------


def parallelize(
    module: nn.Module,
    group: dist.ProcessGroup,
    plan: Iterable[tuple[str, str]],
    *,
    column: type[ColumnParallelLinear] = ColumnParallelLinear,
    row: type[RowParallelLinear] = RowParallelLinear,
) -> nn.Module:
    """``module`` with each ``nn.Linear`` named in ``plan`` (``(module name, style)`` pairs,
    styles of :data:`STYLES`) replaced by a column- or row-parallel layer over ``group``, its
    shards scattered from the group's rank 0, and every other parameter and buffer broadcast
    from it. Collective over the group; returns ``module``, changed in place. ``column`` and
    ``row``: the layer classes (a subclass changes one step). A plan's sequence-parallel
    regions (:data:`REGION_STYLES`) are ``parallel.sequence_parallel``'s to apply."""
    plan = check_plan(module, plan)
    broadcast_replicated(module, group, plan)
    return shard_linears(module, group, plan, column=column, row=row)


def check_plan(module: nn.Module, plan: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """``plan`` as a list, each entry checked: a known style, an ``nn.Linear`` of ``module``
    (a sequence-parallel region's norm or block: ``parallel.sequence_parallel``)."""
    plan = [(str(name), str(style)) for name, style in plan]
    for name, style in plan:
        if style in REGION_STYLES:
            module.get_submodule(name)  # there (apply_regions checks a norm is one)
            continue
        if style not in STYLES:
            raise InvalidArgument(
                f"plan style {style!r} of {name!r}: the styles are {[*STYLES, *REGION_STYLES]}"
            )
        if not isinstance(module.get_submodule(name), nn.Linear):
            raise InvalidArgument(f"plan names {name!r}, which is not an nn.Linear")
    return plan


@torch.no_grad()
def broadcast_replicated(
    module: nn.Module, group: dist.ProcessGroup, plan: list[tuple[str, str]]
) -> None:
    """Every parameter and buffer of ``module`` that stays whole on every rank -- all but the
    planned layers' weights and column layers' biases, which are scattered -- from the group's
    rank 0, in registration order (the same on every rank of the group)."""
    scattered = set()
    for name, style in plan:
        if style not in STYLES:  # a region's norm or block: replicated
            continue
        linear = module.get_submodule(name)
        assert isinstance(linear, nn.Linear)  # check_plan's promise
        scattered.add(id(linear.weight))
        if STYLES[style][0] == "column" and linear.bias is not None:
            scattered.add(id(linear.bias))
    src = dist.get_global_rank(group, 0)
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) in scattered:
            continue
        buffer = tensor.detach().contiguous()
        # rank 0's initial value of a replicated tensor to every rank of the group, once
        dist.broadcast(buffer, src=src, group=group)
        tensor.copy_(buffer)


def shard_linears(
    module: nn.Module,
    group: dist.ProcessGroup,
    plan: list[tuple[str, str]],
    *,
    column: type[ColumnParallelLinear] = ColumnParallelLinear,
    row: type[RowParallelLinear] = RowParallelLinear,
) -> nn.Module:
    """Each planned ``nn.Linear`` of ``module`` replaced by its parallel layer (whose
    construction scatters rank 0's weights), in plan order on every rank."""
    for name, style in plan:
        if style not in STYLES:  # a region's norm or block (parallel.sequence_parallel)
            continue
        linear = module.get_submodule(name)
        assert isinstance(linear, nn.Linear)  # check_plan's promise
        kind, option = STYLES[style]
        sequence = style in SEQUENCE_LINEARS
        layer: ShardedLinear = (
            column(linear, group, gather_output=option, sequence_input=sequence)
            if kind == "column"
            else row(linear, group, input_is_parallel=option, sequence_output=sequence)
        )
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, child, layer)
    return module


def sharded_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter, ShardedLinear, int]]:
    """``(name, parameter, layer, dim)`` for each parameter of ``module`` held as a shard."""
    for prefix, layer in module.named_modules():
        if isinstance(layer, ShardedLinear):
            for local, dim in layer.shard_dims.items():
                name = f"{prefix}.{local}" if prefix else local
                yield name, getattr(layer, local), layer, dim


@torch.no_grad()
def clip_grad_norm_(
    module: nn.Module, group: dist.ProcessGroup, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Scale every gradient of ``module`` so that the ``norm_type``-norm of the *full* gradients
    is at most ``max_norm``; return that norm, as ``torch.nn.utils.clip_grad_norm_`` on the
    unparallelized module would. Collective over the group: one scalar all-reduced.

    Each shard's share (|g|^p summed, or its max for p = inf) is combined over the group; each
    replicated gradient -- the same on every rank -- is counted once, after the combination."""
    max_norm, p = check_positive_number("max_norm", max_norm), float(norm_type)
    sharded = {id(param) for _, param, _, _ in sharded_parameters(module)}
    grads = [(id(q), q.grad) for q in module.parameters() if q.grad is not None]
    device = next(module.parameters()).device
    share = _norm_share([g for i, g in grads if i in sharded], p, device)
    # combine the shards' shares over the group: each rank holds one slice of them
    dist.all_reduce(
        share, op=dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.SUM, group=group
    )
    replicated = _norm_share([g for i, g in grads if i not in sharded], p, device)
    total = torch.maximum(share, replicated) if p == math.inf else share + replicated
    norm = total if p == math.inf else total ** (1.0 / p)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for _, g in grads:
        g.mul_(coefficient.to(g.dtype))
    return norm


def _norm_share(grads: list[torch.Tensor], p: float, device: torch.device) -> torch.Tensor:
    """|g|^p summed over ``grads`` (their max for p = inf), as one float64 scalar."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g.double(), p) for g in grads])
    return norms.max() if p == math.inf else (norms**p).sum()
