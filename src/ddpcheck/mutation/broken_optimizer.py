"""``parallel.ShardedOptimizer`` with one seeded bug each: the optimizer half of the catalogue.

Each class overrides one seam of ``parallel.ShardedOptimizer`` (rarely two, named in its
docstring) with a copy that carries one bug of a class in ``docs/bug-catalogue.md``.
``ddpcheck.mutation.catalogue`` turns each into a target.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from parallel import ShardedOptimizer
from parallel.clipping import norm_from_shares, norm_share
from parallel.sharded_optimizer import hyperparameters


class AveragesAgainOptimizer(ShardedOptimizer):
    """Averages gradients DDP already averaged (kubeflow/pytorch-operator #122: DDP plus a
    hand-written ``average_gradients``). The numbers do not change -- the average of W identical
    gradients -- so only the communication budget sees it."""

    def _average_gradients(self, params: list[torch.Tensor]) -> None:
        for p in params:
            self._take_ddp_mark(p)  # BUG: DDP's mark is consumed and ignored...
        super()._average_gradients(params)  # ...so every gradient is averaged a second time


class SkipsZeroGradOptimizer(ShardedOptimizer):
    """``zero_grad`` does nothing, so every step re-reduces the gradients of all earlier steps
    (DeepSpeed #7839; lodestone-rock/RamTorch #13)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None  # BUG


# =============================================================================================
# A4. Gradient-norm / clipping reduction


class LocalShardNormOptimizer(ShardedOptimizer):
    """Clips by the norm of this rank's own shard: the all-reduce of the shares is missing, so
    each rank scales every gradient by its own coefficient (pytorch/xla #4796: ZeRO-1 did not
    reduce the local norm across shards)."""

    def _global_norm(self, shares: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        return norm_from_shares(norm_share(shares, norm_type), norm_type)  # BUG: no all-reduce


class NormCountsReplicasOptimizer(ShardedOptimizer):
    """Every rank adds every (replicated) gradient to its share, so the all-reduced sum counts
    each W times: the 2-norm is sqrt(W) too large (modelscope/twinkle #290: already-synced
    gradients reduced again for the norm; LBANN/lbann #2376). An inf-norm's max is unaffected."""

    def _norm_shares(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        return [p.grad for p in params if p.grad is not None]  # BUG: not only the owned ones


class ClipsBeforeAveragingOptimizer(ShardedOptimizer):
    """Clips the gradients before averaging them: the norm is the norm of rank-local gradients,
    then ``step()`` averages the clipped ones (horovod/horovod #1346: clipping before the
    allreduce). Equivalent behind ``parallel.DDP``, which has averaged already; the catalogue
    drives it without DDP."""

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        params = self._params()
        # BUG: no self._average_gradients(params) first: the gradients are this rank's own
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.tensor(0.0)
        total = self._global_norm(self._norm_shares(params), norm_type)
        total = total.to(functools.reduce(torch.promote_types, {g.dtype for g in grads}))
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coefficient)
        return total


# =============================================================================================
# E. Sharded optimizer


class OwnersFromReversedOrderOptimizer(ShardedOptimizer):
    """Steps the owners the rule gives, but broadcasts by owners computed over the group in
    reverse order, so a parameter is broadcast from a rank that did not update it
    (fairscale #122: ownership computed in two places that disagree)."""

    def _record_owners(self, params: list[torch.Tensor], owners: list[int]) -> None:
        params = list(params)[::-1]  # BUG: another ordering than the one the inner optimizer got
        super()._record_owners(params, [int(o) for o in self._rule(params, self._world_size)])


class BroadcastsFromWrongRankOptimizer(ShardedOptimizer):
    """Broadcasts owner ``i``'s slab from rank ``i % (W - 1)`` (the catalogue's E1 mutant;
    pytorch/xla #5936, fairscale #121)."""

    def _source_of(self, owner: int) -> int:
        return self._global_ranks[owner % max(self._world_size - 1, 1)]  # BUG: not `owner`


class LastShardNeverBroadcastOptimizer(ShardedOptimizer):
    """The broadcast loop stops one rank short: the last rank's shard is updated there only
    (Megatron-LM #6048: trailing shards never updated)."""

    def _broadcasting_owners(self) -> range:
        return range(self._world_size - 1)  # BUG: range(self._world_size)


class GroupZeroHyperparametersOptimizer(ShardedOptimizer):
    """Every inner group takes group 0's hyperparameters (pytorch #54736: interleaved groups;
    the catalogue's E4 mutant)."""

    def _sync_hyperparameters(self) -> None:
        for inner_group in self._inner.param_groups:
            inner_group.update(hyperparameters(self.param_groups[0]))  # BUG: group 0's


class SchedulerNeverReachesOptimizer(ShardedOptimizer):
    """Edits of ``param_groups`` (an LR scheduler) never reach the inner optimizer
    (microsoft/dp-transformers #43, pytorch #46750)."""

    def _sync_hyperparameters(self) -> None:
        pass  # BUG: the inner groups keep the hyperparameters they were built with


class EveryRankStepsEverythingOptimizer(ShardedOptimizer):
    """Every rank's inner optimizer holds every parameter (ooples/AiDotNet.Tensors #260): the
    numbers are right, the memory saving is gone. Killed by the state-placement check."""

    def _owned_group(self, group: dict[str, Any], owners: list[int]) -> dict[str, Any]:
        return {**hyperparameters(group), "params": list(group["params"])}  # BUG: not only owned


class NeverBroadcastsOptimizer(ShardedOptimizer):
    """Owners update their parameters and never send them (the catalogue's E6 "owner never
    broadcasts")."""

    def _broadcast_parameters(self, params: list[torch.Tensor]) -> None:
        return None  # BUG


class PerParameterBroadcastOptimizer(ShardedOptimizer):
    """Broadcasts each updated parameter on its own instead of one flat slab per (owner, dtype):
    correct numbers, W x parameters calls (fairscale OSS before its broadcast buckets). Killed by
    the broadcast budget."""

    def _broadcast_parameters(self, params: list[torch.Tensor]) -> None:
        for p in params:
            if p.grad is not None:  # BUG: one collective per parameter
                owner = self._owners[id(p)]
                dist.broadcast(p.data, src=self._global_ranks[owner], group=self._group)


# =============================================================================================
# H. Seen in public from-scratch implementations


class ZeroGradOwnedOnlyOptimizer(ShardedOptimizer):
    """``zero_grad`` delegates to the inner optimizer, which holds only this rank's shard: the
    parameters other ranks own keep last step's averaged gradient here, and DDP adds it into the
    next step's all-reduce (H4). Invisible without DDP in front, at W=1 and at step 0."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none=set_to_none)  # BUG: only the owned parameters


class CopiedGroupsOptimizer(ShardedOptimizer):
    """The wrapper is a mere container -- built with ``defaults={}`` -- and its inner optimizer is
    built from copies of its param groups, filled in from ``optimizer_kwargs``; nothing carries
    later edits across (H5). So the wrapper's groups hold only what the caller put in them: any
    torch LR scheduler raises ``KeyError('lr')`` on a group without its own ``lr``, and where every
    group has one, schedules and ``g['lr'] = ...`` edits never reach the inner optimizer (as E5's
    ``SchedulerNeverReaches``). Hyperparameters given per group at construction are copied, so
    they work. Overrides ``add_param_group`` (where the wrapper's defaults fill a new group) and
    ``_sync_hyperparameters``."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.defaults = {}  # BUG: the wrapper's defaults={}; only the inner optimizer has them
        super().add_param_group(param_group)  # the inner group: a copy, defaults from kwargs

    def _sync_hyperparameters(self) -> None:
        pass  # the inner groups stay the copies made at construction


# =============================================================================================
# E7. Checkpoints


class ConsolidatesOwnShardOptimizer(ShardedOptimizer):
    """``consolidate_state_dict`` gathers nothing: the checkpoint holds the state of the
    parameters rank ``to`` owns, the other shards are lost (zhijian-liu/torchpack #18: "Optimizer
    state has not been consolidated. Returning the local state"). A resumed run restarts their
    Adam moments and momentum buffers from zero, without a word."""

    def consolidate_state_dict(self, to: int = 0) -> None:
        index = {id(p): i for i, p in enumerate(self._params())}
        self._consolidated_on = to
        self._consolidated = None
        if self._rank == to:  # BUG: no gather; only this rank's own shard
            state = {index[id(p)]: s for p, s in self._inner.state.items() if s}
            self._consolidated = {
                "state": dict(sorted(state.items())),
                "param_groups": self._packed_groups(),
            }
