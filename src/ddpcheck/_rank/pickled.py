"""Python objects carried between ranks as pickled byte tensors.

Why not ``all_gather_object`` / ``gather_object``: torch decodes their results through numpy,
which ddpcheck does not depend on (from the wheel with only its declared dependencies, every
example that used them failed with "Numpy is not available"). Same two steps as torch's: each
rank's byte count, then the bytes padded to the longest, on the rank's device (NCCL carries only
CUDA tensors). Every object is one of our own ranks', so unpickling it is safe.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, TypeVar, cast

import torch
import torch.distributed as dist

from ddpcheck._base.devices import this_rank

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["all_gathered", "gathered_on_zero"]

T = TypeVar("T")


def all_gathered(value: T, group: ProcessGroup | None = None) -> list[T]:
    """Every rank's ``value`` of ``group`` (the world by default), on every rank, in rank order."""
    padded, sizes = _padded(value, group)
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    return cast("list[T]", [_loaded(g, s) for g, s in zip(gathered, sizes)])


def gathered_on_zero(value: T) -> list[T]:
    """Every rank's ``value`` on rank 0 of the world, in rank order; an empty list elsewhere."""
    padded, sizes = _padded(value, None)
    rank0 = dist.get_rank() == 0
    received = [torch.empty_like(padded) for _ in sizes] if rank0 else None
    dist.gather(padded, received, dst=0)
    return cast("list[T]", [_loaded(g, s) for g, s in zip(received or [], sizes)])


def _padded(value: object, group: ProcessGroup | None) -> tuple[torch.Tensor, list[int]]:
    """``value`` pickled into a byte tensor padded to the group's longest, and every rank's
    byte count (one all-gather)."""
    device = this_rank()
    data = pickle.dumps(value)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    counts = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(counts), dtype=torch.uint8, device=device)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    return padded, counts


def _loaded(buffer: torch.Tensor, count: int) -> object:
    return pickle.loads(bytes(buffer[:count].cpu().tolist()))
