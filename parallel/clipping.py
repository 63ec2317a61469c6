"""Gradient-norm clipping for ``ShardedOptimizer``: one global norm from each rank's owned share.

Invariant: after ``clip_grad_norm_(max_norm, p)`` returns on every rank of the group, every
gradient is the world mean times ``min(1, max_norm / (N + 1e-6))``, bitwise identical on every
rank, where N -- the value returned -- is the p-norm of all the world-mean gradients: what
``torch.nn.utils.clip_grad_norm_`` computes and applies on the full model in one process.

After averaging, every rank holds every gradient, yet each must be counted once: each rank sums
|g|^p (takes the max, for p = inf) over the gradients *it owns*, and one scalar per rank is
all-reduced. Counting every replicated gradient on every rank inflates the norm by W^(1/p)
(modelscope/twinkle #290); skipping the all-reduce leaves each rank its own norm and replicas
that disagree.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from parallel._checks import check_positive_number
from parallel.handover import AveragedGrad

__all__ = ["GlobalNormClipping", "norm_from_shares", "norm_share"]


class GlobalNormClipping:
    """``ShardedOptimizer``'s ``clip_grad_norm_`` (a mixin: see the module docstring).

    The host provides ``_params()``, ``_average_gradients(params)``, ``_owners`` (id(param) ->
    owner rank), ``_rank`` and ``_group``. Seams: ``_norm_shares`` (the gradients this rank
    counts) and ``_global_norm`` (their norm, combined across the group).
    """

    # What the host provides, declared for the type checker only: no value here, so nothing
    # shadows the host's own attributes and methods.
    _owners: dict[int, int]
    _rank: int
    _group: dist.ProcessGroup | None

    if TYPE_CHECKING:

        def _params(self) -> list[torch.Tensor]: ...

        def _average_gradients(self, params: list[torch.Tensor]) -> None: ...

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every gradient so that the ``norm_type``-norm of all of them is at most
        ``max_norm``; return that norm before scaling, as ``torch.nn.utils.clip_grad_norm_`` does.

        Cost: one all-reduce of one float64 scalar per rank (SUM; MAX for inf), whatever the
        model's size. Gradients DDP did not average are averaged first, and marked so ``step()``
        does not average them again: the norm of rank-local gradients is not the norm. Every
        gradient is scaled, owned or not: ``step()`` reads only owned ones, but the replicas'
        gradients stay bitwise identical. Bitwise equal to torch's result only where every sum
        is exact (small integers, powers of two): the shares are summed in another order.

        Collective: call on all ranks of the group, after backward, before ``step()``.
        """
        max_norm = check_positive_number("max_norm", max_norm)
        norm_type = check_positive_number("norm_type", norm_type)
        params = self._params()
        self._average_gradients(params)
        for p in params:  # the world mean now, on every rank: step() must not average it again
            p.ddp_averaged_grad = AveragedGrad(p.grad)  # type: ignore[attr-defined]  # its mark
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:  # the same answer on every rank: gradient presence is, once averaged
            return torch.tensor(0.0)
        total = self._global_norm(self._norm_shares(params), norm_type)
        # torch's dtype for the norm: the widest gradient dtype (the same on every rank)
        total = total.to(functools.reduce(torch.promote_types, {g.dtype for g in grads}))
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as torch computes it
        for g in grads:
            g.mul_(coefficient)
        return total

    def _norm_shares(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients this rank counts in the global norm: those it owns."""
        return [p.grad for p in params if p.grad is not None and self._owners[id(p)] == self._rank]

    def _global_norm(self, shares: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        """The ``norm_type``-norm of every rank's ``shares`` together, the same on every rank."""
        share = norm_share(shares, norm_type, device=self._params()[0].device)
        # all-reduce one float64 scalar per rank (the sum of |g|^p over the gradients it owns, or
        # their largest |g| for inf) among all ranks, before any gradient is scaled: a rank sees
        # only its share of the norm, and every rank must scale by the same coefficient
        dist.all_reduce(
            share,
            op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM,
            group=self._group,
        )
        return norm_from_shares(share, norm_type)


def norm_share(
    grads: list[torch.Tensor], norm_type: float, device: torch.device | None = None
) -> torch.Tensor:
    """What ``grads`` add to a p-norm: the sum of |g|^p (max |g| for inf), a float64 scalar, from
    per-tensor norms as torch's ``clip_grad_norm_`` takes them (exact inputs: torch's bits).
    ``device``: where a rank with no gradients puts its zero (NCCL carries only CUDA tensors)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads]).double()
    if math.isinf(norm_type):
        return norms.max()
    return (norms * norms).sum() if norm_type == 2.0 else norms.pow(norm_type).sum()


def norm_from_shares(partial: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The p-norm from the combined shares (SUM of :func:`norm_share`, or MAX for inf)."""
    if math.isinf(norm_type):
        return partial
    return partial.sqrt() if norm_type == 2.0 else partial.pow(1.0 / norm_type)
