"""The local-shard check: every rank holds exactly the slice of each parameter its placement names.

A sharded parameter is recorded twice by each rank (``StepRecord``): whole, through the target's
gather (``Target.full_tensor``), and as the local shard the rank steps, with the dim it is
sharded along (``Target.local_shard``). The replica check makes the whole tensors bitwise equal
across ranks; this check ties each rank's shard to them, so a rank stepping the wrong slice, or a
gather that returns something other than the shards the ranks hold, is reported by rank,
parameter and slice.

Invariant: :func:`compare_shards` returns no divergence exactly when, for every rank r and every
recorded shard ``(dim, local)`` of parameter ``name``, ``local`` is bitwise ``torch.chunk(whole,
W, dim)[r]`` -- the chunking of DTensor's ``Shard(dim)`` and FSDP2: chunks of ``ceil(n / W)``
rows, the last ones shorter or empty -- or the whole tensor when ``dim`` is None (replicated).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ddpcheck._base.errors import Divergence
from ddpcheck._language.records import RankRecord

__all__ = ["LOCAL_SHARD_DIFFERS", "compare_shards", "shard_bounds"]

#: The kind of a divergence between a rank's local shard and its slice of the whole parameter.
LOCAL_SHARD_DIFFERS = "local shard differs"


def shard_bounds(size: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``rank`` of ``torch.chunk`` over ``size`` rows (empty past
    the last chunk: ``torch.chunk`` may return fewer than ``world_size`` chunks)."""
    chunk = math.ceil(size / world_size) if size else 0
    start = min(rank * chunk, size)
    return start, min(start + chunk, size)


def compare_shards(step: int, world_size: int, records: list[RankRecord]) -> list[Divergence]:
    """Rows for every rank whose local shard of a parameter is not its slice of the whole."""
    out = []
    for record in records:
        taken = record.steps[step]
        for name, (dim, local) in taken.shards.items():
            whole = taken.params.get(name)
            if whole is None:
                continue  # the replica and reference checks report a missing parameter
            if dim is None:
                where, expected = "the whole (replicated)", whole
            else:
                start, stop = shard_bounds(whole.shape[dim], world_size, record.rank)
                where = f"[{start}:{stop}] along dim {dim} of {tuple(whole.shape)}"
                expected = whole.narrow(dim, start, stop - start)
            if local.shape != expected.shape or local.dtype != expected.dtype:
                out.append(
                    Divergence(
                        step,
                        world_size,
                        record.rank,
                        name,
                        LOCAL_SHARD_DIFFERS,
                        detail=f"rank {record.rank} holds a {tuple(local.shape)} "
                        f"{str(local.dtype).replace('torch.', '')} shard; its slice is "
                        f"{where}, {tuple(expected.shape)}",
                    )
                )
            elif not torch.equal(_bits(local), _bits(expected)):
                row = Divergence.of(
                    step,
                    world_size,
                    record.rank,
                    name,
                    LOCAL_SHARD_DIFFERS,
                    local,
                    expected,
                    ("rank", record.rank),
                    ("its slice of the gathered parameter", None),
                )
                out.append(
                    dataclasses.replace(
                        row,
                        detail=f"rank {record.rank}'s local shard is not slice {where} of the "
                        f"gathered parameter: {row.detail}",
                    )
                )
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() and t.element_size() in (2, 4, 8):
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t
