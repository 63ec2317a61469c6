"""Targets: how an implementation under test is driven inside each rank.

A :class:`Target` is pickled to every rank process, so subclasses must be defined at module level
of an importable module. The runner calls, per example and per rank::

    target = target.configure(scenario)          # read hints such as bucket_size_mb
    model, optimizer = target.setup(module, params, optimizer_cls, **kwargs)
        # default: model = target.wrap(module)
        #          optimizer = target.make_optimizer(params, optimizer_cls, [model=model,] **kwargs)
    scheduler = target.make_scheduler(optimizer, gamma)   # scenarios with lr_decay
    (initial state recorded here)
    for each step:
        plan = target.shard_batch(GlobalBatch(indices, step, rank, W, accumulation, reduction))
        target.before_step(model, optimizer)
        for index, micro-batch of plan (count of them):
            with target.micro_batch(model, optimizer, index, count):
                # default: target.no_sync(model) for all but the last
                loss = sum of its samples' loss terms (per-sample losses, or non-padding
                       tokens') * its scale in the plan
                target.backward(model, loss)                   # default: loss.backward()
                if target.steps_every_micro_batch and not last:
                    optimizer.step(); scheduler.step(); optimizer.zero_grad(...)
                    (parameters must not have moved: the framework gates these calls)
        target.after_backward(model, optimizer)
        target.clip_grad_norm(model, optimizer, max_norm, norm_type)   # scenarios that clip
        (gradients recorded here; a target with sharded_gradients: each from its owner,
         target.gradient_shards)
        optimizer.step(); scheduler.step()
        target.reported_loss(model, optimizer, losses)   # the step's loss, as reported
        (everything else recorded here); optimizer.zero_grad(set_to_none=...)
        target.after_step(model, optimizer)
    target.teardown(model, optimizer)

and, once per rank process before its first example of the target's class,
``target.warm_up()`` (a framework's imports and JIT builds, outside any example's deadline).

A target that owns the whole loop (Lightning's ``Trainer.fit``) defines ``fit(module, run)``
instead: it trains on ``run.batches`` and calls ``run.started(...)`` once model and optimizer are
built and ``run.record(...)`` after every optimizer step (``ddpcheck.targets.FitRun``). For a
scenario with epochs a target may run its framework's own data path, ``fit_epochs(module, run)``
(``ddpcheck._language.training.EpochRun``): its ``DataLoader`` over the dataset and, where the
scenario has an evaluation set, its evaluation after every epoch, whose metric it hands to
``run.evaluated(...)`` (say ``reports_metric = True`` then). Hooks and frameworks:
``docs/frameworks.md``.

In scenarios with ``checkpoint_after`` the run stops after that step with
``target.save_checkpoint(module, model, optimizer, scheduler)`` (collective; the checkpoint is
rank 0's answer) and a fresh run -- at ``resume_world_size`` -- builds everything anew, calls
``target.load_checkpoint(checkpoint, module, model, optimizer, scheduler)`` and trains the rest.

and reads ``target.optimizer_state(optimizer)`` to check that optimizer state matches the
reference and -- when ``shards_optimizer_state`` is true -- that each parameter's state lives on
exactly one rank. ``flattened_broadcasts`` opts into the broadcast budget
(``ddpcheck._oracle.budget``). Parameters, gradients and optimizer state a rank holds only
a shard of (FSDP2's DTensors, your own ZeRO-3) are read whole through ``target.full_tensor`` and
their shards through ``target.local_shard`` (both DTensor-aware by default). ``make_optimizer`` gets
the wrapped model only if its signature names a ``model`` parameter. ``shard_batch``
(``ddpcheck.batches``) is where a target that owns the data split -- its sampler, its loss
normalisation -- says which samples this rank trains on and how each micro-batch's loss is scaled;
it is also called in the checking process, before any world runs, so it must be a deterministic
function of its argument. The default is the scenario's batch rule.

Most implementations need no class at all: :meth:`Target.from_wrappers` assembles one from a
wrapper class, the name of its finish method and a sharded optimizer class.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from ddpcheck._base.errors import InvalidArgument, NothingChecked
from ddpcheck._language.batches import BatchPlan, GlobalBatch, contiguous
from ddpcheck._language.features import FEATURES, OPT_IN
from ddpcheck._language.scenario import Scenario
from ddpcheck._language.training import (
    FitRun,  # what Target.fit gets: part of the protocol
    MicroBatchLoss,  # what Target.reported_loss gets
    OptimizerLike,
    Params,
    SchedulerLike,
    optimizer_kwargs,
)

if TYPE_CHECKING:  # hypothesis loads only when a configuration space is built
    from typing import TypeAlias

    from hypothesis.strategies import SearchStrategy
    from torch.distributed.device_mesh import DeviceMesh

    from ddpcheck._language.plans import OwnPlanModels

    #: What ``Target.config_space`` returns: a strategy of options, or None (nothing to fuzz).
    ConfigSpace: TypeAlias = SearchStrategy[dict[str, object]] | None

__all__ = [
    "CONSTRUCTOR_CALL",
    "FitRun",
    "MicroBatchLoss",
    "OwnsLoop",
    "Target",
    "WrapperTarget",
    "supported_but",
]

#: Instance attribute holding ``(args, kwargs)`` of the call that built a target.
CONSTRUCTOR_CALL = "_ddpcheck_call"


def supported_but(declined: Mapping[str, str]) -> frozenset[str]:
    """Every feature but those ``declined`` (``Target.declined_features``); an opt-in feature
    among them stays governed by its flag (``ddpcheck.features.OPT_IN``)."""
    return frozenset(FEATURES) - (set(declined) - set(OPT_IN))


@runtime_checkable
class OwnsLoop(Protocol):
    """A target that owns the whole training loop (Lightning's ``Trainer.fit``): ddpcheck hands it
    the module and a :class:`FitRun` instead of driving the loop through the hooks below."""

    def fit(self, module: nn.Module, run: FitRun) -> None: ...


class Target:
    """Base class: no wrapping, the plain optimizer, no synchronisation (override what you need)."""

    #: True when the optimizer keeps each parameter's state on one rank only (ZeRO-1 style).
    shards_optimizer_state: bool = False
    #: True when updated parameters travel in one flattened broadcast per owner rank and dtype;
    #: the oracle then fails a step with more broadcasts than W x parameter dtypes.
    flattened_broadcasts: bool = False
    #: The features of ``ddpcheck.features.FEATURES`` this target supports. None: everything
    #: within torch DDP's own contract (``ddpcheck.features.DEFAULT_FEATURES``); features beyond
    #: it (``BEYOND_TORCH``: per-rank registration orders) must be declared to be checked, and
    #: so must ``tokens`` when the target owns its batch plan (:attr:`owns_batch_plan`): a plan
    #: written for per-sample losses is not judged on token losses unless it says it weighs them.
    #: Scenarios needing another are not generated, and battery scenarios are skipped naming it.
    supported_features: frozenset[str] | None = None
    #: The features this target declines, each with why (``{feature: reason}``): declaring them
    #: declares every other feature supported -- a class sets this or ``supported_features``, not
    #: both (:meth:`__init_subclass__` derives one from the other). ``ddpcheck targets`` prints
    #: the reasons, and an example declined for one of them quotes it. An opt-in feature
    #: (``ddpcheck.features.OPT_IN``) listed here stays governed by its flag: the reason is why
    #: the flag is unset.
    declined_features: ClassVar[Mapping[str, str]] = MappingProxyType({})

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        declined = cls.__dict__.get("declined_features")
        if declined is None:
            return
        own = cls.__dict__.get("supported_features")
        if own is not None and not isinstance(own, property):
            raise TypeError(
                f"{cls.__name__} declares both supported_features and "
                "declined_features: declare one (the other follows from it)"
            )
        unknown = sorted(set(declined) - set(FEATURES))
        if unknown:
            raise TypeError(
                f"{cls.__name__}.declined_features names {unknown}, which are not "
                f"features (ddpcheck.features.FEATURES)"
            )
        cls.declined_features = MappingProxyType(dict(declined))
        if own is None and not isinstance(getattr(cls, "supported_features", None), property):
            cls.supported_features = supported_but(declined)  # (a property: per instance)

    #: True when the optimizer itself averages gradients inside ``step()`` (ZeRO-2 style, no
    #: wrapper in front): gradients are then recorded after the step, not before it.
    gradients_synchronized_in_step: bool = False
    #: True when the loop calls ``optimizer.step()``, the LR scheduler and ``zero_grad()`` after
    #: *every* micro-batch and the framework decides whether they act (accelerate's
    #: ``accumulate``, DeepSpeed's engine): the oracle then requires the parameters not to move
    #: inside an accumulation window, and compares them at its end as usual.
    steps_every_micro_batch: bool = False
    #: True when each synchronised gradient lives on one rank only, its owner (ZeRO-2, fairscale's
    #: OSS/ShardedDDP, DeepSpeed stage 2): the harness records each gradient as its owner holds it
    #: (:meth:`gradient_shards`, gathered outside the recorded collectives) and does not require
    #: the other ranks' ``.grad`` to agree.
    sharded_gradients: bool = False
    #: True when the target reduces the gradients after every micro-batch by design (DeepSpeed's
    #: ZeRO-2, which cannot accumulate locally): the communication budget then allows the
    #: gradient bytes once per micro-batch instead of once per step.
    reduces_every_micro_batch: bool = False
    #: True when the target applies a scenario's ``param_dtype`` policy itself -- float32 master
    #: weights, forward and backward on copies in ``scenario.param_dtype``, gradients accumulated
    #: and reduced in float32 -- as FSDP2's ``MixedPrecisionPolicy`` does (read it in
    #: ``configure``). Opt-in: scenarios with a ``param_dtype`` are declined otherwise
    #: (``ddpcheck.features.OPT_IN``); ``Scenario.autocast`` needs nothing of the target.
    applies_param_dtype: bool = False
    #: The target applies a tensor-parallel plan in :meth:`parallelize`. Opt-in: scenarios with
    #: a ``tensor_parallel`` mesh are declined otherwise (``ddpcheck.features.OPT_IN``).
    parallelizes: bool = False
    #: False for a target whose framework computes each micro-batch's loss out of the harness's
    #: sight (the Trainer's model wrapper): only the loss it reports is checked then.
    step_losses_seen: bool = True
    #: The releases the target needs, ``(distribution, oldest supported release)`` pairs (the
    #: DeepSpeed targets: ``(("deepspeed", "0.19.0"),)``): checked in the checking process before
    #: any world runs; a missing or older release is a ``SetupError`` naming both.
    requires: tuple[tuple[str, str], ...] = ()

    def __new__(cls, *args: object, **kwargs: object) -> Target:
        # Record the constructor call: a failure's replay line rebuilds a plain-class target as
        # ``module:Cls(args...)`` (``ddpcheck._runs.replay``). Kept in the instance dict,
        # so it travels with the target; unpickling calls ``__new__`` without arguments, then
        # restores it.
        if (args or kwargs) and cls.__init__ is object.__init__:
            raise TypeError(f"{cls.__qualname__}() takes no arguments")
        self = super().__new__(cls)
        object.__setattr__(self, CONSTRUCTOR_CALL, (args, kwargs))  # frozen dataclasses too
        return self

    def configure(self, scenario: Scenario) -> Target:
        """Return the target to use for this scenario (default: itself)."""
        return self

    def config_space(self) -> ConfigSpace:
        """The options ``--fuzz-config`` draws beside each scenario: a Hypothesis strategy of
        keyword arguments for ``dataclasses.replace(self, **drawn)`` -- the target's own fields
        that bear on equivalence, each key optional and drawn only with a non-default value
        (``ddpcheck.targets.option_space.options`` builds one) -- or None: nothing to fuzz, and
        ``fuzz_config=True`` is refused. Default: None."""
        return None

    def own_plan_models(self) -> OwnPlanModels | None:
        """For a target that :attr:`parallelizes`: models that bring their own plan (a
        transformers architecture's ``tp_plan``), drawn beside the drawn plans -- a function of
        the tensor-parallel degree to a strategy of model factories, the plan left empty -- or
        None (default): the drawn plans alone."""
        return None

    def declined_reason(self, feature: str) -> str | None:
        """Why this target declines ``feature``, quoted wherever a scenario needing it is not
        run; None for no reason of its own. Default: its class's ``declined_features``."""
        return self.declined_features.get(feature)

    def drawn_scenarios(
        self,
        world_size: int,
        dtypes: tuple[str, ...],
        without: frozenset[str],
        degrees: tuple[int, ...] | None,
    ) -> SearchStrategy[Scenario] | None:
        """The random scenarios of a target that trains models of its own kind (torchtitan's
        Llama 3, the transformers models DeepSpeed's AutoTP parses) at ``world_size``, in
        ``dtypes``, exercising none of ``without``; ``degrees``: the ``tp`` degrees asked for
        (``--mesh``; None: the target's choice). Such a target's meshes (``--mesh``) are judged
        by its ``supports_at`` alone. Default: None, the scenario language's draws for what the
        target supports."""
        return None

    def own_battery(self) -> list[tuple[str, Scenario]] | None:
        """The built-in battery of a target that trains a model of its own (None, the default:
        the battery of ``ddpcheck.battery`` that fits it)."""
        return None

    def supports(self, scenario: Scenario) -> str | None:
        """None when the target can run ``scenario``; otherwise why not (the example is skipped
        and the reason reported). Called in the parent process, before any rank runs."""
        return None

    def supports_at(self, scenario: Scenario, world_size: int) -> str | None:
        """Like :meth:`supports`, for what only the world size decides (a framework's data path:
        a per-device batch size W divides, a sampler that pads a dataset W does not divide);
        asked wherever the world size is known, before any rank runs."""
        return None

    def parallelize(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        """Apply your tensor-parallel plan to ``module`` over ``mesh`` (a ``DeviceMesh`` with the
        axes ``("dp", "tp")``, torch's ``init_device_mesh`` layout) and return the module, for a
        scenario with ``tensor_parallel`` (:attr:`parallelizes` opts in). Called before
        :meth:`wrap` (or :meth:`setup`), which then syncs over ``mesh["dp"]``; the ranks of a
        ``tp`` group get the same samples, the harness's doing
        (``ddpcheck._language.tensor_parallel``). Default: the module unchanged."""
        return module

    def wrap(self, module: nn.Module) -> nn.Module:
        return module

    def make_optimizer(
        self, params: Params, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any
    ) -> OptimizerLike:
        return optimizer_cls(params, **kwargs)

    def setup(
        self,
        module: nn.Module,
        params: Params,
        optimizer_cls: type[torch.optim.Optimizer],
        **kwargs: Any,  # the scenario's options, for its optimizer class
    ) -> tuple[nn.Module, OptimizerLike]:
        """``(model, optimizer)``, for frameworks that build both at once (accelerate's
        ``prepare``, DeepSpeed's ``initialize``, Fabric's ``setup``). The initial state is
        recorded after it. ``params``: the module's parameters or param groups, as built before
        any wrapping. Default: :meth:`wrap`, then :meth:`make_optimizer` over ``params`` as the
        module holds them after wrapping (FSDP2 replaces each by a DTensor of the same name),
        given the wrapped model when its signature names a ``model`` parameter."""
        names = {id(p): n for n, p in module.named_parameters()}
        model = self.wrap(module)
        params = _rebound(params, names, dict(module.named_parameters()))
        return model, self.make_optimizer(
            params, optimizer_cls, **optimizer_kwargs(self, model, kwargs)
        )

    def make_scheduler(self, optimizer: OptimizerLike, gamma: float) -> SchedulerLike:
        """The scenario's LR schedule over ``optimizer``: ``ExponentialLR(gamma)``, stepped once
        per optimizer step (only scenarios with ``lr_decay`` have one). Override it to return a
        framework's prepared scheduler (accelerate's ``prepare_scheduler``); it needs ``step()``
        and ``state_dict()``. Default: over ``optimizer`` -- or, when that is no
        ``torch.optim.Optimizer``, over the one it wraps as ``.optimizer``."""
        inner = (
            optimizer
            if isinstance(optimizer, torch.optim.Optimizer)
            else getattr(optimizer, "optimizer", None)
        )
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")  # as torch says
        return torch.optim.lr_scheduler.ExponentialLR(inner, gamma)

    def micro_batch(
        self, model: nn.Module, optimizer: OptimizerLike, index: int, count: int
    ) -> AbstractContextManager[object]:
        """The context of micro-batch ``index`` of ``count`` in a step: its forward and backward
        (and, with :attr:`steps_every_micro_batch`, the gated step) run inside. Default:
        :meth:`no_sync` for all but the last. Override it for accelerate's
        ``accumulate(model)`` or Fabric's ``no_backward_sync(model, enabled=not last)``."""
        return self.no_sync(model) if index < count - 1 else contextlib.nullcontext()

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        """Back-propagate one micro-batch's loss. Default: ``loss.backward()``; override it for
        ``accelerator.backward(loss)``, ``fabric.backward(loss)``, ``engine.backward(loss)``."""
        loss.backward()

    def reported_loss(
        self, model: nn.Module, optimizer: OptimizerLike, losses: Sequence[MicroBatchLoss]
    ) -> torch.Tensor | float | None:
        """The step's loss as your loop reports it -- what it prints or logs, what early stopping
        and ``ReduceLROnPlateau`` read -- given this rank's micro-batch losses of the step as
        they were back-propagated (``ddpcheck.targets.MicroBatchLoss``: the loss, its terms,
        its plan's scale). Called on every rank after the optimizer step; it may communicate
        (an all-reduce of the loss is the usual way), and every rank must call the same
        collectives. Return the global value -- the objective over the whole global batch, as
        the one-process reference computes it -- or None where this rank reports nothing. The
        oracle compares each reported value with the reference's ("loss differs").

        Default: None, nothing reported (the harness still checks the step's loss it computed).
        """
        return None

    @property
    def reports_loss(self) -> bool:
        """True when :meth:`reported_loss` is the target's own (a target that owns its loop and
        hands its framework's logged loss to ``FitRun.reported`` says so itself)."""
        return type(self).reported_loss is not Target.reported_loss

    #: True when the target's own data path (``fit_epochs``) evaluates a scenario's evaluation
    #: set after every epoch and reports the metric (``EpochRun.evaluated``): what the closing
    #: line of ``ddpcheck check`` says was checked
    reports_metric: bool = False

    @property
    def owns_batch_plan(self) -> bool:
        """True when :meth:`shard_batch` is the target's own, not the scenario's batch rule."""
        return type(self).shard_batch is not Target.shard_batch

    def shard_batch(self, batch: GlobalBatch) -> BatchPlan:
        """This rank's micro-batches of the step's global batch, and each one's loss scale.

        Default: ``ddpcheck.batches.contiguous``, the scenario's batch rule. Override it (or pass
        ``shard_batch=`` to :meth:`from_wrappers`) to run your own sampler and normalisation;
        ``ddpcheck.batches.DistributedSamplerBatches`` runs torch's ``DistributedSampler``."""
        return contiguous(batch)

    def before_step(self, model: nn.Module, optimizer: OptimizerLike) -> None:
        """Called at the start of every step, before its first forward
        (``on_train_batch_start``)."""

    def after_backward(self, model: nn.Module, optimizer: OptimizerLike) -> None:
        """Called after the last micro-batch's backward, before ``optimizer.step()``."""

    def after_step(self, model: nn.Module, optimizer: OptimizerLike) -> None:
        """Called after ``optimizer.step()`` and ``zero_grad`` (where loops call
        ``model.reset()``)."""

    def teardown(self, model: nn.Module, optimizer: OptimizerLike) -> None:
        """Called once per example on every rank, after its last step (and checkpoint): reset
        per-example framework state -- singletons (accelerate's ``AcceleratorState``), meshes,
        groups -- so the next example in this process starts clean. Default: nothing."""

    def warm_up(self) -> None:
        """Set-up a framework does once per process -- importing it, JIT-building its C++ ops --
        done here, in every rank, before the first example of this target's class runs there: a
        task of its own, under a deadline of its own (``WARM_UP_DEADLINE``, minutes), so that no
        example's deadline pays for it. Issues no collective. A failure is a ``SetupError`` (exit
        2), never a verdict. Default: nothing."""

    def clip_grad_norm(
        self, model: nn.Module, optimizer: OptimizerLike, max_norm: float, norm_type: float
    ) -> object:
        """Clip the synchronised gradients to a global norm; called after ``after_backward`` in
        scenarios that clip (``Scenario.max_grad_norm``).

        Default: ``torch.nn.utils.clip_grad_norm_`` over the wrapped model's parameters, right
        wherever every rank holds every synchronised gradient (any DDP). Override it where each
        rank holds only part of the norm, or where gradients are averaged later, in ``step()``.
        """
        if self.gradients_synchronized_in_step:  # declined, as every default hook declines
            raise NothingChecked(
                f"{type(self).__name__} averages gradients inside optimizer.step(), so clipping "
                "before it would clip each rank's own gradients; override "
                "Target.clip_grad_norm(model, optimizer, max_norm, norm_type) to clip through "
                "the optimizer, or leave 'clipping' out of supported_features"
            )

        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)

    def no_sync(self, model: nn.Module) -> AbstractContextManager[object]:
        """Context for accumulation micro-batches whose gradients stay local."""
        return contextlib.nullcontext()

    def gradient_owner(self, optimizer: OptimizerLike, param: torch.Tensor) -> int:
        """The rank that holds ``param``'s synchronised gradient, for a target with
        :attr:`sharded_gradients` that keeps the default :meth:`gradient_shards`. Default: the
        optimizer's ``owner_of(param)`` (``parallel.ShardedOptimizer``), else the rank torch's
        ZeroRedundancyOptimizer assigned it (``_param_to_rank``)."""
        owner_of = getattr(optimizer, "owner_of", None)
        if callable(owner_of):
            return int(owner_of(param))
        ranks = getattr(optimizer, "_param_to_rank", None)
        if ranks is not None:
            return int(ranks[param])
        raise InvalidArgument(
            f"{type(self).__name__} declares sharded_gradients, but "
            f"{type(optimizer).__name__} has no owner_of(param) or _param_to_rank; "
            "override Target.gradient_owner(optimizer, param) or "
            "Target.gradient_shards(model, optimizer)"
        )

    def gradient_shards(
        self, model: nn.Module, optimizer: OptimizerLike, params: list[torch.Tensor]
    ) -> list[tuple[torch.Tensor, int, torch.Tensor | None]]:
        """The synchronised gradient pieces this rank owns, for a target with
        :attr:`sharded_gradients`: ``(parameter, offset, piece)`` triples, ``piece`` the elements
        ``[offset, offset + piece.numel())`` of the parameter's flattened gradient (a flat shard,
        DeepSpeed stage 2), or the whole gradient at offset 0 (ZeRO-2 per parameter); None for a
        parameter whose owner holds no gradient (unused everywhere). ``params``: the parameters
        whose gradients are recorded. Default: for each parameter this rank owns
        (:meth:`gradient_owner`), its ``.grad`` whole."""
        rank = dist.get_rank()
        return [
            (p, 0, None if p.grad is None else p.grad.detach().reshape(-1))
            for p in params
            if self.gradient_owner(optimizer, p) == rank
        ]

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole of a parameter, gradient or optimizer-state tensor this rank may hold only
        a shard of. Collective: every rank calls it for the same tensors in the same order, and
        the harness's own calls are not counted against the step's communication.

        Default: ``tensor.full_tensor()`` for a DTensor (FSDP2), else ``tensor``. Override it
        for your own ZeRO-3 style sharding (all-gather the shards, return the whole tensor)."""
        full = getattr(tensor, "full_tensor", None)
        return full() if callable(full) else tensor

    def local_shard(self, tensor: torch.Tensor) -> tuple[int | None, torch.Tensor] | None:
        """``(dim, local tensor)`` of a parameter sharded over the world: the rank holds chunk
        ``rank`` of ``torch.chunk(full, W, dim)`` (FSDP2's ``Shard(dim)``; dim None: a replicated
        copy of the whole); None when the parameter is not sharded this way. The harness checks
        the local tensor against that slice of :meth:`full_tensor`
        (``ddpcheck._oracle.shards``).

        Default: a DTensor on a one-dimensional mesh of the whole world with a ``Shard(dim)`` or
        ``Replicate`` placement; anything else (a mesh axis of a tensor-parallel world) is not
        checked here."""
        placements = getattr(tensor, "placements", None)
        to_local = getattr(tensor, "to_local", None)
        if placements is None or len(placements) != 1 or not callable(to_local):
            return None
        mesh = getattr(tensor, "device_mesh", None)
        if mesh is not None and mesh.size() != dist.get_world_size():
            return None
        (placement,) = placements
        if placement.is_replicate():
            return None, to_local()
        if placement.is_shard():
            return placement.dim, to_local()
        return None  # Partial, or a placement this check does not know

    def save_checkpoint(
        self,
        module: nn.Module,
        model: nn.Module,
        optimizer: OptimizerLike,
        scheduler: SchedulerLike | None,
    ) -> object:
        """The checkpoint of a run, returned on rank 0 (scenarios with ``checkpoint_after``).
        Collective: called on every rank after the step ``checkpoint_after``.

        Default: the unwrapped ``module``'s ``state_dict()`` (a wrapper's may prefix its keys,
        torch DDP's with ``module.``), the optimizer's full state -- gathered on rank 0 first by
        ``consolidate_state_dict(to=0)`` where the optimizer has one (a sharded optimizer: each
        rank holds only its shard) -- and the LR ``scheduler``'s ``state_dict()`` (None without
        a schedule). ``model`` is the wrapped model. An optimizer whose
        ``consolidate_state_dict`` names its target rank otherwise (``to`` in torch's
        ZeroRedundancyOptimizer and ``parallel``, ``recipient_rank`` in fairscale's OSS) is
        asked by that name; one that names neither declines the example (:class:`NothingChecked`,
        not a verdict), saying to override this hook."""
        _consolidate_on_rank_zero(self, optimizer)
        if dist.get_rank() != 0:
            return None
        return {
            "model": module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "optimizer_names": _names_by_group(module, optimizer),
            "scheduler": None if scheduler is None else scheduler.state_dict(),
        }

    def load_checkpoint(
        self,
        checkpoint: Any,  # what this target's save_checkpoint returned on rank 0
        module: nn.Module,
        model: nn.Module,
        optimizer: OptimizerLike,
        scheduler: SchedulerLike | None,
    ) -> None:
        """Load what rank 0's ``save_checkpoint`` returned, on every rank of the resumed run
        (its world size may differ), after the model is wrapped and the optimizer and
        scheduler are built, before the step after the checkpoint.

        Default: the module strictly (in place, so the wrapper and the optimizer keep their
        parameters; every rank loads the same weights, so no broadcast is needed), then the
        optimizer (a sharded one keeps the state of the parameters it owns in this world;
        state is paired with parameters by name, since ranks may register them in other orders)
        and the scheduler."""
        module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(
            _in_this_rank_order(
                checkpoint["optimizer"],
                checkpoint.get("optimizer_names"),
                _names_by_group(module, optimizer),
            )
        )
        if scheduler is not None:
            scheduler.load_state_dict(checkpoint["scheduler"])

    def optimizer_state(
        self, optimizer: OptimizerLike
    ) -> Mapping[torch.Tensor, Mapping[str, object]]:
        """The optimizer state this rank holds, keyed by parameter tensor.

        Default: the state of the one ``torch.optim.Optimizer`` the optimizer wraps, if it holds
        one in an attribute (ZeroRedundancyOptimizer's ``.optim``, a ZeRO-1 wrapper's inner
        optimizer), else its own ``state``. Override it when neither is right."""
        inner = [
            v
            for v in vars(optimizer).values()
            if isinstance(v, torch.optim.Optimizer) and v is not optimizer
        ]
        if len(inner) == 1:
            return inner[0].state
        state = getattr(optimizer, "state", None)
        if state is None:
            raise InvalidArgument(
                f"{type(self).__name__}.optimizer_state: {type(optimizer).__name__} has no "
                "`state` and wraps no single torch.optim.Optimizer; override "
                "Target.optimizer_state(optimizer) to return {parameter: state dict} held on "
                "this rank, and set shards_optimizer_state = True if each rank holds only its "
                "shard"
            )
        return state

    @staticmethod
    def from_wrappers(
        *,
        ddp: Callable[..., nn.Module] | None = None,
        ddp_kwargs: dict | None = None,
        finish: str | None = None,
        no_sync: str | None = "no_sync",
        optimizer: Callable[..., OptimizerLike] | None = None,
        optimizer_kwargs: dict | None = None,
        inner_optimizer: str = "class",
        before_step: str | None = None,
        after_step: str | None = None,
        supports: Iterable[str] | None = None,
        shards_optimizer_state: bool | None = None,
        shard_batch: Callable[[GlobalBatch], BatchPlan] | None = None,
    ) -> WrapperTarget:
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
        features it supports (``ddpcheck.features``; None: those within torch DDP's contract,
        ``features.DEFAULT_FEATURES``). ``shards_optimizer_state``
        defaults to True when an ``optimizer`` wrapper is given. ``shard_batch``: a callable
        ``(ddpcheck.batches.GlobalBatch) -> BatchPlan`` that owns the data split (None: the
        scenario's batch rule; see :meth:`Target.shard_batch`).

        Assign the result to a module-level name: ``MODULE:NAME`` is then its replay line and
        its command-line name.
        """
        if shard_batch is not None and not callable(shard_batch):
            raise InvalidArgument(
                f"Target.from_wrappers(shard_batch={shard_batch!r}) must be a "
                "callable (GlobalBatch) -> BatchPlan, or None"
            )
        return WrapperTarget(
            ddp=ddp,
            ddp_kwargs=dict(ddp_kwargs or {}),
            finish=finish,
            no_sync_method=no_sync,
            optimizer=optimizer,
            optimizer_kwargs=dict(optimizer_kwargs or {}),
            inner_optimizer=inner_optimizer,
            before_step_method=before_step,
            after_step_method=after_step,
            supported_features=None if supports is None else frozenset(supports),
            shards_optimizer_state=(
                optimizer is not None if shards_optimizer_state is None else shards_optimizer_state
            ),
            batch_sharding=shard_batch,
        )


@dataclasses.dataclass(frozen=True)
class WrapperTarget(Target):
    """A target assembled by :meth:`Target.from_wrappers` (see there for the fields)."""

    ddp: Callable[..., nn.Module] | None = None
    ddp_kwargs: dict = dataclasses.field(default_factory=dict)
    finish: str | None = None
    no_sync_method: str | None = "no_sync"
    optimizer: Callable[..., OptimizerLike] | None = None
    optimizer_kwargs: dict = dataclasses.field(default_factory=dict)
    inner_optimizer: str = "class"
    before_step_method: str | None = None
    after_step_method: str | None = None
    supported_features: frozenset[str] | None = None
    shards_optimizer_state: bool = False
    batch_sharding: Callable[[GlobalBatch], BatchPlan] | None = None  # from_wrappers(shard_batch)

    def wrap(self, module: nn.Module) -> nn.Module:
        return module if self.ddp is None else self.ddp(module, **self.ddp_kwargs)

    #: True when the target's own data path (``fit_epochs``) evaluates a scenario's evaluation
    #: set after every epoch and reports the metric (``EpochRun.evaluated``): what the closing
    #: line of ``ddpcheck check`` says was checked
    reports_metric: bool = False

    @property
    def owns_batch_plan(self) -> bool:
        return self.batch_sharding is not None

    def shard_batch(self, batch: GlobalBatch) -> BatchPlan:
        return contiguous(batch) if self.batch_sharding is None else self.batch_sharding(batch)

    def make_optimizer(
        self, params: Params, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any
    ) -> OptimizerLike:
        if self.optimizer is None:
            return optimizer_cls(params, **kwargs)
        if self.inner_optimizer == "class":
            return self.optimizer(params, optimizer_cls, **kwargs, **self.optimizer_kwargs)
        if self.inner_optimizer == "instance":
            return self.optimizer(optimizer_cls(params, **kwargs), **self.optimizer_kwargs)
        return self.optimizer(
            params, **{self.inner_optimizer: optimizer_cls}, **kwargs, **self.optimizer_kwargs
        )

    def before_step(self, model: nn.Module, optimizer: OptimizerLike) -> None:
        if self.before_step_method is not None:
            _method(model, self.before_step_method, "before_step")()

    def after_backward(self, model: nn.Module, optimizer: OptimizerLike) -> None:
        if self.finish is not None:
            _method(model, self.finish, "finish")()

    def after_step(self, model: nn.Module, optimizer: OptimizerLike) -> None:
        if self.after_step_method is not None:
            _method(model, self.after_step_method, "after_step")()

    def no_sync(self, model: nn.Module) -> AbstractContextManager[object]:
        if self.no_sync_method is None:
            return contextlib.nullcontext()
        return _method(model, self.no_sync_method, "no_sync")()


def _rebound(params: Params, names: dict[int, str], now: dict[str, nn.Parameter]) -> Params:
    """``params`` (parameters, or param groups) with each parameter replaced by the one the
    module now registers under its name; unchanged where it registers the same objects."""

    def one(p: torch.Tensor) -> torch.Tensor:
        name = names.get(id(p))
        return p if name is None else now.get(name, p)

    items = list(params)
    if items and isinstance(items[0], dict):
        return [
            {**g, "params": [one(p) for p in g["params"]]} for g in items if isinstance(g, dict)
        ]
    return [one(p) for p in items if isinstance(p, torch.Tensor)]


def _method(model: nn.Module, name: str, field: str) -> Callable[[], Any]:
    method = getattr(model, name, None)
    if not callable(method):
        raise InvalidArgument(
            f"Target.from_wrappers({field}={name!r}): the wrapped model "
            f"{type(model).__name__} has no method {name!r}"
        )
    return method


#: How ``consolidate_state_dict`` names the rank that receives the whole state, by optimizer
#: family: torch's ZeroRedundancyOptimizer and ``parallel.ShardedOptimizer``; fairscale's OSS.
_RECIPIENT_KEYWORDS = ("to", "recipient_rank")


def _consolidate_on_rank_zero(target: Target, optimizer: OptimizerLike) -> None:
    """Gather a sharded optimizer's whole state on rank 0, asking it by the keyword it takes.
    Collective; every rank decides the same way, so a decline leaves no collective unpaired."""
    consolidate = getattr(optimizer, "consolidate_state_dict", None)
    if not callable(consolidate):
        return  # not sharded: every rank holds the whole state
    parameters: Mapping[str, inspect.Parameter]
    try:
        parameters = inspect.signature(consolidate).parameters
    except (TypeError, ValueError):
        parameters = {}
    for keyword in _RECIPIENT_KEYWORDS:
        if keyword in parameters:
            consolidate(**{keyword: 0})
            return
    raise NothingChecked(
        f"checkpoint: {type(target).__name__} keeps the default save_checkpoint, which cannot "
        f"tell how {type(optimizer).__name__}.consolidate_state_dict gathers the state on rank 0 "
        f"(it takes none of {', '.join(_RECIPIENT_KEYWORDS)}); override "
        "Target.save_checkpoint, or leave 'checkpoint' out of supported_features"
    )


def _names_by_group(module: nn.Module, optimizer: OptimizerLike) -> list[list[str]] | None:
    """Each param group's parameter names, in the order the optimizer lists them; None when it
    has no plain ``param_groups`` or lists a parameter the module does not name."""
    named = {id(p): n for n, p in module.named_parameters()}
    try:
        return [
            [named[id(p)] for p in _iterated(group["params"])] for group in optimizer.param_groups
        ]
    except (AttributeError, KeyError, TypeError):
        return None


def _iterated(value: object) -> Iterable[object]:
    if not isinstance(value, Iterable):
        raise TypeError(f"'{type(value).__name__}' object is not iterable")
    return value


def _in_this_rank_order(
    saved: dict, saved_names: list[list[str]] | None, mine: list[list[str]] | None
) -> dict:
    """``saved`` (an optimizer ``state_dict``: state by position) with each group's positions
    put in this rank's parameter order. ``load_state_dict`` pairs positions with parameters, and
    a rank may register its parameters in another order than rank 0 (``Scenario.rank_orders``);
    unchanged when the orders agree or the names cannot be matched."""
    if saved_names is None or mine is None or saved_names == mine or not isinstance(saved, dict):
        return saved
    groups = saved.get("param_groups")
    if (
        groups is None
        or len(groups) != len(mine)
        or any(sorted(a) != sorted(b) for a, b in zip(saved_names, mine))
    ):
        return saved
    reordered = []
    for group, names, my_names in zip(groups, saved_names, mine):
        position = dict(zip(names, group["params"]))
        reordered.append({**group, "params": [position[name] for name in my_names]})
    return {**saved, "param_groups": reordered}
