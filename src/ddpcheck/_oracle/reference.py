"""The single-process full-batch reference every target is held to.

Invariant: :func:`reference_run` trains the scenario in this process through the same loop as the
ranks (``ddpcheck._language.training``), on the whole global batch, with the plain optimizer and
rank 0's initial weights: one backward of the global objective per step (the scenario's loss and
precision policy, ``ddpcheck._language.objective``, its ``param_dtype`` policy emulated here as a
rank's target implements it). What it records is what a correct data-parallel target must reproduce;
the budgets a target's communication is held to are derived from the same model. A scenario with
``checkpoint_after`` trains uninterrupted, except that the gradients are dropped after that step, as
a run resumed from a checkpoint has none.
After an epoch's last step of a scenario with an evaluation set it records the evaluation metric
of its own model (``StepRecord.metric``: ``training.evaluation_metric``).

What the reference cannot pin down (:meth:`Reference.noise`): the same run computed in other,
equally valid ways -- :data:`NOISE_VARIANTS`: the global batch accumulated in 2, 3, 4 and 5
micro-batches (the summation orders accumulation and shards introduce); emulated worlds of 3 and 5
ranks, each shard's loss scaled by ``W/T`` and the gradient divided back by W or multiplied by
``1/W`` (the rounding data-parallel code introduces even when the batch cannot be re-split: one
sample at W=3 is its loss scaled by 3 and its gradient divided by 3, a rounding at every float32
layer its backward crosses); the gradients perturbed at rounding level, in each parameter's
own dtype, before every optimizer step; and under a ``param_dtype`` policy
(:data:`PARAM_DTYPE_VARIANTS`) the float32 masters started from their ``param_dtype`` copies, as
DeepSpeed's bf16 mode starts them -- differs from it by rounding. Where the scenario is
ill-conditioned that rounding is not small: a gradient that is zero in exact arithmetic (an
attention key bias: softmax ignores a shift shared by every logit) carries ~1e-16 of
sign-flipping noise, and Adam's first step, ``lr * g / (|g| + eps)``, has a sensitivity of
``lr / eps`` there, turning it into ~1e-9 parameter differences in float64 -- more than any fixed
float64 tolerance. The oracle widens its tolerance element by element by a multiple of this
spread, or declines the example where the spread is as large as the bugs it promises to catch
(``ddpcheck._oracle.tolerances``, ``ddpcheck._oracle.compare``); the variants
are trained only when a comparison would otherwise fail, so passing examples never pay for them.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ddpcheck._language.epochs import ends_epoch
from ddpcheck._language.objective import count, tokens
from ddpcheck._language.records import (
    StepRecord,
    gradients,
    initial_state,
    schedule_state,
    snapshot,
)
from ddpcheck._language.scenario import Scenario, build_model, global_batch, make_param_groups
from ddpcheck._language.training import Loop, evaluation_metric, make_scheduler, train

__all__ = [
    "NOISE_VARIANTS",
    "PARAM_DTYPE_VARIANTS",
    "Noise",
    "Reference",
    "Variant",
    "noise_computed",
    "noise_variants",
    "reference_run",
]

#: References of this process whose :meth:`Reference.noise` was computed -- a comparison beyond
#: the tolerance asked for it (``bench/soak.py`` reports how often; see :func:`noise_computed`).
_NOISE_COMPUTED = [0]


def noise_computed() -> int:
    """How many references of this process have computed their noise variants so far."""
    return _NOISE_COMPUTED[0]


@dataclasses.dataclass(frozen=True)
class Variant:
    """One equally valid way to compute the reference's run: each step's global batch accumulated
    in ``split`` contiguous micro-batches (as ``torch.tensor_split`` cuts them; empty ones
    skipped), each micro-batch's summed loss scaled by ``world / T`` (``world`` for a summed
    objective), and after the last backward every gradient divided by ``world`` --
    multiplied by ``1 / world`` when ``reciprocal``, as torch's DDP reducer does -- then, when
    ``perturb`` is a seed, each element moved by a random fraction in [-1, 1] of its dtype's
    rounding unit (``finfo.eps / 2``), drawn from that seed and the step. ``rounded_masters``:
    under a ``param_dtype`` policy, the float32 master weights start from their ``param_dtype``
    copies, as DeepSpeed's bf16 mode builds them (it casts the module, then copies the cast
    parameters into float32 masters): the policy does not say which, and a forward on
    low-precision copies turns that rounding into an ulp of difference wherever a weight lies
    near a rounding boundary."""

    split: int = 1
    world: int = 1
    reciprocal: bool = False
    perturb: int | None = None
    rounded_masters: bool = False
    #: under a ``param_dtype`` policy, a seed: every step's low-precision copies taken from the
    #: masters each moved by a random fraction in [-1/2, 1/2] of its ``param_dtype`` step (the
    #: masters themselves untouched), so a copy lands one step apart wherever its weight lies
    #: within that fraction of a rounding boundary -- what any framework whose copies are
    #: rounded, kept or updated otherwise than the reference's may do. The spread it measures is
    #: each number's sensitivity to a step of the operands it is computed from.
    nudge: int | None = None


#: The other ways :meth:`Reference.noise` computes the run (see the module docstring): the batch
#: summed in other orders (accumulation at W=1), worlds of 3 and 5 ranks -- non-powers of two,
#: whose scaling rounds (shards scaled ``W/T``, averaged by a division or, in torch's DDP, by a
#: multiplication by ``1/W``; with fewer samples than ranks, the empty ranks add zeros, exactly)
#: -- and the gradients perturbed at rounding level.
NOISE_VARIANTS = (
    Variant(2),
    Variant(3),
    Variant(4),
    Variant(5),
    Variant(3, world=3),
    Variant(6, world=3, reciprocal=True),
    Variant(5, world=5, reciprocal=True),
    Variant(perturb=0),
)
#: Added to :data:`NOISE_VARIANTS` under a ``param_dtype`` policy.
PARAM_DTYPE_VARIANTS = (
    Variant(rounded_masters=True),
    Variant(nudge=1),
    Variant(nudge=2),
)


@dataclasses.dataclass
class Noise:
    """Per tensor of one step, the largest elementwise difference between the reference and its
    variants (:data:`NOISE_VARIANTS`): gradients, parameters, buffers, optimizer state (keyed as
    ``name[key]``)."""

    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    #: the step's loss (the objective over the global batch before the step)
    loss: float = 0.0
    #: the evaluation metric after the step (at an epoch's end; else 0)
    metric: float = 0.0
    #: the global gradient norm the step's clipping returned (0 where it does not clip)
    grad_norm: float = 0.0


@dataclasses.dataclass
class Reference:
    initial: dict[str, torch.Tensor]  # parameters and buffers before the first step
    steps: list[StepRecord]
    gradient_bytes: int  # bytes of all trainable parameters' gradients: the all-reduce budget
    gradient_numel: int  # their elements: more bytes than this in as many elements is widening
    n_dtypes: int  # parameter dtypes: the broadcast budget is W x n_dtypes
    #: the least precise dtype the model computes in -- its parameters', the scenario's autocast
    #: or param_dtype: it sets the tolerance
    compute_dtype: torch.dtype
    #: Scalars a target may all-reduce per step besides the gradients when the scenario clips: a
    #: sharded global norm (one per parameter dtype at most); 0 without clipping.
    norm_scalars: int = 0
    #: Trainable parameter tensors: the budget allows a scalar per tensor for control traffic
    #: (which parameters have a gradient on each rank, per-tensor norms) in any float dtype.
    trainable_tensors: int = 0
    #: Trainable parameters by name: ``(shape, bytes per element)`` -- the padding a target that
    #: shards them along dim 0 (FSDP2) may reduce-scatter on top of their bytes (``budget``).
    trainable_shapes: dict = dataclasses.field(default_factory=dict)
    #: Bytes of all parameters: what a ZeRO-style re-gather of updated parameters may all-gather.
    parameter_bytes: int = 0
    #: The scenario, to train the variants of :meth:`noise` on demand (None: no noise floor).
    scenario: Scenario | None = None
    #: step -> its :class:`Noise`, filled on first use; shared by the parts a resumed run's
    #: judgement slices this reference into (``dataclasses.replace`` keeps the same dict).
    noise_cache: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    #: the narrowest gradient dtype: a gradient all-reduced or reduce-scattered in a narrower one
    #: was sent narrower than promised (``ddpcheck._oracle.budget``)
    gradient_dtype: torch.dtype | None = None

    def noise(self, step: int) -> Noise | None:
        """What the reference cannot pin down after ``step`` (0-based, of the whole run): see
        the module docstring. None without a scenario."""
        if self.scenario is None:
            return None
        if not self.noise_cache:
            _NOISE_COMPUTED[0] += 1
            # the whole run again (this reference may be a part of it), then the variants
            mine = _train(self.scenario)[0]
            variants = [
                _train(self.scenario, variant)[0] for variant in noise_variants(self.scenario)
            ]
            for index, record in enumerate(mine):
                others = [v[index] for v in variants]
                grads, params, buffers = (
                    _spread(getattr(record, f), [getattr(o, f) for o in others])
                    for f in ("grads", "params", "buffers")
                )
                self.noise_cache[index] = Noise(
                    grads,
                    params,
                    buffers,
                    _spread(_flat_state(record.state), [_flat_state(o.state) for o in others]),
                    max((abs(_loss(o) - _loss(record)) for o in others), default=0.0),
                    max((abs(_metric(o) - _metric(record)) for o in others), default=0.0),
                    max(
                        (abs((o.grad_norm or 0.0) - (record.grad_norm or 0.0)) for o in others),
                        default=0.0,
                    ),
                )
        return self.noise_cache.get(step)


def noise_variants(scenario: Scenario) -> tuple[Variant, ...]:
    """The variants :meth:`Reference.noise` trains for ``scenario``."""
    if getattr(scenario, "param_dtype", None) is None:
        return NOISE_VARIANTS
    return NOISE_VARIANTS + PARAM_DTYPE_VARIANTS


def _drop_gradients(model: torch.nn.Module) -> None:
    """A checkpoint carries no gradients: a resumed run starts with none, even where the
    scenario keeps them (``set_to_none=False``) -- and an optimizer skips a parameter whose
    gradient is None but steps (decays, moves with momentum) one whose gradient is zero."""
    for p in model.parameters():
        p.grad = None


def reference_run(scenario: Scenario) -> Reference:
    """Train the scenario in this process on the whole batch: the plain optimizer, rank 0's
    initial weights, one backward per step of the global objective."""
    steps, model, initial = _train(scenario)
    trainable = [p for p in model.parameters() if p.requires_grad]
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    # a float64 layer fed by a float32 one inherits float32 rounding; autocast and param_dtype
    # compute in theirs
    computed = dtypes | {d for d in (scenario.autocast, scenario.param_dtype) if d is not None}
    return Reference(
        initial,
        steps,
        gradient_bytes=sum(p.numel() * p.element_size() for p in trainable),
        gradient_numel=sum(p.numel() for p in trainable),
        n_dtypes=len(dtypes) or 1,
        norm_scalars=(len(dtypes) or 1) if scenario.max_grad_norm is not None else 0,
        trainable_tensors=len(trainable),
        trainable_shapes={
            n: (tuple(p.shape), p.element_size())
            for n, p in model.named_parameters()
            if p.requires_grad
        },
        parameter_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        compute_dtype=max(computed, key=lambda d: torch.finfo(d).eps, default=scenario.torch_dtype),
        gradient_dtype=min(
            (p.dtype for p in trainable if p.is_floating_point()),
            key=lambda d: torch.finfo(d).bits,
            default=None,
        ),
        scenario=scenario,
    )


def _train(
    scenario: Scenario, variant: Variant = Variant()
) -> tuple[list[StepRecord], torch.nn.Module, dict]:
    """The reference's run, computed as ``variant`` says (the default: one backward of the whole
    batch, each term scaled by the whole batch's term count)."""
    model = build_model(scenario, scenario.seed)
    if variant.rounded_masters and scenario.param_dtype is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point():
                    p.copy_(p.to(scenario.param_dtype))
    names: dict[torch.Tensor, str] = {p: n for n, p in model.named_parameters()}
    initial = initial_state(model)
    optimizer = scenario.optimizer(make_param_groups(scenario, model), **scenario.optimizer_kwargs)
    scheduler = make_scheduler(scenario, optimizer)
    steps: list[StepRecord] = []
    grads: dict = {}
    terms: dict = {}
    losses: dict = {}
    norms: dict = {}

    def batches(step: int) -> list:
        if variant.nudge is not None and scenario.param_dtype is not None:
            grads["masters"] = _nudge(model, scenario.param_dtype, variant.nudge, step)
        x, y = global_batch(scenario, step)
        terms[step] = tokens(scenario, y)
        scale = (
            variant.world / count(scenario, y)
            if scenario.reduction == "mean"
            else float(variant.world)
        )
        grads["step"] = step
        return [
            (xs, ys, scale)
            for xs, ys in zip(
                torch.tensor_split(x, variant.split), torch.tensor_split(y, variant.split)
            )
            if len(xs)
        ]

    def record(step: int) -> None:
        steps.append(
            snapshot(
                model,
                names,
                optimizer.state,
                grads=grads["now"],
                schedule=schedule_state(optimizer, scheduler),
            )
        )
        steps[-1].tokens = terms[step]
        # the step's loss: what a correct target reports, the objective over the global batch
        steps[-1].losses = losses[step]
        steps[-1].reported_loss = math.fsum(losses[step]) / variant.world
        steps[-1].grad_norm = norms.get(step)  # what clip_grad_norm_ returned, if it clips
        # an epoch's end: the evaluation set's metric, this model's (what a target must report)
        if scenario.epochs is not None and ends_epoch(scenario.epochs, scenario.global_batch, step):
            steps[-1].metric = evaluation_metric(scenario, model, emulate=True)

    train(
        scenario,
        model,
        optimizer,
        Loop(
            batches=batches,
            after_backward=lambda: _restore_average_and_perturb(
                model, variant, grads["step"], grads.pop("masters", None)
            ),
            before_optimizer_step=lambda step: grads.__setitem__("now", gradients(model)),
            step_losses=lambda step, done: losses.__setitem__(
                step, tuple(float(m.loss.double()) for m in done)
            ),
            clipped=lambda step, norm: norms.__setitem__(step, float(norm)),  # type: ignore[arg-type]
            after_step=record,
            end_step=lambda step: (
                _drop_gradients(model) if step == scenario.checkpoint_after else None
            ),
            emulates_param_dtype=True,
        ),
        scheduler=scheduler,
    )
    return steps, model, initial


def _nudge(model: torch.nn.Module, dtype: torch.dtype, seed: int, step: int) -> list:
    """Each floating master moved by a seeded random fraction in [-1/2, 1/2] of its step in
    ``dtype`` (:attr:`Variant.nudge`); returns the masters as they were, for :func:`_restore`."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    kept = []
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_floating_point():
                continue
            kept.append((p, p.detach().clone()))
            magnitude = p.detach().double().abs().clamp(min=torch.finfo(dtype).tiny)
            spacing = torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(magnitude)))
            u = torch.rand(p.shape, generator=generator, dtype=torch.float64) - 0.5
            p.add_((u * spacing).to(p.dtype))
    return kept


def _restore_average_and_perturb(
    model: torch.nn.Module, variant: Variant, step: int, kept: list | None
) -> None:
    """The masters :func:`_nudge` moved put back (the gradients stay those of the moved copies),
    then :func:`_average_and_perturb`."""
    with torch.no_grad():
        for p, value in kept or ():
            p.copy_(value)
    _average_and_perturb(model, variant, step)


def _average_and_perturb(model: torch.nn.Module, variant: Variant, step: int) -> None:
    """After the last backward of ``step``: the gradients averaged over the variant's world
    (where data-parallel code averages them: before clipping), then perturbed."""
    if variant.world == 1 and variant.perturb is None:
        return
    generator = None
    if variant.perturb is not None:
        generator = torch.Generator().manual_seed(variant.perturb * 1_000_003 + step)
    with torch.no_grad():
        for p in model.parameters():
            g = p.grad
            if g is None or not g.is_floating_point():
                continue
            if variant.world != 1:
                if variant.reciprocal:
                    g.mul_(1.0 / variant.world)
                else:
                    g.div_(variant.world)
            if generator is not None and g.layout == torch.strided:
                unit = torch.finfo(g.dtype).eps / 2
                u = torch.rand(g.shape, generator=generator, dtype=torch.float64) * 2 - 1
                g.add_((g.double() * (u * unit)).to(g.dtype))


def _loss(record: StepRecord) -> float:
    return record.reported_loss if record.reported_loss is not None else 0.0


def _metric(record: StepRecord) -> float:
    return record.metric if record.metric is not None else 0.0


def _flat_state(state: dict) -> dict[str, object]:
    return {
        f"{name}[{key!r}]": value for name, held in state.items() for key, value in held.items()
    }


def _spread(mine: dict, others: list[dict]) -> dict[str, torch.Tensor]:
    """name -> the largest elementwise |other - mine| over ``others`` (float tensors only)."""
    out = {}
    for name, value in mine.items():
        if not torch.is_tensor(value) or not value.is_floating_point():
            continue
        diffs = [
            (o[name].double() - value.double()).abs()
            for o in others
            if torch.is_tensor(o.get(name)) and o[name].shape == value.shape
        ]
        if diffs:
            out[name] = torch.stack(diffs).amax(dim=0).nan_to_num(0.0, 0.0, 0.0)
    return out
