"""The one training loop: the ranks, the trace and the single-process reference all train here.

Invariant: :func:`train` runs ``scenario.steps`` steps of the scenario's objective (or the part
``steps`` of them a run resumed from a checkpoint trains) -- per step,
the micro-batches ``loop.batches(step)``, each ``(x, y, scale)`` inside ``loop.micro_batch(index,
count)`` (default: all but the last under ``loop.no_sync()``) back-propagating its
:func:`micro_batch_loss` (the summed terms of the scenario's objective,
``ddpcheck._language.objective``) times its ``scale`` through ``loop.backward`` -- and, in a loop
that ``steps_every_micro_batch`` (accelerate's and DeepSpeed's idiom: the framework gates),
calling ``optimizer.step()``, the LR schedule and ``zero_grad`` after every micro-batch but the
last too, then ``loop.inside_window(step, index)`` (where callers check nothing moved); then
``loop.after_backward()``, when the scenario clips (``max_grad_norm``) the clipping of the now
synchronised gradients, ``loop.before_optimizer_step(step)`` (gradients are final here),
``optimizer.step()``, the LR schedule, ``loop.step_losses(step, losses)`` (each micro-batch's loss
as back-propagated: what the step reports), ``loop.after_step(step)`` (where callers snapshot),
``zero_grad`` (on the given optimizer: a sharded optimizer's own ``zero_grad`` is what runs) and
``loop.end_step(step)``. Because the runner (every rank of a world),
``ddpcheck._runs.trace`` (timed) and the oracle's reference (one process, the whole batch)
share it, what the trace draws and what the reference computes are exactly the steps the oracle
checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import torch
from torch import nn

from ddpcheck._language import objective
from ddpcheck._language.scenario import Scenario, evaluation_set

if TYPE_CHECKING:  # torch.distributed.device_mesh loads when a scenario on a mesh runs
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "EpochRun",
    "FitRun",
    "Loop",
    "MicroBatchLoss",
    "SampleDataset",
    "OptimizerLike",
    "Params",
    "SchedulerLike",
    "evaluation_metric",
    "make_scheduler",
    "micro_batch_loss",
    "optimizer_kwargs",
    "train",
]


#: What an optimizer is built over: the module's parameters, or its param groups
#: (``Scenario.param_groups``), each a dict of its own options as torch's are.
Params: TypeAlias = list[torch.Tensor] | list[dict[str, Any]]


class OptimizerLike(Protocol):
    """An optimizer as the loop drives it and a record reads it: a ``torch.optim.Optimizer``,
    or a framework's own that is none (DeepSpeed's ZeRO optimizer, a gate around one)."""

    @property
    def param_groups(self) -> Sequence[Mapping[str, object]]: ...

    def step(self) -> object: ...

    def zero_grad(self, set_to_none: bool = ...) -> None: ...

    def state_dict(self) -> Mapping[str, object]: ...

    def load_state_dict(self, state_dict: dict[str, object], /) -> None: ...


class SchedulerLike(Protocol):
    """An LR schedule as the loop steps it and a record or a checkpoint reads it: torch's, or a
    framework's wrapper of one (accelerate's ``AcceleratedScheduler``)."""

    def step(self) -> None: ...

    def state_dict(self) -> Mapping[str, object]: ...

    def load_state_dict(self, state_dict: dict[str, object], /) -> None: ...


def _nothing(*_: object) -> None:
    return None


def _backward(loss: torch.Tensor) -> None:
    loss.backward()


@dataclasses.dataclass(frozen=True)
class MicroBatchLoss:
    """One micro-batch's loss as a step back-propagated it: what a training loop prints, logs,
    or all-reduces to report the step's loss (``Target.reported_loss``)."""

    #: the loss back-propagated (detached): the micro-batch's summed terms times ``scale``
    loss: torch.Tensor
    #: its batch plan's scale (``W / T`` for a mean over T terms at W ranks)
    scale: float
    #: ``() ->`` its terms, counted only when :attr:`terms` is read: every step of every example
    #: builds these, and only a loop that reports a per-term mean needs the count
    count: Callable[[], int] = dataclasses.field(repr=False, compare=False)

    @functools.cached_property
    def terms(self) -> int:
        """The terms of the objective it holds: its samples, or its non-padding tokens."""
        return self.count()

    @property
    def summed(self) -> torch.Tensor:
        """The sum of its terms, unscaled."""
        return self.loss / self.scale if self.scale else torch.zeros_like(self.loss)

    @property
    def mean(self) -> torch.Tensor:
        """The mean of its terms: what ``criterion(output, target)`` returns for it."""
        return self.summed / max(self.terms, 1)

    @staticmethod
    def total(losses: Sequence[MicroBatchLoss]) -> torch.Tensor:
        """The step's losses summed: this rank's part of the objective (summed over the ranks
        and divided by W, the step's loss). A rank with no micro-batch: a zero (in torch's
        default dtype), so that it can still join the collectives that report the loss."""
        if not losses:
            return torch.zeros(())
        return torch.stack([m.loss for m in losses]).sum()


@dataclasses.dataclass
class Loop:
    """What differs between the callers of :func:`train`; the defaults are a plain process."""

    #: step -> micro-batches ``(x, y, scale)``: scale multiplies the summed terms of the loss
    batches: Callable[[int], list[tuple[torch.Tensor, torch.Tensor, float]]]
    no_sync: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext  # all but last
    #: ``(index, count) ->`` the context of micro-batch ``index`` of ``count`` (None: ``no_sync``
    #: around all but the last)
    micro_batch: Callable[[int, int], AbstractContextManager[object]] | None = None
    backward: Callable[[torch.Tensor], None] = _backward  # ``loss ->`` back-propagate it
    #: optimizer.step(), the schedule and zero_grad after every micro-batch; the framework gates
    steps_every_micro_batch: bool = False
    inside_window: Callable[[int, int], None] = _nothing  # (step, index) after such a step
    after_backward: Callable[[], None] = _nothing
    #: ``(max_norm, norm_type) ->`` clip the synchronised gradients; only called when the
    #: scenario clips. None: ``torch.nn.utils.clip_grad_norm_`` over the model's parameters.
    clip_grad_norm: Callable[[float, float], object] | None = None
    #: ``(step, norm) ->`` what the clipping returned: the global gradient norm, judged on a mesh
    clipped: Callable[[int, object], None] = _nothing
    before_step: Callable[[int], None] = _nothing  # after the batches are drawn, before forward
    before_optimizer_step: Callable[[int], None] = _nothing  # after after_backward
    after_step: Callable[[int], None] = _nothing  # after optimizer.step and the schedule
    end_step: Callable[[int], None] = _nothing  # after zero_grad
    #: ``(step, losses) ->`` the step's micro-batch losses, after its optimizer step, before
    #: ``after_step``: what a loop prints or reports (``MicroBatchLoss``)
    step_losses: Callable[[int, list[MicroBatchLoss]], None] = _nothing
    #: When a list, (phase, start, end) ``time.perf_counter()`` spans are appended to it.
    phases: list[tuple[str, float, float]] | None = None
    #: True for the single-process reference: it runs the scenario's ``param_dtype`` policy
    #: itself, which in a rank is the target's to implement.
    emulates_param_dtype: bool = False


def micro_batch_loss(
    scenario: Scenario,
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    scale: float,
    *,
    emulate: bool = False,
) -> torch.Tensor:
    """The loss one micro-batch back-propagates: the sum of its terms of the scenario's
    objective, under its precision policy (``emulate``: the reference's ``param_dtype``), times
    ``scale`` (its batch plan's)."""
    return objective.micro_batch_loss(scenario, model, x, y, emulate=emulate) * scale


@dataclasses.dataclass
class FitRun:
    """What a target that owns the whole training loop (``Target.fit(module, run)``: Lightning's
    ``Trainer.fit``) is given, to train the scenario as the reference does.

    ``batches[step]`` are this rank's micro-batches ``(x, y, scale)`` of that step, in order: the
    loss of one is :meth:`loss` (the summed terms of the scenario's objective, under its precision
    policy, times ``scale``), and the step's
    gradient is the sum over its micro-batches. ``params``: what the optimizer gets (parameters,
    or param groups); ``optimizer(params, **optimizer_kwargs)``; ``gamma``: an ``ExponentialLR``
    stepped once per optimizer step (None: no schedule); ``max_grad_norm``/``grad_norm_type``:
    clip the synchronised gradients before each step (None: no clipping); ``set_to_none``: how
    ``zero_grad`` clears. The target calls :attr:`started` once, when model and optimizer are
    built and before the first forward (the initial state is recorded then), and :attr:`record`
    after every optimizer step, once the LR schedule stepped and before ``zero_grad``."""

    scenario: Scenario
    module: nn.Module
    params: Params
    optimizer: type[torch.optim.Optimizer]
    optimizer_kwargs: dict
    gamma: float | None
    max_grad_norm: float | None
    grad_norm_type: float
    set_to_none: bool
    batches: list
    #: ``(model, optimizer) ->`` call once, model and optimizer built, before the first forward
    started: Callable[[nn.Module, OptimizerLike], None]
    #: ``(model, optimizer, scheduler) ->`` call after every optimizer step (and its schedule)
    record: Callable[[nn.Module, OptimizerLike, SchedulerLike | None], None]
    #: ``loss ->`` note a micro-batch's loss that :meth:`loss` computed (the harness's)
    noted: Callable[[MicroBatchLoss], None] = dataclasses.field(default=_nothing, kw_only=True)
    #: ``(value, dtype=None) ->`` the loss the framework reported (logged) for the step last
    #: recorded, and the dtype it was computed in when ``value`` is a number (a framework's
    #: float32 running loss): call it after :attr:`record`, on every rank that reports one.
    #: (Every :meth:`loss` computed between two :attr:`record` calls is noted as that step's:
    #: the ranks' losses summed over W must be the reference's objective.)
    reported: Callable[..., None] = dataclasses.field(default=_nothing, kw_only=True)
    #: ``(model, optimizer) ->`` the step's gradients are final and the framework's optimizer
    #: step will clear them (DeepSpeed's ``engine.step()`` at its accumulation boundary): call
    #: it then, and the harness reads them now for the next :attr:`record` instead of at it
    gradients_ready: Callable[[nn.Module, OptimizerLike], None] = dataclasses.field(
        default=_nothing, kw_only=True
    )
    #: the world's device mesh for a scenario on one (a pipeline's ``(dp, pp)``), else None
    mesh: DeviceMesh | None = dataclasses.field(default=None, kw_only=True)

    @property
    def steps(self) -> int:
        return len(self.batches)

    def loss(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """One micro-batch's loss through ``model``, as the reference computes it (noted as the
        step's: the oracle compares the step's loss with the reference's)."""
        loss = micro_batch_loss(self.scenario, model, x, y, scale)
        counted = functools.partial(objective.count, self.scenario, y)
        self.noted(MicroBatchLoss(loss.detach(), scale, counted))
        return loss


class SampleDataset(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """A scenario's dataset as a framework's ``DataLoader`` reads it: sample ``i`` is
    ``(x[i], y[i], i)``, so that every batch carries the indices it holds and the harness knows
    which samples each rank consumed in each step (collated, ``batch[2]`` is their tensor)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


@dataclasses.dataclass
class EpochRun(FitRun):
    """What a target that runs its framework's own data path (``Target.fit_epochs(module, run)``)
    is given for a scenario with epochs: :class:`FitRun`'s model, optimizer and hooks (its
    ``batches`` empty), the :class:`SampleDataset`, the epochs, ``global_batch`` (B, samples per
    optimizer step across the ranks) and the ``accumulation`` (micro-batches per step, so a
    micro-batch holds ``B / accumulation`` samples across the ranks: per device, that over W --
    or, for a loader that splits batches across ranks, the whole of it).

    The target builds its framework's ``DataLoader`` over :attr:`dataset`, loops over the epochs
    as its documentation shows, computes each micro-batch's loss with :meth:`loss_of` (what a
    user's loop computes: the mean of the micro-batch's terms; it also notes which samples this
    rank consumed in the step) and calls :attr:`record` after every optimizer step. The harness
    judges what the ranks consumed against the epoch's steps (``ddpcheck._language.epochs``), and
    the numbers against the reference."""

    dataset: SampleDataset
    epochs: int
    global_batch: int
    accumulation: int
    world_size: int
    #: ``indices ->`` note the samples of one micro-batch this rank consumed (the harness's)
    consumed: Callable[[list[int]], None]
    #: the evaluation set (``Epochs.evaluation`` samples, ``(x, y, index)`` as :attr:`dataset`);
    #: None: the scenario evaluates nothing
    evaluation: SampleDataset | None = dataclasses.field(default=None, kw_only=True)
    #: the evaluation loader's per-device batch size (``Epochs.evaluation_batch_at``)
    evaluation_batch: int = dataclasses.field(default=1, kw_only=True)
    #: ``(value, dtype=None) ->`` the evaluation metric the framework reported after an epoch
    #: (the mean of the objective's terms over the whole evaluation set, :meth:`metric_of`):
    #: call it after the epoch's last :attr:`record`, on every rank that reports one
    evaluated: Callable[..., None] = dataclasses.field(default=_nothing, kw_only=True)

    @property
    def steps(self) -> int:
        return self.scenario.steps

    def terms_of(self, batch: Sequence[torch.Tensor]) -> int:
        """The terms of the objective a micro-batch ``(x, y, indices)`` holds: its samples, or
        its non-padding tokens under a token loss."""
        return objective.count(self.scenario, batch[1])

    def loss_of(self, model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        """The loss of one micro-batch ``(x, y, indices)`` as a user's loop computes it, the mean
        of its terms of the scenario's objective (under its precision policy); notes the
        samples as consumed in the current step."""
        x, y, indices = batch
        self.consumed([int(i) for i in indices])
        summed = objective.micro_batch_loss(self.scenario, model, x, y)
        return summed / max(objective.count(self.scenario, y), 1)

    def evaluation_terms(self, model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        """Each sample's summed terms of the objective and its number of terms, ``(n, 2)``, for
        one evaluation batch ``(x, y, indices)``, as a user's evaluation loop computes them:
        without gradients, under the precision policy. Gathered across the ranks, each sample
        once, they give the metric (:meth:`metric_of`)."""
        x, y, _ = batch
        with torch.no_grad():
            return objective.sample_terms(
                self.scenario, objective.forward(self.scenario, model, x), y
            )

    @staticmethod
    def metric_of(terms: torch.Tensor) -> torch.Tensor:
        """The metric of per-sample terms ``(n, 2)`` (:meth:`evaluation_terms`, gathered): the
        mean of the objective's terms, each sample counted once."""
        return terms[:, 0].sum() / terms[:, 1].sum()


def evaluation_metric(
    scenario: Scenario, model: nn.Module, *, emulate: bool = False
) -> float | None:
    """The scenario's evaluation metric for ``model`` (None: no evaluation set), as the reference
    computes it: the mean of the objective's terms over the whole evaluation set, in one
    forward without gradients, in eval mode as an evaluation loop runs it (``emulate``: the
    reference's ``param_dtype`` policy)."""
    found = evaluation_set(scenario)
    if found is None:
        return None
    x, y = found
    device = next(model.parameters()).device
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            summed = objective.micro_batch_loss(
                scenario, model, x.to(device), y.to(device), emulate=emulate
            )
    finally:
        model.train(training)
    return float(summed.double()) / max(objective.count(scenario, y), 1)


def optimizer_kwargs(target: object, model: nn.Module, kwargs: dict) -> dict:
    """``kwargs`` for ``target.make_optimizer``, with the wrapped ``model`` added when its
    signature names a ``model`` parameter (a sharded optimizer that must know its DDP); older
    targets' signatures are left as they are."""
    if _takes_model(getattr(type(target), "make_optimizer", None)):
        return {**kwargs, "model": model}
    return dict(kwargs)


@functools.lru_cache(maxsize=256)
def _takes_model(method: Callable[..., object] | None) -> bool:
    """Cached: every rank asks it for every example."""
    if method is None:
        return False
    try:
        return "model" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def make_scheduler(
    scenario: Scenario, optimizer: OptimizerLike
) -> torch.optim.lr_scheduler.ExponentialLR | None:
    """The scenario's LR schedule on ``optimizer`` (None without ``lr_decay``), which must then
    be a ``torch.optim.Optimizer`` (torch's ``TypeError`` otherwise)."""
    if scenario.lr_decay is None:
        return None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")  # as torch says it
    return torch.optim.lr_scheduler.ExponentialLR(optimizer, scenario.lr_decay)


def train(
    scenario: Scenario,
    model: nn.Module,
    optimizer: OptimizerLike,
    loop: Loop,
    *,
    scheduler: SchedulerLike | None = None,
    steps: range | None = None,
) -> None:
    """Train ``model`` with ``optimizer`` on the scenario's steps, as ``loop`` says.

    ``scheduler``: the LR schedule to step (None: :func:`make_scheduler`'s), given by callers
    that record or checkpoint it; ``steps``: a part of the run (default all of it), so that a
    run resumed from a checkpoint continues at the step after it."""
    if scheduler is None:
        scheduler = make_scheduler(scenario, optimizer)
    clock = time.perf_counter
    for step in range(scenario.steps) if steps is None else steps:
        micro_batches = loop.batches(step)
        loop.before_step(step)
        losses: list[MicroBatchLoss] = []
        for i, (x, y, scale) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with _micro_batch(loop, i, len(micro_batches)):
                t0 = clock()
                loss = micro_batch_loss(
                    scenario, model, x, y, scale, emulate=loop.emulates_param_dtype
                )
                t1 = clock()
                loop.backward(loss)
                t2 = clock()
                counted = functools.partial(objective.count, scenario, y)
                losses.append(MicroBatchLoss(loss.detach(), scale, counted))
                if loop.steps_every_micro_batch and not last:  # the framework must not act yet
                    _optimizer_step(scenario, optimizer, scheduler)
                    loop.inside_window(step, i)
            if loop.phases is not None:
                loop.phases += [("forward", t0, t1), ("backward", t1, t2)]
        t3 = clock()
        loop.after_backward()
        if scenario.max_grad_norm is not None:
            loop.clipped(step, _clip(scenario.max_grad_norm, scenario.grad_norm_type, model, loop))
        loop.before_optimizer_step(step)
        t4 = clock()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        t5 = clock()
        if loop.phases is not None:
            loop.phases += [("after_backward", t3, t4), ("optimizer.step", t4, t5)]
        loop.step_losses(step, losses)
        loop.after_step(step)
        optimizer.zero_grad(set_to_none=scenario.set_to_none)
        loop.end_step(step)


def _micro_batch(loop: Loop, index: int, count: int) -> AbstractContextManager[object]:
    if loop.micro_batch is not None:
        return loop.micro_batch(index, count)
    return contextlib.nullcontext() if index == count - 1 else loop.no_sync()


def _optimizer_step(
    scenario: Scenario, optimizer: OptimizerLike, scheduler: SchedulerLike | None
) -> None:
    """What a loop that steps after every micro-batch calls inside an accumulation window."""
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=scenario.set_to_none)


def _clip(max_norm: float, norm_type: float, model: nn.Module, loop: Loop) -> object:
    if loop.clip_grad_norm is None:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    return loop.clip_grad_norm(max_norm, norm_type)
