"""Built-in models, data and parameter-group layouts for the equivalence battery.

Invariant: every model here is a deterministic function of its weights and of each *sample*
separately (no dropout, no batch statistics), so the full-batch reference and W shards of the
same batch compute the same objective; where a branch depends on the data it depends on each
sample, never on the batch as a whole. Each class is defined at module level, so scenarios that
name it travel to rank processes by pickle.

Inputs are ``(B, 5)`` features and targets ``(B, 3)``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

__all__ = [
    "IN_FEATURES",
    "OUT_FEATURES",
    "BiasGroups",
    "ChannelsLastConv",
    "MLP",
    "MixedPrecision",
    "NonContiguous",
    "SampleBranch",
    "Tied",
    "UnusedAndFrozen",
    "WithBuffers",
    "regression_data",
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

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, 8)
        self.fc2 = nn.Linear(8, OUT_FEATURES)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class Tied(nn.Module):
    """``fc3`` reuses ``fc2``'s weight: one parameter, two uses, reduced once."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, 6)
        self.fc2 = nn.Linear(6, 6)
        self.fc3 = nn.Linear(6, 6)
        self.fc3.weight = self.fc2.weight
        self.out = nn.Linear(6, OUT_FEATURES)

    def forward(self, x):
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))  # (B, 6)
        return self.out(torch.tanh(self.fc3(h)))


class SampleBranch(nn.Module):
    """``extra`` is used only by samples with ``x[:, 0] > 0``: some shards may have none, so the
    parameter is unused on some ranks but not in the full batch."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(IN_FEATURES, OUT_FEATURES)
        self.extra = nn.Linear(IN_FEATURES, OUT_FEATURES)

    def forward(self, x):
        out = self.body(x)
        take = x[:, 0] > 0  # (B,)
        if bool(take.any()):
            out = out + torch.where(take[:, None], self.extra(x), torch.zeros_like(out))
        return out


class UnusedAndFrozen(nn.Module):
    """A layer no sample ever uses (grad stays None everywhere), a frozen layer between trainable
    ones, and a frozen bias: each must be left alone by synchronisation and by the optimizer."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, 6)
        self.frozen = nn.Linear(6, 6).requires_grad_(False)
        self.never_used = nn.Linear(6, 6)
        self.fc2 = nn.Linear(6, OUT_FEATURES)
        self.fc2.bias.requires_grad_(False)

    def forward(self, x):
        return self.fc2(torch.tanh(self.frozen(torch.tanh(self.fc1(x)))))


class WithBuffers(nn.Module):
    """Buffers (a random scale, an integer counter) that must start as rank 0's everywhere."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.rand(IN_FEATURES) + 0.5)
        self.register_buffer("version", torch.randint(0, 1000, (1,)))
        self.fc = nn.Linear(IN_FEATURES, OUT_FEATURES)

    def forward(self, x):
        return self.fc(x * self.scale)


class NonContiguous(nn.Module):
    """A weight used transposed and created as a transposed view: non-default gradient strides."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(OUT_FEATURES, IN_FEATURES).t() * 0.3)  # (5, 3)
        self.proj = nn.Linear(OUT_FEATURES, OUT_FEATURES)

    def forward(self, x):
        return self.proj(torch.tanh(x @ self.w))  # (B, 5) x (5, 3) -> (B, 3)


class ChannelsLastConv(nn.Module):
    """A Conv2d in the ``channels_last`` memory format, as vision models are converted for speed:
    its weight ``(4, 2, 3, 1)`` has strides ``(6, 1, 2, 2)``, not the default ``(6, 3, 1, 1)``
    -- the realistic non-contiguous parameter (docs/stride-bug.md)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, kernel_size=(3, 1), padding=(1, 0))
        self.conv.to(memory_format=torch.channels_last)
        self.head = nn.Linear(4 * IN_FEATURES, OUT_FEATURES)

    def forward(self, x):
        image = torch.stack([x, x.flip(-1)], dim=1)[..., None]  # (B, 2, 5, 1)
        y = torch.tanh(self.conv(image.contiguous(memory_format=torch.channels_last)))
        return self.head(y.flatten(1))  # (B, 4*5) -> (B, 3)


class MixedPrecision(nn.Module):
    """A float32 layer and a float64 layer in one model: buckets and broadcasts must not mix
    dtypes. The scenario's dtype applies to the float64 half only."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(IN_FEATURES, 6).double()
        self.b = nn.Linear(6, OUT_FEATURES).float()

    def restore_dtypes(self) -> None:
        """After the runner casts the model to the scenario's dtype, ``a`` is float64 and ``b``
        float32 again, whatever that dtype was."""
        self.a.double()
        self.b.float()

    def forward(self, x):
        return self.b(torch.tanh(self.a(x.double())).float()).to(x.dtype)


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
        groups = [{"params": matrices}]
        if vectors:
            groups.append({"params": vectors, "lr": self.lr, "weight_decay": self.weight_decay})
        return groups
