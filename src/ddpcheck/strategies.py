"""Hypothesis strategies for data-parallel equivalence examples (public API).

Each function validates its arguments, then returns a strategy; arguments are keyword-only.
Everything drawn is plain, picklable data whose ``repr`` is code (a failing example prints as a
line that rebuilds it), and shrinks towards the simplest case: fewer and plainer layers, one
world size of 1, SGD, one step, no accumulation, float64.

    from hypothesis import given
    from ddpcheck import strategies as dst

    @given(dst.scenarios(), dst.world_sizes())
    def test_my_ddp(scenario, world_size):
        ddpcheck.assert_equivalent(MY_TARGET, scenario, world_sizes=(world_size,))
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch
from hypothesis import strategies as st

from ddpcheck import features
from ddpcheck._internal.validation import InvalidArgument
from ddpcheck.models import KINDS, Layer, ModelSpec
from ddpcheck.scenario import Scenario
from ddpcheck.zoo import BiasGroups

__all__ = ["BUCKET_SIZES", "MAX_GRAD_NORMS", "bucket_sizes", "layers", "models", "optimizers",
           "scenarios", "world_sizes"]

#: Bucket-size hints: the target's default, one parameter per bucket, a few, all in one.
BUCKET_SIZES = (None, 1e-6, 2e-4, 1e6)


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


def layers(*, kinds: Sequence[str] = KINDS, unused: bool = True, frozen: bool = True,
           float32: bool = False) -> st.SearchStrategy[Layer]:
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
def _models(draw, min_layers, max_layers, kinds, unused, frozen, mixed_dtypes, tie=True):
    drawn = tuple(draw(st.lists(layers(kinds=kinds, unused=unused, frozen=frozen,
                                       float32=mixed_dtypes),
                                min_size=min_layers, max_size=max_layers)))
    registration = tuple(draw(st.permutations(range(len(drawn)))))
    return ModelSpec(
        layers=drawn,
        width=draw(st.integers(2, 6)),
        registration=None if registration == tuple(range(len(drawn))) else registration,
        head_bias=draw(st.booleans().map(lambda b: not b)),
        tie_head=tie and any(layer.kind == "embedding" for layer in drawn) and draw(st.booleans()),
    )


def models(*, min_layers: int = 0, max_layers: int = 5, kinds: Sequence[str] = KINDS,
           unused: bool = True, frozen: bool = True, mixed_dtypes: bool = False,
           without: Iterable[str] = ()) -> st.SearchStrategy[ModelSpec]:
    """Random architectures as :class:`ddpcheck.models.ModelSpec`: ``min_layers`` to
    ``max_layers`` layers on a hidden state of width 2-6 and a linear head (so 1 to ~25
    parameter tensors -- fewer and more than W), registered in a random order independent of
    their execution order, an embedding optionally tied to the head. Shrinks towards fewer
    layers, plainer kinds, registration in execution order, and a head with a bias.

    ``without`` (features of ``ddpcheck.features.FEATURES``) removes what produces them:
    layers used by some samples or none (``unused-*``), frozen layers, the reused linear and the
    tied head (``tied``), the buffer layer, the transposed weight (``non-contiguous``), float32
    layers (``mixed-dtypes``)."""
    _check_range("min_layers", min_layers, "max_layers", max_layers, 0)
    without = features.parse(without, "without")
    dropped = {"tied": ("reused",), "buffers": ("buffer",), "non-contiguous": ("transposed",)}
    kinds = tuple(k for k in kinds
                  if not any(k in dropped.get(f, ()) for f in without))
    if not kinds:
        raise InvalidArgument(f"without={sorted(without)!r} leaves no layer kind to draw")
    unused = unused and not without & {"unused-on-some-ranks", "unused-everywhere"}
    return _models(min_layers, max_layers, kinds, unused, frozen and "frozen" not in without,
                   mixed_dtypes and "mixed-dtypes" not in without, "tied" not in without)


def optimizers() -> st.SearchStrategy[tuple[type, dict]]:
    """``(optimizer_cls, kwargs)``: SGD (plain, momentum, nesterov, weight decay), Adam, AdamW.
    Shrinks towards plain SGD (the optimizer that shows constant-scale bugs)."""
    sgd = st.builds(
        lambda momentum, nesterov, weight_decay: (torch.optim.SGD, {
            "lr": 0.1, **({"momentum": momentum} if momentum else {}),
            **({"nesterov": True} if nesterov and momentum else {}),
            **({"weight_decay": weight_decay} if weight_decay else {})}),
        st.sampled_from((0.0, 0.9)), st.booleans(), st.sampled_from((0.0, 0.01)))
    adam = st.builds(lambda cls, wd: (cls, {"lr": 0.01, **({"weight_decay": wd} if wd else {})}),
                     st.sampled_from((torch.optim.Adam, torch.optim.AdamW)),
                     st.sampled_from((0.0, 0.1)))
    return st.one_of(sgd, adam)


@st.composite
def _scenarios(draw, model_strategy, dtypes, max_batch, max_steps, max_accumulation, without,
               world_size):
    spec = draw(model_strategy)
    optimizer, kwargs = draw(optimizers())
    dtype = draw(st.sampled_from(dtypes))
    float32 = dtype == "float32" or any(layer.float32 for layer in spec.layers)
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
    steps = draw(st.integers(1, min(max_steps, 2) if float32 else max_steps))
    reduction = "mean" if float32 else draw(st.sampled_from(("mean", "sum")))
    groups = None if "param-groups" in without else draw(st.one_of(
        st.none(), st.builds(BiasGroups, lr=st.sampled_from((0.05, 0.2)),
                             weight_decay=st.sampled_from((0.0, 0.05)))))
    if "uneven-batches" in without and world_size is not None:  # multiples of W only
        batch = world_size * draw(st.integers(1, max(1, max_batch // world_size)))
    else:
        batch = draw(st.integers(1, max_batch))
    return Scenario(
        model=spec,
        data=spec.data,
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
        set_to_none=True if "grads-kept" in without else draw(st.booleans().map(lambda b: not b)),
        rank_seeds="broadcast" not in without,
        **({} if "clipping" in without else draw(_clipping())),
    )


#: Clipping thresholds, around the gradient norms random scenarios have (measured at step 0: the
#: 2-norm's quartiles are ~2.4 / 4.2 / 7.2, the inf-norm's ~1.4 / 2.4 / 4.3): most clip, some not.
MAX_GRAD_NORMS = (0.5, 2.0, 8.0)


@st.composite
def _clipping(draw) -> dict:
    """A quarter of scenarios clip (shrinking towards none that does)."""
    if draw(st.integers(0, 3)) < 3:
        return {}
    return {"max_grad_norm": draw(st.sampled_from(MAX_GRAD_NORMS)),
            "grad_norm_type": draw(st.sampled_from((2.0, math.inf)))}


def scenarios(*, models: st.SearchStrategy[ModelSpec] | None = None,
              dtypes: Sequence[str] = ("float64",), max_batch: int = 12, max_steps: int = 4,
              max_accumulation: int = 3, without: Iterable[str] = (),
              world_size: int | None = None) -> st.SearchStrategy[Scenario]:
    """Whole training runs: a model (default: :func:`models`), an optimizer with optional
    param groups and LR decay, a global batch of 1 to ``max_batch`` samples (often not divisible
    by W, sometimes smaller than W), 1 to ``max_steps`` steps, 1 to ``max_accumulation``
    micro-batches, a dtype from ``dtypes`` (float64 by default; ``("float64", "float32")``
    adds float32 at its calibrated tolerance), a bucket-size hint, a seed, and in a quarter of
    them gradient clipping (2-norm or inf-norm, :data:`MAX_GRAD_NORMS`). Shrinks towards one
    step of plain SGD on a one-sample batch of the simplest model, without clipping.

    ``without`` names features of ``ddpcheck.features.FEATURES`` never to generate (what a
    target does not support): they cost no example. ``uneven-batches`` needs ``world_size`` (the
    batch is then a multiple of it); the model-derived features are honoured by the default
    model strategy (pass your own ``models`` and it is yours to honour them)."""
    without = features.parse(without, "without")
    dtypes = tuple(d for d in dtypes if d not in without)
    if not dtypes or any(d not in ("float64", "float32") for d in dtypes):
        raise InvalidArgument(f"dtypes={dtypes!r} must be a non-empty subset of "
                              "('float64', 'float32') once `without` is applied")
    _check_range("1", 1, "max_batch", max_batch, 1)
    _check_range("1", 1, "max_steps", max_steps, 1)
    _check_range("1", 1, "max_accumulation", max_accumulation, 1)
    if models is not None and not isinstance(models, st.SearchStrategy):
        raise InvalidArgument(f"Expected a SearchStrategy, such as ddpcheck.strategies.models(), "
                              f"but got models={models!r} (type={type(models).__name__})")
    if models is None:
        models = globals()["models"](without=without)
    return _scenarios(models, dtypes, max_batch, max_steps, max_accumulation, without,
                      world_size)
