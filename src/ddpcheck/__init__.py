"""ddpcheck: finds bugs in data-parallel training code.

It runs a target (a DDP wrapper, a sharded optimizer, or both) in real multi-process
``torch.distributed`` worlds and checks that every replica stays bitwise identical and that all of
them match a single-process full-batch reference step.

Names are imported lazily, so ``import ddpcheck.pytest_plugin`` (loaded by every pytest run) and
the command line's ``--help`` do not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from ddpcheck._internal.options import DEFAULT_DEADLINE, DEFAULT_WORLD_SIZES
from ddpcheck.errors import (Divergence, EquivalenceError, InvalidArgument, NothingChecked,
                             ScenarioError, SetupError, WorldStartError)

__version__ = "0.1.0"

_LAZY = {
    "Report": "ddpcheck.api",
    "Scenario": "ddpcheck.scenario",
    "Survey": "ddpcheck.surveys",
    "Target": "ddpcheck.targets",
    "assert_equivalent": "ddpcheck.api",
    "check_example": "ddpcheck.api",
    "get_world": "ddpcheck._internal.world",
    "shutdown_worlds": "ddpcheck._internal.world",
    "survey": "ddpcheck.surveys",
}

__all__ = ["DEFAULT_DEADLINE", "DEFAULT_WORLD_SIZES", "Divergence", "EquivalenceError",
           "InvalidArgument", "NothingChecked", "ScenarioError", "SetupError", "WorldStartError",
           "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ddpcheck' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
