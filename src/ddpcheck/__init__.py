"""ddpcheck: finds bugs in data-parallel training code.

It runs a target (a DDP wrapper, a sharded optimizer, or both) in real multi-process
``torch.distributed`` worlds and checks that every replica stays bitwise identical and that all of
them match a single-process full-batch reference step.

This module is the whole public surface: :data:`__all__` lists every public name, and each is
reachable from a fresh ``import ddpcheck``. Names that need torch (and the public modules
``batches``, ``battery``, ``features``, ``models``, ``strategies``, ``targets``, ``zoo``) load on
first use, so ``import ddpcheck.pytest_plugin`` (loaded by every pytest run) and the command
line's ``--help`` do not import torch; the outcomes and defaults below import nothing heavy.
Every folder whose name starts with an underscore (``ddpcheck._runs``, ...) is private: no
stability promise.
"""

from __future__ import annotations

import importlib
from typing import Any

from ddpcheck._base.errors import DdpcheckError as DdpcheckError
from ddpcheck._base.errors import Divergence as Divergence
from ddpcheck._base.errors import EquivalenceError as EquivalenceError
from ddpcheck._base.errors import ExitCode as ExitCode
from ddpcheck._base.errors import Inconclusive as Inconclusive
from ddpcheck._base.errors import InternalError as InternalError
from ddpcheck._base.errors import InvalidArgument as InvalidArgument
from ddpcheck._base.errors import NothingChecked as NothingChecked
from ddpcheck._base.errors import ScenarioError as ScenarioError
from ddpcheck._base.errors import SetupError as SetupError
from ddpcheck._base.errors import WorldStartError as WorldStartError

# `name as name`: a re-export, not an unused import (PEP 484; ruff and mypy read it so).
from ddpcheck._base.options import DEFAULT_DEADLINE as DEFAULT_DEADLINE
from ddpcheck._base.options import DEFAULT_WORLD_SIZES as DEFAULT_WORLD_SIZES

__version__ = "0.1.0"

#: Public names that load on first use, and the module each comes from.
_LAZY = {
    "Epochs": "ddpcheck.scenario",
    "FuzzResult": "ddpcheck._runs.fuzz",
    "PipelineParallel": "ddpcheck.scenario",
    "Report": "ddpcheck.api",
    "Scenario": "ddpcheck.scenario",
    "Survey": "ddpcheck._runs.survey",
    "TensorParallel": "ddpcheck.scenario",
    "Target": "ddpcheck.targets",
    "World": "ddpcheck._world.worlds",
    "WorldFailure": "ddpcheck._world.failures",
    "assert_equivalent": "ddpcheck.api",
    "check_example": "ddpcheck.api",
    "fuzz": "ddpcheck._runs.fuzz",
    "get_world": "ddpcheck._world.registry",
    "shutdown_worlds": "ddpcheck._world.registry",
    "survey": "ddpcheck._runs.survey",
}
#: The public modules, imported on first use as attributes (``ddpcheck.zoo.MLP``): what a
#: printed scenario or replay line names evaluates after ``import ddpcheck, torch`` alone.
_MODULES = (
    "batches",
    "battery",
    "features",
    "models",
    "sharded_models",
    "strategies",
    "targets",
    "tensor_parallel",
    "zoo",
)

__all__ = sorted(
    [
        "DEFAULT_DEADLINE",
        "DEFAULT_WORLD_SIZES",
        "DdpcheckError",
        "Divergence",
        "EquivalenceError",
        "ExitCode",
        "Inconclusive",
        "InternalError",
        "InvalidArgument",
        "NothingChecked",
        "ScenarioError",
        "SetupError",
        "WorldStartError",
        "__version__",
        *_LAZY,
        *_MODULES,
    ]
)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(f"ddpcheck.{name}")
    else:
        raise AttributeError(f"module 'ddpcheck' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(globals()))
