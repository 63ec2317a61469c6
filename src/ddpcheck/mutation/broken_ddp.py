"""``parallel.DDP`` with one seeded bug each: the DDP half of the mutant catalogue.

Each class overrides one seam of ``parallel.DDP`` (rarely two, named in its docstring) with a copy
that carries one bug of a class in ``docs/bug-catalogue.md``, grouped by that catalogue's sections.
``ddpcheck.mutation.catalogue`` turns each into a target.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist

from parallel import DDP
from parallel.buckets import Bucket, BucketState

# =============================================================================================
# A. Gradient scaling and averaging


class SumThenDivideDDP(DDP):
    """Pins the original's gloo path -- SUM in the collective, divide after the wait -- even on a
    backend that averages in the collective. (Not a bug; the A1/A2 mutants break its division.)"""

    def __init__(
        self,
        module: torch.nn.Module,
        bucket_size_mb: float = 25.0,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(module, bucket_size_mb, process_group)
        self._average_in_collective = False


class NoDivideDDP(SumThenDivideDDP):
    """Sums but never divides by W (Arctic-Platform #119: ``dp_size`` dropped)."""

    def _wait_and_average(self, bucket: Bucket) -> None:
        bucket.handle.wait()
        # BUG: no bucket.flat.div_(self.world_size) after the SUM


class DivideTwiceDDP(SumThenDivideDDP):
    """Divides by W twice (torchtitan #2323: the loss was already normalised globally and DDP
    averaged too; the catalogue's "divide on top of AVG")."""

    def _wait_and_average(self, bucket: Bucket) -> None:
        bucket.handle.wait()
        bucket.flat.div_(self.world_size)
        bucket.flat.div_(self.world_size)  # BUG: a second division by W


class DivideByNumelDDP(SumThenDivideDDP):
    """Divides the SUM by the bucket's element count, not by W (meta-pytorch/torchcomms #287:
    gloo AVG divided by ``tensor.numel()``)."""

    def _wait_and_average(self, bucket: Bucket) -> None:
        bucket.handle.wait()
        bucket.flat.div_(bucket.flat.numel())  # BUG: numel instead of world size


# =============================================================================================
# B. Bucketing and hook mechanics


class NoFinalFlushDDP(DDP):
    """``finish_gradient_sync`` waits for the buckets backward launched but flushes none: a bucket
    holding a parameter unused on this step is never reduced (pytorch #128949, fairscale #223)."""

    def finish_gradient_sync(self) -> None:
        if not self._sync_enabled or not self._step_started:
            return super().finish_gradient_sync()  # the original's misuse errors
        self._check_parameters_unchanged()
        # BUG: no loop launching self._buckets[self._next_launch:]
        if self._used_handle is None:
            self._launch_usage_exchange()
        self._used_handle.wait()
        assert self._used is not None  # exchanged with the last bucket, as in DDP
        used_anywhere = self._used.tolist()
        for bucket in self._buckets[: self._next_launch]:
            self._wait_and_write_back(bucket, used_anywhere)
        self._mark_averaged()
        self._reset_iteration()


class DropsEarlierMicroBatchesDDP(DDP):
    """At the synchronised micro-batch, a parameter whose hook did not fire contributes zeros --
    even if earlier ``no_sync`` micro-batches accumulated a gradient for it (pytorch #69031)."""

    @staticmethod
    @torch.no_grad()
    def _fill(bucket: Bucket) -> None:
        for i, (p, view) in enumerate(zip(bucket.params, bucket.views)):
            if p.grad is None or i not in bucket.ready:  # BUG: `or i not in bucket.ready`
                view.zero_()
            elif p.grad is not view:
                view.copy_(p.grad)


class ZeroFillsUnusedDDP(DDP):
    """Writes zeros into the gradients of parameters no rank used, so momentum and weight decay
    move them where single-process training would not (pytorch #28294 / #28883)."""

    @torch.no_grad()
    def _wait_and_write_back(self, bucket: Bucket, used_anywhere: list[int]) -> None:
        self._wait_and_average(bucket)
        for p, view, as_grad in zip(bucket.params, bucket.views, bucket.as_grad):
            # BUG: no `continue` for parameters unused on every rank
            self._write_grad(p, view, as_grad)


class LocallyUnusedStaysNoneDDP(DDP):
    """A parameter unused on this rank but used on another keeps ``grad=None`` here, so this
    replica skips it in ``step()`` (pytorch #32612; detectron2 fakes zero grads for this)."""

    @staticmethod
    def _write_grad(p: torch.nn.Parameter, view: torch.Tensor, as_grad: bool) -> None:
        if p.grad is None:
            return  # BUG: the world's average is dropped where this rank had no gradient
        DDP._write_grad(p, view, as_grad)


class TiedListedTwiceDDP(DDP):
    """Buckets are laid out by parameter *name* (``named_parameters(remove_duplicate=False)``), so
    a tied weight has two entries: its bucket never completes during backward and the flush
    reduces the weight twice (NVIDIA/Megatron-LM #6164, pytorch #51929)."""

    def __init__(
        self,
        module: torch.nn.Module,
        bucket_size_mb: float = 25.0,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(module, bucket_size_mb, process_group)
        by_name = [
            p for _, p in module.named_parameters(remove_duplicate=False) if p.requires_grad
        ]  # BUG: one entry per name, not per tensor
        self._lay_out_buckets(by_name)


class ReadinessOrderDDP(DDP):
    """Launches each bucket as soon as it is complete, in the order *this rank's* hooks fired, so
    ranks whose backward differs pair different buckets in one all-reduce -- silently when the
    sizes coincide (pytorch #13496, Megatron-LM #2218, DeepSpeed #2343)."""

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if not self._sync_enabled:
            return
        self._step_started = True
        bucket_index, position = self._where[param]
        bucket = self._buckets[bucket_index]
        bucket.ready.add(position)
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)  # BUG: not in index order
            self._next_launch += 1  # (counts launches, for the in-flight guard)

    def finish_gradient_sync(self) -> None:
        if not self._sync_enabled or not self._step_started:
            return super().finish_gradient_sync()
        self._check_parameters_unchanged()
        for bucket in self._buckets:
            if bucket.state is BucketState.FILLING:
                self._launch(bucket)
        self._used_handle.wait()
        assert self._used is not None  # exchanged with the last bucket, as in DDP
        used_anywhere = self._used.tolist()
        for bucket in self._buckets:
            self._wait_and_write_back(bucket, used_anywhere)
        self._mark_averaged()
        self._reset_iteration()


class ReadsBeforeWaitDDP(DDP):
    """Reads each bucket's averages out of its buffer before waiting for its all-reduce
    (OpenNMT-py #2295, NERSC/sc24-dl-tutorial #1): whenever the all-reduce has not finished yet,
    the gradients are this rank's own. A race: killed with high probability, not certainty."""

    @torch.no_grad()
    def _wait_and_write_back(self, bucket: Bucket, used_anywhere: list[int]) -> None:
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


class AssumesGradIsViewDDP(DDP):
    """After a bucket's first sync, assumes every ``.grad`` is still its slice of the bucket and
    stops copying gradients in; ``zero_grad(set_to_none=True)`` makes backward allocate fresh
    gradients, so the bucket re-reduces last step's values (facebookresearch/fairscale #354,
    pytorch #43307: "for just 2 iterations, it wouldn't fail")."""

    @torch.no_grad()
    def _fill(self, bucket: Bucket) -> None:  # type: ignore[override]  # DDP's is static; this one needs self
        synced = self.__dict__.setdefault("_synced_buckets", set())
        if bucket.index in synced:
            return  # BUG: p.grad may be a new tensor, not the bucket's view
        DDP._fill(bucket)
        synced.add(bucket.index)


class ReshapeWriteBackDDP(DDP):
    """Writes averages back through ``grad.reshape(-1)``, which is a *copy* for a non-contiguous
    gradient, so the write is lost (DeepSpeed #2489, Megatron-LM #5337)."""

    @staticmethod
    def _write_grad(p: torch.nn.Parameter, view: torch.Tensor, as_grad: bool) -> None:
        if not as_grad and p.grad is not None:
            p.grad.reshape(-1).copy_(view.reshape(-1))  # BUG: reshape may copy
        else:
            DDP._write_grad(p, view, as_grad)


class MixedDtypeBucketsDDP(DDP):
    """Buckets ignore dtype, so a float64 gradient lands in a bucket whose buffer has the first
    parameter's dtype, float32 (fairscale #583, pytorch #59834, NVIDIA/apex #1893). Here that
    fails loudly when the float32 slice is installed as a float64 parameter's ``.grad``; where a
    copy is made instead, precision is lost silently."""

    def _build_buckets(
        self, params: list[torch.nn.Parameter], cap_bytes: int
    ) -> list[list[torch.nn.Parameter]]:
        buckets: list[list[torch.nn.Parameter]] = []
        current: list[torch.nn.Parameter] | None = None
        size_so_far = 0
        for p in reversed(params):  # BUG: no (dtype, device) key, one open bucket for all
            size = p.numel() * p.element_size()
            if current is None or (size_so_far + size > cap_bytes and current):
                current, size_so_far = [], 0
                buckets.append(current)
            current.append(p)
            size_so_far += size
        return buckets


class BucketsFrozenDDP(DDP):
    """Frozen (``requires_grad=False``) parameters are bucketed too: their bucket never completes
    during backward and their zeros cross the wire every step (fairscale #369, DeepSpeed #4055,
    where the bucket waits forever). Killed by the communication budget."""

    def __init__(
        self,
        module: torch.nn.Module,
        bucket_size_mb: float = 25.0,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(module, bucket_size_mb, process_group)
        self._params = list(module.parameters())  # BUG: frozen ones included
        self._positions = {p: i for i, p in enumerate(self._params)}
        self._lay_out_buckets(self._params)


# =============================================================================================
# C. Gradient accumulation and no_sync


class FreesNoSyncGradsDDP(DDP):
    """Inside ``no_sync`` the hook frees each accumulated gradient (optimizer-in-backward style),
    so only the last micro-batch reaches ``step()`` (allenai/open-instruct #1498,
    DeepSpeed #7967)."""

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if not self._sync_enabled:
            param.grad = None  # BUG: the micro-batch's gradient is dropped
            return
        super()._on_grad_ready(param)


class SumsEachMicroBatchDDP(DDP):
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


class SkipsBuffersDDP(DDP):
    """Broadcasts parameters but not buffers at construction (fairscale #68, timm #110)."""

    def _initial_state(self) -> list[torch.Tensor]:
        return list(self.module.parameters())  # BUG: + list(self.module.buffers()) missing


class BroadcastsFromLastRankDDP(DDP):
    """Broadcasts the initial state from the group's last rank, not rank 0 (pytorch #63213)."""

    def _broadcast_source(self) -> int:
        # BUG: the group's last rank, not rank 0
        last = self.world_size - 1
        return (
            last if self.process_group is None else dist.get_global_rank(self.process_group, last)
        )


class NoInitialBroadcastDDP(DDP):
    """No broadcast at construction: replicas start from their own seeds (detectron2/detr #544,
    bl0/moco #4, pytorch #36613)."""

    def _broadcast_state(self) -> None:
        return None  # BUG


# =============================================================================================
# G. Parameter list and identity consistency


class OwnRegistrationOrderDDP(DDP):
    """Lays out the gradient buckets over *this rank's* registration order, not the order the
    ranks agreed on (rank 0's) -- right only while every rank registers in one order, torch DDP's
    documented precondition (catalogue G1; pytorch #74113, NVIDIA/Megatron-LM #2218). A rank
    that registered differently all-reduces other parameters' gradients together with its
    peers': silently when the bucket sizes coincide, a mismatched collective otherwise."""

    def _lay_out_buckets(self, params: list[torch.nn.Parameter]) -> None:
        agreed = set(params)
        mine = [p for p in self.module.parameters() if p in agreed]  # BUG: not `params`' order
        super()._lay_out_buckets(mine)


# =============================================================================================
# H. Seen in public from-scratch implementations


class ReducesParameterDDP(DDP):
    """The hook reduces the tensor it is handed as if it were the gradient -- but a
    post-accumulate-grad hook is handed the *parameter* (code written for ``register_hook(fn)``,
    which calls ``fn(grad)``): the weights are all-reduced and divided in place, ``.grad`` is never
    synchronised, and the replicas step on their own gradients (H1). Here the bucket carries what
    the hook was handed: ``_fill`` packs the parameters, ``_write_grad`` writes their average back
    into them. The buckets keep their schedule, so every rank still pairs the same collectives."""

    @staticmethod
    @torch.no_grad()
    def _fill(bucket: Bucket) -> None:
        for p, view in zip(bucket.params, bucket.views):
            view.copy_(p)  # BUG: the parameter, not p.grad

    @staticmethod
    @torch.no_grad()
    def _write_grad(p: torch.nn.Parameter, view: torch.Tensor, as_grad: bool) -> None:
        p.copy_(view)  # BUG: the "averaged gradient" goes back into the weights; .grad stays local


class AddsIntoAliasedBufferDDP(DDP):
    """Each bucket buffer is a persistent gradient accumulator (a flat ``main_grad``): a step's
    slot starts from zero and the fill *adds* the gradient into it -- written for a ``.grad`` that
    is a copy of the buffer, but after a sync ``.grad`` *is* its slot (``p.grad =
    main_grad.to(p.dtype)`` returns the same tensor when the dtypes match). Under
    ``zero_grad(set_to_none=False)`` the next backward accumulates into the slot in place and the
    fill adds it again, so from step 1 the gradient counts twice; ``set_to_none=True`` hides it
    (H2)."""

    @staticmethod
    @torch.no_grad()
    def _fill(bucket: Bucket) -> None:
        for p, view in zip(bucket.params, bucket.views):
            if p.grad is not view:
                view.zero_()  # the step's slot starts from zero (zero_grad zeroed an aliased one)
            if p.grad is not None:
                view.add_(p.grad)  # BUG: when p.grad *is* the slot, it is added to itself


class ReducesLastMicroBatchOnlyDDP(DDP):
    """Reduction driven by per-tensor ``register_hook``: each hook sees the gradient of the
    current backward only, and reduces it when sync is on -- so only the last micro-batch of an
    accumulation is averaged; what the ``no_sync`` micro-batches accumulated in ``.grad`` stays
    local, and the replicas differ (H3; C1's ``FreesNoSyncGrads`` drops them instead). The tensor
    hooks (added in ``__init__``) take the synchronised backward's gradient into the bucket
    (``_fill``) instead of letting autograd accumulate it; ``_write_grad`` adds the average to the
    local rest, as autograd adds what a tensor hook returns."""

    def __init__(
        self,
        module: torch.nn.Module,
        bucket_size_mb: float = 25.0,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(module, bucket_size_mb, process_group)
        # param -> its gradient from the synchronised backward
        self._this_backward: dict[torch.Tensor, torch.Tensor] = {}

        def tensor_hook(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
            if not self._sync_enabled:
                return grad  # accumulation micro-batch: autograd accumulates it locally
            self._this_backward[p] = grad  # BUG: only this backward's gradient is reduced
            return torch.zeros_like(grad)  # its average is added at the write-back

        for p in self._params:
            p.register_hook(functools.partial(tensor_hook, p))

    @torch.no_grad()
    def _fill(self, bucket: Bucket) -> None:  # type: ignore[override]  # DDP's is static; this one needs self
        for p, view in zip(bucket.params, bucket.views):
            grad = self._this_backward.pop(p, None)
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad)

    @staticmethod
    @torch.no_grad()
    def _write_grad(p: torch.nn.Parameter, view: torch.Tensor, as_grad: bool) -> None:
        if p.grad is None:
            p.grad = torch.empty_like(p).copy_(view)
        else:
            p.grad.add_(view)  # the earlier micro-batches' local sum + this one's average


# =============================================================================================
# J. Language-model training: tokens and mixed precision


class LastMicroBatchAfterReduceDDP(DDP):
    """Gradient accumulation in a float32 accumulator whose all-reduce runs *before* the last
    micro-batch's gradient is added to it: the earlier micro-batches are averaged, the last one
    stays local, and the replicas differ from the first step (J4; DeepSpeed #7985, the
    BF16_Optimizer that leaked the last micro-batch's gradient: per-rank gradients differed by
    ~3.8 % at the boundary). Tensor hooks (``__init__``) hold the synchronised backward's
    gradient aside in the accumulator's dtype (float32, or the parameter's when wider), so the
    bucket carries what ``.grad`` had accumulated before it; ``_wait_and_write_back`` adds it
    after the all-reduce."""

    def __init__(
        self,
        module: torch.nn.Module,
        bucket_size_mb: float = 25.0,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(module, bucket_size_mb, process_group)
        # param -> its gradient from the synchronised backward
        self._last_micro_batch: dict[torch.Tensor, torch.Tensor] = {}

        def tensor_hook(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
            if not self._sync_enabled:
                return grad  # accumulation micro-batch: into the accumulator (.grad), locally
            wide = torch.promote_types(grad.dtype, torch.float32)
            self._last_micro_batch[p] = grad.to(wide)  # BUG: held aside until after the reduce
            return torch.zeros_like(grad)

        for p in self._params:
            p.register_hook(functools.partial(tensor_hook, p))

    @torch.no_grad()
    def _wait_and_write_back(self, bucket: Bucket, used_anywhere: list[int]) -> None:
        super()._wait_and_write_back(bucket, used_anywhere)
        for p in bucket.params:
            last = self._last_micro_batch.pop(p, None)
            if last is not None and p.grad is not None:
                p.grad.copy_((p.grad.to(last.dtype) + last).to(p.grad.dtype))  # local, after
