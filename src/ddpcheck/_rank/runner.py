"""One equivalence example, executed inside every rank of a world.

Invariant: :func:`run_example` is deterministic given (target, scenario, rank, world size): every
rank builds the same model (from a rank-dependent seed when ``scenario.rank_seeds``, so the
target's broadcast from rank 0 is exercised; registered in a rank-dependent order when
``scenario.rank_orders``, so pairing tensors by position is caught), takes the micro-batches of
each global batch that its target's ``shard_batch`` plans (``ddpcheck.batches``; by default
``scenario``'s batch rule), trains through the one loop (``ddpcheck._language.training``) and
records after every step what the oracle compares -- gradients as ``optimizer.step()`` receives them
(after ``after_backward``; after the step instead for a target whose optimizer synchronises
gradients itself, ``Target.gradients_synchronized_in_step``), parameters, buffers and the optimizer
state this rank holds after the step, every collective it issued through ``torch.distributed``, and
the step's batch plan (the oracle checks that the plans weigh every sample as the reference does).

The target's hooks run where a real training loop runs them: ``before_step`` before the step's
first forward, ``no_sync`` around every micro-batch but the last, ``after_backward`` after the last
backward, ``clip_grad_norm`` when the scenario clips, then ``optimizer.step()``,
``optimizer.zero_grad()`` (the target's optimizer's own) and ``after_step``.

A scenario with ``checkpoint_after`` runs in two parts (``run_example``'s ``part``): the steps up
to it, then ``save_checkpoint`` (collective; rank 0's answer leaves as ``torch.save`` bytes); and,
in a fresh run -- possibly at another world size -- everything built anew, ``load_checkpoint``,
and the remaining steps, with the LR scheduler loaded rather than restarted.
"""

from __future__ import annotations

import contextlib
import io
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ddpcheck._base.devices import to_rank_device
from ddpcheck._base.errors import NothingChecked
from ddpcheck._language.batches import BatchPlan, contiguous, global_indices, plan_for
from ddpcheck._language.pipeline_parallel import (
    ND_AXES,
    PIPELINE_AXES,
    held_modules,
    pipeline_shape,
)
from ddpcheck._language.records import (
    RankRecord,
    StepRecord,
    gradients,
    initial_state,
    placements_of,
    schedule_state,
    snapshot,
)
from ddpcheck._language.scenario import (
    Scenario,
    build_model,
    dataset,
    evaluation_set,
    global_batch,
    make_param_groups,
    stage_tp,
)
from ddpcheck._language.tensor_parallel import mesh_shape
from ddpcheck._language.training import (
    EpochRun,
    FitRun,
    Loop,
    MicroBatchLoss,
    OptimizerLike,
    Params,
    SampleDataset,
    SchedulerLike,
    make_scheduler,
    optimizer_kwargs,
    train,
)
from ddpcheck._rank import meshes, recorder
from ddpcheck._rank.orders import ORDER_SEED_STRIDE, permute_registration
from ddpcheck._rank.owned import owned_gradients
from ddpcheck._rank.stages import Stages
from ddpcheck._rank.transport import Packed, pack
from ddpcheck.targets.framework import torch_api_missing
from ddpcheck.targets.protocol import OwnsLoop, Target

__all__ = [
    "StepRecords",
    "checkpoint_from_bytes",
    "checkpoint_to_bytes",
    "fit_data_path",
    "fit_owned_loop",
    "make_optimizer",
    "rank_seed",
    "run_example",
    "run_example_packed",
    "run_warm_up",
    "rank_batches",
    "setup",
    "target_loop",
    "target_scheduler",
]

#: Seed offset between ranks when each rank initialises its own weights differently.
_RANK_SEED_STRIDE = 7919


V = TypeVar("V")


def rank_seed(scenario: Scenario, rank: int) -> int:
    return scenario.seed + (_RANK_SEED_STRIDE * rank if scenario.rank_seeds else 0)


def run_example(
    target: Target, scenario: Scenario, *, part: str = "whole", checkpoint: bytes | None = None
) -> RankRecord | tuple[RankRecord, bytes | None]:
    """Train ``scenario`` under ``target`` on this rank. Collective: runs on every rank.

    ``part``: ``"whole"`` (the record), ``"until checkpoint"`` (steps ``0..checkpoint_after``;
    ``(record, checkpoint)``, the checkpoint as ``torch.save`` bytes on rank 0, None elsewhere)
    or ``"resumed"`` (a fresh run that loads ``checkpoint`` and trains the steps after it)."""
    if part not in ("whole", "until checkpoint", "resumed"):
        raise ValueError(f"part={part!r} must be 'whole', 'until checkpoint' or 'resumed'")
    started = time.perf_counter()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    target = target.configure(scenario)
    # on the rank's device (a CUDA world's), parameters and buffers, before the target wraps it
    module = to_rank_device(build_model(scenario, rank_seed(scenario, rank)))
    if scenario.rank_orders:  # the reference keeps the canonical order; the oracle pairs by name
        permute_registration(module, scenario.seed + ORDER_SEED_STRIDE * (rank + 1))
    plans: dict[int, BatchPlan] = {}
    owned = _owned_loop(target, scenario)
    if owned is not None:  # Lightning's Trainer, say, or a framework's own DataLoader
        if part != "whole":
            raise NothingChecked(
                f"checkpoint: {type(target).__name__} owns its training loop "
                "(Target.fit, Target.fit_epochs), which has no checkpoint round trip; leave "
                "'checkpoint' out of its supported_features"
            )
        return owned(module, scenario, rank, world_size, plans, started)
    module = parallelized(target, module, scenario, world_size)
    model, optimizer = setup(target, module, make_param_groups(scenario, module), scenario)
    # after wrap: FSDP2 replaces them
    names: dict[torch.Tensor, str] = {p: n for n, p in module.named_parameters()}
    scheduler = target_scheduler(target, optimizer, scenario)
    records = StepRecords(target, module, names, plans)
    failed = True
    try:
        steps_run = range(scenario.steps)
        if part == "until checkpoint":
            steps_run = range(_saved_at(scenario, part) + 1)
        elif part == "resumed":
            steps_run = range(_saved_at(scenario, part) + 1, scenario.steps)
            if checkpoint is None:
                raise ValueError("part='resumed' needs the checkpoint rank 0 saved")
            target.load_checkpoint(
                checkpoint_from_bytes(checkpoint), module, model, optimizer, scheduler
            )
        # The state training starts from: once the target has built model *and* optimizer (a
        # wrapper may broadcast when its optimizer is attached), and after a resumed run's load.
        initial = records.initial()

        train(
            scenario,
            model,
            optimizer,
            target_loop(
                target,
                model,
                optimizer,
                scenario,
                rank,
                world_size,
                plans=plans,
                before_step=lambda step: recorder.reset(),
                before_optimizer_step=lambda step: records.gradients(model, optimizer),
                inside_window=lambda step, index: records.inside_window(index),
                step_losses=lambda step, losses: records.step_losses(model, optimizer, losses),
                clipped=lambda step, norm: records.clipped(norm),
                after_step=lambda step: records.step(step, model, optimizer, scheduler),
            ),
            scheduler=scheduler,
            steps=steps_run,
        )
        record = RankRecord(
            rank, initial, records.steps, time.perf_counter() - started, placements_of(module)
        )
        result: RankRecord | tuple[RankRecord, bytes | None] = record
        if part == "until checkpoint":
            saved = target.save_checkpoint(module, model, optimizer, scheduler)
            result = (
                record,
                (checkpoint_to_bytes(saved, type(target).__name__) if rank == 0 else None),
            )
        failed = False
    finally:  # per-example framework state (singletons, meshes, groups), even after a failure
        _teardown(target, model, optimizer, failed)
    return result


OwnedLoop = Callable[[nn.Module, Scenario, int, int, dict[int, BatchPlan], float], RankRecord]


def _owned_loop(target: Target, scenario: Scenario) -> OwnedLoop | None:
    """How ``target`` trains ``scenario`` when it owns the loop: its framework's own data path
    for a scenario with epochs (``Target.fit_epochs``), or its own loop over the harness's
    batches (``Target.fit``); None when the harness's loop drives its hooks."""
    fit_epochs = getattr(target, "fit_epochs", None)
    if scenario.epochs is not None and callable(fit_epochs):
        return lambda *args: fit_data_path(target, fit_epochs, *args)
    if isinstance(target, OwnsLoop) and callable(target.fit):
        return lambda *args: fit_owned_loop(target, target.fit, *args)
    return None


def _saved_at(scenario: Scenario, part: str) -> int:
    """The step after which ``scenario`` saves its checkpoint, which ``part`` needs."""
    if scenario.checkpoint_after is None:
        raise ValueError(
            f"part={part!r} needs a scenario that saves a checkpoint (checkpoint_after=None)"
        )
    return scenario.checkpoint_after


def _teardown(
    target: Target, model: nn.Module | None, optimizer: OptimizerLike | None, failed: bool
) -> None:
    """``target.teardown``; after the example ``failed``, a teardown that raises too is printed
    to the rank's log and the example's own exception goes on: it came first."""
    teardown = getattr(target, "teardown", None)  # duck-typed targets may have none
    if not callable(teardown):
        return
    try:
        teardown(model, optimizer)
    except Exception:
        if not failed:
            raise
        traceback.print_exc()


class StepRecords:
    """What one rank records of a run, step after step, as its target holds it: gradients as
    ``optimizer.step()`` receives them (after it, for ``gradients_synchronized_in_step``; from
    their owners, for ``sharded_gradients``), then everything else after the step."""

    def __init__(
        self,
        target: Target,
        module: nn.Module,
        names: dict[torch.Tensor, str],
        plans: dict[int, BatchPlan],
    ):
        self.target, self.module, self.names, self.plans = target, module, names, plans
        #: a pipeline's: what this rank holds, and how it records the rest (``_rank.stages``)
        self.stages: Stages | None = None
        self.in_step = getattr(target, "gradients_synchronized_in_step", False)
        self.sharded = getattr(target, "sharded_gradients", False)
        self.steps: list[StepRecord] = []
        self.grads: dict[str, torch.Tensor | None] | None = None
        self.window: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.losses: tuple[float, ...] | None = None  # this step's, until it is recorded
        self.reported: tuple[float, str | None] | None = None
        self.grad_norm: float | None = None  # this step's, until it is recorded

    def initial(self) -> dict:
        with recorder.paused():  # the harness's own gathers of sharded tensors aren't the target's
            return self._whole(initial_state(self.module, self.target.full_tensor))

    def _whole(self, values: dict[str, V]) -> dict[str, V]:
        """``values``, a pipeline's modules this rank does not hold taken from their holder."""
        return values if self.stages is None else self.stages.assemble(values)

    def _gradients(
        self, model: nn.Module, optimizer: OptimizerLike
    ) -> dict[str, torch.Tensor | None]:
        with recorder.paused():
            if self.sharded:
                params: list[torch.Tensor] = [p for _, p in self.module.named_parameters()]
                return owned_gradients(
                    self.module, self.target.gradient_shards(model, optimizer, params)
                )
            return self._whole(gradients(self.module, self.target.full_tensor))

    def gradients(self, model: nn.Module, optimizer: OptimizerLike) -> None:
        if not self.in_step:
            self.grads = self._gradients(model, optimizer)

    def inside_window(self, index: int) -> None:
        """After a gated step inside an accumulation window: the parameters, which must not
        have moved (``ddpcheck._oracle.window``)."""
        with recorder.paused(), torch.no_grad():
            self.window.append(
                (
                    index,
                    {
                        n: self.target.full_tensor(p.detach()).clone()
                        for n, p in self.module.named_parameters()
                    },
                )
            )

    def step_losses(
        self, model: nn.Module, optimizer: OptimizerLike, losses: list[MicroBatchLoss]
    ) -> None:
        """The step's micro-batch losses as back-propagated, and the loss the target reports
        from them (``Target.reported_loss``). The loss a loop logs is no part of the gradient
        communication the budget judges, so its collectives are not logged for the step; like
        the harness's own, they still go to the sequence file a hang is diagnosed from."""
        report = getattr(self.target, "reported_loss", None)  # duck-typed targets: none
        with recorder.paused():
            self.losses = tuple(_scalar(self.target.full_tensor(m.loss)) for m in losses)
            reported = report(model, optimizer, losses) if callable(report) else None
            if reported is None:
                return
            if torch.is_tensor(reported):
                reported = self.target.full_tensor(reported.detach())
            who = f"what {type(self.target).__name__}.reported_loss returned"
            self.reported = (_scalar(reported, who), _dtype_of(reported))

    def clipped(self, norm: object) -> None:
        """The norm the target's clipping returned, whole (a DTensor's full value: a collective
        every rank issues alike, so not the target's); anything but a number is not judged."""
        if torch.is_tensor(norm):
            with recorder.paused():
                norm = self.target.full_tensor(norm.detach())
        try:
            self.grad_norm = _scalar(norm)
        except TypeError:
            self.grad_norm = None

    def step(
        self,
        step: int,
        model: nn.Module,
        optimizer: OptimizerLike,
        scheduler: SchedulerLike | None,
    ) -> None:
        collectives = recorder.records()
        grads = self._gradients(model, optimizer) if self.in_step else self.grads
        with recorder.paused():
            self.steps.append(
                snapshot(
                    self.module,
                    self.names,
                    self.target.optimizer_state(optimizer),
                    collectives,
                    grads=grads,
                    gather=self.target.full_tensor,
                    local_shard=self.target.local_shard,
                    schedule=schedule_state(optimizer, scheduler),
                )
            )
        if self.stages is not None:
            with recorder.paused():
                last = self.steps[-1]
                last.params, last.buffers = self._whole(last.params), self._whole(last.buffers)
                last.state = self._whole(last.state)
        self.steps[-1].batch_plan = self.plans.get(step)
        self.steps[-1].window, self.window = self.window, []
        self.steps[-1].losses, self.losses = self.losses, None
        if self.reported is not None:
            self.steps[-1].reported_loss, self.steps[-1].reported_dtype = self.reported
        self.reported = None
        self.steps[-1].grad_norm, self.grad_norm = self.grad_norm, None


def _dtype_of(value: object, given: torch.dtype | None = None) -> str | None:
    """The dtype a reported loss was computed in: a tensor's own, else ``given``."""
    dtype = value.dtype if torch.is_tensor(value) else given
    return None if dtype is None else str(dtype).replace("torch.", "")


def _scalar(value: object, who: str = "a micro-batch's loss") -> float:
    """``value`` -- a one-element tensor or a number -- as a Python float."""
    if torch.is_tensor(value):
        if value.numel() != 1:
            raise TypeError(f"{who} is a tensor of shape {tuple(value.shape)}, not a scalar")
        return float(value.detach().double().reshape(()))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{who} is a {type(value).__name__}, not a tensor or a number")


def parallelized(
    target: Target, module: nn.Module, scenario: Scenario, world_size: int
) -> nn.Module:
    """``module`` with the target's tensor-parallel plan applied over the world's ``(dp, tp)``
    mesh (``Target.parallelize``), for a scenario with ``tensor_parallel``; else ``module``."""
    if scenario.tensor_parallel is None:
        return module
    dp, tp = mesh_shape(scenario.tensor_parallel, world_size)
    parallelize = getattr(target, "parallelize", None)
    if not callable(parallelize):
        raise NothingChecked(
            f"tensor-parallel: {type(target).__name__} has no parallelize(module, mesh) hook"
        )
    done = parallelize(module, meshes.mesh(dp, tp))
    if not isinstance(done, nn.Module):
        raise TypeError(
            f"{type(target).__name__}.parallelize(module, mesh) returned "
            f"{type(done).__name__}, not the nn.Module"
        )
    return done


def setup(
    target: Target, module: nn.Module, params: Params, scenario: Scenario
) -> tuple[nn.Module, OptimizerLike]:
    """``(model, optimizer)`` from ``target.setup`` (a duck-typed target without one: ``wrap``
    then :func:`make_optimizer`)."""
    build = getattr(target, "setup", None)
    if callable(build):
        return build(module, params, scenario.optimizer, **scenario.optimizer_kwargs)
    model = target.wrap(module)
    return model, make_optimizer(target, model, params, scenario)


def target_scheduler(
    target: Target, optimizer: OptimizerLike, scenario: Scenario
) -> SchedulerLike | None:
    """The scenario's LR schedule as the target builds it (``Target.make_scheduler``)."""
    if scenario.lr_decay is None:
        return None
    build = getattr(target, "make_scheduler", None)
    if not callable(build):
        return make_scheduler(scenario, optimizer)
    return build(optimizer, scenario.lr_decay)


class _OwnedRecords:
    """What a target that owns its loop reports through ``run.started`` and ``run.record``
    (``training.FitRun``), recorded as the harness's loop records it. ``bounded``: a call of
    ``run.record`` beyond the scenario's steps is the target's misuse (``Target.fit``); in a
    framework's own data path it is a step the framework took, for the oracle to judge."""

    def __init__(
        self,
        target: Target,
        module: nn.Module,
        scenario: Scenario,
        plans: dict[int, BatchPlan],
        bounded: bool,
    ):
        names: dict[torch.Tensor, str] = {p: n for n, p in module.named_parameters()}
        self.target, self.scenario, self.bounded = target, scenario, bounded
        self.records = StepRecords(target, module, names, plans)
        self.initial: list[dict] = []
        #: (model, optimizer) that run.started was given
        self.seen: list[tuple[nn.Module, OptimizerLike]] = []
        self.consumed: list[tuple[int, ...]] = []  # this step's micro-batches, as consumed
        self.noted: list[MicroBatchLoss] = []  # this step's losses, as run.loss computed them
        self.kept = False  # this step's gradients read already (run.gradients_ready)

    def started(self, model: nn.Module, optimizer: OptimizerLike) -> None:
        if self.initial:
            raise RuntimeError(f"{type(self.target).__name__} called run.started twice")
        # by name as the target built them: FSDP2 replaces the parameters it shards
        self.records.names = {p: n for n, p in self.records.module.named_parameters()}
        self.initial.append(self.records.initial())
        self.seen.append((model, optimizer))
        self.noted.clear()  # a forward before training (a sanity check) is no step's loss
        recorder.reset()

    def consume(self, indices: list[int]) -> None:
        self.consumed.append(tuple(indices))

    def gradients_ready(self, model: nn.Module, optimizer: OptimizerLike) -> None:
        """The step's gradients, read before the framework's step clears them
        (``FitRun.gradients_ready``)."""
        self.records.gradients(model, optimizer)
        self.kept = True

    def record(
        self, model: nn.Module, optimizer: OptimizerLike, scheduler: SchedulerLike | None
    ) -> None:
        step = len(self.records.steps)
        if not self.initial or (self.bounded and step >= self.scenario.steps):
            raise RuntimeError(
                f"{type(self.target).__name__} called run.record "
                + (
                    "before run.started"
                    if not self.initial
                    else f"more often than the scenario's {self.scenario.steps} step(s)"
                )
            )
        if not self.kept:
            self.records.gradients(model, optimizer)
        self.kept = False
        if self.noted:  # what the target computed through run.loss (not a framework's own)
            losses = list(self.noted)
            self.noted.clear()
            self.records.step_losses(model, optimizer, losses)
        self.records.step(step, model, optimizer, scheduler)
        if not self.bounded:
            self.records.steps[-1].consumed, self.consumed = tuple(self.consumed), []
        recorder.reset()

    def reported(self, value: object, dtype: torch.dtype | None = None) -> None:
        """The loss the framework reported for the step recorded last (``FitRun.reported``)."""
        if not self.records.steps:
            raise RuntimeError(
                f"{type(self.target).__name__} called run.reported before any run.record"
            )
        who = f"{type(self.target).__name__}'s reported loss"
        last = self.records.steps[-1]
        last.reported_loss, last.reported_dtype = _scalar(value, who), _dtype_of(value, dtype)

    def evaluated(self, value: object, dtype: torch.dtype | None = None) -> None:
        """The evaluation metric the framework reported after the step recorded last (an
        epoch's last: ``EpochRun.evaluated``). The evaluation's collectives -- its gathers, a
        forward's buffer broadcast -- ran since that step's record and are no part of the next
        step's gradient communication, which the budget judges: they are dropped from it (the
        sequence file a hang is diagnosed from still holds them)."""
        if not self.records.steps:
            raise RuntimeError(
                f"{type(self.target).__name__} called run.evaluated before any run.record"
            )
        who = f"{type(self.target).__name__}'s evaluation metric"
        last = self.records.steps[-1]
        last.metric, last.metric_dtype = _scalar(value, who), _dtype_of(value, dtype)
        recorder.reset()

    def fit(self, fit: Callable[[], None]) -> None:
        """Run ``fit``, then the target's teardown (on what run.started was given)."""
        failed = True
        try:
            fit()
            failed = False
        finally:
            model, optimizer = self.seen[0] if self.seen else (None, None)
            _teardown(self.target, model, optimizer, failed)

    def rank_record(self, rank: int, started: float) -> RankRecord:
        if not self.initial:
            raise RuntimeError(f"{type(self.target).__name__} never called run.started")
        return RankRecord(rank, self.initial[0], self.records.steps, time.perf_counter() - started)


def _run_fields(scenario: Scenario, module: nn.Module, owned: _OwnedRecords) -> dict[str, Any]:
    """The fields :class:`FitRun` and :class:`EpochRun` share: the scenario's model, optimizer,
    schedule and clipping, and the harness's callbacks."""
    return dict(
        scenario=scenario,
        module=module,
        params=make_param_groups(scenario, module),
        optimizer=scenario.optimizer,
        optimizer_kwargs=dict(scenario.optimizer_kwargs),
        gamma=scenario.lr_decay,
        max_grad_norm=scenario.max_grad_norm,
        grad_norm_type=scenario.grad_norm_type,
        set_to_none=scenario.set_to_none,
        started=owned.started,
        record=owned.record,
        noted=owned.noted.append,
        reported=owned.reported,
        gradients_ready=owned.gradients_ready,
    )


def fit_owned_loop(
    target: Target,
    fit: Callable[[nn.Module, FitRun], None],
    module: nn.Module,
    scenario: Scenario,
    rank: int,
    world_size: int,
    plans: dict[int, BatchPlan],
    started: float,
) -> RankRecord:
    """Run a target that owns its loop (``Target.fit(module, run)``) on this rank's batches,
    recording when it calls ``run.started`` and ``run.record`` (``training.FitRun``)."""
    batches = rank_batches(target, scenario, rank, world_size, plans)
    owned = _OwnedRecords(target, module, scenario, plans, bounded=True)
    mesh = None
    if scenario.pipeline is not None:  # the stages follow the scenario, the mesh the world
        tp = stage_tp(scenario)  # (dp, pp, tp) when the stages are tensor-parallel
        dp, pp = pipeline_shape(scenario.pipeline, world_size, tp)
        nd = scenario.tensor_parallel is not None
        mesh = meshes.grid((dp, pp, tp), ND_AXES) if nd else meshes.mesh(dp, pp, PIPELINE_AXES)
        held = held_modules(scenario.pipeline, scenario.model, rank // tp % pp, pp)
        owned.records.stages = Stages(held, mesh.get_group("pp"))
    run = FitRun(
        **_run_fields(scenario, module, owned),
        batches=[batches(step) for step in range(scenario.steps)],
        mesh=mesh,
    )
    owned.fit(lambda: fit(module, run))
    if len(owned.records.steps) != scenario.steps:
        raise RuntimeError(
            f"{type(target).__name__}.fit recorded {len(owned.records.steps)} of the "
            f"scenario's {scenario.steps} step(s): call run.record after every "
            "optimizer step"
        )
    return owned.rank_record(rank, started)


def fit_data_path(
    target: Target,
    fit_epochs: Callable[[nn.Module, EpochRun], None],
    module: nn.Module,
    scenario: Scenario,
    rank: int,
    world_size: int,
    plans: dict[int, BatchPlan],
    started: float,
) -> RankRecord:
    """Run a target through its framework's own data path (``Target.fit_epochs(module, run)``)
    over the scenario's dataset, recording what each step consumed and the evaluation metric it
    reports after each epoch: how many steps the framework took, which samples, and what it
    evaluated, is the oracle's to judge (``training.EpochRun``)."""
    owned = _OwnedRecords(target, module, scenario, plans, bounded=False)
    evaluation = evaluation_set(scenario)
    run = EpochRun(
        **_run_fields(scenario, module, owned),
        batches=[],
        dataset=SampleDataset(*(to_rank_device(t) for t in dataset(scenario))),
        epochs=scenario.epochs.epochs if scenario.epochs is not None else 1,
        global_batch=scenario.global_batch,
        accumulation=scenario.accumulation,
        world_size=world_size,
        consumed=owned.consume,
        evaluation=None
        if evaluation is None
        else SampleDataset(*(to_rank_device(t) for t in evaluation)),
        evaluation_batch=1
        if scenario.epochs is None
        else scenario.epochs.evaluation_batch_at(
            scenario.global_batch, scenario.accumulation, world_size
        ),
        evaluated=owned.evaluated,
    )
    owned.fit(lambda: fit_epochs(module, run))
    return owned.rank_record(rank, started)


def checkpoint_to_bytes(checkpoint: object, who: str) -> bytes:
    """Rank 0's checkpoint as bytes: a copy taken now (a state dict aliases live tensors), and
    what a real checkpoint goes through on its way to a file."""
    if checkpoint is None:
        raise TypeError(
            f"{who}.save_checkpoint(module, model, optimizer, scheduler) returned "
            "None on rank 0; it must return the checkpoint there"
        )
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return buffer.getvalue()


def checkpoint_from_bytes(data: bytes) -> object:
    # weights_only=False: the bytes are rank 0's own checkpoint of this example, which may hold
    # more than tensors and numbers (whatever the target's save_checkpoint returned)
    return torch.load(io.BytesIO(data), weights_only=False)


def rank_batches(
    target: Target,
    scenario: Scenario,
    rank: int,
    world_size: int,
    plans: dict[int, BatchPlan] | None = None,
) -> Callable[[int], list[tuple[torch.Tensor, torch.Tensor, float]]]:
    """step -> this rank's micro-batches ``(x, y, scale)``, as its target plans them; each
    step's plan is stored in ``plans`` when given."""
    who = f"{type(target).__name__}.shard_batch"
    hook = getattr(target, "shard_batch", contiguous)  # a duck-typed target: the batch rule

    def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
        x, y = global_batch(scenario, step)
        plan = plan_for(hook, global_indices(scenario, step, rank, world_size, y), who)
        if plans is not None:
            plans[step] = plan
        return to_rank_device(
            [
                (*_select(x, y, indices), scale)
                for indices, scale in zip(plan.micro_batches, plan.scales)
            ]
        )

    return batches


def target_loop(
    target: Target,
    model: nn.Module,
    optimizer: OptimizerLike,
    scenario: Scenario,
    rank: int,
    world_size: int,
    plans: dict[int, BatchPlan] | None = None,
    **hooks: Any,  # more of Loop's fields, each of its own type
) -> Loop:
    """The loop of one rank: the micro-batches its target plans (:func:`rank_batches`), the
    target's hooks where a real training loop calls them (``hooks`` add to them:
    ``before_step`` runs before the target's own); each step's plan is stored in ``plans`` when
    given."""
    first = hooks.pop("before_step", None)
    batches = rank_batches(target, scenario, rank, world_size, plans)

    def before_step(step: int) -> None:
        if first is not None:
            first(step)
        target.before_step(model, optimizer)

    micro_batch = getattr(target, "micro_batch", None)  # duck-typed targets: no_sync
    backward = getattr(target, "backward", None)
    return Loop(
        batches=batches,
        no_sync=lambda: target.no_sync(model),
        micro_batch=None
        if micro_batch is None
        else lambda index, count: micro_batch(model, optimizer, index, count),
        backward=(lambda loss: loss.backward())
        if backward is None
        else lambda loss: backward(model, loss),
        steps_every_micro_batch=getattr(target, "steps_every_micro_batch", False),
        after_backward=lambda: target.after_backward(model, optimizer),
        clip_grad_norm=lambda max_norm, norm_type: target.clip_grad_norm(
            model, optimizer, max_norm, norm_type
        ),
        before_step=before_step,
        end_step=lambda step: target.after_step(model, optimizer),
        **hooks,
    )


def _select(
    x: torch.Tensor, y: torch.Tensor, indices: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples ``indices`` of ``(x, y)``: a view for a contiguous run (what ``tensor_split``
    gives, so the default plan computes bit for bit as before), else a gathered copy."""
    start = indices[0] if indices else 0
    if indices == tuple(range(start, start + len(indices))):
        return x[start : start + len(indices)], y[start : start + len(indices)]
    at = torch.tensor(indices, dtype=torch.long)
    return x.index_select(0, at), y.index_select(0, at)


def make_optimizer(
    target: Target, model: nn.Module, params: Params, scenario: Scenario
) -> OptimizerLike:
    """``target.make_optimizer``, given the wrapped model when it takes a ``model`` keyword
    (``ddpcheck._language.training.optimizer_kwargs``)."""
    return target.make_optimizer(
        params, scenario.optimizer, **optimizer_kwargs(target, model, scenario.optimizer_kwargs)
    )


def run_example_packed(
    target: Target, scenario: Scenario, part: str = "whole", checkpoint: bytes | None = None
) -> Packed[RankRecord | tuple[RankRecord, bytes | None]]:
    """:func:`run_example`, its tensors packed for a fast trip to the parent
    (``ddpcheck._rank.transport.unpack`` restores the record)."""
    with _glue_failures(target):
        return pack(run_example(target, scenario, part=part, checkpoint=checkpoint))


def run_warm_up(target: Target) -> None:
    """``target.warm_up()``, a task of its own: what a framework does once per process
    (``Target.warm_up``), outside any example's deadline."""
    with _glue_failures(target):
        target.warm_up()


@contextlib.contextmanager
def _glue_failures(target: Target) -> Iterator[None]:
    """An exception that ddpcheck's own glue raised (``FrameworkTarget.glue_failure`` says which,
    ``ddpcheck.targets.framework``) leaves the block as that outcome, an ``InternalError`` that
    ``serve`` answers as "refused" -- never as the target's failure; so does an API the
    installed torch lacks (``torch_api_missing``: a ``SetupError``), for any target."""
    try:
        yield
    except Exception as exc:
        missing = torch_api_missing(target, exc)  # the installed torch lacks an API: exit 2
        if missing is not None:
            raise missing from None
        judge = getattr(target, "glue_failure", None)
        own = judge(exc) if callable(judge) else None
        if own is None:
            raise
        raise own from None
