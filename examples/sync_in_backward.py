"""A wrapper that synchronises inside backward, like torch's DistributedDataParallel.

The training loop looks like single-process code, except for ``no_sync()`` on accumulation
micro-batches: when ``loss.backward()`` returns, every gradient already holds the world mean::

    model = BackwardSyncDDP(net)
    for x, y in micro_batches[:-1]:
        with model.no_sync():
            loss_fn(model(x), y).backward()
    loss_fn(model(*micro_batches[-1]), ...).backward()
    optimizer.step()

How: ``forward`` (outside ``no_sync()``) puts a hook on its output; when backward reaches it --
first thing -- the hook queues a callback with the autograd engine, which runs once backward has
finished. Meanwhile each parameter's post-accumulate-grad hook launches the all-reduce of its
gradient (asynchronously, and in one fixed order on every rank: reverse registration order). The
callback launches the gradients whose hooks did not fire in this backward (used only in earlier
micro-batches), waits for everything and divides by the world size.

Like torch's DDP without ``find_unused_parameters=True``, it expects every trainable parameter
to have a gradient on every rank: one that has none raises.

Seeded bug (``BUGGY``, docs/bug-catalogue.md A1): ``BackwardSyncDDP(bug=True)`` leaves the sum of
the ranks' gradients where their mean belongs (the division is missing). The replicas agree
with each other bitwise; only the full-batch reference shows the gradients are W times too large.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

import ddpcheck
from ddpcheck import features


class BackwardSyncDDP(nn.Module):
    """Averages gradients over the default process group before ``backward()`` returns."""

    def __init__(self, module: nn.Module, bug: bool = False):
        super().__init__()
        self.module = module
        self.bug = bug
        self.world_size = dist.get_world_size()
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                # every replica starts from rank 0's weights and buffers
                flat = tensor.detach().contiguous()
                dist.broadcast(flat, src=0)
                tensor.copy_(flat)
        self.names = {p: n for n, p in module.named_parameters()}
        self.order = [p for p in reversed(list(module.parameters())) if p.requires_grad]
        for p in self.order:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.sync = True
        self.ready: set[nn.Parameter] = set()
        self.launched = 0  # how many of self.order have their all-reduce in flight
        self.pending: list[tuple[nn.Parameter, torch.Tensor, dist.Work]] = []

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if self.sync and out.requires_grad:
            out.register_hook(self._queue_finish)  # fires when backward starts
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes in this context keep their gradients local (accumulation)."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def _queue_finish(self, grad: torch.Tensor) -> None:
        Variable._execution_engine.queue_callback(self._finish)  # runs when backward is done

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.sync:
            return
        self.ready.add(param)
        while self.launched < len(self.order) and self.order[self.launched] in self.ready:
            self._launch(self.order[self.launched])
            self.launched += 1

    @torch.no_grad()
    def _launch(self, param: nn.Parameter) -> None:
        if param.grad is None:
            raise RuntimeError(
                f"parameter {self.names[param]!r} has no gradient on this rank; "
                "every trainable parameter must take part in every step"
            )
        buffer = param.grad if param.grad.is_contiguous() else param.grad.contiguous()
        self.pending.append((param, buffer, dist.all_reduce(buffer, async_op=True)))

    @torch.no_grad()
    def _finish(self) -> None:
        for param in self.order[self.launched :]:
            self._launch(param)  # not produced by this backward, accumulated under no_sync()
        for param, buffer, work in self.pending:
            work.wait()
            if not self.bug:  # A1 when it is missing: the sum, not the mean
                buffer.div_(self.world_size)
            if buffer is not param.grad:
                param.grad.copy_(buffer)
        self.ready, self.launched, self.pending = set(), 0, []


# -- the ddpcheck targets: public API only ---------------------------------------------------
# Every parameter must have a gradient on every rank, and every rank must register them in one
# order (torch DDP's default contract: buckets pair tensors by registration position).
SUPPORTS = frozenset(features.FEATURES) - features.parse(
    "unused-on-some-ranks,unused-everywhere,rank-orders"
)
TARGET = ddpcheck.Target.from_wrappers(ddp=BackwardSyncDDP, finish=None, supports=SUPPORTS)
BUGGY = ddpcheck.Target.from_wrappers(
    ddp=BackwardSyncDDP, ddp_kwargs={"bug": True}, finish=None, supports=SUPPORTS
)
