"""The accumulation window: a framework that gates the optimizer must not let it act early.

accelerate and DeepSpeed are driven by calling ``optimizer.step()``, the LR scheduler and
``zero_grad()`` after *every* micro-batch; the framework decides, from its accumulation counter,
which calls act (``Target.steps_every_micro_batch``). A framework that steps inside the window
moves the parameters on a partial gradient. The ranks record the parameters after each such
gated call (``StepRecord.window``); this check holds them to the parameters the step started
from -- bitwise, since nothing may have touched them -- and the ordinary checks compare the end
of the window with the reference.

Invariant: :func:`check_window` returns no divergence exactly when, on every rank, every
parameter recorded inside step ``step``'s window is bitwise the parameter that rank held before
the step (after the previous step, or initially).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ddpcheck._base.errors import Divergence
from ddpcheck._language.records import RankRecord

if TYPE_CHECKING:
    import torch

__all__ = ["STEPPED_INSIDE_WINDOW", "check_window"]

#: The kind of a divergence where parameters moved before the accumulation window ended.
STEPPED_INSIDE_WINDOW = "stepped inside accumulation window"


def check_window(
    step: int,
    world_size: int,
    records: list[RankRecord],
    bitwise_equal: Callable[[torch.Tensor, torch.Tensor], bool],
) -> list[Divergence]:
    """Rows for each rank whose parameters moved inside step ``step``'s accumulation window
    (the first micro-batch and parameter where they did)."""
    out = []
    for record in records:
        taken = record.steps[step]
        before = record.steps[step - 1].params if step > 0 else record.initial
        for index, params in taken.window:
            moved = [
                name
                for name, value in params.items()
                if name in before and not bitwise_equal(value, before[name])
            ]
            if moved:
                name = moved[0]
                delta = (params[name].double() - before[name].double()).abs().max().item()
                out.append(
                    Divergence(
                        step,
                        world_size,
                        record.rank,
                        name,
                        STEPPED_INSIDE_WINDOW,
                        detail=f"{len(moved)} parameter(s) moved (max |change| {delta:.3g} in "
                        f"{name!r}) by the optimizer.step() after micro-batch {index}, "
                        "before the window's last micro-batch: the framework must gate "
                        "step(), the LR schedule and zero_grad() until the window ends",
                    )
                )
                break
    return out
