"""Built-in models, data and parameter-group layouts for the equivalence battery.

Invariant: every model here is a deterministic function of its weights and of each *sample*
separately (no dropout, no batch statistics), so the full-batch reference and W shards of the
same batch compute the same objective; where a branch depends on the data it depends on each
sample, never on the batch as a whole. Each class is defined at module level, so scenarios that
name it travel to rank processes by pickle.

Inputs are ``(B, 5)`` features and targets ``(B, 3)``; the language model, :class:`TinyGPT`,
reads token sequences ``(B, BLOCK)`` from :func:`token_data` and returns next-token logits
``(B, BLOCK, VOCAB)`` (train it with ``Scenario(loss="token_cross_entropy")``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ddpcheck._base.errors import InvalidArgument
from ddpcheck._base.options import named_fields
from ddpcheck._language.objective import IGNORE_INDEX

__all__ = [
    "BLOCK",
    "IGNORE_INDEX",
    "IN_FEATURES",
    "OUT_FEATURES",
    "VOCAB",
    "BiasGroups",
    "ChannelsLastConv",
    "GPTConfig",
    "MLP",
    "MixedPrecision",
    "NonContiguous",
    "SampleBranch",
    "Tied",
    "TinyGPT",
    "UnusedAndFrozen",
    "WithBuffers",
    "regression_data",
    "token_data",
]

IN_FEATURES, OUT_FEATURES = 5, 3


def regression_data(seed: int, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch ``(x, y)``: x ``(B, 5)``, y ``(B, 3)``; about half the samples have
    ``x[:, 0] > 0`` (the switch of :class:`SampleBranch`)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, IN_FEATURES, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(batch, OUT_FEATURES, generator=g, dtype=torch.float64).to(dtype)
    return x, y


class MLP(nn.Module):
    """Two linear layers: the plainest case."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, 8)
        self.fc2 = nn.Linear(8, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Tied(nn.Module):
    """``fc3`` reuses ``fc2``'s weight: one parameter, two uses, reduced once."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, 6)
        self.fc2 = nn.Linear(6, 6)
        self.fc3 = nn.Linear(6, 6)
        self.fc3.weight = self.fc2.weight
        self.out = nn.Linear(6, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))  # (B, 6)
        return self.out(torch.tanh(self.fc3(h)))


class SampleBranch(nn.Module):
    """``extra`` is used only by samples with ``x[:, 0] > 0``: some shards may have none, so the
    parameter is unused on some ranks but not in the full batch."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(IN_FEATURES, OUT_FEATURES)
        self.extra = nn.Linear(IN_FEATURES, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        take = x[:, 0] > 0  # (B,)
        if bool(take.any()):
            out = out + torch.where(take[:, None], self.extra(x), torch.zeros_like(out))
        return out


class UnusedAndFrozen(nn.Module):
    """A layer no sample ever uses (grad stays None everywhere), a frozen layer between trainable
    ones, and a frozen bias: each must be left alone by synchronisation and by the optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, 6)
        self.frozen = nn.Linear(6, 6).requires_grad_(False)
        self.never_used = nn.Linear(6, 6)
        self.fc2 = nn.Linear(6, OUT_FEATURES)
        self.fc2.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.frozen(torch.tanh(self.fc1(x)))))


class WithBuffers(nn.Module):
    """Buffers (a random scale, an integer counter) that must start as rank 0's everywhere."""

    scale: torch.Tensor  # a buffer (register_buffer), so typed here

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.rand(IN_FEATURES) + 0.5)
        self.register_buffer("version", torch.randint(0, 1000, (1,)))
        self.fc = nn.Linear(IN_FEATURES, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x * self.scale)


class NonContiguous(nn.Module):
    """A weight used transposed and created as a transposed view: non-default gradient strides."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(OUT_FEATURES, IN_FEATURES).t() * 0.3)  # (5, 3)
        self.proj = nn.Linear(OUT_FEATURES, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(x @ self.w))  # (B, 5) x (5, 3) -> (B, 3)


class ChannelsLastConv(nn.Module):
    """A Conv2d in the ``channels_last`` memory format, as vision models are converted for speed:
    its weight ``(4, 2, 3, 1)`` has strides ``(6, 1, 2, 2)``, not the default ``(6, 3, 1, 1)``
    -- the realistic non-contiguous parameter (docs/stride-bug.md)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, kernel_size=(3, 1), padding=(1, 0))
        # Module.to takes memory_format; torch's overloads of it leave the keyword out
        self.conv.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        self.head = nn.Linear(4 * IN_FEATURES, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        image = torch.stack([x, x.flip(-1)], dim=1)[..., None]  # (B, 2, 5, 1)
        y = torch.tanh(self.conv(image.contiguous(memory_format=torch.channels_last)))
        return self.head(y.flatten(1))  # (B, 4*5) -> (B, 3)


class MixedPrecision(nn.Module):
    """A float32 layer and a float64 layer in one model: buckets and broadcasts must not mix
    dtypes. The scenario's dtype applies to the float64 half only."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(IN_FEATURES, 6).double()
        self.b = nn.Linear(6, OUT_FEATURES).float()

    def restore_dtypes(self) -> None:
        """After the runner casts the model to the scenario's dtype, ``a`` is float64 and ``b``
        float32 again, whatever that dtype was."""
        self.a.double()
        self.b.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x.double())).float()).to(x.dtype)


@named_fields
@dataclasses.dataclass(frozen=True)
class BiasGroups:
    """Two param groups with interleaved membership: 1-D parameters (biases) in a second group
    with their own learning rate and weight decay -- the classic "no decay" layout."""

    lr: float = 0.05
    weight_decay: float = 0.0

    def __call__(self, model: nn.Module) -> list[dict]:
        params = list(model.parameters())
        matrices = [p for p in params if p.dim() > 1]
        vectors = [p for p in params if p.dim() <= 1]
        groups: list[dict[str, object]] = [{"params": matrices}]
        if vectors:
            groups.append({"params": vectors, "lr": self.lr, "weight_decay": self.weight_decay})
        return groups


# ---------------------------------------------------------------------------------------------
# A language model: tokens, padding, a tied head

#: Tokens of the vocabulary, and the longest sequence (the positions :class:`TinyGPT` knows).
VOCAB, BLOCK = 11, 8


def token_data(seed: int, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of token sequences ``(x, y)``, both ``(B, BLOCK)`` int64: sample i is a
    random sequence of 1 to ``BLOCK`` tokens (lengths drawn per sample, so samples, micro-batches
    and ranks hold different numbers of tokens), ``y`` its next tokens, padded on the right --
    ``x`` with token 0, ``y`` with :data:`IGNORE_INDEX`, which no loss term counts. ``dtype`` is
    ignored: tokens are integers."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, BLOCK + 1, (batch,), generator=g)  # (B,)
    sequences = torch.randint(0, VOCAB, (batch, BLOCK + 1), generator=g)  # (B, BLOCK + 1)
    x, y = sequences[:, :-1].clone(), sequences[:, 1:].clone()  # (B, BLOCK) each
    padding = torch.arange(BLOCK)[None, :] >= lengths[:, None]  # (B, BLOCK)
    x[padding] = 0
    y[padding] = IGNORE_INDEX
    return x, y


@named_fields
@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """A :class:`TinyGPT`'s shape; calling it builds one (a model factory, as ``nanoGPT``'s
    config, whose ``repr`` is code): ``width`` (a multiple of ``heads``), ``layers`` blocks, and a
    head ``tied`` to the token embedding or not."""

    width: int = 8
    heads: int = 2
    layers: int = 1
    tied: bool = True

    def __post_init__(self) -> None:
        if self.width < 1 or self.heads < 1 or self.width % self.heads or self.layers < 0:
            raise InvalidArgument(
                f"{self!r}: width must be a positive multiple of heads, layers >= 0"
            )

    def __call__(self) -> TinyGPT:
        return TinyGPT(self)


class TinyGPT(nn.Module):
    """A decoder-only language model of the GPT-2 shape, small enough for examples of tens of
    milliseconds: token embedding (tied to the LM head unless the config says otherwise) plus
    learned positions, pre-LayerNorm blocks of causal self-attention and a GELU MLP, a final
    LayerNorm and the head; ``(B, L)`` tokens in, ``(B, L, VOCAB)`` logits out.

    Per sample, as every model here: attention is causal within a sequence and never across
    samples, and right padding is never attended to by a real token. Linear layers have no bias
    (as LLaMA's, or nanoGPT's ``bias=False``): the key projection's bias has a gradient that is
    zero in exact arithmetic (softmax ignores a shift), and Adam would turn rounding noise on it
    into updates.
    """

    def __init__(self, config: GPTConfig | None = None):
        super().__init__()
        c = config or GPTConfig()
        self.tok = nn.Embedding(VOCAB, c.width)
        self.pos = nn.Embedding(BLOCK, c.width)
        self.blocks = nn.ModuleList(_Block(c.width, c.heads) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, VOCAB, bias=False)
        with torch.no_grad():  # embeddings of nanoGPT's scale, not N(0, 1): calmer logits
            self.tok.weight.normal_(0.0, 0.3)
            self.pos.weight.normal_(0.0, 0.3)
        if c.tied:
            self.head.weight = self.tok.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)  # (L,)
        h = self.tok(x) + self.pos(positions)  # (B, L, width)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))  # (B, L, VOCAB)


class _Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = _CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width, bias=False)
        self.proj = nn.Linear(4 * width, width, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (B, L, width)
        h = h + self.attn(self.ln1(h))
        return h + self.proj(F.gelu(self.fc(self.ln2(h))))


class _CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (B, L, width)
        b, length, width = h.shape
        d = width // self.heads
        q, k, v = (
            t.reshape(b, length, self.heads, d).transpose(1, 2)  # (B, heads, L, d)
            for t in self.qkv(h).split(width, dim=-1)
        )
        att = q @ k.transpose(-2, -1) / math.sqrt(d)  # (B, heads, L, L)
        causal = torch.ones(length, length, dtype=torch.bool, device=h.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        return self.out((att @ v).transpose(1, 2).reshape(b, length, width))
