"""Hypothesis strategies for data-parallel equivalence examples (public API).

Each function validates its arguments, then returns a strategy; arguments are keyword-only.
Everything drawn is plain, picklable data whose ``repr`` is code (a failing example prints as a
line that rebuilds it), and shrinks towards the simplest case: fewer and plainer layers, one
world size of 1, SGD, one step, no accumulation, float64. The strategies here take feature
sets, never a target: ``examples(target)``, which reads what a target supports, lives beside
the targets (``ddpcheck.targets.support``); ``ddpcheck.strategies`` hands on both.

    from hypothesis import given
    from ddpcheck import strategies as dst

    @given(example=dst.examples(MY_TARGET, world_sizes=(1, 2)))
    def test_my_ddp(example):
        scenario, world_size = example
        ddpcheck.check_example(MY_TARGET, scenario, world_size)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping, Sequence

import torch
from hypothesis import strategies as st

from ddpcheck._base.errors import InvalidArgument, NothingChecked
from ddpcheck._language import features
from ddpcheck._language.mesh_draws import on_meshes
from ddpcheck._language.models import KINDS, Layer, ModelSpec
from ddpcheck._language.optimizers import optimizers
from ddpcheck._language.pipeline_draws import pipeline_scenarios
from ddpcheck._language.plans import DRAWN, OwnPlanModels, tensor_parallel_scenarios, token_losses
from ddpcheck._language.scenario import Epochs, Scenario
from ddpcheck._language.torch_limits import autocast_unavailable
from ddpcheck._language.zoo import BiasGroups, GPTConfig, token_data

__all__ = [
    "BUCKET_SIZES",
    "FLOAT32_ONLY",
    "LOW_PRECISION_EPS",
    "MAX_GRAD_NORMS",
    "NEEDS_SEVERAL_RANKS",
    "bucket_sizes",
    "can_exercise",
    "exercising",
    "gpt_models",
    "layers",
    "models",
    "optimizers",
    "pipeline_scenarios",
    "scenarios",
    "tensor_parallel_scenarios",
    "world_sizes",
]

#: Features only float32 scenarios can have: the precision policies keep float32 master weights.
FLOAT32_ONLY = ("float32", "autocast", "param-dtype")
#: Adam's eps under a precision policy. A shard rounds a gradient element differently from the
#: full batch by ~1 % of the tensor's scale in bfloat16, and Adam's first step, lr * g / (|g| +
#: eps), turns that into a different *sign* wherever |g| is below it: an lr-sized update (a token
#: soak hit 2 * lr at its third example with eps 1e-8). With eps above the noise the update moves
#: by noise * lr / eps, within the tolerance; float32 needs 1e-3 for zero-in-exact gradients.
LOW_PRECISION_EPS = 0.1

#: Bucket-size hints: the target's default, one parameter per bucket, a few, all in one.
BUCKET_SIZES = (None, 1e-6, 2e-4, 1e6)

#: Memoises a strategy built from hashable arguments: built anew at every draw, each was validated
#: again (~17,000 validations per 200 examples; a draw 6.6 -> 2.6 ms). Built once or anew, it draws
#: the same choices (400 seeded draws compared: identical).
_built_once = functools.lru_cache(maxsize=None)
#: A boolean shrinking towards True, built once as above.
_TRUE_FIRST = st.booleans().map(lambda b: not b)


def _check_range(name_lo: str, lo: int, name_hi: str, hi: int, minimum: int) -> None:
    for name, value in ((name_lo, lo), (name_hi, hi)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise InvalidArgument(f"{name}={value!r} must be an integer >= {minimum}")
    if hi < lo:
        raise InvalidArgument(f"Cannot have {name_hi}={hi!r} < {name_lo}={lo!r}")


def world_sizes(*, min_size: int = 1, max_size: int = 4) -> st.SearchStrategy[int]:
    """World sizes in ``[min_size, max_size]``. Odd sizes matter: W=2 hides divisor and
    ordering bugs. Shrinks towards ``min_size``."""
    _check_range("min_size", min_size, "max_size", max_size, 1)
    return st.integers(min_size, max_size)


def bucket_sizes() -> st.SearchStrategy[float | None]:
    """A bucket-size hint in MB from :data:`BUCKET_SIZES`: ``None`` (the target's default),
    one parameter per bucket, several buckets, everything in one. Shrinks towards ``None``."""
    return st.sampled_from(BUCKET_SIZES)


def layers(
    *, kinds: Sequence[str] = KINDS, unused: bool = True, frozen: bool = True, float32: bool = False
) -> st.SearchStrategy[Layer]:
    """One :class:`ddpcheck.models.Layer` of the given ``kinds``; ``unused`` allows layers used
    by some samples only or never, ``frozen`` frozen layers, ``float32`` float32 layers in a
    float64 model. Shrinks towards an always-used, trainable ``linear`` (or the first kind)."""
    kinds = tuple(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if not kinds or bad:
        raise InvalidArgument(f"kinds={kinds!r} must be a non-empty subset of {KINDS}")
    return st.builds(
        Layer,
        kind=st.sampled_from(kinds),
        use=st.sampled_from(("always", "sample", "never") if unused else ("always",)),
        frozen=st.booleans() if frozen else st.just(False),
        float32=st.booleans() if float32 else st.just(False),
    )


@st.composite
def _models(
    draw: st.DrawFn,
    min_layers: int,
    max_layers: int,
    kinds: tuple[str, ...],
    unused: bool,
    frozen: bool,
    mixed_dtypes: bool,
    tie: bool = True,
) -> ModelSpec:
    drawn = tuple(
        draw(_layer_lists(tuple(kinds), unused, frozen, mixed_dtypes, min_layers, max_layers))
    )
    registration = tuple(draw(_permutations(len(drawn))))
    return ModelSpec(
        layers=drawn,
        width=draw(st.integers(2, 6)),
        registration=None if registration == tuple(range(len(drawn))) else registration,
        head_bias=draw(_TRUE_FIRST),
        tie_head=tie and any(layer.kind == "embedding" for layer in drawn) and draw(st.booleans()),
    )


@_built_once
def _layer_lists(
    kinds: tuple, unused: bool, frozen: bool, float32: bool, min_size: int, max_size: int
) -> st.SearchStrategy[list[Layer]]:
    return st.lists(
        layers(kinds=kinds, unused=unused, frozen=frozen, float32=float32),
        min_size=min_size,
        max_size=max_size,
    )


@_built_once
def _permutations(n: int) -> st.SearchStrategy[list[int]]:
    return st.permutations(range(n))


def models(
    *,
    min_layers: int = 0,
    max_layers: int = 5,
    kinds: Sequence[str] = KINDS,
    unused: bool = True,
    frozen: bool = True,
    mixed_dtypes: bool = False,
    without: Iterable[str] = (),
) -> st.SearchStrategy[ModelSpec]:
    """Random architectures as :class:`ddpcheck.models.ModelSpec`: ``min_layers`` to
    ``max_layers`` layers on a hidden state of width 2-6 and a linear head (so 1 to ~25
    parameter tensors -- fewer and more than W), registered in a random order independent of
    their execution order, an embedding optionally tied to the head. Shrinks towards fewer
    layers, plainer kinds, registration in execution order, and a head with a bias.

    ``without`` (features of ``ddpcheck.features.FEATURES``) removes what produces them:
    layers used by some samples or none (``unused-*``), frozen layers, the reused linear and the
    tied head (``tied``), the buffer layer, the transposed weight and the ``channels_last`` conv
    (``non-contiguous``), float32 layers (``mixed-dtypes``)."""
    _check_range("min_layers", min_layers, "max_layers", max_layers, 0)
    without = features.parse(without, "without")
    dropped = {
        "tied": ("reused",),
        "buffers": ("buffer",),
        "non-contiguous": ("transposed", "conv_channels_last"),
    }
    kinds = tuple(k for k in kinds if not any(k in dropped.get(f, ()) for f in without))
    if not kinds:
        raise InvalidArgument(f"without={sorted(without)!r} leaves no layer kind to draw")
    unused = unused and not without & {"unused-on-some-ranks", "unused-everywhere"}
    return _models(
        min_layers,
        max_layers,
        kinds,
        unused,
        frozen and "frozen" not in without,
        mixed_dtypes and "mixed-dtypes" not in without,
        "tied" not in without,
    )


@_built_once
def gpt_models(*, without: Iterable[str] = ()) -> st.SearchStrategy[GPTConfig]:
    """Language models (``ddpcheck.zoo.GPTConfig``, each a :class:`ddpcheck.zoo.TinyGPT`
    factory): width 8 or 12, 1, 2 or 4 heads, 0 to 2 blocks, the head tied to the token
    embedding or not (never with ``tied`` in ``without``). Shrinks towards one head, no block,
    an untied head: a bigram model."""
    return _gpt_models(features.parse(without, "without"))


@_built_once
def _gpt_models(without: frozenset[str]) -> st.SearchStrategy[GPTConfig]:
    return st.builds(
        GPTConfig,
        width=st.sampled_from((8, 12)),
        heads=st.sampled_from((1, 2, 4)),
        layers=st.integers(0, 2),
        tied=st.just(False) if "tied" in without else st.booleans(),
    )


#: The precision policies a float32 scenario may draw: (feature, field, dtype), param_dtype
#: twice -- Hypothesis favours the first choices, and an opted-in target should see it as often as
#: autocast (bench/feature_rates.py --opt-in param-dtype).
_POLICIES = (
    ("autocast", "autocast", torch.bfloat16),
    ("param-dtype", "param_dtype", torch.bfloat16),
    ("autocast", "autocast", torch.float16),
    ("param-dtype", "param_dtype", torch.bfloat16),
)


@_built_once
@st.composite
def _precision(draw: st.DrawFn, without: frozenset[str], opt_in: frozenset[str]) -> dict:
    """A third of float32 scenarios run a precision policy (shrinking towards none): autocast in
    bfloat16 or float16 unless ``without`` excludes it, or -- about as often, for a target that
    opts in (``opt_in``) -- ``param_dtype`` bfloat16."""
    allowed = [
        (field, dtype)
        for feature, field, dtype in _POLICIES
        if feature not in without
        and (feature not in features.OPT_IN or feature in opt_in)
        and (field != "autocast" or autocast_unavailable(dtype) is None)  # torch 2.1: no float16
    ]
    if not allowed or not draw(st.sampled_from((False, False, True))):
        return {}
    field, dtype = draw(st.sampled_from(allowed))
    return {field: dtype}


def _autocast_dtypes() -> tuple[torch.dtype, ...]:
    """The autocast dtypes the installed torch runs on the CPU (``torch_limits``)."""
    return tuple(d for d in (torch.bfloat16, torch.float16) if autocast_unavailable(d) is None)


def _low_precision(optimizer: type, kwargs: dict) -> dict:
    """``kwargs`` of ``optimizer`` under a precision policy: Adam's eps above the noise."""
    if optimizer is torch.optim.SGD:
        return kwargs
    return {**kwargs, "eps": LOW_PRECISION_EPS}


@st.composite
def _scenarios(
    draw: st.DrawFn,
    model_strategy: st.SearchStrategy[ModelSpec],
    dtypes: tuple[str, ...],
    max_batch: int,
    max_steps: int,
    max_accumulation: int,
    without: frozenset[str],
    world_size: int | None,
    resume_world_sizes: tuple[int, ...],
    opt_in: frozenset[str] = frozenset(),
    tokens: bool | None = None,
) -> Scenario:
    if tokens is None:  # a fifth of scenarios train a language model (shrinking towards none)
        tokens = "tokens" not in without and draw(st.sampled_from((False,) * 4 + (True,)))
    spec: GPTConfig | ModelSpec  # a language model, or layers on a hidden state
    mixed = False  # float32 layers in a float64 model
    if tokens:
        spec, data, loss = draw(gpt_models(without=without)), token_data, draw(token_losses())
    else:
        spec = layered = draw(model_strategy)
        data, loss = layered.data, "squared_error"
        mixed = any(layer.float32 for layer in layered.layers)
    optimizer, kwargs = draw(optimizers())
    dtype = draw(st.sampled_from(dtypes))
    float32 = dtype == "float32" or mixed
    if float32 and optimizer is not torch.optim.SGD:
        # Adam divides by sqrt(v) + eps: on a gradient that is zero in exact arithmetic (a key
        # bias under softmax, say) float32 rounding noise of ~1e-9 becomes an O(lr) update with
        # the default eps=1e-8, so no tolerance could tell it from a bug. eps=1e-3 keeps noise
        # at noise level; float64 needs nothing of the kind.
        kwargs = {**kwargs, "eps": 1e-3}
    # float32 also runs at most 2 steps of the mean objective: a fast-moving model (a summed
    # loss, attention, tied embeddings) amplifies float32 rounding exponentially step after step,
    # until no tolerance tells drift from a bug (bench/tolerance.py measured it). float64 drifts
    # by ~1e-16 and keeps every step.
    most_steps = min(max_steps, 2) if float32 else max_steps
    steps = draw(st.integers(1, most_steps))
    reduction = "mean" if float32 else draw(st.sampled_from(("mean", "sum")))
    groups = None if "param-groups" in without else draw(_param_groups())
    if "uneven-batches" in without and world_size is not None:  # multiples of W only
        batch = world_size * draw(st.integers(1, max(1, max_batch // world_size)))
    else:
        batch = draw(st.integers(1, max_batch))
    precision = (
        draw(_precision(frozenset(without), frozenset(opt_in))) if dtype == "float32" else {}
    )
    if precision:
        kwargs = _low_precision(optimizer, kwargs)
    # drawn in the order of Scenario's fields, as before the epochs, which come last: the draws
    # of every earlier scenario are unchanged
    fields = dict(
        model=spec,
        data=data,
        loss=loss,
        **precision,
        optimizer=optimizer,
        optimizer_kwargs=kwargs,
        param_groups=groups,
        lr_decay=None if "lr-schedule" in without else draw(st.sampled_from((None, 0.5))),
        global_batch=batch,
        steps=steps,
        accumulation=1 if "accumulation" in without else draw(st.integers(1, max_accumulation)),
        dtype=dtype,
        reduction=reduction,
        seed=draw(st.integers(0, 2**16)),
        bucket_size_mb=draw(bucket_sizes()),
        set_to_none=True if "grads-kept" in without else draw(_TRUE_FIRST),
        rank_seeds="broadcast" not in without,
        **({} if "clipping" in without else draw(_clipping())),
        rank_orders=False if "rank-orders" in without else draw(_rank_orders()),
        **({} if "checkpoint" in without else draw(_checkpoint(steps, tuple(resume_world_sizes)))),
    )
    scenario = Scenario(**fields)
    if _EPOCHS_CLASH & without or scenario.checkpoint_after is not None:
        return scenario
    if not draw(st.sampled_from((False,) * 4 + (True,))):  # a fifth, shrinking towards none
        return scenario
    return draw(_with_epochs(scenario, most_steps, world_size))


#: Features an epoch structure cannot do without: its last step is short (any size), and with
#: a checkpoint its steps would have to be counted twice.
_EPOCHS_CLASH = frozenset({"epochs", "uneven-batches"})


@st.composite
def _with_epochs(
    draw: st.DrawFn, scenario: Scenario, most_steps: int, world_size: int | None
) -> Scenario:
    """``scenario`` over a dataset (``Scenario.epochs``): the global batch rounded down to a
    multiple of the accumulation -- at a known ``world_size``, in half of them a micro-batch W
    divides, which a framework's own data path needs (a per-device batch size) -- 1 to
    ``most_steps`` steps per epoch the last of which is full (shrinking towards it), holds 1 to
    B - 1 samples, or fewer whole micro-batches than the accumulation, as many epochs as the
    steps allow, and in half of them (shrinking towards none) an evaluation set of 1 to 3
    micro-batches' samples, in the training's per-device batch or one of 1-4 of its own: mostly
    no multiple of the per-device batch x W, so its last batch is uneven."""
    accumulation = scenario.accumulation
    micro = max(1, scenario.global_batch // accumulation)
    if world_size is not None and world_size > 1:
        micro = draw(st.sampled_from((micro, world_size * max(1, micro // world_size))))
    batch = accumulation * micro
    per_epoch = draw(st.integers(1, most_steps))
    # the last step full, any shorter size, or -- a third of them under accumulation -- whole
    # micro-batches fewer than the accumulation: a short last window with no short batch, which
    # a loader that pads or drops a short batch still trains (else A - 1 of B - 1 short draws)
    windows = (
        [st.integers(1, accumulation - 1).map(lambda k: k * micro)] if accumulation > 1 else []
    )
    last = (
        batch
        if batch == 1
        else draw(st.one_of(st.just(batch), st.integers(1, batch - 1), *windows))
    )
    samples = (per_epoch - 1) * batch + last
    epochs = draw(st.integers(1, max(1, most_steps // per_epoch)))
    evaluation = draw(st.one_of(st.none(), st.integers(1, 3 * micro)))
    evaluation_batch = None
    if evaluation is not None:  # a loader's own per-device batch, or the training one's
        evaluation_batch = draw(st.one_of(st.none(), st.integers(1, 4)))
    return dataclasses.replace(
        scenario,
        global_batch=batch,
        steps=epochs * per_epoch,
        epochs=Epochs(samples, epochs, evaluation=evaluation, evaluation_batch=evaluation_batch),
    )


@_built_once
def _param_groups() -> st.SearchStrategy[BiasGroups | None]:
    return st.one_of(
        st.none(),
        st.builds(
            BiasGroups, lr=st.sampled_from((0.05, 0.2)), weight_decay=st.sampled_from((0.0, 0.05))
        ),
    )


def _rank_orders() -> st.SearchStrategy[bool]:
    """One scenario in six registers in per-rank orders (shrinking towards the same order)."""
    return st.sampled_from((False,) * 5 + (True,))


#: Clipping thresholds, around the gradient norms random scenarios have (measured at step 0: the
#: 2-norm's quartiles are ~2.4 / 4.2 / 7.2, the inf-norm's ~1.4 / 2.4 / 4.3): most clip, some not.
MAX_GRAD_NORMS = (0.5, 2.0, 8.0)


@_built_once
@st.composite
def _clipping(draw: st.DrawFn) -> dict:
    """A quarter of scenarios clip (shrinking towards none that does). ``sampled_from``, not
    ``integers(0, 3) == 3``: Hypothesis favours small integers, which made it ~15 %."""
    if not draw(st.sampled_from((False, False, False, True))):
        return {}
    return {
        "max_grad_norm": draw(st.sampled_from(MAX_GRAD_NORMS)),
        "grad_norm_type": draw(st.sampled_from((2.0, math.inf))),
    }


@_built_once
@st.composite
def _checkpoint(draw: st.DrawFn, steps: int, resume_world_sizes: tuple[int, ...]) -> dict:
    """A third of multi-step scenarios save after a step and resume, at the same world size or
    one of ``resume_world_sizes`` (shrinking towards none, then the same W, then the first)."""
    # drawn whatever the steps: shrinking the steps then leaves the later choices in place
    if not draw(st.sampled_from((False, False, True))) or steps < 2:
        return {}
    return {
        "checkpoint_after": draw(st.integers(0, steps - 2)),
        "resume_world_size": draw(st.one_of(st.none(), st.sampled_from(resume_world_sizes))),
    }


def scenarios(
    *,
    models: st.SearchStrategy[ModelSpec] | None = None,
    dtypes: Sequence[str] = ("float64",),
    max_batch: int = 12,
    max_steps: int = 4,
    max_accumulation: int = 3,
    without: Iterable[str] = (),
    world_size: int | None = None,
    resume_world_sizes: Sequence[int] = (1, 2, 3),
    opt_in: Iterable[str] = (),
    _tokens: bool | None = None,
) -> st.SearchStrategy[Scenario]:
    """Whole training runs: a model (default: :func:`models`; in a fifth of them a language model
    of :func:`gpt_models` on padded token sequences, ``loss="token_cross_entropy"``), an optimizer
    with optional
    param groups and LR decay, a global batch of 1 to ``max_batch`` samples (often not divisible
    by W, sometimes smaller than W), 1 to ``max_steps`` steps, 1 to ``max_accumulation``
    micro-batches, a dtype from ``dtypes`` (float64 by default; ``("float64", "float32")``
    adds float32 at its calibrated tolerance; a third of float32 scenarios run the forward under
    ``autocast`` in bfloat16 or float16), a bucket-size hint, a seed, in a quarter of
    them gradient clipping (2-norm or inf-norm, :data:`MAX_GRAD_NORMS`), in a sixth of them
    per-rank registration orders (``rank_orders``), and in a third of those with several steps
    a checkpoint round trip, resumed at the same world size or one of ``resume_world_sizes`` (pass
    the world sizes your run allows). Shrinks towards one step of plain SGD on a one-sample batch
    of the simplest model, without clipping or checkpoint, in one registration order.

    ``without`` names features of ``ddpcheck.features.FEATURES`` never to generate (what a
    target does not support; ``examples`` reads them from the target): they cost no
    example. ``uneven-batches`` needs ``world_size`` (the
    batch is then a multiple of it); the model-derived features are honoured by the default
    model strategy (pass your own ``models`` and it is yours to honour them). ``opt_in`` names
    the features beyond torch's contract to generate too (``ddpcheck.features.OPT_IN``:
    ``param-dtype``, a bfloat16 ``param_dtype`` policy, for a target that applies it).
    (``_tokens``: :func:`exercising`'s, True or False to force or forbid a language model.)"""
    tokens = _tokens
    without = features.parse(without, "without")
    opt_in = features.parse(opt_in, "opt_in")
    if opt_in - features.OPT_IN.keys():
        raise InvalidArgument(
            f"opt_in={sorted(opt_in)!r} may name only the opt-in features {sorted(features.OPT_IN)}"
        )
    dtypes = tuple(d for d in dtypes if d not in without)
    if not dtypes or any(d not in ("float64", "float32") for d in dtypes):
        raise InvalidArgument(
            f"dtypes={dtypes!r} must be a non-empty subset of "
            "('float64', 'float32') once `without` is applied"
        )
    _check_range("1", 1, "max_batch", max_batch, 1)
    _check_range("1", 1, "max_steps", max_steps, 1)
    _check_range("1", 1, "max_accumulation", max_accumulation, 1)
    resume_world_sizes = tuple(resume_world_sizes)
    if not resume_world_sizes or any(
        isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in resume_world_sizes
    ):
        raise InvalidArgument(
            f"resume_world_sizes={resume_world_sizes!r} must be a non-empty "
            "sequence of positive integers"
        )
    if models is not None and not isinstance(models, st.SearchStrategy):
        raise InvalidArgument(
            f"Expected a SearchStrategy, such as ddpcheck.strategies.models(), "
            f"but got models={models!r} (type={type(models).__name__})"
        )
    if models is None:
        models = globals()["models"](without=without)
    return _scenarios(
        models,
        dtypes,
        max_batch,
        max_steps,
        max_accumulation,
        without,
        world_size,
        resume_world_sizes,
        opt_in,
        tokens,
    )


@st.composite
def paired(
    draw: st.DrawFn, sizes: st.SearchStrategy[int], runs: Mapping[int, st.SearchStrategy[Scenario]]
) -> tuple[Scenario, int]:
    """``(scenario, world_size)``: a world size of ``sizes``, then a scenario of its strategy in
    ``runs`` (``ddpcheck.strategies.examples`` draws a target's examples so)."""
    world_size = draw(sizes)
    return draw(runs[world_size]), world_size


def per_world_size(
    sizes: tuple[int, ...],
    dtypes: Sequence[str],
    unsupported: frozenset[str],
    focus: frozenset[str],
    who: str,
    degrees: Mapping[int, tuple[int, ...]] | None = None,
    layouts: Mapping[int, tuple[tuple[int, int], ...]] | None = None,
    own_models: OwnPlanModels | None = None,
) -> dict[int, st.SearchStrategy[Scenario]]:
    """``{W: the scenarios drawn at W}`` for a target checked on none of ``unsupported`` (the
    features it does not support, and those the user excluded), named ``who``: :func:`scenarios`
    at each of ``sizes``, or -- with ``focus`` (``--only``) -- :func:`exercising` one of those
    features, at the world sizes where one can be. Built once per call: Hypothesis validates a
    strategy the first time it draws from it. Raises ``NothingChecked`` when nothing can be
    drawn. ``degrees``: ``{W: the tensor-parallel degrees drawn at W}`` (``--mesh``; default:
    every divisor of W), for a target that applies plans; ``layouts``: ``{W: the (pp, tp)
    layouts drawn at W}`` (``--mesh``), for a pipeline target. Under a mesh, a world size none
    of whose shapes the target's scenarios can take is left out. ``own_models``: a plan
    target's models with their own plan (``Target.own_plan_models``), drawn beside the drawn
    plans."""
    opt_in = frozenset(features.OPT_IN) - unsupported  # generated only for a target that opts in
    kept = tuple(d for d in dtypes if d not in unsupported)
    if not kept:
        raise NothingChecked(
            f"{who} supports none of the dtypes "
            f"{', '.join(dtypes)} once `without` (--without) is applied"
        )
    if opt_in & {"pipeline-parallel", "tensor-parallel"}:  # schedules, or a plan hook
        return on_meshes(sizes, kept, unsupported, opt_in, who, degrees, layouts, own_models)
    if focus:
        per_size = {
            w: st.one_of(
                [
                    exercising(
                        f,
                        world_size=w,
                        dtypes=_dtypes_exercising(f, kept),
                        without=unsupported,
                        resume_world_sizes=sizes,
                        opt_in=opt_in,
                    )
                    for f in sorted(focus)
                    if can_exercise(f, w)
                ]
            )
            for w in sizes
            if any(can_exercise(f, w) for f in focus)
        }
        if not per_size:
            raise NothingChecked(
                f"no world size of {sizes} can exercise "
                f"{', '.join(sorted(focus))} (one rank holds every sample)"
            )
        return per_size
    return {
        w: scenarios(
            models=models(mixed_dtypes=True, without=unsupported),
            dtypes=kept,
            without=unsupported,
            world_size=w,
            resume_world_sizes=sizes,
            opt_in=opt_in,
        )
        for w in sizes
    }


#: Features no example at W=1 can exercise: one rank holds every sample.
NEEDS_SEVERAL_RANKS = ("unused-on-some-ranks", "uneven-batches")


def can_exercise(feature: str, world_size: int) -> bool:
    """Whether an example at ``world_size`` can exercise ``feature``."""
    return not (world_size == 1 and feature in NEEDS_SEVERAL_RANKS)


def _dtypes_exercising(feature: str, dtypes: Sequence[str]) -> tuple[str, ...]:
    """The dtypes :func:`exercising` draws ``feature`` in, of those allowed."""
    if feature in FLOAT32_ONLY:
        return ("float32",)
    if feature in ("float64", "float32"):
        return (feature,)
    return tuple(dtypes)


#: The layer a model gets so that it exercises the feature (``exercising``).
_LAYERS = {
    "unused-everywhere": Layer(use="never"),
    "unused-on-some-ranks": Layer(use="sample"),
    "frozen": Layer(frozen=True),
    "tied": Layer(kind="reused"),
    "buffers": Layer(kind="buffer"),
    "mixed-dtypes": Layer(float32=True),
    "non-contiguous": (Layer(kind="transposed"), Layer(kind="conv_channels_last")),
}


def exercising(
    feature: str,
    *,
    world_size: int,
    dtypes: Sequence[str] | None = None,
    without: Iterable[str] = (),
    resume_world_sizes: Sequence[int] | None = None,
    opt_in: Iterable[str] = (),
    tp_degrees: Sequence[int] | None = None,
) -> st.SearchStrategy[Scenario]:
    """:func:`scenarios` made to exercise ``feature`` (of ``ddpcheck.features.FEATURES``) at
    ``world_size``: the model gets the layer that produces it (a never-used, sample-gated, frozen,
    reused, buffer, float32 or transposed layer), or the scenario the field (micro-batches, param
    groups, LR decay, kept gradients, clipping, per-rank orders, a checkpoint resumed at W or
    one of ``resume_world_sizes`` -- default 1..W, which fit wherever W does, GPUs included --
    a batch not divisible by W, few samples per rank); nothing in ``without`` is generated.
    Shrinks towards the simplest scenario that still has it.

    ``tokens`` trains a language model (:func:`gpt_models`) on padded token sequences;
    ``autocast`` and ``param-dtype`` run a precision policy (bfloat16 or float16 autocast, a
    bfloat16 ``param_dtype``) in float32 scenarios; the features a layer gives never train a
    language model. ``opt_in``: as for :func:`scenarios`. ``tp_degrees``: the tensor-parallel
    degrees drawn, for scenarios on a mesh (default: every divisor of ``world_size``).

    ``unused-on-some-ranks`` depends on the data (whether some rank's samples all skip the
    layer) and cannot happen at W=1, nor ``uneven-batches``: check ``feature in
    features.of(scenario, world_size)`` (``assume``) when you rely on it. ``dtypes`` defaults to
    ``("float32",)`` for the features of :data:`FLOAT32_ONLY` and ``("float64",)`` otherwise."""
    without = features.parse(without, "without")
    _check_range("1", 1, "world_size", world_size, 1)
    if feature not in features.FEATURES or feature in without:
        raise InvalidArgument(
            f"feature={feature!r} must be one of ddpcheck.features.FEATURES and not in `without`"
        )
    if dtypes is None:
        dtypes = ("float32",) if feature in FLOAT32_ONLY else ("float64",)
    if feature in FLOAT32_ONLY and tuple(dtypes) != ("float32",):
        raise InvalidArgument(f"feature={feature!r} needs dtypes=('float32',), not {dtypes!r}")
    if feature == "tensor-parallel" or "tensor-parallel" in opt_in:  # meshes and plans only
        return _on_a_mesh(feature, world_size, tuple(dtypes), without, tp_degrees)
    if feature in features.OPT_IN:
        opt_in = (*opt_in, feature)
    model = models(mixed_dtypes=True, without=without)
    if feature in _LAYERS:
        layer = _LAYERS[feature]
        model = st.builds(
            _with_layer,
            model,
            st.sampled_from(layer) if isinstance(layer, tuple) else st.just(layer),
            st.integers(0, 5),
        )
    resumes = tuple(resume_world_sizes or range(1, world_size + 1))
    drawn = scenarios(
        models=model,
        dtypes=dtypes,
        without=without,
        world_size=world_size,
        resume_world_sizes=resumes,
        opt_in=opt_in,
        _tokens=True if feature == "tokens" else False if feature in _LAYERS else None,
    )
    return _forced(drawn, feature, world_size, "uneven-batches" in without, resumes)


def _on_a_mesh(
    feature: str,
    world_size: int,
    dtypes: tuple[str, ...],
    without: frozenset[str],
    degrees: Sequence[int] | None = None,
) -> st.SearchStrategy[Scenario]:
    """Tensor-parallel scenarios exercising ``feature`` (a target that applies plans is given
    no others); ``NothingChecked`` for a feature they are not drawn with."""
    if feature not in DRAWN or (world_size == 1 and feature == "uneven-batches"):
        raise NothingChecked(f"tensor-parallel scenarios are not drawn with {feature} yet")
    drawn = tensor_parallel_scenarios(
        world_size=world_size, dtypes=dtypes, without=without, degrees=degrees
    )
    return drawn.filter(lambda s: feature in features.of(s, world_size))


def _with_layer(spec: ModelSpec, layer: Layer, index: int) -> ModelSpec:
    i = min(index, len(spec.layers))
    order = spec.registration
    if order is not None:  # the new layer is registered last
        order = (*(j + (j >= i) for j in order), i)
    return dataclasses.replace(
        spec, layers=(*spec.layers[:i], layer, *spec.layers[i:]), registration=order
    )


#: Features :func:`_forced` makes by changing the batch, the steps or the accumulation.
_FIXED_BATCH = frozenset({"accumulation", "checkpoint", "uneven-batches", "unused-on-some-ranks"})


@st.composite
def _epochs_as_needed(draw: st.DrawFn, s: Scenario, feature: str, world_size: int) -> Scenario:
    """``s`` with epochs for ``feature="epochs"``, without them for the features
    :func:`_forced` makes by changing what the epochs derive (the batch, steps, accumulation)."""
    if s.epochs is not None and feature in _FIXED_BATCH:
        return dataclasses.replace(s, epochs=None)
    if feature == "epochs" and s.epochs is None:
        no_checkpoint = dataclasses.replace(s, checkpoint_after=None, resume_world_size=None)
        return draw(_with_epochs(no_checkpoint, max(s.steps, 2), world_size))
    return s


@st.composite
def _forced(
    draw: st.DrawFn,
    drawn: st.SearchStrategy[Scenario],
    feature: str,
    world_size: int,
    even_batches: bool,
    resumes: tuple[int, ...],
) -> Scenario:
    s = draw(_epochs_as_needed(draw(drawn), feature, world_size))
    # keyword arguments are evaluated in order: the draws are those of one change at a time
    if feature == "accumulation":
        return dataclasses.replace(s, accumulation=draw(st.integers(2, 3)))
    if feature == "param-groups" and s.param_groups is None:
        return dataclasses.replace(s, param_groups=BiasGroups())
    if feature == "lr-schedule":
        return dataclasses.replace(s, lr_decay=0.5)
    if feature == "grads-kept":
        return dataclasses.replace(s, set_to_none=False)
    if feature == "rank-orders":
        return dataclasses.replace(s, rank_orders=True)
    if feature == "clipping" and s.max_grad_norm is None:
        return dataclasses.replace(
            s,
            max_grad_norm=draw(st.sampled_from(MAX_GRAD_NORMS)),
            grad_norm_type=draw(st.sampled_from((2.0, math.inf))),
        )
    if feature == "checkpoint" and s.checkpoint_after is None:
        steps = max(s.steps, 2)
        return dataclasses.replace(
            s,
            steps=steps,
            checkpoint_after=draw(st.integers(0, steps - 2)),
            resume_world_size=draw(st.one_of(st.none(), st.sampled_from(resumes))),
        )
    if feature == "uneven-batches" and world_size > 1 and s.global_batch % world_size == 0:
        # >= W - 1 >= 1, and not a multiple of W
        return dataclasses.replace(s, global_batch=s.global_batch - 1)
    if feature == "autocast" and s.autocast is None:
        return dataclasses.replace(
            s,
            autocast=draw(st.sampled_from(_autocast_dtypes())),
            param_dtype=None,
            optimizer_kwargs=_low_precision(s.optimizer, s.optimizer_kwargs),
        )
    if feature == "param-dtype" and s.param_dtype is None:
        return dataclasses.replace(
            s,
            param_dtype=torch.bfloat16,
            autocast=None,
            optimizer_kwargs=_low_precision(s.optimizer, s.optimizer_kwargs),
        )
    if feature == "unused-on-some-ranks":  # few samples per rank: some rank skips the layer
        return dataclasses.replace(
            s,
            global_batch=(
                world_size * draw(st.integers(1, 2))
                if even_batches
                else draw(st.integers(1, 2 * world_size))
            ),
        )
    return s
