"""A small, readable data-parallel wrapper: which gradients cross the wire, and when.

Invariant: after ``finish_gradient_sync()`` returns, on every rank of the group, each trainable
parameter's ``.grad`` is the world mean of the ranks' local gradients -- a rank that produced no
gradient for it contributes zeros -- and is bitwise identical across ranks; a parameter no rank
produced a gradient for keeps ``grad is None``. Between ``backward()`` and
``finish_gradient_sync()`` gradients are in flight and must not be read.

Gradients as bucket views: each bucket owns one flat buffer for its whole life, and after a sync
the ``.grad`` of each contiguous parameter *is* its slice of that buffer (as torch DDP's
``gradient_as_bucket_view=True``). No copy comes back after the all-reduce, and a gradient that
is still that slice at the next launch (``zero_grad(set_to_none=False)``, accumulation) is not
copied in either. The cost: a ``.grad`` kept from an earlier step is overwritten by later ones.
A non-contiguous parameter's gradient keeps the parameter's strides and is copied both ways.

What moves, and when:

1. construction: after checking that every rank wraps the same parameters and buffers (names,
   shapes, dtypes), rank 0's registration order is broadcast (ranks may register in different
   orders; everything below pairs tensors in rank 0's), then parameters and buffers are broadcast
   from the group's rank 0 (one flattened broadcast per dtype);
2. backward: a post-accumulate-grad hook marks each gradient ready; when every gradient of a
   bucket is ready -- and every earlier bucket has been launched, so all ranks pair the same
   tensors in the same collectives whatever order their hooks fire in -- the bucket is flattened
   and all-reduced asynchronously, overlapping with the rest of backward;
3. ``finish_gradient_sync()``: the buckets still waiting (a parameter unused on this rank, a
   last partial bucket) are launched with zeros or the gradient accumulated under ``no_sync()``;
   right after the last bucket, one tiny all-reduce tells every rank which parameters any rank
   used; every handle is waited on, each ``.grad`` is pointed at its averaged slice, and each
   synchronised parameter gets a mark, ``param.ddp_averaged_grad`` (an :class:`AveragedGrad`).

The mark is the hand-over to ``ShardedOptimizer``, which otherwise averages gradients itself:
averaging again the mean of W equal gradients changes no number but sends every gradient byte
twice, so it skips the parameters DDP marked (see ``DDP`` and ``AveragedGrad``). A second mark,
``param.ddp_position`` (set at construction), lets it put its param groups in rank 0's order
(``parallel/handover.py``).

Averaging: NCCL averages inside the collective (``ReduceOp.AVG``); gloo sums and we divide the
flat bucket after the wait. (gloo's own AVG is bitwise equal on torch 2.13, but releases before
it reject AVG on gloo, and pyproject.toml promises torch >= 2.1.)

Buckets are fixed at construction: trainable parameters in reverse registration order -- rank 0's
-- (the order backward usually produces them), grouped by dtype and device, capped at
``bucket_size_mb``.
"""

from __future__ import annotations

import contextlib
import hashlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel._checks import check_ddp_arguments
from parallel.buckets import Bucket, BucketState
from parallel.handover import AveragedGrad, mark_positions

__all__ = ["AveragedGrad", "Bucket", "BucketState", "DDP"]


class DDP(nn.Module):
    """Wraps ``module`` so its gradients are averaged over ``process_group`` (default: world).

    Call ``finish_gradient_sync()`` after every synchronised ``backward()`` and before
    ``optimizer.step()``; use ``no_sync()`` for accumulation micro-batches.

    Collective: construction broadcasts parameters and buffers; call it on all ranks of the group,
    with the same module structure, or the world hangs. The registration order may differ per
    rank: tensors are paired in rank 0's order, matched by name.

    With ``ShardedOptimizer``: ``finish_gradient_sync()`` marks every parameter it synchronised
    (``param.ddp_averaged_grad``, see :class:`AveragedGrad`), and the optimizer does not
    all-reduce those gradients again: they already hold the world mean, and a second all-reduce
    would move every gradient byte twice for the same numbers.

    Seams: each step is one method a subclass may override to change exactly that step --
    ``_agree_on_order`` (the order every rank pairs tensors in), ``_build_buckets`` (which
    parameters travel together), ``_initial_state`` and
    ``_broadcast_source`` (what construction broadcasts, from where), ``_on_grad_ready`` (when a
    bucket launches), ``_fill`` (gradients into the bucket), ``_launch`` (its all-reduce),
    ``_wait_and_average``, ``_wait_and_write_back`` and ``_write_grad`` (averages back into
    ``.grad``), ``_mark_averaged`` (the hand-over). ``_lay_out_buckets(params)`` lays out the
    buckets and the parameter -> bucket map together, for a subclass that changes ``params``.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0, process_group: Any = None):
        super().__init__()
        # validated before any collective, so a mistake fails the same way on every rank
        params = check_ddp_arguments(module, bucket_size_mb, process_group)

        # fixed at construction
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        # NCCL averages in the collective; gloo (and the rest) sum, and we divide after the wait.
        self._average_in_collective = dist.get_backend(process_group) == "nccl"
        self._names = {p: n for n, p in module.named_parameters()}
        # checks and flags travel where the gradients do: NCCL carries only CUDA tensors
        self._device = params[0].device if params else torch.device("cpu")
        self._check_same_parameters_everywhere()
        # every parameter and buffer in rank 0's registration order: what collectives pair by
        self._state_order = self._agree_on_order()
        mark_positions(self._state_order)  # for ShardedOptimizer (parallel.handover)
        trainable = set(params)
        self._params = params = [
            t for t in self._state_order if isinstance(t, nn.Parameter) and t in trainable
        ]
        self._broadcast_state()
        self._bucket_cap_bytes = int(bucket_size_mb * 1024 * 1024)
        self._lay_out_buckets(params)  # sets self._buckets and self._where
        self._positions = {p: i for i, p in enumerate(params)}  # index into the usage flags
        # The hooks hold the wrapper weakly: a bound method would tie the wrapper to its own
        # parameters through autograd's C++ hook table, a cycle the garbage collector cannot see,
        # so every wrapper (and its buckets) would live as long as its parameters.
        self._hooks = [p.register_post_accumulate_grad_hook(_call_weakly(self)) for p in params]
        weakref.finalize(self, _remove_all, self._hooks)

        # modified by no_sync()
        self._sync_enabled = True
        # per iteration (reset by _reset_iteration)
        self._step_started = False  # a synced forward ran, or a synced hook fired
        self._next_launch = 0  # buckets launch strictly in index order on every rank
        # usage flags, reduced in flight after the last bucket
        self._used: torch.Tensor | None = None
        self._used_handle: Any = None

    # -- the training-loop surface ------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_no_gradients_in_flight("forward")
        if self._sync_enabled and torch.is_grad_enabled():
            self._step_started = True
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this block accumulate gradients locally, with no communication.

        The next synchronised backward (outside the block) reduces the accumulated gradients,
        including those of parameters that were used only in earlier micro-batches.
        """
        self._check_no_gradients_in_flight("no_sync()")
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish_gradient_sync(self) -> None:
        """Flush every bucket, wait for all all-reduces, and write the averages into ``.grad``.

        Collective: call on all ranks of the group after each synchronised backward, in the same
        order, or the world hangs.
        """
        if not self._sync_enabled:
            raise RuntimeError(
                "finish_gradient_sync() was called inside no_sync(), where "
                "gradients stay local; call it after the backward that runs "
                "outside no_sync()"
            )
        if not self._step_started:
            raise RuntimeError(
                "finish_gradient_sync() was called twice, or before any forward/"
                "backward through the DDP wrapper; call it exactly once after "
                "each synchronised backward"
            )
        self._check_parameters_unchanged()
        # Launch what is still filling, in index order: every rank issues the same sequence.
        for bucket in self._buckets[self._next_launch :]:
            self._launch(bucket)
        self._next_launch = len(self._buckets)
        # Sync point: which parameters any rank used decides between a gradient and None.
        self._used_handle.wait()
        assert self._used is not None  # the last bucket's launch, just above, exchanged it
        used_anywhere = self._used.tolist()
        for bucket in self._buckets:
            self._wait_and_write_back(bucket, used_anywhere)
        self._mark_averaged()
        self._reset_iteration()

    @torch.no_grad()
    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to print: this rank's loss for the step (its micro-batches' losses summed,
        each as it was back-propagated) averaged over the group, exactly as the gradients are.

        A gradient averaged over W ranks is the gradient of the mean of their losses, so the
        loss that belongs to the averaged gradients is that mean -- not rank 0's own (the loss
        of a W-th of the batch), not the sum (W times too large). Collective: every rank of the
        group calls it. Returns a new tensor; ``loss`` is left as it was.
        """
        # all-reduce one scalar: the same reduction, and the same division, as a bucket's
        total = loss.detach().reshape(1).clone()
        op = dist.ReduceOp.AVG if self._average_in_collective else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op, group=self.process_group)
        if not self._average_in_collective:
            total.div_(self.world_size)  # gloo summed; now the world mean
        return total[0]

    @property
    def bucket_layout(self) -> list[list[str]]:
        """Parameter names of each bucket, in launch order (fixed at construction; no collective).

        Bucket ``i`` travels as the ``i``-th gradient all-reduce of every synchronised step.
        """
        return [[self._names.get(p, "?") for p in b.params] for b in self._buckets]

    # every form of Module.state_dict (its overloads), passed on as called
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped module's state dict, without a wrapper prefix."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    # -- construction-time collectives --------------------------------------------------------

    def _check_same_parameters_everywhere(self) -> None:
        """Refuse to start if ranks wrap different parameters or buffers: buckets would mis-pair.

        Names, not positions: the registration order may differ (see ``_agree_on_order``).
        """
        tensors = [*self.module.named_parameters(), *self.module.named_buffers()]
        signature = repr(
            sorted((n, tuple(t.shape), str(t.dtype), t.requires_grad) for n, t in tensors)
        ).encode()
        digest = int.from_bytes(hashlib.sha256(signature).digest()[:7], "little")
        mine = torch.tensor([digest, len(tensors)], dtype=torch.int64, device=self._device)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        # all-gather (hash of the parameters' and buffers' names, shapes, dtypes and trainability,
        # count) from every rank, so every rank sees the same verdict and raises together
        # instead of hanging later.
        dist.all_gather(gathered, mine, group=self.process_group)
        differ = [r for r, t in enumerate(gathered) if not torch.equal(t, gathered[0])]
        if differ:
            counts = {r: int(gathered[r][1]) for r in range(self.world_size)}
            raise RuntimeError(
                f"ranks {differ} (group ranks) wrap different parameters or buffers than rank 0 "
                f"(names, shapes, dtypes or requires_grad differ; tensors per rank: {counts}); "
                "build the same module on every rank"
            )

    def _agree_on_order(self) -> list[torch.Tensor]:
        """Every parameter and buffer, in the group's rank-0 registration order, on every rank.

        Collectives pair tensors by position, so all ranks must list them in one order, and
        ranks may register in different orders. Rank 0's order, rather than sorted names, keeps
        "reverse registration" a good guess at the order backward produces gradients (buckets).
        It travels as positions in the sorted names, which every rank has (checked above).
        """
        named = {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}
        ranked = sorted(named)
        position = {name: i for i, name in enumerate(ranked)}
        order = torch.tensor(
            [position[name] for name in named], dtype=torch.int64, device=self._device
        )  # (tensors,)
        # broadcast rank 0's registration order (one int64 per parameter and buffer), once, at
        # construction: every rank then pairs tensors in it, whatever order it registered them in
        dist.broadcast(order, src=self._broadcast_source(), group=self.process_group)
        return [named[ranked[i]] for i in order.tolist()]

    @torch.no_grad()
    def _broadcast_state(self) -> None:
        """Make every replica start from the group's rank-0 parameters and buffers."""
        tensors = self._initial_state()
        src = self._broadcast_source()
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.detach().reshape(-1) for t in same])  # (sum of numels,)
            # broadcast all parameters and buffers of this dtype from group rank 0, once, at
            # construction: rank 0's initialisation becomes everyone's.
            dist.broadcast(flat, src=src, group=self.process_group)
            for t, synced in zip(same, flat.split([t.numel() for t in same])):
                t.copy_(synced.view_as(t))

    def _initial_state(self) -> list[torch.Tensor]:
        """What construction makes equal on every rank: all parameters (frozen too) and buffers,
        in rank 0's order."""
        return list(self._state_order)

    def _broadcast_source(self) -> int:
        """The group's rank 0, as the global rank that broadcast's ``src`` expects."""
        return 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)

    # -- bucket layout (fixed at construction; no collective) ----------------------------------

    def _lay_out_buckets(self, params: list[nn.Parameter]) -> None:
        """Build the buckets over ``params``, and the map from each parameter to its bucket slot."""
        layout = self._build_buckets(params, self._bucket_cap_bytes)
        self._buckets = [Bucket(i, members) for i, members in enumerate(layout)]
        # param -> (bucket index, position in bucket)
        self._where = {p: (b.index, i) for b in self._buckets for i, p in enumerate(b.params)}

    def _build_buckets(
        self, params: list[nn.Parameter], cap_bytes: int
    ) -> list[list[nn.Parameter]]:
        """The parameters of each bucket, in launch order: reverse registration order (the order
        backward usually produces them), one dtype and device per bucket, at most ``cap_bytes``
        each (a larger parameter gets a bucket of its own)."""
        buckets: list[list[nn.Parameter]] = []
        # (dtype, device) -> (its open bucket's params, their bytes)
        open_bucket: dict[tuple, tuple[list[nn.Parameter], int]] = {}
        for p in reversed(params):
            key = (p.dtype, p.device)
            size = p.numel() * p.element_size()
            current = open_bucket.get(key)
            if current is None or (current[1] + size > cap_bytes and current[0]):
                current = ([], 0)
                buckets.append(current[0])
            current[0].append(p)
            open_bucket[key] = (current[0], current[1] + size)
        return buckets

    # -- backward: hooks and bucket launches -------------------------------------------------

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: ``param.grad`` now holds this backward's contribution."""
        if not self._sync_enabled:
            return  # accumulation micro-batch: the gradient stays local
        self._step_started = True
        bucket_index, position = self._where[param]
        bucket = self._buckets[bucket_index]
        if position in bucket.ready or bucket.state is not BucketState.FILLING:
            raise RuntimeError(
                f"the gradient of parameter {self._names.get(param, '?')!r} was produced twice in "
                "one synchronised backward (a second backward() before finish_gradient_sync(), "
                "or reentrant checkpointing); run the earlier backwards under no_sync(), or call "
                "finish_gradient_sync() in between"
            )
        bucket.ready.add(position)
        # Launch every bucket that is complete, but never out of index order.
        while self._next_launch < len(self._buckets) and len(
            self._buckets[self._next_launch].ready
        ) == len(self._buckets[self._next_launch].params):
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1

    @torch.no_grad()
    def _launch(self, bucket: Bucket) -> None:
        """Gather the bucket's gradients into its buffer and start their all-reduce."""
        self._fill(bucket)
        op = dist.ReduceOp.AVG if self._average_in_collective else dist.ReduceOp.SUM
        # all-reduce bucket `bucket.index` (grads of its params) across the group as soon as its
        # last gradient is ready, so communication overlaps the rest of backward.
        bucket.handle = dist.all_reduce(bucket.flat, op=op, group=self.process_group, async_op=True)
        bucket.state = BucketState.IN_FLIGHT
        if bucket.index == len(self._buckets) - 1:
            self._launch_usage_exchange()

    @staticmethod
    @torch.no_grad()
    def _fill(bucket: Bucket) -> None:
        """Copy this rank's gradients into the bucket buffer (zeros where there is none)."""
        for p, view in zip(bucket.params, bucket.views):
            if p.grad is None:
                view.zero_()  # no gradient here: contribute zeros
            elif p.grad is not view:  # already in place when .grad is still last sync's slice
                view.copy_(p.grad)

    def _launch_usage_exchange(self) -> None:
        """Start summing which parameters produced a gradient on each rank this step.

        Called right after the last bucket launches: every gradient of this step exists by then.
        """
        self._used = torch.tensor(
            [p.grad is not None for p in self._params], dtype=torch.int32, device=self._device
        )
        # all-reduce the per-parameter "has a gradient here" flags (4 bytes per parameter) behind
        # the last bucket, so a parameter no rank used keeps grad=None, as in one process.
        self._used_handle = dist.all_reduce(
            self._used, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True
        )

    # -- finish: waits, write-back ------------------------------------------------------------

    @torch.no_grad()
    def _wait_and_write_back(self, bucket: Bucket, used_anywhere: list[int]) -> None:
        """Wait for the bucket, then give each parameter some rank used its averaged gradient."""
        self._wait_and_average(bucket)
        for p, view, as_grad in zip(bucket.params, bucket.views, bucket.as_grad):
            if not used_anywhere[self._positions[p]]:
                continue  # no rank had a gradient: leave grad None, as a single process would
            self._write_grad(p, view, as_grad)

    def _wait_and_average(self, bucket: Bucket) -> None:
        """Wait for the bucket's all-reduce; leave the world mean in its buffer."""
        # Sync point: the bucket's reduced values exist only after its handle completes.
        bucket.handle.wait()
        if not self._average_in_collective:
            bucket.flat.div_(self.world_size)  # gloo summed; now the world mean

    @staticmethod
    def _write_grad(p: nn.Parameter, view: torch.Tensor, as_grad: bool) -> None:
        """Make ``p.grad`` the averaged ``view`` (its slice of the bucket buffer)."""
        if as_grad:
            if p.grad is not view:
                p.grad = view  # the averaged slice itself: no copy
        elif p.grad is None:
            p.grad = torch.empty_like(p).copy_(view)  # strides follow the parameter
        else:
            p.grad.copy_(view)  # copy_ honours the gradient's strides

    def _mark_averaged(self) -> None:
        """Hand-over to ``ShardedOptimizer``: these gradients need no second all-reduce."""
        for p in self._params:
            p.ddp_averaged_grad = AveragedGrad(p.grad)  # type: ignore[attr-defined]  # its mark

    def _reset_iteration(self) -> None:
        """The one place per-iteration state is cleared."""
        for bucket in self._buckets:
            bucket.reset()
        self._next_launch = 0
        self._step_started = False
        self._used = self._used_handle = None

    # -- guards -------------------------------------------------------------------------------

    def _check_no_gradients_in_flight(self, what: str) -> None:
        if self._next_launch or any(b.ready for b in self._buckets):
            raise RuntimeError(
                f"{what} while gradients of the last backward are still being synchronised; "
                "call model.finish_gradient_sync() after loss.backward() and before the next "
                "forward or optimizer.step()"
            )

    def _check_parameters_unchanged(self) -> None:
        """Catch parameters replaced or unfrozen after wrapping: they would never be reduced."""
        for name, p in self.module.named_parameters():
            if p.requires_grad and p not in self._where:
                raise RuntimeError(
                    f"parameter {name!r} requires grad but was not trainable (or did not exist) "
                    "when DDP was constructed, so it is never synchronised; set requires_grad "
                    "and assign parameters before wrapping the module"
                )


def _call_weakly(ddp: DDP) -> Any:
    """A post-accumulate-grad hook calling ``ddp._on_grad_ready`` while ``ddp`` is alive."""
    ref = weakref.ref(ddp)

    def on_grad_ready(param: nn.Parameter) -> None:
        owner = ref()
        if owner is not None:
            owner._on_grad_ready(param)

    return on_grad_ready


def _remove_all(handles: list) -> None:
    for handle in handles:
        handle.remove()
