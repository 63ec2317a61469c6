"""Targets, models and data functions for tests/oracle/, tests/runs/test_replay.py.

A module of its own (not a test module), imported by name in rank processes and in the replay
processes the tests start (``tests.verdict_helpers:...``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

import ddpcheck
from ddpcheck import targets, zoo

# ---------------------------------------------------------------------------------------------
# Targets (test_verdict_replay.py)


class MyTarget(ddpcheck.Target):
    """The README's plain-class target: torch DDP, with an optional bug that doubles every
    averaged gradient."""

    def __init__(self, scale_bug=False):
        self.scale_bug = scale_bug

    def wrap(self, module):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module)

    def no_sync(self, model):
        return model.no_sync()

    def after_backward(self, model, optimizer):
        if self.scale_bug:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(2)


class Positional(MyTarget):
    """Takes its arguments positionally, one of them a function."""

    def __init__(self, scale_bug, rule=None):
        super().__init__(scale_bug)
        self.rule = rule


class NoInit(ddpcheck.Target):
    """Defines neither __init__ nor __new__."""


@dataclasses.dataclass(frozen=True)
class ScaledDataclass(targets.TorchDDPTarget):
    """A dataclass target whose field is a module-level function."""

    rule: object = None
    scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class SmallBuckets(targets.ParallelTarget):
    """A user's subclass of a ready-made target that changes one of its defaults."""

    bucket_size_mb: float | None = 1.0


class Opaque:
    """An argument whose repr is not code."""


#: A module-attribute target.
SCALED = MyTarget(scale_bug=True)


def a_rule(params, world_size):
    return [i % world_size for i in range(len(params))]


# ---------------------------------------------------------------------------------------------
# Bad scenarios (test_verdict_scenario.py)


def two_arg_data(seed, batch):
    return zoo.regression_data(seed, batch, torch.float64)


def one_tensor_data(seed, batch, dtype):
    return torch.zeros(batch, 5, dtype=dtype)


def short_data(seed, batch, dtype):
    x, y = zoo.regression_data(seed, batch, dtype)
    return x, y[:-1]


class TupleOutput(zoo.MLP):
    def forward(self, x):
        out = super().forward(x)
        return out, out.sum()


class DictOutput(zoo.MLP):
    def forward(self, x):
        return {"logits": super().forward(x)}


class WrongShape(zoo.MLP):
    def forward(self, x):
        return super().forward(x)[:, :1]


class WithDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(zoo.IN_FEATURES, 8)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(8, zoo.OUT_FEATURES)

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(zoo.IN_FEATURES, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, zoo.OUT_FEATURES)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def batchnorm_eval():
    """BatchNorm in eval mode: per sample, accepted."""
    return WithBatchNorm().eval()


class BatchMean(zoo.MLP):
    """Subtracts the batch mean: batch statistics without any BatchNorm."""

    def forward(self, x):
        return super().forward(x - x.mean(dim=0, keepdim=True))


class CountsForwards(zoo.MLP):
    """Writes a buffer in forward (a per-sample function otherwise)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


class AllFrozen(zoo.MLP):
    def __init__(self):
        super().__init__()
        self.requires_grad_(False)


def linear():
    """A module-level factory for a module that needs arguments."""
    return nn.Linear(zoo.IN_FEATURES, zoo.OUT_FEATURES)
