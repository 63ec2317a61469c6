"""A gradient bucket: a fixed set of same-dtype parameters whose gradients travel in one all-reduce.

Invariant: a bucket's flat buffer is allocated once, at construction, and ``views[i]`` is always
``params[i]``'s slice of it, shaped like the parameter -- so a synchronised gradient can *be* its
slice (no copy back), and the buffer is reused every step. ``DDP`` (``parallel/ddp.py``) decides
when a bucket is filled, launched and waited on; nothing here communicates.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch import nn

__all__ = ["Bucket", "BucketState"]


class BucketState(enum.IntEnum):
    """Lifecycle of one bucket within one synchronised backward."""

    FILLING = 0  # waiting for gradients
    IN_FLIGHT = 1  # all-reduce launched, handle not yet waited on


class Bucket:
    """A fixed set of same-dtype parameters whose gradients travel in one all-reduce.

    Public because DDP's seams (``_fill``, ``_launch``, ``_wait_and_average``, ...) receive it.
    """

    def __init__(self, index: int, params: list[nn.Parameter]):
        # fixed at construction
        self.index = index
        self.params = params
        self.dtype = params[0].dtype
        self.nbytes = sum(p.numel() * p.element_size() for p in params)
        # The buffer the all-reduce works on, allocated once: no allocation (and no page faults)
        # per step. views[i] is params[i]'s slice, shaped like it; it becomes params[i].grad
        # after a sync when params[i] is contiguous (as_grad[i]).
        self.flat = torch.zeros(
            sum(p.numel() for p in params), dtype=self.dtype, device=params[0].device
        )  # (bucket numel,)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(self.flat[offset : offset + p.numel()].view(p.shape))  # (p.shape)
            offset += p.numel()
        self.as_grad = [p.is_contiguous() for p in params]
        # per iteration (reset by DDP._reset_iteration)
        self.ready: set[int] = set()  # positions in self.params whose hook fired
        self.state = BucketState.FILLING
        self.handle: Any = None

    def reset(self) -> None:
        self.ready.clear()
        self.state = BucketState.FILLING
        self.handle = None
