"""Which gradients ``DDP`` has already averaged this step, so ``ShardedOptimizer`` does not again.

Invariant: ``take_synchronized(p)`` is True exactly when ``DDP.finish_gradient_sync()`` averaged
``p``'s gradient since the last time the optimizer looked, and ``p.grad`` is still the very tensor
that sync produced (or is still None, for a parameter no rank used). Each mark is consumed once, so
a later step that skips the DDP sync is averaged by the optimizer again rather than silently not at
all. No collective happens here; this is bookkeeping local to one rank.
"""

from __future__ import annotations

import weakref

from torch.utils.weak import WeakIdKeyDictionary

import torch

__all__ = ["mark_synchronized", "take_synchronized"]

# param -> weak reference to the gradient the sync left in param.grad (None: no rank had one).
# A weak reference, not id(): a freed gradient's id can be reused by the next backward's.
_MARKS: "WeakIdKeyDictionary" = WeakIdKeyDictionary()  # keyed by identity, not tensor ==


def mark_synchronized(params) -> None:
    """Record that these parameters' gradients now hold the world average."""
    for p in params:
        _MARKS[p] = None if p.grad is None else weakref.ref(p.grad)


def take_synchronized(param: torch.Tensor) -> bool:
    """Whether ``param``'s gradient was averaged by DDP and is unchanged since; consumes the mark."""
    if param not in _MARKS:
        return False
    ref = _MARKS.pop(param)
    if ref is None:
        return param.grad is None
    return ref() is param.grad
