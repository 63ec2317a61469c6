"""A wrapper with an explicit finish method, and a ZeRO-1 optimizer behind it.

``OverlapDDP`` all-reduces each parameter's gradient asynchronously, launched from its
post-accumulate-grad hook while backward is still running; the training loop must call
``finish_gradient_synchronization()`` after the last backward of a step, which waits for every
all-reduce and divides by the world size::

    model = OverlapDDP(net)
    optimizer = Zero1(model.parameters(), torch.optim.AdamW, lr=1e-3)
    loss_fn(model(x), y).backward()
    model.finish_gradient_synchronization()
    optimizer.step()
    optimizer.zero_grad()

Every rank launches the all-reduces in one fixed order (reverse registration order), whatever
order its hooks fire in: a parameter whose hook has not fired holds back the ones after it until
``finish_gradient_synchronization()``, which launches the rest, a parameter this rank did not use
contributing zeros. So a parameter no rank used ends up with a zero gradient, not None.

``Zero1`` keeps optimizer state only for the parameters this rank owns (the i-th parameter
belongs to rank i % W), steps them, and broadcasts every parameter from its owner. It never
averages gradients: it relies on the wrapper in front having done it.

Seeded bug (``BUGGY``, docs/bug-catalogue.md H4): ``Zero1(bug=True).zero_grad()`` delegates to
the inner optimizer, which holds only this rank's shard, so the other parameters keep last step's
averaged gradient, and the next backward accumulates into it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

import ddpcheck
from ddpcheck import features


@torch.no_grad()
def broadcast(tensor: torch.Tensor, src: int) -> None:
    """Broadcast ``tensor`` in place from rank ``src`` (a contiguous copy travels if need be)."""
    buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
    dist.broadcast(buffer, src=src)
    if buffer is not tensor:
        tensor.copy_(buffer)


class OverlapDDP(nn.Module):
    """Averages gradients over the default process group; call the finish method every step."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        for tensor in [*module.parameters(), *module.buffers()]:
            broadcast(tensor, src=0)  # every replica starts from rank 0's weights and buffers
        self.order = [p for p in reversed(list(module.parameters())) if p.requires_grad]
        for p in self.order:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.sync = True
        self.ready: set[nn.Parameter] = set()
        self.launched = 0  # how many of self.order have their all-reduce in flight
        self.pending: list[tuple[nn.Parameter, torch.Tensor, dist.Work]] = []

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes in this context keep their gradients local (accumulation)."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

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
            param.grad = torch.zeros_like(param)  # not used on this rank: contribute zeros
        buffer = param.grad if param.grad.is_contiguous() else param.grad.contiguous()
        self.pending.append((param, buffer, dist.all_reduce(buffer, async_op=True)))

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Launch what is left, wait for every all-reduce, and leave the mean in ``.grad``."""
        for param in self.order[self.launched :]:
            self._launch(param)
        for param, buffer, work in self.pending:
            work.wait()
            buffer.div_(self.world_size)
            if buffer is not param.grad:
                param.grad.copy_(buffer)
        self.ready, self.launched, self.pending = set(), 0, []


class Zero1:
    """ZeRO-1 over ``optimizer_cls``: state for owned parameters only. Not a torch Optimizer."""

    def __init__(self, params, optimizer_cls, bug: bool = False, **defaults):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        groups = list(params)
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.params = [p for group in groups for p in group["params"]]
        self.owner = {p: i % world_size for i, p in enumerate(self.params)}
        mine = [
            {**group, "params": [p for p in group["params"] if self.owner[p] == rank]}
            for group in groups
        ]
        mine = [group for group in mine if group["params"]]
        # W > number of parameters leaves a rank with nothing to own: no inner optimizer there
        self.inner = optimizer_cls(mine, **defaults) if mine else None
        self.state = self.inner.state if self.inner is not None else {}
        self.bug = bug

    @torch.no_grad()
    def step(self) -> None:
        if self.inner is not None:
            self.inner.step()  # gradients are already averaged by the wrapper
        for p in self.params:
            broadcast(p, src=self.owner[p])

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.bug:  # H4: only this rank's shard is cleared
            if self.inner is not None:
                self.inner.zero_grad(set_to_none=set_to_none)
            return
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()


# -- the ddpcheck targets: public API only ---------------------------------------------------
# Zero-filled unused parameters (not None); Zero1 is no torch Optimizer, so no LR scheduler;
# tensors paired by registration position (as torch DDP does), so one order on every rank;
# and it has no state_dict to checkpoint.
SUPPORTS = frozenset(features.FEATURES) - features.parse(
    "unused-everywhere,lr-schedule,rank-orders,checkpoint"
)
TARGET = ddpcheck.Target.from_wrappers(
    ddp=OverlapDDP, finish="finish_gradient_synchronization", optimizer=Zero1, supports=SUPPORTS
)
BUGGY = ddpcheck.Target.from_wrappers(
    ddp=OverlapDDP,
    finish="finish_gradient_synchronization",
    optimizer=Zero1,
    optimizer_kwargs={"bug": True},
    supports=SUPPORTS,
)
