"""Random models that tensor-parallel plans apply to, and the plans valid for each.

A :class:`ShardedSpec` is a transformer-shaped stack on sequences: an input projection, blocks --
``"mlp"`` (a column/row pair of linears around a GELU), ``"attention"`` (q, k, v and an output
projection; heads split by ``view`` from the *local* width, as tensor-parallel code must), or
``"norm"`` (a LayerNorm, replicated) -- each with a residual connection, and a linear head. Widths,
hidden sizes and head counts are drawn, **including ones the tensor-parallel degree does not
divide** (first-class, as an uneven batch is for data parallelism): torch shards them as
``torch.chunk`` does, and a plan must still train the one-process model.

:func:`plan_choices` says, per module group, which styles keep the model computing the same
function under tensor parallelism (valid by construction): a column-wise layer whose output stays
sharded must be consumed by its row-wise partner; attention may be split only along whole heads;
a lone linear may be column-wise with its output all-gathered or row-wise on a replicated input.

Invariant (as in ``zoo``): every model is a deterministic function of its weights and of each
sample separately, so W ranks and the reference compute the same objective.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ddpcheck._base.errors import InvalidArgument
from ddpcheck._base.options import named_fields

__all__ = [
    "BLOCK_KINDS",
    "IN_FEATURES",
    "OUT_FEATURES",
    "SEQUENCE",
    "ShardedBlock",
    "ShardedModel",
    "ShardedSpec",
    "plan_choices",
    "every_rank_holds",
    "holders",
    "sequence_data",
]

IN_FEATURES, OUT_FEATURES, SEQUENCE = 5, 3, 3
BLOCK_KINDS = ("mlp", "attention", "norm")


def sequence_data(seed: int, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of sequences: x ``(B, 3, 5)``, y ``(B, 3, 3)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, SEQUENCE, IN_FEATURES, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(batch, SEQUENCE, OUT_FEATURES, generator=g, dtype=torch.float64).to(dtype)
    return x, y


@named_fields
@dataclasses.dataclass(frozen=True)
class ShardedBlock:
    """One block: ``kind`` one of :data:`BLOCK_KINDS`; ``size``: an MLP's hidden width or the
    number of attention heads (unused by a norm); ``bias``: whether its linears have biases."""

    kind: str = "mlp"
    size: int = 4
    bias: bool = True

    def __post_init__(self) -> None:
        if self.kind not in BLOCK_KINDS:
            raise InvalidArgument(f"ShardedBlock(kind={self.kind!r}) must be one of {BLOCK_KINDS}")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise InvalidArgument(f"ShardedBlock(size={self.size!r}) must be an integer >= 1")


@named_fields
@dataclasses.dataclass(frozen=True)
class ShardedSpec:
    """A whole model (see the module docstring); ``head_dim``: each attention head's width."""

    blocks: tuple[ShardedBlock, ...] = (ShardedBlock(),)
    width: int = 4
    head_dim: int = 2

    def __post_init__(self) -> None:
        for name in ("width", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"ShardedSpec({name}={value!r}) must be an integer >= 1")

    def __call__(self) -> ShardedModel:
        return ShardedModel(self)


class _MLP(nn.Module):
    def __init__(self, width: int, hidden: int, bias: bool):
        super().__init__()
        self.up = nn.Linear(width, hidden, bias=bias)
        self.down = nn.Linear(hidden, width, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class _Attention(nn.Module):
    """Causal self-attention; the heads come from the local width (``width // head_dim``),
    so column-wise q, k, v hold whole heads on each rank when the plan splits along heads."""

    def __init__(self, width: int, heads: int, head_dim: int, bias: bool):
        super().__init__()
        self.head_dim = head_dim
        self.q = nn.Linear(width, heads * head_dim, bias=bias)
        self.k = nn.Linear(width, heads * head_dim, bias=bias)
        self.v = nn.Linear(width, heads * head_dim, bias=bias)
        self.out = nn.Linear(heads * head_dim, width, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            local_heads = t.shape[-1] // self.head_dim  # this rank's share of the heads
            return t.view(b, length, local_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = (weights @ v).transpose(1, 2).reshape(b, length, v.shape[1] * self.head_dim)
        return x + self.out(y)


class _Norm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class ShardedModel(nn.Module):
    """The module a :class:`ShardedSpec` describes: ``inp``, ``blocks.<i>``, ``head``."""

    def __init__(self, spec: ShardedSpec):
        super().__init__()
        w = spec.width
        self.inp = nn.Linear(IN_FEATURES, w)
        self.blocks = nn.ModuleList(_block(b, w, spec.head_dim) for b in spec.blocks)
        self.head = nn.Linear(w, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _block(block: ShardedBlock, width: int, head_dim: int) -> nn.Module:
    if block.kind == "mlp":
        return _MLP(width, block.size, block.bias)
    if block.kind == "attention":
        return _Attention(width, block.size, head_dim, block.bias)
    return _Norm(width)


def holders(size: int, tp: int) -> int:
    """How many of ``tp`` ranks hold a piece of ``size`` features as torch shards them
    (``torch.chunk``: ``ceil(size / tp)`` each while they last -- 5 over 4 is 2, 2, 1, nothing;
    6 over 4 is 2, 2, 2, nothing)."""
    return 0 if size <= 0 else math.ceil(size / math.ceil(size / tp))


def every_rank_holds(size: int, tp: int) -> bool:
    """Whether sharding ``size`` features over ``tp`` ranks leaves no rank empty-handed."""
    return holders(size, tp) == tp


def _lone(
    name: str, outputs: int, inputs: int, tp: int, *styles: str
) -> list[tuple[tuple[str, str], ...]]:
    """A lone linear's fragments: left alone, column-wise with its output all-gathered, row-wise
    on its replicated input (``styles``: those allowed; default both) -- each only where every
    rank holds at least one feature (an empty shard is no plan anybody writes, and torch 2.13
    then fails in the optimizer's step)."""
    allowed = styles or ("colwise-replicate", "rowwise-replicate")
    found: list[tuple[tuple[str, str], ...]] = [()]
    if every_rank_holds(outputs, tp) and "colwise-replicate" in allowed:
        found.append(((name, "colwise-replicate"),))
    if every_rank_holds(inputs, tp) and "rowwise-replicate" in allowed:
        found.append(((name, "rowwise-replicate"),))
    return found


def plan_choices(spec: ShardedSpec, tp: int) -> list[list[tuple[tuple[str, str], ...]]]:
    """Per module group of ``spec``'s model, the plan fragments that keep it computing the same
    function over a ``tp``-way axis (the first of each: nothing sharded). A plan is one fragment
    of each group, concatenated."""
    w = spec.width
    groups = [_lone("inp", w, IN_FEATURES, tp)]
    for i, block in enumerate(spec.blocks):
        at = f"blocks.{i}"
        if block.kind == "mlp":
            ups = _lone(f"{at}.up", block.size, w, tp, "colwise-replicate")
            downs = _lone(f"{at}.down", w, block.size, tp, "rowwise-replicate")
            fragments = [up + down for up in ups for down in downs]
            if every_rank_holds(block.size, tp):  # the pair keeps the hidden features sharded
                even = ("colwise",) if block.size % tp == 0 else ()  # uneven: as a DTensor
                fragments += [
                    ((f"{at}.up", up), (f"{at}.down", "rowwise"))
                    for up in (*even, "colwise-dtensor")
                ]
            groups.append(fragments)
        elif block.kind == "attention":
            width = block.size * spec.head_dim
            fragments = _lone(f"{at}.out", w, width, tp, "rowwise-replicate")
            if block.size % tp == 0:  # whole heads on every rank
                fragments.append(
                    (*((f"{at}.{n}", "colwise") for n in "qkv"), (f"{at}.out", "rowwise"))
                )
            groups.append(fragments)
    groups.append(_lone("head", OUT_FEATURES, w, tp))
    return groups
