"""The hand-over between ``parallel.DDP`` and ``parallel.ShardedOptimizer``: marks on parameters.

DDP knows things about a parameter that the optimizer, which receives bare tensors, cannot know:

* ``param.ddp_averaged_grad`` (:class:`AveragedGrad`): this gradient is already the world mean,
  so ``ShardedOptimizer.step()`` need not all-reduce it again;
* ``param.ddp_position``: its index in the group's rank-0 registration order, which DDP agreed on
  at construction (ranks may register parameters in different orders). ``ShardedOptimizer``
  assigns owners and packs broadcasts by position in a param group, so it puts every group in
  rank 0's order (:func:`rank0_order`); without DDP in front there is no mark, and every rank
  must pass its parameters in the same order.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["AveragedGrad", "mark_positions", "put_in_rank0_order", "rank0_order"]


class AveragedGrad:
    """DDP's mark on a parameter, ``param.ddp_averaged_grad``: its gradient is the world mean.

    Set by ``DDP.finish_gradient_sync()`` on every parameter it synchronised (and by
    ``ShardedOptimizer.clip_grad_norm_``, which averages what DDP did not); consumed (read and
    deleted) by ``ShardedOptimizer.step()``, which then skips that parameter's all-reduce. Valid
    only while ``param.grad`` is still the very tensor the sync left there (or still None, where
    no rank had a gradient); a later step whose backward skipped the sync finds no mark, and the
    optimizer averages it again. Bookkeeping local to one rank: no collective.
    """

    __slots__ = ("_grad",)

    def __init__(self, grad: torch.Tensor | None):
        # A weak reference, not id(): a freed gradient's id can be reused by the next backward's.
        self._grad = None if grad is None else weakref.ref(grad)

    def holds(self, grad: torch.Tensor | None) -> bool:
        """Whether ``grad`` is the gradient the sync averaged (or None where it left None)."""
        if self._grad is None:
            return grad is None
        return self._grad() is grad

    def __reduce__(self) -> tuple:
        # A pickled or copied parameter was averaged by nobody: its copy carries no mark (None).
        return type(None), ()


def mark_positions(ordered: list[torch.Tensor]) -> None:
    """DDP's mark: ``param.ddp_position`` = the index of each parameter in rank 0's order."""
    for i, tensor in enumerate(ordered):
        if isinstance(tensor, torch.nn.Parameter):
            tensor.ddp_position = i  # type: ignore[attr-defined]  # the mark is the parameter's


def rank0_order(params: list[torch.Tensor], process_group: Any, src: int) -> list[int]:
    """The permutation of ``params`` (a param group's, in this rank's order) into the order rank 0
    passed them in, by DDP's ``ddp_position`` marks; the identity where a parameter has none.

    Collective when every parameter is marked (every rank of a DDP-wrapped model): call on all
    ranks of the group. ``src`` is the group's rank 0 as a global rank.
    """
    marks = [getattr(p, "ddp_position", None) for p in params]
    positions: list[int] = [m for m in marks if m is not None]
    if not params or len(positions) < len(params):
        return list(range(len(params)))  # no DDP in front: the order given must be the same
    theirs = torch.tensor(positions, dtype=torch.int64, device=params[0].device)  # (params,)
    # broadcast rank 0's order of this param group (DDP's position of each parameter, one int64
    # each), once per group at construction, so owners and broadcast slabs pair by rank 0's order
    dist.broadcast(theirs, src=src, group=process_group)
    index = {position: i for i, position in enumerate(positions)}
    wanted = theirs.tolist()
    if sorted(wanted) != sorted(positions):  # other members: the layout check reports it
        return list(range(len(params)))
    return [index[position] for position in wanted]


def put_in_rank0_order(group: dict[str, Any], process_group: Any, src: int) -> None:
    """Reorder a param group's ``params`` (and ``param_names``) into rank 0's order, in place
    (:func:`rank0_order`, a broadcast when DDP marked the parameters)."""
    order = rank0_order(group["params"], process_group, src)
    for key in ("params", "param_names"):
        if key in group:
            group[key] = [group[key][i] for i in order]
