"""The mutant catalogue: the built-in ``parallel`` target with exactly one seeded bug each.

Invariant: every entry of :data:`CATALOGUE` is :class:`~ddpcheck.targets.ParallelTarget` (or, where
noted, :class:`~ddpcheck.targets.ParallelDDPTarget`) whose ``parallel.DDP`` or
``parallel.ShardedOptimizer`` is replaced by a subclass overriding one method (rarely two, always
named in the docstring) with a copy that carries one bug of a class in
``shared/bug-catalogue.md``. Each docstring says what the bug is and which real report it mirrors.
``ddpcheck mutants`` (and ``tests/test_mutants.py``) hold the harness to killing all of them.

Classes of the catalogue without a mutant here, and why:

* A3 (mean of per-rank means), F1-F3 (samplers, padding, uneven batch counts): loss
  normalisation and data sharding belong to the training loop -- ddpcheck's runner owns them --
  not to ``parallel.DDP`` / ``ShardedOptimizer``, which never see the batch.
* A4 (clipping): neither ``parallel`` class clips, and the runner does not clip; a mutant would
  have no code to break.
* B5 (a hook firing twice) and "no already-marked guard": the guard only matters where the
  unmutated ``DDP`` *raises* (a second synchronised backward, reentrant checkpointing); within
  what the target supports the mutant is equivalent. Killing it needs "misuse must raise"
  examples, which the oracle does not have.
* B7 "wait only on the last handle": not included. On gloo, work of one process group is queued
  in launch order, so the earlier buckets have very likely finished when the last one has: at
  best a flaky kill (expected, not measured). ``ReadsBeforeWait`` covers B7.
* B12 (bypassing the wrapper): the runner always calls the wrapper's forward and
  ``finish_gradient_sync``; the bypass is a training-loop bug.
* C2 (sync/step flag logic of trainers) and E3 (a group-level step counter skipped on empty
  shards): ``parallel`` has no trainer flags and torch's optimizers count steps per parameter, so
  there is no such counter to skip.
* E7, E8 (checkpoints): the oracle has no checkpoint round trip yet.
* G1 (parameter order differing per rank): needs per-rank permuted construction order, which no
  scenario generates; orders derived from ``id()`` or ``set`` iteration happen to agree across
  spawned ranks (address randomisation moves whole pages), so such a mutant is not reliably
  killable -- the oracle would need a per-rank permutation feature.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import torch
import torch.distributed as dist

from parallel import DDP, ShardedOptimizer
from parallel.ddp import BucketState
from parallel.sharded_optimizer import hyperparameters
from ddpcheck.targets import ParallelDDPTarget, ParallelTarget

__all__ = ["CATALOGUE", "Mutant", "by_name"]


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One entry of the catalogue: a target with one seeded bug, and what the bug is."""

    name: str  # the target class's name, e.g. "NoDivide"
    bug_class: str  # catalogue id, e.g. "A1"
    description: str  # one line
    target: Any


# ---------------------------------------------------------------------------------------------
# How a mutant target swaps in its broken class


@dataclasses.dataclass(frozen=True)
class _Seeded(ParallelTarget):
    """``ParallelTarget`` driving ``ddp_class`` and ``optimizer_class`` instead of the originals."""

    ddp_class = DDP
    optimizer_class = ShardedOptimizer

    def wrap(self, module: Any) -> Any:
        return self.ddp_class(module, bucket_size_mb=self.bucket_size_mb or 25.0)

    def make_optimizer(self, params: Any, optimizer_cls: type, **kwargs: Any) -> Any:
        if self.sharding_rule is not None:
            kwargs["sharding_rule"] = self.sharding_rule
        return self.optimizer_class(params, optimizer_cls, **kwargs)


@dataclasses.dataclass(frozen=True)
class _SeededDDPOnly(ParallelDDPTarget):
    """``ParallelDDPTarget`` (plain optimizer) driving ``ddp_class``."""

    ddp_class = DDP

    def wrap(self, module: Any) -> Any:
        return self.ddp_class(module, bucket_size_mb=self.bucket_size_mb or 25.0)


# =============================================================================================
# A. Gradient scaling and averaging


class _SumThenDivideDDP(DDP):
    """Pins the original's gloo path -- SUM in the collective, divide after the wait -- even on a
    backend that averages in the collective. (Not a bug; the A1/A2 mutants break its division.)"""

    def __init__(self, module, bucket_size_mb=25.0, process_group=None):
        super().__init__(module, bucket_size_mb, process_group)
        self._average_in_collective = False


class _NoDivideDDP(_SumThenDivideDDP):
    """Sums but never divides by W (Arctic-Platform #119: ``dp_size`` dropped)."""

    def _wait_and_average(self, bucket):
        bucket.handle.wait()
        # BUG: no bucket.flat.div_(self.world_size) after the SUM


class _DivideTwiceDDP(_SumThenDivideDDP):
    """Divides by W twice (torchtitan #2323: the loss was already normalised globally and DDP
    averaged too; the catalogue's "divide on top of AVG")."""

    def _wait_and_average(self, bucket):
        bucket.handle.wait()
        bucket.flat.div_(self.world_size)
        bucket.flat.div_(self.world_size)  # BUG: a second division by W


class _DivideByNumelDDP(_SumThenDivideDDP):
    """Divides the SUM by the bucket's element count, not by W (meta-pytorch/torchcomms #287:
    gloo AVG divided by ``tensor.numel()``)."""

    def _wait_and_average(self, bucket):
        bucket.handle.wait()
        bucket.flat.div_(bucket.flat.numel())  # BUG: numel instead of world size


class _AveragesAgainOptimizer(ShardedOptimizer):
    """Averages gradients DDP already averaged (kubeflow/pytorch-operator #122: DDP plus a
    hand-written ``average_gradients``). The numbers do not change -- the average of W identical
    gradients -- so only the communication budget sees it."""

    def _average_gradients(self, params):
        for p in params:
            self._take_ddp_mark(p)  # BUG: DDP's mark is consumed and ignored...
        super()._average_gradients(params)  # ...so every gradient is averaged a second time


# =============================================================================================
# B. Bucketing and hook mechanics


class _NoFinalFlushDDP(DDP):
    """``finish_gradient_sync`` waits for the buckets backward launched but flushes none: a bucket
    holding a parameter unused on this step is never reduced (pytorch #128949, fairscale #223)."""

    def finish_gradient_sync(self):
        if not self._sync_enabled or not self._step_started:
            return super().finish_gradient_sync()  # the original's misuse errors
        self._check_parameters_unchanged()
        # BUG: no loop launching self._buckets[self._next_launch:]
        if self._used_handle is None:
            self._launch_usage_exchange()
        self._used_handle.wait()
        used_anywhere = self._used.tolist()
        for bucket in self._buckets[:self._next_launch]:
            self._wait_and_write_back(bucket, used_anywhere)
        self._mark_averaged()
        self._reset_iteration()


class _DropsEarlierMicroBatchesDDP(DDP):
    """At the synchronised micro-batch, a parameter whose hook did not fire contributes zeros --
    even if earlier ``no_sync`` micro-batches accumulated a gradient for it (pytorch #69031)."""

    @staticmethod
    @torch.no_grad()
    def _fill(bucket):
        for i, (p, view) in enumerate(zip(bucket.params, bucket.views)):
            if p.grad is None or i not in bucket.ready:  # BUG: `or i not in bucket.ready`
                view.zero_()
            elif p.grad is not view:
                view.copy_(p.grad)


class _ZeroFillsUnusedDDP(DDP):
    """Writes zeros into the gradients of parameters no rank used, so momentum and weight decay
    move them where single-process training would not (pytorch #28294 / #28883)."""

    @torch.no_grad()
    def _wait_and_write_back(self, bucket, used_anywhere):
        self._wait_and_average(bucket)
        for p, view, as_grad in zip(bucket.params, bucket.views, bucket.as_grad):
            # BUG: no `continue` for parameters unused on every rank
            self._write_grad(p, view, as_grad)


class _LocallyUnusedStaysNoneDDP(DDP):
    """A parameter unused on this rank but used on another keeps ``grad=None`` here, so this
    replica skips it in ``step()`` (pytorch #32612; detectron2 fakes zero grads for this)."""

    @staticmethod
    def _write_grad(p, view, as_grad):
        if p.grad is None:
            return  # BUG: the world's average is dropped where this rank had no gradient
        DDP._write_grad(p, view, as_grad)


class _TiedListedTwiceDDP(DDP):
    """Buckets are laid out by parameter *name* (``named_parameters(remove_duplicate=False)``), so
    a tied weight has two entries: its bucket never completes during backward and the flush
    reduces the weight twice (NVIDIA/Megatron-LM #6164, pytorch #51929)."""

    def __init__(self, module, bucket_size_mb=25.0, process_group=None):
        super().__init__(module, bucket_size_mb, process_group)
        by_name = [p for _, p in module.named_parameters(remove_duplicate=False)
                   if p.requires_grad]  # BUG: one entry per name, not per tensor
        self._lay_out_buckets(by_name)


class _ReadinessOrderDDP(DDP):
    """Launches each bucket as soon as it is complete, in the order *this rank's* hooks fired, so
    ranks whose backward differs pair different buckets in one all-reduce -- silently when the
    sizes coincide (pytorch #13496, Megatron-LM #2218, DeepSpeed #2343)."""

    def _on_grad_ready(self, param):
        if not self._sync_enabled:
            return
        self._step_started = True
        bucket_index, position = self._where[param]
        bucket = self._buckets[bucket_index]
        bucket.ready.add(position)
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)  # BUG: not in index order
            self._next_launch += 1  # (counts launches, for the in-flight guard)

    def finish_gradient_sync(self):
        if not self._sync_enabled or not self._step_started:
            return super().finish_gradient_sync()
        self._check_parameters_unchanged()
        for bucket in self._buckets:
            if bucket.state is BucketState.FILLING:
                self._launch(bucket)
        self._used_handle.wait()
        used_anywhere = self._used.tolist()
        for bucket in self._buckets:
            self._wait_and_write_back(bucket, used_anywhere)
        self._mark_averaged()
        self._reset_iteration()


class _ReadsBeforeWaitDDP(DDP):
    """Reads each bucket's averages out of its buffer before waiting for its all-reduce
    (OpenNMT-py #2295, NERSC/sc24-dl-tutorial #1): whenever the all-reduce has not finished yet,
    the gradients are this rank's own. A race: killed with high probability, not certainty."""

    @torch.no_grad()
    def _wait_and_write_back(self, bucket, used_anywhere):
        early = bucket.flat.clone()  # BUG: read before bucket.handle.wait()
        bucket.handle.wait()
        if not self._average_in_collective:
            early.div_(self.world_size)
        for p, averaged in zip(bucket.params, early.split([p.numel() for p in bucket.params])):
            if not used_anywhere[self._positions[p]]:
                continue
            averaged = averaged.view_as(p)
            if p.grad is None:
                p.grad = torch.empty_like(p).copy_(averaged)
            else:
                p.grad.copy_(averaged)


class _AssumesGradIsViewDDP(DDP):
    """After a bucket's first sync, assumes every ``.grad`` is still its slice of the bucket and
    stops copying gradients in; ``zero_grad(set_to_none=True)`` makes backward allocate fresh
    gradients, so the bucket re-reduces last step's values (facebookresearch/fairscale #354,
    pytorch #43307: "for just 2 iterations, it wouldn't fail")."""

    @torch.no_grad()
    def _fill(self, bucket):
        synced = self.__dict__.setdefault("_synced_buckets", set())
        if bucket.index in synced:
            return  # BUG: p.grad may be a new tensor, not the bucket's view
        DDP._fill(bucket)
        synced.add(bucket.index)


class _ReshapeWriteBackDDP(DDP):
    """Writes averages back through ``grad.reshape(-1)``, which is a *copy* for a non-contiguous
    gradient, so the write is lost (DeepSpeed #2489, Megatron-LM #5337)."""

    @staticmethod
    def _write_grad(p, view, as_grad):
        if not as_grad and p.grad is not None:
            p.grad.reshape(-1).copy_(view.reshape(-1))  # BUG: reshape may copy
        else:
            DDP._write_grad(p, view, as_grad)


class _MixedDtypeBucketsDDP(DDP):
    """Buckets ignore dtype, so a float64 gradient lands in a bucket whose buffer has the first
    parameter's dtype, float32 (fairscale #583, pytorch #59834, NVIDIA/apex #1893). Here that
    fails loudly when the float32 slice is installed as a float64 parameter's ``.grad``; where a
    copy is made instead, precision is lost silently."""

    def _build_buckets(self, params, cap_bytes):
        buckets, current, size_so_far = [], None, 0
        for p in reversed(params):  # BUG: no (dtype, device) key, one open bucket for all
            size = p.numel() * p.element_size()
            if current is None or (size_so_far + size > cap_bytes and current):
                current, size_so_far = [], 0
                buckets.append(current)
            current.append(p)
            size_so_far += size
        return buckets


class _BucketsFrozenDDP(DDP):
    """Frozen (``requires_grad=False``) parameters are bucketed too: their bucket never completes
    during backward and their zeros cross the wire every step (fairscale #369, DeepSpeed #4055,
    where the bucket waits forever). Killed by the communication budget."""

    def __init__(self, module, bucket_size_mb=25.0, process_group=None):
        super().__init__(module, bucket_size_mb, process_group)
        self._params = list(module.parameters())  # BUG: frozen ones included
        self._positions = {p: i for i, p in enumerate(self._params)}
        self._lay_out_buckets(self._params)


# =============================================================================================
# C. Gradient accumulation and no_sync


class _FreesNoSyncGradsDDP(DDP):
    """Inside ``no_sync`` the hook frees each accumulated gradient (optimizer-in-backward style),
    so only the last micro-batch reaches ``step()`` (allenai/open-instruct #1498,
    DeepSpeed #7967)."""

    def _on_grad_ready(self, param):
        if not self._sync_enabled:
            param.grad = None  # BUG: the micro-batch's gradient is dropped
            return
        super()._on_grad_ready(param)


class _SkipsZeroGradOptimizer(ShardedOptimizer):
    """``zero_grad`` does nothing, so every step re-reduces the gradients of all earlier steps
    (DeepSpeed #7839; lodestone-rock/RamTorch #13)."""

    def zero_grad(self, set_to_none: bool = True):
        return None  # BUG


class _SumsEachMicroBatchDDP(DDP):
    """Accumulation micro-batches are all-reduced with SUM as they finish, then the synchronised
    step averages the sum again: earlier micro-batches count W times (RamTorch #13,
    ColossalAI #247). A no-op at W=1."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with super().no_sync():
            yield
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.process_group)  # BUG: reduced now, and again later
        for p, summed in zip(self._params, flat.split([g.numel() for g in grads])):
            if p.grad is not None:
                p.grad.copy_(summed.view_as(p.grad))


# =============================================================================================
# D. Buffers and initial state


class _SkipsBuffersDDP(DDP):
    """Broadcasts parameters but not buffers at construction (fairscale #68, timm #110)."""

    def _initial_state(self):
        return list(self.module.parameters())  # BUG: + list(self.module.buffers()) missing


class _BroadcastsFromLastRankDDP(DDP):
    """Broadcasts the initial state from the group's last rank, not rank 0 (pytorch #63213)."""

    def _broadcast_source(self):
        # BUG: the group's last rank, not rank 0
        return dist.get_global_rank(self.process_group or dist.group.WORLD, self.world_size - 1)


class _NoInitialBroadcastDDP(DDP):
    """No broadcast at construction: replicas start from their own seeds (detectron2/detr #544,
    bl0/moco #4, pytorch #36613)."""

    def _broadcast_state(self):
        return None  # BUG


# =============================================================================================
# E. Sharded optimizer


class _OwnersFromReversedOrderOptimizer(ShardedOptimizer):
    """Steps the owners the rule gives, but broadcasts by owners computed over the group in
    reverse order, so a parameter is broadcast from a rank that did not update it
    (fairscale #122: ownership computed in two places that disagree)."""

    def _record_owners(self, params, owners):
        params = list(params)[::-1]  # BUG: another ordering than the one the inner optimizer got
        super()._record_owners(params, [int(o) for o in self._rule(params, self._world_size)])


class _BroadcastsFromWrongRankOptimizer(ShardedOptimizer):
    """Broadcasts owner ``i``'s slab from rank ``i % (W - 1)`` (the catalogue's E1 mutant;
    pytorch/xla #5936, fairscale #121)."""

    def _source_of(self, owner):
        return self._global_ranks[owner % max(self._world_size - 1, 1)]  # BUG: not `owner`


class _LastShardNeverBroadcastOptimizer(ShardedOptimizer):
    """The broadcast loop stops one rank short: the last rank's shard is updated there only
    (Megatron-LM #6048: trailing shards never updated)."""

    def _broadcasting_owners(self):
        return range(self._world_size - 1)  # BUG: range(self._world_size)


class _GroupZeroHyperparametersOptimizer(ShardedOptimizer):
    """Every inner group takes group 0's hyperparameters (pytorch #54736: interleaved groups;
    the catalogue's E4 mutant)."""

    def _sync_hyperparameters(self):
        for inner_group in self._inner.param_groups:
            inner_group.update(hyperparameters(self.param_groups[0]))  # BUG: group 0's


class _SchedulerNeverReachesOptimizer(ShardedOptimizer):
    """Edits of ``param_groups`` (an LR scheduler) never reach the inner optimizer
    (microsoft/dp-transformers #43, pytorch #46750)."""

    def _sync_hyperparameters(self):
        pass  # BUG: the inner groups keep the hyperparameters they were built with


class _EveryRankStepsEverythingOptimizer(ShardedOptimizer):
    """Every rank's inner optimizer holds every parameter (ooples/AiDotNet.Tensors #260): the
    numbers are right, the memory saving is gone. Killed by the state-placement check."""

    def _owned_group(self, group, owners):
        return {**hyperparameters(group), "params": list(group["params"])}  # BUG: not only owned


class _NeverBroadcastsOptimizer(ShardedOptimizer):
    """Owners update their parameters and never send them (the catalogue's E6 "owner never
    broadcasts")."""

    def _broadcast_parameters(self, params):
        return None  # BUG


class _PerParameterBroadcastOptimizer(ShardedOptimizer):
    """Broadcasts each updated parameter on its own instead of one flat slab per (owner, dtype):
    correct numbers, W x parameters calls (fairscale OSS before its broadcast buckets). Killed by
    the broadcast budget."""

    def _broadcast_parameters(self, params):
        for p in params:
            if p.grad is not None:  # BUG: one collective per parameter
                owner = self._owners[id(p)]
                dist.broadcast(p.data, src=self._global_ranks[owner], group=self._group)


# =============================================================================================
# The targets, and the catalogue

def _target(name: str, *, ddp: type = DDP, optimizer: type = ShardedOptimizer,
            ddp_only: bool = False) -> type:
    base = _SeededDDPOnly if ddp_only else _Seeded
    attrs = {"ddp_class": ddp, "__module__": __name__, "__qualname__": name}
    if not ddp_only:
        attrs["optimizer_class"] = optimizer
    cls = type(name, (base,), attrs)
    return dataclasses.dataclass(frozen=True)(cls)


_ENTRIES: list[tuple[str, str, str, dict]] = [
    ("NoDivide", "A1", "gloo SUM without the /W", {"ddp": _NoDivideDDP}),
    ("DivideTwice", "A1", "gradients divided by W twice", {"ddp": _DivideTwiceDDP}),
    ("AveragesAgain", "A1", "ShardedOptimizer averages gradients DDP already averaged",
     {"optimizer": _AveragesAgainOptimizer}),
    ("DivideByNumel", "A2", "gloo SUM divided by the bucket's numel instead of W",
     {"ddp": _DivideByNumelDDP}),
    ("NoFinalFlush", "B1", "finish_gradient_sync never flushes incomplete buckets",
     {"ddp": _NoFinalFlushDDP}),
    ("DropsEarlierMicroBatches", "B2",
     "no_sync grads of params unused in the last micro-batch are dropped",
     {"ddp": _DropsEarlierMicroBatchesDDP}),
    ("ZeroFillsUnused", "B3", "globally unused params get zero grads (not None)",
     {"ddp": _ZeroFillsUnusedDDP}),
    ("LocallyUnusedStaysNone", "B3",
     "a param unused here but used elsewhere keeps grad=None (DDP + plain optimizer)",
     {"ddp": _LocallyUnusedStaysNoneDDP, "ddp_only": True}),
    ("TiedListedTwice", "B4", "buckets by name: a tied weight is reduced twice",
     {"ddp": _TiedListedTwiceDDP}),
    ("ReadinessOrder", "B6", "buckets launched in this rank's readiness order",
     {"ddp": _ReadinessOrderDDP}),
    ("ReadsBeforeWait", "B7", "bucket averages read before its all-reduce is waited on",
     {"ddp": _ReadsBeforeWaitDDP}),
    ("AssumesGradIsView", "B8", "after the first sync, grads assumed to be bucket views: not copied in",
     {"ddp": _AssumesGradIsViewDDP}),
    ("ReshapeWriteBack", "B9", "write-back through grad.reshape(-1), lost for non-contiguous grads",
     {"ddp": _ReshapeWriteBackDDP}),
    ("MixedDtypeBuckets", "B10", "float64 grads put in a float32 bucket (buckets ignore dtype)",
     {"ddp": _MixedDtypeBucketsDDP}),
    ("BucketsFrozen", "B11", "frozen params bucketed: their zeros are all-reduced every step",
     {"ddp": _BucketsFrozenDDP}),
    ("FreesNoSyncGrads", "C1", "no_sync micro-batch grads freed: only the last micro-batch counts",
     {"ddp": _FreesNoSyncGradsDDP}),
    ("SkipsZeroGrad", "C1", "zero_grad does nothing: grads accumulate across steps",
     {"optimizer": _SkipsZeroGradOptimizer}),
    ("SumsEachMicroBatch", "C3", "every micro-batch all-reduced with SUM, then averaged again",
     {"ddp": _SumsEachMicroBatchDDP}),
    ("SkipsBuffers", "D1", "buffers not broadcast at construction", {"ddp": _SkipsBuffersDDP}),
    ("BroadcastsFromLastRank", "D2", "initial state broadcast from the last rank, not rank 0",
     {"ddp": _BroadcastsFromLastRankDDP}),
    ("NoInitialBroadcast", "D2", "no broadcast of the initial state at construction",
     {"ddp": _NoInitialBroadcastDDP}),
    ("OwnersFromReversedOrder", "E1", "broadcast owners computed over a different param order",
     {"optimizer": _OwnersFromReversedOrderOptimizer}),
    ("BroadcastsFromWrongRank", "E1", "owner i's slab broadcast from rank i % (W-1)",
     {"optimizer": _BroadcastsFromWrongRankOptimizer}),
    ("LastShardNeverBroadcast", "E2", "the last rank's shard is never broadcast",
     {"optimizer": _LastShardNeverBroadcastOptimizer}),
    ("GroupZeroHyperparameters", "E4", "every param group stepped with group 0's hyperparameters",
     {"optimizer": _GroupZeroHyperparametersOptimizer}),
    ("SchedulerNeverReaches", "E5", "LR scheduler edits never reach the inner optimizer",
     {"optimizer": _SchedulerNeverReachesOptimizer}),
    ("EveryRankStepsEverything", "E6", "every rank keeps state for and steps every param",
     {"optimizer": _EveryRankStepsEverythingOptimizer}),
    ("NeverBroadcasts", "E6", "owners never broadcast their updated params",
     {"optimizer": _NeverBroadcastsOptimizer}),
    ("PerParameterBroadcast", "E6", "one broadcast per param instead of per (owner, dtype)",
     {"optimizer": _PerParameterBroadcastOptimizer}),
]

CATALOGUE: list[Mutant] = []
for _name, _class, _description, _swap in _ENTRIES:
    _cls = _target(_name, **_swap)
    globals()[_name] = _cls
    CATALOGUE.append(Mutant(_name, _class, _description, _cls()))
del _name, _class, _description, _swap, _cls


def by_name(name: str) -> Mutant:
    """The catalogue entry called ``name`` (case-insensitive)."""
    for mutant in CATALOGUE:
        if mutant.name.lower() == name.lower():
            return mutant
    from ddpcheck._internal.validation import InvalidArgument

    raise InvalidArgument(f"mutant {name!r} is not in the catalogue; known: "
                          f"{', '.join(m.name for m in CATALOGUE)}")


def _check_overrides() -> None:
    """Every method a mutant overrides must exist in ``parallel``: when ``parallel`` renames one,
    the mutant would otherwise silently stop being a mutant (and "survive")."""
    for mutant in CATALOGUE:
        for broken in (type(mutant.target).ddp_class,
                       getattr(type(mutant.target), "optimizer_class", ShardedOptimizer)):
            original = DDP if issubclass(broken, DDP) else ShardedOptimizer
            for name, value in vars(broken).items():
                if callable(value) and not name.startswith("__") and not hasattr(original, name):
                    raise ImportError(
                        f"mutant {mutant.name}: {broken.__qualname__}.{name} overrides nothing in "
                        f"{original.__module__}.{original.__qualname__}; update ddpcheck.mutation.catalogue "
                        "to the current parallel/ code")


_check_overrides()
