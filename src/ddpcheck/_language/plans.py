"""Hypothesis strategies for tensor-parallel scenarios: a mesh, a model and a plan valid for it.

Drawn as data-parallel scenarios are, and shrinking the same way: towards the smallest
tensor-parallel degree, fewer and plainer blocks, **fewer parallelized modules** (each module
group's first choice is "nothing sharded", ``ddpcheck._language.sharded_models.plan_choices``),
SGD, one step, float64. Sizes the degree does not divide (a hidden width of 5 over ``tp=2``,
3 heads over 2 ranks) are drawn as often as the others: torch shards them unevenly, and a plan
that keeps whole heads on each rank is the only valid split of attention, so 3 heads stay
replicated where the plan would otherwise cut one in half.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable

import torch
from hypothesis import strategies as st
from torch import Tensor, nn

from ddpcheck._base.errors import InvalidArgument
from ddpcheck._language.objective import LOSS_PARALLEL, TOKEN_LOSSES
from ddpcheck._language.optimizers import optimizers
from ddpcheck._language.scenario import Scenario
from ddpcheck._language.sharded_models import (
    BLOCK_KINDS,
    ShardedBlock,
    ShardedSpec,
    id_tokens,
    plan_choices,
    sequence_data,
    sequence_ids,
    sequence_tokens,
)
from ddpcheck._language.tensor_parallel import TensorParallel
from ddpcheck._language.zoo import token_data

__all__ = [
    "DRAWN",
    "OwnPlanModels",
    "check_degrees",
    "clip_norm",
    "divisors",
    "largest_degree",
    "optimizer_for",
    "plans",
    "sharded_models",
    "tensor_parallel_scenarios",
    "token_losses",
]

#: The features tensor-parallel scenarios are drawn with (``exercising`` one of them keeps the
#: draws that do; the others are not drawn on a mesh yet).
DRAWN = frozenset(
    {
        "float64",
        "float32",
        "accumulation",
        "lr-schedule",
        "clipping",
        "uneven-batches",
        "broadcast",
        "tokens",
        "tensor-parallel",
    }
)

#: Models that bring their own plan (``Target.own_plan_models``): the tensor-parallel degree to
#: a strategy of model factories, each a scenario's ``model`` trained on token data.
OwnPlanModels = Callable[[int], st.SearchStrategy[Callable[[], nn.Module]]]

#: The largest of each size drawn: small, so that an example runs in well under a second.
MAX_BLOCKS, MAX_WIDTH, MAX_SIZE = 3, 6, 6


@st.composite
def _blocks(draw: st.DrawFn) -> ShardedBlock:
    """A block; an attention block of grouped-query attention half the time: 1-3 kv heads, each
    serving 2 or more q heads (so that ``tp`` = 2 or 3 divides the kv heads in a good share of
    the draws, the only split drawn), shrinking towards one kv head of two q heads; q/k norms
    half the time (shrinking towards none)."""
    kind = draw(st.sampled_from(BLOCK_KINDS))
    bias = not draw(st.booleans())  # towards biases: the classic row-wise bug
    if kind == "attention":
        qk = draw(st.booleans())
        if draw(st.booleans()):
            kv = draw(st.integers(1, 3))
            group = draw(st.integers(2, MAX_SIZE // kv))
            return ShardedBlock(kind, kv * group, bias, kv, qk_norm=qk)
        return ShardedBlock(kind, draw(st.integers(1, MAX_SIZE)), bias, qk_norm=qk)
    return ShardedBlock(kind, draw(st.integers(1, MAX_SIZE)), bias)


def sharded_models() -> st.SearchStrategy[ShardedSpec]:
    """Models plans apply to (``ShardedSpec``), shrinking towards one MLP block of width 2 on
    features (an embedding of token ids: drawn half the time; tied in ``_scenarios``). q/k norms
    only over heads of 2 or more features: an RMSNorm of one feature outputs its sign times the
    weight, and its input's gradient is rounding (chaotic, as a width-2 LayerNorm's)."""
    return st.builds(
        ShardedSpec,
        blocks=st.lists(_blocks(), min_size=1, max_size=MAX_BLOCKS).map(tuple),
        width=st.integers(2, MAX_WIDTH),
        head_dim=st.integers(1, 3),
        embedding=st.booleans(),
    ).map(_no_one_feature_norms)


def _no_one_feature_norms(spec: ShardedSpec) -> ShardedSpec:
    if spec.head_dim > 1:
        return spec
    blocks = tuple(dataclasses.replace(b, qk_norm=False) for b in spec.blocks)
    return dataclasses.replace(spec, blocks=blocks)


def token_losses() -> st.SearchStrategy[str]:
    """The losses a language model is trained with (``objective.TOKEN_LOSSES``), shrinking
    towards token cross-entropy."""
    return st.sampled_from(TOKEN_LOSSES)


@st.composite
def plans(
    draw: st.DrawFn, spec: ShardedSpec, tp: int, loss_parallel: bool = True
) -> tuple[tuple[str, str], ...]:
    """A plan valid for ``spec``'s model at degree ``tp``: one fragment per module group,
    shrinking towards nothing sharded. At ``tp=1`` nothing: a one-rank axis shards nothing,
    and torch 2.13's DTensor refuses some views of a dimension "sharded" over it (a hidden width
    of 1, column- then row-wise: "would remove or reshape sharded dimension 1").
    ``loss_parallel=False``: no head leaves its logits sharded (a loss torch's
    ``loss_parallel()`` cannot compute, ``objective.LOSS_PARALLEL``)."""
    if tp == 1:
        return ()
    groups = plan_choices(spec, tp, loss_head=loss_parallel)
    return tuple(pair for group in groups for pair in draw(st.sampled_from(group)))


@functools.cache
def largest_degree() -> int:
    """The largest ``tp`` some drawn model can use: one of its layers holds a shard on each of
    ``tp`` ranks (:func:`plan_choices` offers more than "nothing sharded"). A larger degree
    would draw only empty plans: a mesh that shards nothing (``--mesh`` refuses it)."""
    usable = 1
    for tp in range(2, 4 * max(MAX_WIDTH, MAX_SIZE) + 1):
        for kind in BLOCK_KINDS:
            for size in range(1, MAX_SIZE + 1):
                for width in range(2, MAX_WIDTH + 1):
                    for head_dim in (1, 2, 3):
                        spec = ShardedSpec((ShardedBlock(kind, size),), width, head_dim)
                        if any(len(group) > 1 for group in plan_choices(spec, tp)):
                            usable = tp
    return usable


def check_degrees(shapes: Iterable[tuple[int, int, int]], shown: object, name: str) -> None:
    """Refuse a mesh whose ``tp`` no drawn model can use (above :func:`largest_degree`): every
    plan drawn at it would shard nothing. ``shapes``: ``(dp, pp, tp)``; ``shown``: the shapes as
    the user wrote them."""
    largest = largest_degree()
    for *_, tp in shapes:
        if tp > largest:
            raise InvalidArgument(
                f"{name}={shown!r}: tp={tp} is more ranks than any drawn model's layer can "
                f"give each a shard of (the drawn models use tp up to {largest}); every plan "
                "drawn would shard nothing"
            )


def divisors(world_size: int) -> tuple[int, ...]:
    """The degrees a world of ``world_size`` ranks can hold, smallest first (above 1 when any):
    a tensor-parallel or a pipeline axis."""
    found = tuple(d for d in range(2, world_size + 1) if world_size % d == 0)
    return found or (1,)


def tensor_parallel_scenarios(
    *,
    world_size: int,
    dtypes: Iterable[str] = ("float64", "float32"),
    without: Iterable[str] = (),
    tp: int | None = None,
    degrees: Iterable[int] | None = None,
    max_batch: int = 8,
    max_steps: int = 3,
    max_accumulation: int = 2,
    own_models: OwnPlanModels | None = None,
) -> st.SearchStrategy[Scenario]:
    """Tensor-parallel scenarios at ``world_size``: a degree ``tp`` (default: drawn among the
    divisors of W; ``tp=W`` is torch_tp's mesh; ``degrees``: drawn among these, each dividing W,
    as ``--mesh`` asks), a :func:`sharded_models` model, a plan of
    :func:`plans`, and what data-parallel scenarios draw besides -- optimizer, dtype, batch
    (split over ``dp``), steps, accumulation, LR decay, clipping -- none of ``without``.
    ``own_models``: half the draws are instead one of its models (its own plan; the
    scenario's left empty) on token data with a token loss (``Target.own_plan_models``)."""
    dtypes, without = tuple(dtypes), frozenset(without)
    if not dtypes:
        raise InvalidArgument("dtypes must name at least one of float64, float32")
    if tp is not None and (tp < 1 or world_size % tp):
        raise InvalidArgument(f"tp={tp!r} must divide world_size={world_size}")
    if tp is not None and degrees is not None:
        raise InvalidArgument("give tp= or degrees=, not both")
    if degrees is not None:
        degrees = tuple(sorted(set(degrees)))
        wrong = [d for d in degrees if d < 1 or world_size % d]
        if not degrees or wrong:
            raise InvalidArgument(
                f"degrees={degrees!r} must be degrees that divide world_size={world_size}"
            )
    else:
        degrees = (tp,) if tp is not None else divisors(world_size)
    limits = (max_batch, max_steps, max_accumulation)
    return _scenarios(world_size, dtypes, without, degrees, limits, own_models)


@st.composite
def _scenarios(
    draw: st.DrawFn,
    world_size: int,
    dtypes: tuple[str, ...],
    without: frozenset[str],
    degrees: tuple[int, ...],
    limits: tuple[int, int, int],
    own_models: OwnPlanModels | None,
) -> Scenario:
    max_batch, max_steps, max_accumulation = limits
    tp = draw(st.sampled_from(degrees))
    # a model with its own plan half the time (shrinking towards the drawn plans)
    plan: tuple[tuple[str, str], ...] = ()
    own = own_models is not None and "tokens" not in without and draw(st.booleans())
    if own_models is not None and own:
        model, data, loss = draw(own_models(tp)), token_data, draw(token_losses())
    else:
        model, data, loss, plan = draw(_sharded(tp, without))
    dtype = draw(st.sampled_from(dtypes))
    optimizer, kwargs = optimizer_for(draw, dtype)
    dp = world_size // tp
    if "uneven-batches" in without:
        batch = dp * draw(st.integers(1, max(1, max_batch // dp)))
    else:  # a sample for each of the W ranks features.of runs a model of its own plan on (a
        # transformers model fails on an empty batch: its attention cannot reshape 0 elements)
        batch = draw(st.integers(min(world_size, max_batch) if own else 1, max_batch))
    max_grad_norm = clip_norm(draw, without)
    return Scenario(
        model=model,
        data=data,
        loss=loss,
        optimizer=optimizer,
        optimizer_kwargs=kwargs,
        lr_decay=None if "lr-schedule" in without else draw(st.sampled_from((None, 0.5))),
        global_batch=batch,
        steps=draw(st.integers(1, min(max_steps, 2) if dtype == "float32" else max_steps)),
        accumulation=1 if "accumulation" in without else draw(st.integers(1, max_accumulation)),
        dtype=dtype,
        seed=draw(st.integers(0, 2**16)),
        rank_seeds="broadcast" not in without,
        max_grad_norm=max_grad_norm,
        tensor_parallel=TensorParallel(plan, None if tp == world_size else tp),
    )


@st.composite
def _sharded(
    draw: st.DrawFn, tp: int, without: frozenset[str]
) -> tuple[ShardedSpec, Callable, str, tuple[tuple[str, str], ...]]:
    """A :func:`sharded_models` model, its data, its loss, and a plan for it."""
    spec = draw(sharded_models())
    # token cross-entropy on a vocabulary head (shrinking towards none), what loss_parallel()
    # applies to: half the draws (a fifth drew it in 2-8 % of them)
    tokens = "tokens" not in without and draw(st.booleans())
    # the head tied to a vocabulary embedding half the time (shrinking towards untied)
    tied = tokens and spec.embedding and draw(st.booleans())
    spec = dataclasses.replace(spec, tokens=tokens, tied=tied)
    loss = draw(token_losses()) if tokens else "squared_error"
    plan = draw(plans(spec, tp, loss_parallel=loss in LOSS_PARALLEL))
    return spec, _data(tokens, spec.embedding), loss, plan


def _data(tokens: bool, ids: bool) -> Callable[[int, int, torch.dtype], tuple[Tensor, Tensor]]:
    """The data of a model: token targets or not, token ids in or features."""
    if ids:
        return id_tokens if tokens else sequence_ids
    return sequence_tokens if tokens else sequence_data


def optimizer_for(draw: st.DrawFn, dtype: str) -> tuple[type, dict]:
    """An optimizer and its keyword arguments for a scenario on a mesh in ``dtype``."""
    optimizer, kwargs = draw(optimizers())
    if dtype == "float32" and optimizer is not torch.optim.SGD:
        kwargs = {**kwargs, "eps": 1e-3}  # as data-parallel float32 scenarios (strategies.py)
    return optimizer, kwargs


def clip_norm(draw: st.DrawFn, without: frozenset[str]) -> float | None:
    """The clipping norm of a scenario on a mesh: a quarter clip, as data-parallel scenarios do."""
    if "clipping" not in without and draw(st.sampled_from((False, False, False, True))):
        return draw(st.sampled_from((0.5, 2.0, 8.0)))
    return None
