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
communication budget); a name is held by exactly one rank of a pipeline. Not
``all_gather_object``: torch decodes its result through numpy, which ddpcheck does not depend on
(from the wheel alone every pipeline example failed so).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

from ddpcheck._base.devices import this_rank

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
        for theirs in _all_gathered(mine, self.group):
            out.update(theirs)
        return out


def _all_gathered(value: dict[str, V], group: ProcessGroup) -> list[dict[str, V]]:
    """Every rank's ``value`` of ``group``, pickled into byte tensors and all-gathered (each
    rank's length first, then the bytes padded to the longest)."""
    device = this_rank()
    data = pickle.dumps(value)
    size = torch.tensor([len(data)], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    return [
        pickle.loads(bytes(g[: int(s.item())].cpu().tolist()))  # our own ranks' bytes
        for g, s in zip(gathered, sizes)
    ]
