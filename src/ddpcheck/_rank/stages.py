"""Pipeline stages' tensors, made whole: each rank records the model as its pipeline holds it.

Why: under pipeline parallelism a rank holds only its stages' parameters; the others stay on
the rank as they were built, untrained. Comparing every rank's copy would blame a rank for a stage
it never held, and comparing only what each holds would leave the replica check nothing to pair.
So after every record (initial state, gradients, parameters, buffers, optimizer state) each rank
takes, for every module it does not hold, the values of the rank of its own pipeline that holds
it: every rank then records its pipeline's whole model, the reference judges each stage's tensors
as their holder has them, and ranks of different pipelines (``dp`` replicas) are compared as
data-parallel replicas are.

Invariant: :meth:`Stages.assemble` is collective over the pipeline group (two ``all_gather``
calls, issued by the harness inside ``recorder.paused()``, so no part of the target's
communication budget); a name is held by exactly one rank of a pipeline.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, TypeVar

from ddpcheck._rank.pickled import all_gathered

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Stages"]

V = TypeVar("V")


class Stages:
    """This rank's modules (``held``, module names) and its pipeline's process ``group``."""

    def __init__(self, held: Iterable[str], group: ProcessGroup):
        self.held = tuple(held)
        self.group = group

    def holds(self, name: str) -> bool:
        return any(name == m or name.startswith(f"{m}.") for m in self.held)

    def assemble(self, values: dict[str, V]) -> dict[str, V]:
        """``values`` by tensor name, those of modules this rank does not hold replaced by their
        holder's (see the module's invariant)."""
        mine = {n: v for n, v in values.items() if self.holds(n)}
        out = dict(values)
        for theirs in all_gathered(mine, self.group):
            out.update(theirs)
        return out
