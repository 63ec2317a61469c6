"""Targets: how an implementation under test is driven inside each rank.

A :class:`Target` is pickled to every rank process, so subclasses must be defined at module level
of an importable module. The runner calls, per example and per rank::

    target = target.configure(scenario)          # read hints such as bucket_size_mb
    model = target.wrap(module)
    optimizer = target.make_optimizer(params, optimizer_cls, [model=model,] **kwargs)
    for each step:
        target.before_step(model, optimizer)
        for each micro-batch but the last:  with target.no_sync(model): forward/backward
        last micro-batch:                   forward/backward
        target.after_backward(model, optimizer)
        target.clip_grad_norm(model, optimizer, max_norm, norm_type)   # scenarios that clip
        (gradients recorded here)
        optimizer.step(); optimizer.zero_grad(set_to_none=...)   # the target's optimizer's own
        target.after_step(model, optimizer)

In scenarios with ``checkpoint_after`` the run stops after that step with
``target.save_checkpoint(module, model, optimizer, scheduler)`` (collective; the checkpoint is
rank 0's answer) and a fresh run -- at ``resume_world_size`` -- builds everything anew, calls
``target.load_checkpoint(checkpoint, module, model, optimizer, scheduler)`` and trains the rest.

and reads ``target.optimizer_state(optimizer)`` to check that optimizer state matches the
reference and -- when ``shards_optimizer_state`` is true -- that each parameter's state lives on
exactly one rank. ``flattened_broadcasts`` opts into the broadcast budget (see ``oracle``).
``make_optimizer`` gets the wrapped model only if its signature names a ``model`` parameter.

Most implementations need no class at all: :meth:`Target.from_wrappers` assembles one from a
wrapper class, the name of its finish method and a sharded optimizer class.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, ContextManager, Mapping

from ddpcheck.features import FEATURES

__all__ = ["LOCAL", "PARALLEL", "PARALLEL_DDP", "TORCH_DDP", "TORCH_ZERO", "BUILTIN",
           "LocalTarget", "ParallelDDPTarget", "ParallelTarget", "Target", "TorchDDPTarget",
           "TorchZeroTarget", "WrapperTarget"]

#: Instance attribute holding ``(args, kwargs)`` of the call that built a target.
CONSTRUCTOR_CALL = "_ddpcheck_call"


class Target:
    """Base class: no wrapping, the plain optimizer, no synchronisation (override what you need)."""

    #: True when the optimizer keeps each parameter's state on one rank only (ZeRO-1 style).
    shards_optimizer_state: bool = False
    #: True when updated parameters travel in one flattened broadcast per owner rank and dtype;
    #: the oracle then fails a step with more broadcasts than W x parameter dtypes.
    flattened_broadcasts: bool = False
    #: The features of ``ddpcheck.features.FEATURES`` this target supports (None: all of them).
    #: Scenarios needing another are not generated, and battery scenarios are skipped naming it.
    supported_features: frozenset[str] | None = None
    #: True when the optimizer itself averages gradients inside ``step()`` (ZeRO-2 style, no
    #: wrapper in front): gradients are then recorded after the step, not before it.
    gradients_synchronized_in_step: bool = False

    def __new__(cls, *args: Any, **kwargs: Any) -> "Target":
        # Record the constructor call: a failure's replay line rebuilds a plain-class target as
        # ``module:Cls(args...)`` (``ddpcheck.replay``). Kept in the instance dict, so it travels
        # with the target; unpickling calls ``__new__`` without arguments, then restores it.
        if (args or kwargs) and cls.__init__ is object.__init__:
            raise TypeError(f"{cls.__qualname__}() takes no arguments")
        self = super().__new__(cls)
        object.__setattr__(self, CONSTRUCTOR_CALL, (args, kwargs))  # frozen dataclasses too
        return self

    def configure(self, scenario: Any) -> "Target":
        """Return the target to use for this scenario (default: itself)."""
        return self

    def supports(self, scenario: Any) -> str | None:
        """None when the target can run ``scenario``; otherwise why not (the example is skipped
        and the reason reported). Called in the parent process, before any rank runs."""
        return None

    def wrap(self, module: Any) -> Any:
        return module

    def make_optimizer(self, params: Any, optimizer_cls: type, **kwargs: Any) -> Any:
        return optimizer_cls(params, **kwargs)

    def before_step(self, model: Any, optimizer: Any) -> None:
        """Called at the start of every step, before its first forward (``on_train_batch_start``)."""

    def after_backward(self, model: Any, optimizer: Any) -> None:
        """Called after the last micro-batch's backward, before ``optimizer.step()``."""

    def after_step(self, model: Any, optimizer: Any) -> None:
        """Called after ``optimizer.step()`` and ``zero_grad`` (where loops call ``model.reset()``)."""

    def clip_grad_norm(self, model: Any, optimizer: Any, max_norm: float,
                       norm_type: float) -> Any:
        """Clip the synchronised gradients to a global norm; called after ``after_backward`` in
        scenarios that clip (``Scenario.max_grad_norm``).

        Default: ``torch.nn.utils.clip_grad_norm_`` over the wrapped model's parameters, right
        wherever every rank holds every synchronised gradient (any DDP). Override it where each
        rank holds only part of the norm, or where gradients are averaged later, in ``step()``.
        """
        if self.gradients_synchronized_in_step:
            raise NotImplementedError(
                f"{type(self).__name__} averages gradients inside optimizer.step(), so clipping "
                "before it would clip each rank's own gradients; override "
                "Target.clip_grad_norm(model, optimizer, max_norm, norm_type) to clip through "
                "the optimizer, or leave 'clipping' out of supported_features")
        import torch

        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)

    def no_sync(self, model: Any) -> ContextManager[Any]:
        """Context for accumulation micro-batches whose gradients stay local."""
        return contextlib.nullcontext()

    def save_checkpoint(self, module: Any, model: Any, optimizer: Any, scheduler: Any) -> Any:
        """The checkpoint of a run, returned on rank 0 (scenarios with ``checkpoint_after``).
        Collective: called on every rank after the step ``checkpoint_after``.

        Default: the unwrapped ``module``'s ``state_dict()`` (a wrapper's may prefix its keys,
        torch DDP's with ``module.``), the optimizer's full state -- gathered on rank 0 first by
        ``consolidate_state_dict(to=0)`` where the optimizer has one (a sharded optimizer: each
        rank holds only its shard) -- and the LR ``scheduler``'s ``state_dict()`` (None without
        a schedule). ``model`` is the wrapped model."""
        import torch.distributed as dist

        if callable(getattr(optimizer, "consolidate_state_dict", None)):
            optimizer.consolidate_state_dict(to=0)
        if dist.get_rank() != 0:
            return None
        return {"model": module.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": None if scheduler is None else scheduler.state_dict()}

    def load_checkpoint(self, checkpoint: Any, module: Any, model: Any, optimizer: Any,
                        scheduler: Any) -> None:
        """Load what rank 0's ``save_checkpoint`` returned, on every rank of the resumed run
        (its world size may differ), after the model is wrapped and the optimizer and
        scheduler are built, before the step after the checkpoint.

        Default: the module strictly (in place, so the wrapper and the optimizer keep their
        parameters; every rank loads the same weights, so no broadcast is needed), then the
        optimizer (a sharded one keeps the state of the parameters it owns in this world) and
        the scheduler."""
        module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(checkpoint["scheduler"])

    def optimizer_state(self, optimizer: Any) -> Mapping[Any, dict]:
        """The optimizer state this rank holds, keyed by parameter tensor.

        Default: the state of the one ``torch.optim.Optimizer`` the optimizer wraps, if it holds
        one in an attribute (ZeroRedundancyOptimizer's ``.optim``, a ZeRO-1 wrapper's inner
        optimizer), else its own ``state``. Override it when neither is right."""
        import torch

        inner = [v for v in vars(optimizer).values()
                 if isinstance(v, torch.optim.Optimizer) and v is not optimizer]
        if len(inner) == 1:
            return inner[0].state
        state = getattr(optimizer, "state", None)
        if state is None:
            raise TypeError(
                f"{type(self).__name__}.optimizer_state: {type(optimizer).__name__} has no "
                "`state` and wraps no single torch.optim.Optimizer; override "
                "Target.optimizer_state(optimizer) to return {parameter: state dict} held on "
                "this rank, and set shards_optimizer_state = True if each rank holds only its "
                "shard")
        return state

    @staticmethod
    def from_wrappers(*, ddp: Any = None, ddp_kwargs: dict | None = None,
                      finish: str | None = None, no_sync: str | None = "no_sync",
                      optimizer: Any = None, optimizer_kwargs: dict | None = None,
                      inner_optimizer: str = "class", before_step: str | None = None,
                      after_step: str | None = None, supports: Any = None,
                      shards_optimizer_state: bool | None = None) -> "WrapperTarget":
        """A target for the common shapes of data-parallel code, with no class to write.

        ``ddp(module, **ddp_kwargs)`` wraps the model; ``finish`` names the wrapper's method to
        call after backward (e.g. ``"finish_gradient_sync"``; None for a wrapper that syncs inside
        backward, like torch's); ``no_sync`` names its accumulation context manager (None: the
        wrapper has none). ``optimizer`` wraps the optimizer: called as
        ``optimizer(params, optimizer_cls, **kwargs, **optimizer_kwargs)`` when ``inner_optimizer``
        is ``"class"``, as ``optimizer(optimizer_cls(params, **kwargs), **optimizer_kwargs)`` when
        it is ``"instance"``, or with ``inner_optimizer`` as the keyword naming the class (e.g.
        ``"optimizer_class"`` for ZeroRedundancyOptimizer). ``before_step`` / ``after_step`` name
        wrapper methods a real loop calls there (e.g. ``after_step="reset"``). ``supports``: the
        features it supports (``ddpcheck.features``; None for all). ``shards_optimizer_state``
        defaults to True when an ``optimizer`` wrapper is given.

        Assign the result to a module-level name: ``MODULE:NAME`` is then its replay line and
        its command-line name.
        """
        return WrapperTarget(
            ddp=ddp, ddp_kwargs=dict(ddp_kwargs or {}), finish=finish, no_sync_method=no_sync,
            optimizer=optimizer, optimizer_kwargs=dict(optimizer_kwargs or {}),
            inner_optimizer=inner_optimizer, before_step_method=before_step,
            after_step_method=after_step,
            supported_features=None if supports is None else frozenset(supports),
            shards_optimizer_state=(optimizer is not None if shards_optimizer_state is None
                                    else shards_optimizer_state))


@dataclasses.dataclass(frozen=True)
class _Bucketed(Target):
    """A target whose wrapper buckets gradients; takes the scenario's bucket size hint."""

    bucket_size_mb: float | None = None

    def configure(self, scenario: Any) -> "Target":
        hint = getattr(scenario, "bucket_size_mb", None)
        if hint is None or self.bucket_size_mb is not None:
            return self
        return dataclasses.replace(self, bucket_size_mb=hint)


@dataclasses.dataclass(frozen=True)
class ParallelDDPTarget(_Bucketed):
    """``parallel.DDP`` with the plain optimizer."""

    def wrap(self, module: Any) -> Any:
        from parallel import DDP

        return DDP(module, bucket_size_mb=self.bucket_size_mb or 25.0)

    def after_backward(self, model: Any, optimizer: Any) -> None:
        model.finish_gradient_sync()

    def no_sync(self, model: Any) -> ContextManager[Any]:
        return model.no_sync()


@dataclasses.dataclass(frozen=True)
class ParallelTarget(ParallelDDPTarget):
    """``parallel.DDP`` with ``parallel.ShardedOptimizer`` (the built-in ``parallel`` target)."""

    sharding_rule: Any = None  # None: the ShardedOptimizer's default (sharding.modulo)
    shards_optimizer_state = True
    flattened_broadcasts = True

    def make_optimizer(self, params: Any, optimizer_cls: type, **kwargs: Any) -> Any:
        from parallel import ShardedOptimizer

        if self.sharding_rule is not None:
            kwargs["sharding_rule"] = self.sharding_rule
        return ShardedOptimizer(params, optimizer_cls, **kwargs)

    def clip_grad_norm(self, model: Any, optimizer: Any, max_norm: float,
                       norm_type: float) -> Any:
        # the global norm from each rank's owned shard: one scalar all-reduced, not W full norms
        return optimizer.clip_grad_norm_(max_norm, norm_type)


@dataclasses.dataclass(frozen=True)
class TorchDDPTarget(_Bucketed):
    """torch's ``DistributedDataParallel`` with the plain optimizer."""

    def wrap(self, module: Any) -> Any:
        from torch.nn.parallel import DistributedDataParallel

        kwargs = {} if self.bucket_size_mb is None else {"bucket_cap_mb": self.bucket_size_mb}
        # Unused parameters are part of every battery; torch needs to be told to look for them.
        return DistributedDataParallel(module, find_unused_parameters=True, **kwargs)

    def no_sync(self, model: Any) -> ContextManager[Any]:
        return model.no_sync()


@dataclasses.dataclass(frozen=True)
class TorchZeroTarget(TorchDDPTarget):
    """torch DDP with ``ZeroRedundancyOptimizer``."""

    shards_optimizer_state = True

    # ZeroRedundancyOptimizer rejects parameters of several dtypes.
    supported_features = frozenset(FEATURES) - {"mixed-dtypes"}

    def supports(self, scenario: Any) -> str | None:
        if getattr(scenario, "checkpoint_after", None) is not None and not _numpy_available():
            return ("checkpoint: ZeroRedundancyOptimizer.consolidate_state_dict decodes every "
                    "rank's shard through numpy (torch 2.13), which is not installed here")
        return None

    def make_optimizer(self, params: Any, optimizer_cls: type, **kwargs: Any) -> Any:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        params = list(params)
        if params and isinstance(params[0], dict):
            first, *rest = params
            first = dict(first)
            optimizer = ZeroRedundancyOptimizer(first.pop("params"), optimizer_class=optimizer_cls,
                                                **{**kwargs, **first})
            for group in rest:  # a later group falls back to the kwargs, not to group 0's values
                optimizer.add_param_group({**kwargs, **group})
            return optimizer
        # Not parameters_as_bucket_view=True: with torch DDP in front (torch 2.13), a parameter
        # created non-contiguous then gets wrong gradients even at W=1 -- ZeRO swaps param.data
        # for a contiguous bucket view after DDP's Reducer fixed the gradient layout (found by
        # the battery's non-contiguous scenario; ZeRO alone is fine). So ZeRO broadcasts one
        # parameter at a time, and this target does not promise flattened broadcasts.
        return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_cls, **kwargs)



@dataclasses.dataclass(frozen=True)
class WrapperTarget(Target):
    """A target assembled by :meth:`Target.from_wrappers` (see there for the fields)."""

    ddp: Any = None
    ddp_kwargs: dict = dataclasses.field(default_factory=dict)
    finish: str | None = None
    no_sync_method: str | None = "no_sync"
    optimizer: Any = None
    optimizer_kwargs: dict = dataclasses.field(default_factory=dict)
    inner_optimizer: str = "class"
    before_step_method: str | None = None
    after_step_method: str | None = None
    supported_features: frozenset[str] | None = None
    shards_optimizer_state: bool = False

    def wrap(self, module: Any) -> Any:
        return module if self.ddp is None else self.ddp(module, **self.ddp_kwargs)

    def make_optimizer(self, params: Any, optimizer_cls: type, **kwargs: Any) -> Any:
        if self.optimizer is None:
            return optimizer_cls(params, **kwargs)
        if self.inner_optimizer == "class":
            return self.optimizer(params, optimizer_cls, **kwargs, **self.optimizer_kwargs)
        if self.inner_optimizer == "instance":
            return self.optimizer(optimizer_cls(params, **kwargs), **self.optimizer_kwargs)
        return self.optimizer(params, **{self.inner_optimizer: optimizer_cls}, **kwargs,
                              **self.optimizer_kwargs)

    def before_step(self, model: Any, optimizer: Any) -> None:
        if self.before_step_method is not None:
            _method(model, self.before_step_method, "before_step")()

    def after_backward(self, model: Any, optimizer: Any) -> None:
        if self.finish is not None:
            _method(model, self.finish, "finish")()

    def after_step(self, model: Any, optimizer: Any) -> None:
        if self.after_step_method is not None:
            _method(model, self.after_step_method, "after_step")()

    def no_sync(self, model: Any) -> ContextManager[Any]:
        if self.no_sync_method is None:
            return contextlib.nullcontext()
        return _method(model, self.no_sync_method, "no_sync")()


def _numpy_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("numpy") is not None


def _method(model: Any, name: str, field: str) -> Any:
    method = getattr(model, name, None)
    if not callable(method):
        raise AttributeError(f"Target.from_wrappers({field}={name!r}): the wrapped model "
                             f"{type(model).__name__} has no method {name!r}")
    return method


@dataclasses.dataclass(frozen=True)
class LocalTarget(Target):
    """No synchronisation at all: every rank trains on its own shard. Fails for W > 1."""


PARALLEL = ParallelTarget()
PARALLEL_DDP = ParallelDDPTarget()
TORCH_DDP = TorchDDPTarget()
TORCH_ZERO = TorchZeroTarget()
LOCAL = LocalTarget()

#: Built-in targets by the short names the command line accepts.
BUILTIN = {"parallel": PARALLEL, "parallel_ddp": PARALLEL_DDP, "torch_ddp": TORCH_DDP,
           "torch_zero": TORCH_ZERO, "local": LOCAL}
