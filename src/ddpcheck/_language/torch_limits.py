"""What the installed torch cannot run, found by trying it: the vocabulary follows the torch at
hand, so a scenario it cannot compute is never drawn and never blamed on a target.

torch 2.1 runs CPU autocast in bfloat16 only (``RuntimeError: Currently, AutocastCPU only support
Bfloat16``; float16 arrived in 2.2): float16 autocast drawn there made the single-process
reference fail, and tests that expected a verdict went red on torch's limit. Each limit is probed
once per process on the CPU, where the reference computes, rather than read from release
numbers (a build may differ from its release's).
"""

from __future__ import annotations

import functools
import warnings

import torch

__all__ = ["autocast_unavailable", "release", "unavailable"]

#: The precision policies' dtypes, by the name the reports give them.
_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def release() -> str:
    """The installed torch's release, without its build tag: ``"2.1.2"`` for ``2.1.2+cu121``."""
    return torch.__version__.split("+")[0]


@functools.cache
def autocast_unavailable(dtype: torch.dtype) -> str | None:
    """Why CPU ``torch.autocast`` in ``dtype`` cannot run on the installed torch (``"float16
    autocast: not available on torch 2.1.2"``); None where it runs. torch 2.1 raises, or warns and
    disables autocast: either way a matmul under it does not compute in ``dtype``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a disabled autocast says so in a warning
            with torch.autocast("cpu", dtype=dtype):
                computed = (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    except (RuntimeError, ValueError, TypeError):
        computed = None
    if computed == dtype:
        return None
    return f"{_NAMES.get(dtype, dtype)} autocast: not available on torch {release()}"


def unavailable() -> list[str]:
    """Why each part of the vocabulary the installed torch cannot run is never drawn, for the
    feature line of a report (empty on a torch that runs all of it)."""
    return [why for why in map(autocast_unavailable, _NAMES) if why is not None]
