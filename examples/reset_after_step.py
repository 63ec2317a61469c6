"""A wrapper that needs ``model.reset()`` after every step (Megatron-style gradient buffer).

Gradients accumulate in one persistent flat buffer per dtype, ``main_grad``, instead of in
``.grad``: each parameter's post-accumulate-grad hook adds its gradient into its slice of the
buffer and frees ``.grad``. ``sync_gradients()`` all-reduces each buffer once (one collective
per dtype, whatever the number of parameters), divides by the world size and hands every
parameter a copy of its averaged slice as ``.grad``. The buffer and the per-step bookkeeping --
which parameters produced a gradient on this rank -- persist across the step; the loop must call
``reset()`` after each step (as trainers call ``model.reset()`` or ``on_train_batch_end``)::

    model = MainGradDDP(net)
    for x, y in micro_batches:
        loss_fn(model(x), y).backward()      # no no_sync() needed: nothing moves in backward
    model.sync_gradients()
    optimizer.step()
    optimizer.zero_grad()
    model.reset()

Every parameter some rank used gets the world mean (zeros from the ranks that did not use it);
one no rank used keeps ``.grad`` as it was (None, or last step's zeroed gradient), as in a single
process: a small int32 all-reduce of "used here" flags decides.

Seeded bug (``BUGGY``, docs/bug-catalogue.md H2): ``MainGradDDP(bug=True)`` hands out the slice
itself as ``.grad`` instead of a copy. With ``zero_grad(set_to_none=False)`` the next backward
accumulates into that slice in place, and the hook adds the gradient to it once more: every
gradient counts twice from the second step on.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

import ddpcheck
from ddpcheck import features


class MainGradDDP(nn.Module):
    """Averages gradients over the default process group in ``sync_gradients()``."""

    def __init__(self, module: nn.Module, bug: bool = False):
        super().__init__()
        self.module = module
        self.bug = bug
        self.world_size = dist.get_world_size()
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                flat = tensor.detach().contiguous()
                dist.broadcast(flat, src=0)  # every replica starts from rank 0's state
                tensor.copy_(flat)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.main_grad: dict[torch.dtype, torch.Tensor] = {}  # one flat buffer per dtype
        self.slice: dict[nn.Parameter, torch.Tensor] = {}  # each parameter's view of it
        for dtype in dict.fromkeys(p.dtype for p in self.params):
            members = [p for p in self.params if p.dtype == dtype]
            self.main_grad[dtype] = torch.zeros(sum(p.numel() for p in members), dtype=dtype)
            for p, view in zip(members, self.main_grad[dtype].split([p.numel() for p in members])):
                self.slice[p] = view.view(p.shape)
        self.index = {p: i for i, p in enumerate(self.params)}
        self.used = torch.zeros(len(self.params), dtype=torch.int32)  # per step: see reset()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._accumulate)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def _accumulate(self, param: nn.Parameter) -> None:
        self.slice[param].add_(param.grad)
        param.grad = None  # the gradient lives in main_grad until sync_gradients()
        self.used[self.index[param]] = 1

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Average main_grad over the ranks and give each used parameter its ``.grad``."""
        dist.all_reduce(self.used)  # how many ranks used each parameter
        for buffer in self.main_grad.values():
            dist.all_reduce(buffer)
            buffer.div_(self.world_size)
        for p in self.params:
            if self.used[self.index[p]]:  # no rank used it: leave .grad as it is
                averaged = self.slice[p]
                # H2 when aliased: the next backward writes into main_grad through .grad
                p.grad = averaged if self.bug else torch.empty_like(p).copy_(averaged)

    def reset(self) -> None:
        """Start the next step: clear the gradient buffer and the "used" flags."""
        for buffer in self.main_grad.values():
            buffer.zero_()
        self.used.zero_()


# -- the ddpcheck targets: public API only ---------------------------------------------------
# It handles every feature but per-rank registration orders: main_grad is laid out by position.
@dataclasses.dataclass(frozen=True)
class MainGradTarget(ddpcheck.Target):
    bug: bool = False  # True: the seeded bug (H2)
    supported_features = frozenset(features.FEATURES) - {"rank-orders"}

    def wrap(self, module):
        return MainGradDDP(module, bug=self.bug)

    def after_backward(self, model, optimizer):  # after the last micro-batch's backward
        model.sync_gradients()

    def after_step(self, model, optimizer):  # after optimizer.step() and zero_grad()
        model.reset()


TARGET = MainGradTarget()
BUGGY = MainGradTarget(bug=True)
