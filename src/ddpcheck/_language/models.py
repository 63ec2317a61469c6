"""Random architectures from a small, printable spec (the vocabulary of ``ddpcheck.strategies``).

Invariant: a :class:`ModelSpec` builds a model whose output for each sample depends only on that
sample and the weights (no dropout, no batch statistics, no data-dependent buffer updates), so the
full-batch reference and W shards compute the same objective. Data-dependent branches are decided
per sample (``use="sample"``): only the samples that take a layer go through it, so a rank whose
samples all skip it has *no* gradient for it (None) while the batch as a whole has one -- a
parameter unused on some ranks, the case unused-parameter handling exists for.

The hidden state is ``(B, width)`` throughout; every layer maps it to the same shape, so layers
compose in any order and Hypothesis can delete any of them while shrinking. Parameters are
registered in ``registration`` order, independently of the execution order of ``layers``.

Supported layers (see :data:`KINDS`): linear, a linear reused twice, a transposed (non-contiguous)
weight, Conv1d, Conv2d, LayerNorm, a random buffer, a small self-attention block, an embedding
optionally tied to the output, and a Conv2d in the ``channels_last`` memory format (its weight's
strides are not the default ones: the realistic way a model gets non-contiguous parameters, and
the trigger of a torch DDP bug, docs/stride-bug.md). Not supported, and why: BatchNorm in train mode
and anything else with batch statistics (not shard-invariant), dropout (random per rank), buffers
updated from data (torch DDP keeps them rank-local).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import nn

from ddpcheck._base.errors import InvalidArgument
from ddpcheck._base.options import named_fields

__all__ = ["KINDS", "Layer", "ModelSpec", "SpecData", "SpecModel"]

KINDS = (
    "linear",
    "reused",
    "transposed",
    "conv1d",
    "conv2d",
    "layernorm",
    "buffer",
    "attention",
    "embedding",
    "conv_channels_last",
)
USES = ("always", "sample", "never")
OUT_FEATURES = 3


@named_fields
@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer of a spec: its kind, and how it is trained and used.

    ``use``: ``"always"``; ``"sample"`` -- only for samples whose feature ``index % width`` is
    positive (other samples skip it), ``"never"`` -- registered, never called (its gradient stays
    None everywhere). ``frozen``: ``requires_grad=False``. ``float32``: this layer's parameters are
    float32 in a float64 model (mixed dtypes).
    """

    kind: str = "linear"
    use: str = "always"
    frozen: bool = False
    float32: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument(f"kind={self.kind!r} must be one of {KINDS}")
        if self.use not in USES:
            raise InvalidArgument(f"use={self.use!r} must be one of {USES}")


@named_fields
@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A whole model: ``layers`` run in order on a ``(B, width)`` state, then a linear head.

    ``registration`` is a permutation of the layer indices: the order in which the layers'
    parameters are registered (and so the order DDP buckets and optimizers see them).
    ``tie_head`` ties the head to the first embedding layer's weight, if there is one.
    """

    layers: tuple[Layer, ...] = ()
    width: int = 4
    registration: tuple[int, ...] | None = None
    head_bias: bool = True
    tie_head: bool = False

    def __post_init__(self) -> None:
        order = self.registration
        if order is not None and sorted(order) != list(range(len(self.layers))):
            raise InvalidArgument(
                f"registration={order!r} must be a permutation of range({len(self.layers)})"
            )
        if self.width < 2:
            raise InvalidArgument(f"width={self.width!r} must be at least 2")

    def __call__(self) -> SpecModel:
        return SpecModel(self)

    @property
    def data(self) -> SpecData:
        return SpecData(self.width)


@named_fields
@dataclasses.dataclass(frozen=True)
class SpecData:
    """Inputs ``(B, width)`` and targets ``(B, 3)`` for a spec model of that width."""

    width: int

    def __call__(
        self, seed: int, batch: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(batch, self.width, generator=g, dtype=torch.float64).to(dtype)
        y = torch.randn(batch, OUT_FEATURES, generator=g, dtype=torch.float64).to(dtype)
        return x, y


class SpecModel(nn.Module):
    """The module a :class:`ModelSpec` describes."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        w = spec.width
        blocks = [_make_block(layer.kind, w) for layer in spec.layers]
        order = spec.registration or tuple(range(len(blocks)))
        for i in order:  # registration order, independent of execution order
            self.add_module(f"l{i}", blocks[i])
        for layer, block in zip(spec.layers, blocks):
            if layer.frozen:
                block.requires_grad_(False)
        self.head = nn.Linear(w, OUT_FEATURES, bias=spec.head_bias)
        self._tied = None
        if spec.tie_head:
            for i, layer in enumerate(spec.layers):
                if layer.kind == "embedding" and not layer.float32:
                    self._tied = i
                    break

    def restore_dtypes(self) -> None:
        """Called after the model is cast to the scenario's dtype: float32 layers stay float32."""
        for i, layer in enumerate(self.spec.layers):
            if layer.float32:
                getattr(self, f"l{i}").float()

    @staticmethod
    def _run_block(
        layer: Layer, block: nn.Module, h: torch.Tensor, x: torch.Tensor
    ) -> torch.Tensor:
        """``block`` on the hidden state ``h`` (and, for an embedding, the inputs ``x``), in the
        layer's dtype, returned in ``h``'s."""
        dtype = next(block.parameters(), h).dtype if layer.float32 else h.dtype
        if layer.kind == "embedding":  # the row is chosen from the input, not from h
            return block(h.to(dtype), x).to(h.dtype)  # (b, width)
        return block(h.to(dtype)).to(h.dtype)  # (b, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x  # (B, width)
        for i, layer in enumerate(self.spec.layers):
            if layer.use == "never":
                continue
            block = getattr(self, f"l{i}")
            if layer.use == "always":
                h = self._run_block(layer, block, h, x)
                continue
            # "sample": only the samples whose feature says so go through the block. The others
            # never touch it, so a rank none of whose samples take it has no gradient for it
            # (None), while the batch as a whole does: unused on some ranks only.
            take = x[:, i % self.spec.width] > 0  # (B,): decided per sample
            if bool(take.any()):
                out = h.clone()
                out[take] = self._run_block(layer, block, h[take], x[take])  # (taken, width)
                h = out
        out = self.head(h)  # (B, 3)
        if self._tied is not None:
            emb = getattr(self, f"l{self._tied}").table.weight  # (vocab, width)
            out = out + (h @ emb.t())[:, :OUT_FEATURES]  # tied output projection
        return out


class _Linear(nn.Module):
    def __init__(self, w: int, repeat: int = 1):
        super().__init__()
        self.fc = nn.Linear(w, w)
        self.repeat = repeat

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for _ in range(self.repeat):  # a reused module: one parameter, several uses
            h = torch.tanh(self.fc(h))
        return h


class _Transposed(nn.Module):
    def __init__(self, w: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(w, w).t() / math.sqrt(w))  # strides (1, w)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ self.weight)


class _Conv1d(nn.Module):
    def __init__(self, w: int):
        super().__init__()
        self.conv = nn.Conv1d(1, 2, kernel_size=3, padding=1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.conv(h[:, None, :]).sum(dim=1))  # (B,1,w) -> (B,2,w) -> (B,w)


class _Conv2d(nn.Module):
    def __init__(self, w: int):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, kernel_size=(3, 1), padding=(1, 0))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = self.conv(h[:, None, :, None])  # (B,1,w,1) -> (B,2,w,1)
        return torch.tanh(y.sum(dim=(1, 3)))  # (B,w)


class _ConvChannelsLast(nn.Module):
    """A 2-channel Conv2d converted to ``channels_last``, as vision models are for speed: its
    weight ``(2, 2, 3, 1)`` has strides ``(6, 1, 2, 2)``, and so has its gradient."""

    def __init__(self, w: int):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, kernel_size=(3, 1), padding=(1, 0))
        # Module.to takes memory_format; torch's overloads of it leave the keyword out
        self.conv.to(memory_format=torch.channels_last)  # type: ignore[call-overload]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = torch.stack([h, h.flip(-1)], dim=1)[..., None]  # (B,2,w,1)
        y = self.conv(x.contiguous(memory_format=torch.channels_last))  # (B,2,w,1)
        return torch.tanh(y.sum(dim=(1, 3)))  # (B,w)


class _LayerNorm(nn.Module):
    def __init__(self, w: int):
        super().__init__()
        self.norm = nn.LayerNorm(w)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)


class _Buffer(nn.Module):
    scale: torch.Tensor  # a buffer (register_buffer), so typed here

    def __init__(self, w: int):
        super().__init__()
        self.register_buffer("scale", torch.rand(w) + 0.5)  # random: must come from rank 0
        self.fc = nn.Linear(w, w, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(h * self.scale))


class _Attention(nn.Module):
    """Self-attention over two tokens made from the sample: per-sample, no batch mixing."""

    def __init__(self, w: int):
        super().__init__()
        self.qkv = nn.Linear(w, 3 * w)
        self.proj = nn.Linear(w, w)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        tokens = torch.stack([h, h.flip(-1)], dim=1)  # (B, 2, w)
        q, k, v = self.qkv(tokens).chunk(3, dim=-1)  # 3 x (B, 2, w)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(h.shape[-1]), dim=-1)  # (B, 2, 2)
        return self.proj((att @ v).mean(dim=1))  # (B, 2, w) -> (B, w)


class _Embedding(nn.Module):
    VOCAB = 5

    def __init__(self, w: int):
        super().__init__()
        self.table = nn.Embedding(self.VOCAB, w)

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # The row comes from the sample's *input*, never from computed activations: a floor of
        # an activation flips when rounding differs (full batch vs shards), a false alarm.
        idx = (x[:, 0].abs() * 2).long().clamp(max=self.VOCAB - 1)  # (B,) per sample
        return h + self.table(idx)  # (B, w)


def _make_block(kind: str, w: int) -> nn.Module:
    makers: dict[str, Callable[[], nn.Module]] = {
        "linear": lambda: _Linear(w),
        "reused": lambda: _Linear(w, repeat=2),
        "transposed": lambda: _Transposed(w),
        "conv1d": lambda: _Conv1d(w),
        "conv2d": lambda: _Conv2d(w),
        "layernorm": lambda: _LayerNorm(w),
        "buffer": lambda: _Buffer(w),
        "attention": lambda: _Attention(w),
        "embedding": lambda: _Embedding(w),
        "conv_channels_last": lambda: _ConvChannelsLast(w),
    }
    return makers[kind]()
