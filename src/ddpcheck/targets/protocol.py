"""Targets: how an implementation under test is driven inside each rank.

A :class:`Target` is pickled to every rank process, so subclasses must be defined at module level
of an importable module. The runner calls, per example and per rank::

    target = target.configure(scenario)          # read hints such as bucket_size_mb
    model = target.wrap(module)
    optimizer = target.make_optimizer(params, optimizer_cls, [model=model,] **kwargs)
    for each step:
        plan = target.shard_batch(GlobalBatch(indices, step, rank, W, accumulation, reduction))
        target.before_step(model, optimizer)
        for each micro-batch of plan but the last:  with target.no_sync(model): forward/backward
        last micro-batch:                           forward/backward
        (each backward of the sum of its samples' loss terms -- per-sample losses, or non-padding
         tokens' -- times its scale in the plan)
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
exactly one rank. ``flattened_broadcasts`` opts into the broadcast budget (``ddpcheck._internal.oracle.budget``).
Parameters, gradients and optimizer state a rank holds only a shard of (FSDP2's DTensors, your
own ZeRO-3) are read whole through ``target.full_tensor`` and their shards through
``target.local_shard`` (both DTensor-aware by default).
``make_optimizer`` gets the wrapped model only if its signature names a ``model`` parameter.
``shard_batch`` (``ddpcheck.batches``) is where a target that owns the data split -- its sampler,
its loss normalisation -- says which samples this rank trains on and how each micro-batch's loss is
scaled; it is also called in the checking process, before any world runs, so it must be a
deterministic function of its argument. The default is the scenario's batch rule.

Most implementations need no class at all: :meth:`Target.from_wrappers` assembles one from a
wrapper class, the name of its finish method and a sharded optimizer class.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, ContextManager, Mapping

import torch
import torch.distributed as dist

from ddpcheck.batches import BatchPlan, GlobalBatch, contiguous
from ddpcheck.errors import InvalidArgument

__all__ = ["CONSTRUCTOR_CALL", "Target", "WrapperTarget"]

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
    #: True when the target applies a scenario's ``param_dtype`` policy itself -- float32 master
    #: weights, forward and backward on copies in ``scenario.param_dtype``, gradients accumulated
    #: and reduced in float32 -- as FSDP2's ``MixedPrecisionPolicy`` does (read it in
    #: ``configure``). Opt-in: scenarios with a ``param_dtype`` are declined otherwise
    #: (``ddpcheck.features.OPT_IN``); ``Scenario.autocast`` needs nothing of the target.
    applies_param_dtype: bool = False

    def __new__(cls, *args: Any, **kwargs: Any) -> "Target":
        # Record the constructor call: a failure's replay line rebuilds a plain-class target as
        # ``module:Cls(args...)`` (``ddpcheck._internal.runs.replay``). Kept in the instance dict, so it travels
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

    def shard_batch(self, batch: GlobalBatch) -> BatchPlan:
        """This rank's micro-batches of the step's global batch, and each one's loss scale.

        Default: ``ddpcheck.batches.contiguous``, the scenario's batch rule. Override it (or pass
        ``shard_batch=`` to :meth:`from_wrappers`) to run your own sampler and normalisation;
        ``ddpcheck.batches.DistributedSamplerBatches`` runs torch's ``DistributedSampler``."""
        return contiguous(batch)

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

        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)

    def no_sync(self, model: Any) -> ContextManager[Any]:
        """Context for accumulation micro-batches whose gradients stay local."""
        return contextlib.nullcontext()

    def full_tensor(self, tensor: Any) -> Any:
        """The whole of a parameter, gradient or optimizer-state tensor this rank may hold only
        a shard of. Collective: every rank calls it for the same tensors in the same order, and
        the harness's own calls are not counted against the step's communication.

        Default: ``tensor.full_tensor()`` for a DTensor (FSDP2), else ``tensor``. Override it
        for your own ZeRO-3 style sharding (all-gather the shards, return the whole tensor)."""
        full = getattr(tensor, "full_tensor", None)
        return full() if callable(full) else tensor

    def local_shard(self, tensor: Any) -> tuple[int | None, Any] | None:
        """``(dim, local tensor)`` of a parameter sharded over the world: the rank holds chunk
        ``rank`` of ``torch.chunk(full, W, dim)`` (FSDP2's ``Shard(dim)``; dim None: a replicated
        copy of the whole); None when the parameter is not sharded this way. The harness checks
        the local tensor against that slice of :meth:`full_tensor` (``ddpcheck._internal.oracle.shards``).

        Default: a DTensor on a one-dimensional mesh with a ``Shard(dim)`` or ``Replicate``
        placement; anything else is not checked."""
        placements = getattr(tensor, "placements", None)
        if placements is None or len(placements) != 1 or not callable(
                getattr(tensor, "to_local", None)):
            return None
        (placement,) = placements
        if placement.is_replicate():
            return None, tensor.to_local()
        if placement.is_shard():
            return placement.dim, tensor.to_local()
        return None  # Partial, or a placement this check does not know

    def save_checkpoint(self, module: Any, model: Any, optimizer: Any, scheduler: Any) -> Any:
        """The checkpoint of a run, returned on rank 0 (scenarios with ``checkpoint_after``).
        Collective: called on every rank after the step ``checkpoint_after``.

        Default: the unwrapped ``module``'s ``state_dict()`` (a wrapper's may prefix its keys,
        torch DDP's with ``module.``), the optimizer's full state -- gathered on rank 0 first by
        ``consolidate_state_dict(to=0)`` where the optimizer has one (a sharded optimizer: each
        rank holds only its shard) -- and the LR ``scheduler``'s ``state_dict()`` (None without
        a schedule). ``model`` is the wrapped model."""
        if callable(getattr(optimizer, "consolidate_state_dict", None)):
            optimizer.consolidate_state_dict(to=0)
        if dist.get_rank() != 0:
            return None
        return {"model": module.state_dict(), "optimizer": optimizer.state_dict(),
                "optimizer_names": _names_by_group(module, optimizer),
                "scheduler": None if scheduler is None else scheduler.state_dict()}

    def load_checkpoint(self, checkpoint: Any, module: Any, model: Any, optimizer: Any,
                        scheduler: Any) -> None:
        """Load what rank 0's ``save_checkpoint`` returned, on every rank of the resumed run
        (its world size may differ), after the model is wrapped and the optimizer and
        scheduler are built, before the step after the checkpoint.

        Default: the module strictly (in place, so the wrapper and the optimizer keep their
        parameters; every rank loads the same weights, so no broadcast is needed), then the
        optimizer (a sharded one keeps the state of the parameters it owns in this world;
        state is paired with parameters by name, since ranks may register them in other orders)
        and the scheduler."""
        module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(_in_this_rank_order(
            checkpoint["optimizer"], checkpoint.get("optimizer_names"),
            _names_by_group(module, optimizer)))
        if scheduler is not None:
            scheduler.load_state_dict(checkpoint["scheduler"])

    def optimizer_state(self, optimizer: Any) -> Mapping[Any, dict]:
        """The optimizer state this rank holds, keyed by parameter tensor.

        Default: the state of the one ``torch.optim.Optimizer`` the optimizer wraps, if it holds
        one in an attribute (ZeroRedundancyOptimizer's ``.optim``, a ZeRO-1 wrapper's inner
        optimizer), else its own ``state``. Override it when neither is right."""
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
                      shards_optimizer_state: bool | None = None,
                      shard_batch: Any = None) -> "WrapperTarget":
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
        defaults to True when an ``optimizer`` wrapper is given. ``shard_batch``: a callable
        ``(ddpcheck.batches.GlobalBatch) -> BatchPlan`` that owns the data split (None: the
        scenario's batch rule; see :meth:`Target.shard_batch`).

        Assign the result to a module-level name: ``MODULE:NAME`` is then its replay line and
        its command-line name.
        """
        if shard_batch is not None and not callable(shard_batch):
            raise InvalidArgument(f"Target.from_wrappers(shard_batch={shard_batch!r}) must be a "
                                  "callable (GlobalBatch) -> BatchPlan, or None")
        return WrapperTarget(
            ddp=ddp, ddp_kwargs=dict(ddp_kwargs or {}), finish=finish, no_sync_method=no_sync,
            optimizer=optimizer, optimizer_kwargs=dict(optimizer_kwargs or {}),
            inner_optimizer=inner_optimizer, before_step_method=before_step,
            after_step_method=after_step,
            supported_features=None if supports is None else frozenset(supports),
            shards_optimizer_state=(optimizer is not None if shards_optimizer_state is None
                                    else shards_optimizer_state),
            batch_sharding=shard_batch)


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
    batch_sharding: Any = None  # from_wrappers(shard_batch=...)

    def wrap(self, module: Any) -> Any:
        return module if self.ddp is None else self.ddp(module, **self.ddp_kwargs)

    def shard_batch(self, batch: GlobalBatch) -> BatchPlan:
        return contiguous(batch) if self.batch_sharding is None else self.batch_sharding(batch)

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


def _method(model: Any, name: str, field: str) -> Any:
    method = getattr(model, name, None)
    if not callable(method):
        raise AttributeError(f"Target.from_wrappers({field}={name!r}): the wrapped model "
                             f"{type(model).__name__} has no method {name!r}")
    return method


def _names_by_group(module: Any, optimizer: Any) -> list[list[str]] | None:
    """Each param group's parameter names, in the order the optimizer lists them; None when it
    has no plain ``param_groups`` or lists a parameter the module does not name."""
    named = {id(p): n for n, p in module.named_parameters()}
    try:
        return [[named[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    except (AttributeError, KeyError, TypeError):
        return None


def _in_this_rank_order(saved: dict, saved_names: Any, mine: Any) -> dict:
    """``saved`` (an optimizer ``state_dict``: state by position) with each group's positions
    put in this rank's parameter order. ``load_state_dict`` pairs positions with parameters, and
    a rank may register its parameters in another order than rank 0 (``Scenario.rank_orders``);
    unchanged when the orders agree or the names cannot be matched."""
    if saved_names is None or mine is None or saved_names == mine or not isinstance(saved, dict):
        return saved
    groups = saved.get("param_groups")
    if groups is None or len(groups) != len(mine) or any(
            sorted(a) != sorted(b) for a, b in zip(saved_names, mine)):
        return saved
    reordered = []
    for group, names, my_names in zip(groups, saved_names, mine):
        position = dict(zip(names, group["params"]))
        reordered.append({**group, "params": [position[name] for name in my_names]})
    return {**saved, "param_groups": reordered}
