"""Data-parallel code as others write it, for the verdict tests (imported by rank processes).

* :class:`CourseDDP` -- a DDP as courses teach it: rank 0's state broadcast at construction, then
  after backward every gradient all-reduced in registration order. Correct, with the contract of
  torch's own DDP: one parameter order on every rank.
* :class:`CourseTarget` -- its target, written against the previous release's API: a class with a
  ``supports()`` method and no ``supported_features``.
* :class:`ManagedTarget` -- the same DDP behind a process-group manager of the kind training
  frameworks keep: dp/tp/pp groups built for every model. ``weights_bug=True`` all-reduces the
  weights where the gradients belong (a real framework's bug).
* :class:`RecipientRankTarget`, :class:`UnknownConsolidateTarget` -- sharded optimizers whose
  ``consolidate_state_dict`` names the receiving rank as fairscale does, or as nobody does.
* :class:`BroadcastsWhenAttached` -- rank 0's weights broadcast when the optimizer is built
  (Horovod's shape), not when the model is wrapped.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ddpcheck


class CourseDDP(nn.Module):
    """Broadcast at construction; after backward, all-reduce every used gradient in position
    order (a gradient some ranks lack counts as zeros there; one no rank has stays None)."""

    def __init__(self, module: nn.Module, group: Any = None, weights_bug: bool = False):
        super().__init__()
        self.module = module
        self.group = group
        self.weights_bug = weights_bug
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, dist.get_global_rank(group, 0) if group else 0, group=group)

    def forward(self, *args: Any) -> Any:
        return self.module(*args)

    def finish(self) -> None:
        params = [p for p in self.module.parameters() if p.requires_grad]
        size = dist.get_world_size(self.group)
        held = torch.tensor([float(p.grad is not None) for p in params], dtype=torch.float64)
        dist.all_reduce(held, group=self.group)
        for p, anyone in zip(params, held.tolist()):
            if not anyone:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            reduced = (p.data if self.weights_bug else p.grad).contiguous()
            dist.all_reduce(reduced, group=self.group)
            if self.weights_bug:  # the bug: the weights averaged, the gradients left local
                p.data.copy_(reduced / size)
            else:
                p.grad.copy_(reduced / size)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield  # gradients accumulate locally; finish() averages their sum


class CourseTarget(ddpcheck.Target):
    """Written against the previous release's API: no supported_features, a supports()."""

    def wrap(self, module: Any) -> Any:
        return CourseDDP(module)

    def after_backward(self, model: Any, optimizer: Any) -> None:
        model.finish()

    def no_sync(self, model: Any) -> Any:
        return model.no_sync()

    def supports(self, scenario: Any) -> str | None:
        return None


class ProcessGroupManager:
    """dp, tp and pp groups for a data-parallel world (tp and pp of size 1), built per model as
    frameworks' managers do; every rank builds every group, in the same order."""

    def __init__(self) -> None:
        ranks = range(dist.get_world_size())
        self.dp = dist.new_group(list(ranks))
        self.tp = [dist.new_group([r]) for r in ranks]
        self.pp = [dist.new_group([r]) for r in ranks]


@dataclasses.dataclass(frozen=True)
class ManagedTarget(ddpcheck.Target):
    weights_bug: bool = False

    def wrap(self, module: Any) -> Any:
        manager = ProcessGroupManager()
        model = CourseDDP(module, group=manager.dp, weights_bug=self.weights_bug)
        model.manager = manager  # kept by the model, as a framework keeps its singleton
        return model

    def after_backward(self, model: Any, optimizer: Any) -> None:
        model.finish()

    def no_sync(self, model: Any) -> Any:
        return model.no_sync()

    def teardown(self, model: Any, optimizer: Any) -> None:
        del model.manager  # the framework's reset: its groups go with it


def _fairscale_style(base: type) -> type:
    """``base`` with fairscale OSS's spelling: ``consolidate_state_dict(recipient_rank=0)``."""

    class OSSLike(base):
        def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
            super().consolidate_state_dict(to=recipient_rank)

    return OSSLike


@dataclasses.dataclass(frozen=True)
class RecipientRankTarget(ddpcheck.targets.ParallelTarget):
    """parallel's ShardedOptimizer behind fairscale's spelling of consolidate_state_dict."""

    def make_optimizer(self, params: Any, optimizer_cls: type, **kwargs: Any) -> Any:
        from parallel import ShardedOptimizer

        return _fairscale_style(ShardedOptimizer)(params, optimizer_cls, **kwargs)


@dataclasses.dataclass(frozen=True)
class UnknownConsolidateTarget(ddpcheck.targets.ParallelTarget):
    """A sharded optimizer whose consolidate_state_dict names its rank in a way nobody uses."""

    def make_optimizer(self, params: Any, optimizer_cls: type, **kwargs: Any) -> Any:
        from parallel import ShardedOptimizer

        class Odd(ShardedOptimizer):
            def consolidate_state_dict(self, destination: int = 0) -> None:
                super().consolidate_state_dict(to=destination)

        return Odd(params, optimizer_cls, **kwargs)


class BroadcastsWhenAttached(ddpcheck.Target):
    """Horovod's shape: no wrapper broadcast; rank 0's weights are broadcast when the optimizer is
    built, and gradients averaged after backward."""

    def make_optimizer(self, params: Any, optimizer_cls: type, **kwargs: Any) -> Any:
        params = list(params)
        with torch.no_grad():
            for group in params if params and isinstance(params[0], dict) else [{"params": params}]:
                for p in group["params"]:
                    dist.broadcast(p, 0)
        return optimizer_cls(params, **kwargs)

    def wrap(self, module: Any) -> Any:
        with torch.no_grad():  # buffers are the model's business, as in Horovod's examples
            for b in module.buffers():
                dist.broadcast(b, 0)
        return _Averaging(module)

    def after_backward(self, model: Any, optimizer: Any) -> None:
        model.finish()

    def no_sync(self, model: Any) -> Any:
        return contextlib.nullcontext()


class _Averaging(CourseDDP):
    def __init__(self, module: nn.Module):  # no broadcast here: the optimizer's does it
        nn.Module.__init__(self)
        self.module, self.group, self.weights_bug = module, None, False
