"""Scenario validity before blame: is this a scenario the oracle can judge?

A divergence is blamed on the target, so the scenario must be one in which a correct target
cannot diverge. :func:`check_scenario` probes it once, in the parent, before any world runs, and
raises :class:`ddpcheck.ScenarioError` with one message per cause, naming the cause and the fix:

* the model factory is a zero-argument callable returning an ``nn.Module`` (not a module
  instance, not a class that needs arguments);
* the data function returns ``(inputs, targets)``, two tensors with ``global_batch`` rows, for
  ``(seed, batch, dtype)``;
* the forward on that batch returns ONE tensor the scenario's loss takes (not a tuple or a
  dict): shaped like the targets for a squared error, logits ``(B, L, V)`` for integer target
  tokens ``(B, L)`` under ``loss="token_cross_entropy"`` (``ddpcheck._language.objective``);
* the model is a per-sample function: the whole batch gives the outputs of its two shards at
  world size 2 put together (no batch statistics), the same batch twice gives the same outputs (no
  dropout), and the forward writes no buffer (no running statistics). Ranks train on parts of the
  batch, so without this there is no full-batch reference;
* the optimizer is a ``torch.optim.Optimizer`` that steps without a closure (not LBFGS) and
  accepts the kwargs (built on a dummy tensor).

The probe costs about what one reference step does (the model built, step 0's batch, three
forwards without autograd); a scenario that passes is remembered (by object), so the battery's
scenarios are probed once per process.

What only training shows -- the backward, ``param_groups``, the optimizer on the model's
parameters and its step, later steps' data -- the reference itself exercises right after. When
it fails, :func:`explain_reference_failure` replays its steps with each of those in its own
``try`` block and returns the ScenarioError naming which one failed. Errors are labelled by where
they were raised, never by matching their text.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from ddpcheck._base.errors import ScenarioError
from ddpcheck._language import objective
from ddpcheck._language.messages import (
    active_modules,
    brief,
    code_name,
    describe_value,
    exception_text,
    needs_arguments,
    short_name,
)
from ddpcheck._language.models import ModelSpec
from ddpcheck._language.scenario import (
    Scenario,
    batch_size_of,
    global_batch,
    import_path,
    make_param_groups,
)
from ddpcheck._language.torch_limits import autocast_unavailable
from ddpcheck._oracle.tolerances import TOLERANCES

__all__ = ["check_scenario", "explain_reference_failure"]

_PASSED: dict[int, weakref.ref] = {}  # id(scenario) -> the scenario, for scenarios that passed
_MAX_PASSED = 1024


def check_scenario(scenario: Scenario) -> None:
    """Raise :class:`ScenarioError` when the oracle cannot judge ``scenario`` (see the module
    docstring); return None when it can. Leaves the global CPU random state as it was."""
    seen = _PASSED.get(id(scenario))
    if seen is not None and seen() is scenario:
        return
    with _random_state_kept():
        _probe(scenario)
    try:
        ref = weakref.ref(scenario)
    except TypeError:
        return
    if len(_PASSED) >= _MAX_PASSED:
        _PASSED.clear()
    _PASSED[id(scenario)] = ref


def explain_reference_failure(scenario: Scenario, error: BaseException) -> ScenarioError:
    """The :class:`ScenarioError` for a reference run of ``scenario`` that raised ``error``:
    the reference's steps are replayed with the model, the data function, the backward,
    ``param_groups``, the optimizer and its schedule each in its own ``try`` block, so the
    message names the part that failed."""
    try:
        with _random_state_kept(), torch.enable_grad():
            _train(scenario)
    except ScenarioError as found:
        found.__cause__ = error
        return found
    except Exception:  # not reproduced part by part: the generic message below
        pass
    generic = ScenarioError(
        "the single-process reference of the scenario failed, so there is nothing to compare "
        f"against (no target was involved): {exception_text(error)}"
    )
    generic.__cause__ = error
    return generic


@contextlib.contextmanager
def _random_state_kept() -> Iterator[None]:
    generator = torch.random.default_generator
    state = generator.get_state()
    try:
        yield
    finally:
        generator.set_state(state)


def _probe(scenario: Scenario) -> None:
    limit = scenario.autocast is not None and autocast_unavailable(scenario.autocast)
    if limit:  # torch's own limit: the reference would fail, and no target is to blame
        raise ScenarioError(f"autocast={scenario.autocast}: {limit}")
    cls = _optimizer_class(scenario)
    model = _build(scenario)
    x, y = _data(scenario, 0)
    _optimizer_kwargs(scenario, cls)
    if isinstance(scenario.model, ModelSpec) and scenario.data == scenario.model.data:
        # ddpcheck's own vocabulary: per-sample, deterministic and buffer-read-only by
        # construction (ddpcheck.models; tests/language/test_strategies.py), so the forwards
        # below -- a fifth of a random example's cost in this process -- would find nothing
        with torch.no_grad():
            _forward(scenario, model, x, y)
        return
    with torch.no_grad():
        facts = _Forwards(scenario, model, x, y)
    if facts.random:
        raise ScenarioError(
            f"the model is random per call (dropout?): model={code_name(scenario.model)} gave "
            "different outputs for the same inputs on two forwards"
            f"{active_modules(model, 'dropout')}; "
            "each rank would draw different masks, so no full-batch reference exists; put dropout "
            "in eval mode or set p=0"
        )
    if facts.part_failure is not None or facts.mixing is not None:
        _refuse_batch_dependence(scenario, model, facts)
    if facts.buffers_changed:
        raise ScenarioError(
            f"the model's forward changes its buffers {facts.buffers_changed} (running "
            f"statistics?){active_modules(model, 'batchnorm')}: each rank would update them from "
            "its own shard and micro-batches, the reference from the whole batch, so they cannot "
            "agree; put those layers in eval mode, use track_running_stats=False, or keep forward "
            "from writing buffers"
        )


def _train(scenario: Scenario) -> None:
    """The reference's training loop (``oracle.reference_run``), each part labelled."""
    cls = _optimizer_class(scenario)
    name = import_path(cls)
    model = _build(scenario)
    try:
        groups = make_param_groups(scenario, model)
    except Exception as exc:
        raise ScenarioError(
            f"param_groups={code_name(scenario.param_groups)} raised "
            f"{exception_text(exc)} on the model"
        ) from exc
    try:
        optimizer = cls(groups, **scenario.optimizer_kwargs)
    except Exception as exc:
        raise ScenarioError(
            f"optimizer_kwargs={scenario.optimizer_kwargs!r} were rejected by "
            f"{name} (with the param groups of the model): "
            f"{exception_text(exc)}"
        ) from exc
    scheduler = None
    if scenario.lr_decay is not None:
        try:
            scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, scenario.lr_decay)
        except Exception as exc:
            raise ScenarioError(
                f"lr_decay={scenario.lr_decay!r} (an ExponentialLR schedule) "
                f"cannot drive {name}: {exception_text(exc)}"
            ) from exc
    for step in range(scenario.steps):
        x, y = _data(scenario, step)
        out = _forward(scenario, model, x, y)
        _backward(scenario, model, out, y, step)
        try:
            optimizer.step()
        except Exception as exc:
            raise ScenarioError(
                f"{name}.step() with optimizer_kwargs={scenario.optimizer_kwargs!r} raised "
                f"{exception_text(exc)} at step {step} (a step on the model's gradients, without a "
                "closure)"
            ) from exc
        if scheduler is not None:
            try:
                scheduler.step()
            except Exception as exc:
                raise ScenarioError(
                    f"lr_decay={scenario.lr_decay!r}: the ExponentialLR "
                    f"schedule of {name} raised {exception_text(exc)}"
                ) from exc
        optimizer.zero_grad(set_to_none=scenario.set_to_none)


# ---------------------------------------------------------------------------------------------
# The model factory and the data function


def _build(scenario: Scenario) -> nn.Module:
    factory = scenario.model
    if isinstance(factory, nn.Module):
        raise ScenarioError(
            f"model={brief(factory)} is a module instance, not a factory: every rank and the "
            "reference build their own model by calling model(), so pass a class whose "
            "constructor takes no arguments, or a module-level function returning a new module "
            f"(def make_model(): return {type(factory).__qualname__}(...))"
        )
    if not callable(factory):
        raise ScenarioError(
            f"model={brief(factory)} is not callable; pass a class or a "
            "module-level function returning an nn.Module"
        )
    torch.random.default_generator.manual_seed(scenario.seed)
    try:
        model = factory()
    except Exception as exc:
        if needs_arguments(factory):
            raise ScenarioError(
                f"model={code_name(factory)} cannot be called without arguments "
                f"({exception_text(exc)}): the model factory is called as model(), so pass a "
                "class whose constructor takes no arguments, or a module-level function such as "
                "def make_model(): return "
                f"{short_name(factory)}(...)"
            ) from exc
        raise ScenarioError(
            f"the model factory model={code_name(factory)} raised "
            f"{exception_text(exc)} when called to build the model"
        ) from exc
    if not isinstance(model, nn.Module):
        raise ScenarioError(
            f"model={code_name(factory)} returned {type(model).__name__}, not a torch.nn.Module"
        )
    try:
        model = model.to(scenario.torch_dtype)
        restore = getattr(model, "restore_dtypes", None)
        if callable(restore):
            restore()
    except Exception as exc:
        raise ScenarioError(
            f"the model from model={code_name(factory)} could not be cast to "
            f"dtype={scenario.dtype!r}: {exception_text(exc)}"
        ) from exc
    return model


def _data(scenario: Scenario, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    data, batch, dtype = scenario.data, scenario.global_batch, scenario.torch_dtype
    seed = scenario.seed * 1_000 + step  # as scenario.global_batch draws the step's batch
    if scenario.epochs is not None:  # the dataset, drawn once (ddpcheck._language.epochs)
        seed, batch = scenario.seed * 1_000, scenario.epochs.samples
    try:
        result = data(seed, batch, dtype)
    except Exception as exc:
        if needs_arguments(data, seed, batch, dtype):
            raise ScenarioError(
                f"data={code_name(data)} cannot be called as data(seed, batch, dtype) "
                f"({exception_text(exc)}); the data function receives the step's seed, the "
                "global batch size and the dtype, and returns (inputs, targets)"
            ) from exc
        raise ScenarioError(
            f"the data function data={code_name(data)} raised "
            f"{exception_text(exc)} when called as "
            f"data({seed}, {batch}, {dtype})"
        ) from exc
    if not (
        isinstance(result, (tuple, list))
        and len(result) == 2
        and all(torch.is_tensor(t) for t in result)
    ):
        raise ScenarioError(
            f"data={code_name(data)} returned {describe_value(result)}; it must return "
            "(inputs, targets), two tensors whose first dimension is the batch"
        )
    x, y = result
    if x.dim() == 0 or y.dim() == 0 or x.shape[0] != batch or y.shape[0] != batch:
        raise ScenarioError(
            f"data={code_name(data)} returned inputs of shape {tuple(x.shape)} and targets of "
            f"shape {tuple(y.shape)} for batch={batch}; both need {batch} rows: dimension 0 is "
            "what is split between ranks and micro-batches"
        )
    if scenario.epochs is not None:
        return global_batch(scenario, step)
    return x, y


# ---------------------------------------------------------------------------------------------
# The forward: one tensor like the targets, deterministic, per sample, no buffer writes


def _forward(
    scenario: Scenario, model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """The model's output on ``x``: one tensor the scenario's loss takes with ``y``."""
    try:
        out = model(x)
    except Exception as exc:
        raise ScenarioError(
            f"the forward of model={code_name(scenario.model)} raised {exception_text(exc)} on "
            "the inputs from data="
            f"{code_name(scenario.data)} (shape {tuple(x.shape)}, dtype "
            f"{str(x.dtype).replace('torch.', '')}){active_modules(model, 'batchnorm', hint=True)}"
        ) from exc
    if not torch.is_tensor(out):
        raise ScenarioError(
            f"the model's forward returned {describe_value(out)}, not one tensor: the loss "
            f"({scenario.loss}) takes one output tensor and the targets, so make forward return "
            "only the prediction (for instance a wrapper module whose forward returns its first "
            "output)"
        )
    wrong = objective.check_output(scenario, out, y)
    if wrong is not None:
        raise ScenarioError(f"{wrong} (data={code_name(scenario.data)})")
    return out


class _Forwards:
    """What forwards without autograd find: the output, and each way the model is not a
    per-sample function. Buffers are put back before every forward, so each fact is seen on its
    own."""

    def __init__(self, scenario: Scenario, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
        buffers = [(n, b, b.detach().clone()) for n, b in model.named_buffers()]
        out = _forward(scenario, model, x, y)
        self.buffers_changed = [n for n, b, before in buffers if not _equal(b, before)]
        rtol, atol = _tolerance(model, out)
        reference = out.double()
        floor = (
            atol + rtol * float(reference.abs().nan_to_num(0.0, 0.0, 0.0).max())
            if reference.numel()
            else atol
        )
        self.sizes: list[int] = []
        self.part_failure: tuple[int, Exception] | None = None
        self.mixing: float | None = None
        self.random = False
        if x.shape[0] > 1:  # the two shards of world size 2: sizes every W >= 2 run reaches
            self._parts(model, list(torch.tensor_split(x, 2)), buffers, reference, rtol, floor)
        if x.shape[0] == 1 or self.part_failure is not None or self.mixing is not None:
            # Random, or a function of the batch? The same batch again tells them apart. (When
            # the parts agree, a random model is all but impossible: two draws of masks would
            # have had to agree.)
            _restore(buffers)
            self.random = not _close(model(x), reference, rtol, floor)
        _restore(buffers)

    def _parts(
        self,
        model: nn.Module,
        parts: list,
        buffers: list,
        reference: torch.Tensor,
        rtol: float,
        floor: float,
    ) -> None:
        outputs = []
        for part in parts:
            _restore(buffers)
            self.sizes.append(part.shape[0])
            try:
                outputs.append(model(part))
            except Exception as exc:
                self.part_failure = (part.shape[0], exc)
                return
        if not all(
            torch.is_tensor(o) and o.dim() and o.shape[0] == n for o, n in zip(outputs, self.sizes)
        ):
            self.mixing = float("inf")
            return
        joined = torch.cat([o.double() for o in outputs])
        if joined.shape != reference.shape:
            self.mixing = float("inf")
        elif not _close(joined, reference, rtol, floor):
            self.mixing = float((joined - reference).abs().nan_to_num(float("inf")).max())


def _refuse_batch_dependence(scenario: Scenario, model: nn.Module, facts: _Forwards) -> None:
    batch = batch_size_of(scenario, 0)
    parts = " + ".join(map(str, facts.sizes))
    if facts.part_failure is not None:
        size, exc = facts.part_failure
        how = (
            f"the forward runs on the whole batch of {batch} but raises "
            f"{exception_text(exc)} on a shard of {size} sample{'s' if size > 1 else ''} "
            "(world size 2)"
        )
    elif facts.mixing == float("inf"):
        how = (
            f"the two shards of world size 2 ({parts} samples) give outputs of other shapes "
            "than the whole batch"
        )
    else:
        how = (
            f"forwards on the whole batch of {batch} and on the two shards of world size 2 "
            f"({parts} samples) differ by up to {facts.mixing:.3g}"
        )
    found = active_modules(model, "batchnorm")
    if facts.part_failure is not None and not found:
        raise ScenarioError(
            f"the model cannot run on shards of the batch: {how}; ranks see shards and "
            "micro-batches of the batch, so make forward work on any number of samples"
        )
    raise ScenarioError(
        "the output of a sample depends on the other samples of its batch (batch statistics, "
        f"e.g. BatchNorm in train mode){found}: {how}; data-parallel shards see different "
        "batches, so no full-batch reference exists; use eval mode, GroupNorm/LayerNorm, or "
        "SyncBatchNorm in your own test"
    )


def _tolerance(model: nn.Module, out: torch.Tensor) -> tuple[float, float]:
    """The oracle's per-step tolerance for the model's least precise dtype: outputs closer than
    this are indistinguishable to it, outputs further apart would be blamed on the target."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if out.is_floating_point():
        dtypes.add(out.dtype)
    least = max(dtypes, key=lambda d: torch.finfo(d).eps, default=torch.float64)
    return TOLERANCES.get(least, TOLERANCES[torch.float32])


def _close(got: object, reference: torch.Tensor, rtol: float, floor: float) -> bool:
    if not torch.is_tensor(got) or got.shape != reference.shape:
        return False
    return bool(
        torch.allclose(got.detach().double(), reference, rtol=rtol, atol=floor, equal_nan=True)
    )


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(
        torch.equal(a, b)
        or (a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))
    )


def _restore(buffers: list) -> None:
    with torch.no_grad():
        for _, b, before in buffers:
            b.copy_(before)


# ---------------------------------------------------------------------------------------------
# Backward and the optimizer


def _backward(
    scenario: Scenario, model: nn.Module, out: torch.Tensor, y: torch.Tensor, step: int
) -> None:
    """Back-propagate the loss as the reference does."""
    if not out.requires_grad:
        trainable = sum(p.requires_grad for p in model.parameters())
        raise ScenarioError(
            f"the output of model={code_name(scenario.model)} does not depend on any trainable "
            f"parameter ({trainable} of its parameters require grad): there is no gradient to "
            "synchronise; leave some parameters trainable and used by forward"
        )
    try:
        objective.summed(scenario, out, y).backward()
    except Exception as exc:
        raise ScenarioError(
            f"the backward of the loss through model={code_name(scenario.model)} "
            f"raised {exception_text(exc)} at step {step}"
        ) from exc


def _optimizer_class(scenario: Scenario) -> type[torch.optim.Optimizer]:
    cls = scenario.optimizer
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ScenarioError(
            f"optimizer={cls!r} must be a torch.optim.Optimizer subclass, such as torch.optim.SGD"
        )
    # mypy checks an optimizer's instance __hash__ against Hashable here, not the class's
    if _requires_closure(cls):  # type: ignore[arg-type]
        raise ScenarioError(
            f"optimizer={import_path(cls)} requires a closure (its step(closure) re-evaluates "
            "the loss, like LBFGS); data-parallel training calls optimizer.step() once per step "
            "without one, and so does ddpcheck; use a first-order optimizer such as "
            "torch.optim.SGD, Adam or AdamW"
        )
    return cls


def _optimizer_kwargs(scenario: Scenario, cls: type) -> None:
    """Build the optimizer with the scenario's kwargs on a dummy parameter (2-D: torch.optim.Muon
    takes matrices only)."""
    dummy = torch.zeros(2, 2, dtype=scenario.torch_dtype, requires_grad=True)
    try:
        cls([dummy], **scenario.optimizer_kwargs)
    except Exception as exc:
        raise ScenarioError(
            f"optimizer_kwargs={scenario.optimizer_kwargs!r} were rejected by "
            f"{import_path(cls)}: {exception_text(exc)}"
        ) from exc


@functools.lru_cache(maxsize=64)
def _requires_closure(cls: type[torch.optim.Optimizer]) -> bool:
    try:
        parameters = inspect.signature(cls.step).parameters
    except (TypeError, ValueError):
        return False
    closure = parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty
