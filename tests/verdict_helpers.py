"""Targets for tests/test_verdict_replay.py.

A module of its own (not a test module), imported by name in rank processes and in the replay
processes the tests start (``tests.verdict_helpers:...``).
"""

from __future__ import annotations

import dataclasses

import ddpcheck
from ddpcheck import targets

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


class Opaque:
    """An argument whose repr is not code."""


#: A module-attribute target.
SCALED = MyTarget(scale_bug=True)


def a_rule(params, world_size):
    return [i % world_size for i in range(len(params))]
