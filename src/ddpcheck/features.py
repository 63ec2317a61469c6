"""The capability vocabulary: the features a scenario can exercise, and which ones it does.

A target declares the features it supports (``Target.supported_features``, ``None`` for all
but the opt-in ones, :data:`OPT_IN`); the battery, the random examples and the command line
honour it -- a declined feature is not generated, and a scenario that needs one is skipped with
the feature named. :func:`of` says which
features a scenario exercises at a world size, so nobody reads ``ModelSpec`` fields again.

Invariant: :func:`of` is a pure function of (scenario, world size). The model-derived features
are read from the model the scenario builds (frozen, tied, buffers, mixed dtypes, non-contiguous)
and, for parameter usage, from one forward/backward per rank shard and step on the initial
weights -- what every rank of a world would see at step 0 -- cached per scenario.
"""

from __future__ import annotations

from typing import Any

import torch

from ddpcheck._internal import objective
from ddpcheck._internal.options import FEATURES, OPT_IN
from ddpcheck._internal.options import parse_features as parse
from ddpcheck.models import ModelSpec
from ddpcheck.scenario import Scenario, build_model, global_batch

__all__ = ["FEATURES", "OPT_IN", "declines", "exercised", "of", "parse", "supported",
           "unsupported"]


def of(scenario: Scenario, world_size: int | None = None) -> frozenset[str]:
    """The features ``scenario`` exercises at ``world_size`` (None: those that do not depend on
    it; ``uneven-batches`` and ``unused-on-some-ranks`` need a world size), and at its
    ``resume_world_size`` when it resumes from a checkpoint in another world."""
    found = set(_fields(scenario))
    if world_size is not None and scenario.global_batch % world_size:
        found.add("uneven-batches")
    resumed_at = scenario.resume_world_size
    if world_size is not None and resumed_at not in (None, world_size):
        found |= of(scenario, resumed_at)  # the resumed run's world shards the batch its way
    return frozenset(found | _model_features(scenario, world_size or 1))


def _fields(scenario: Scenario) -> set[str]:
    """The features read from the scenario's fields alone (cheap: no model is built)."""
    found = {scenario.dtype}
    if scenario.accumulation > 1:
        found.add("accumulation")
    if scenario.param_groups is not None:
        found.add("param-groups")
    if scenario.lr_decay is not None:
        found.add("lr-schedule")
    if scenario.max_grad_norm is not None:
        found.add("clipping")
    if scenario.rank_seeds:
        found.add("broadcast")
    if not scenario.set_to_none:
        found.add("grads-kept")
    if scenario.rank_orders:
        found.add("rank-orders")
    if scenario.checkpoint_after is not None:
        found.add("checkpoint")
    if scenario.loss == "token_cross_entropy":
        found.add("tokens")
    if scenario.autocast is not None:
        found.add("autocast")
    if scenario.param_dtype is not None:
        found.add("param-dtype")
    return found


def supported(target: Any) -> frozenset[str]:
    """The features ``target`` supports: its ``supported_features`` (None: every feature),
    less the opt-in ones (:data:`OPT_IN`) whose attribute it does not set."""
    declared = getattr(target, "supported_features", None)
    found = frozenset(FEATURES) if declared is None else frozenset(declared)
    return found - {f for f, flag in OPT_IN.items() if not getattr(target, flag, False)}


def unsupported(target: Any, without: frozenset[str] = frozenset()) -> frozenset[str]:
    """The features never to generate for ``target``: those it does not support, and
    ``without`` (what the user excluded)."""
    return (frozenset(FEATURES) - supported(target)) | without


def declines(target: Any, scenario: Scenario, world_size: int | None = None,
             without: frozenset[str] = frozenset()) -> str | None:
    """Why ``target`` does not run ``scenario`` -- a feature it does not support, a feature the
    user excluded (``without``), or its own ``supports()`` reason -- or None when it does."""
    declared = getattr(target, "supported_features", None)
    if declared is not None or without or _fields(scenario) & OPT_IN.keys():
        needed = of(scenario, world_size)
        missing = sorted(needed - supported(target))
        opted_out = [f"{f} (opt-in: {type(target).__name__}.{OPT_IN[f]} is not set)"
                     for f in missing if f in OPT_IN]
        if opted_out:
            return f"needs {', '.join(opted_out)}"
        if missing:
            return (f"needs {', '.join(missing)} (not in {type(target).__name__}."
                    "supported_features)")
        excluded = sorted(needed & without)
        if excluded:
            return f"needs {', '.join(excluded)} (excluded with --without)"
    if scenario.checkpoint_after is not None and not all(
            callable(getattr(target, hook, None)) for hook in ("save_checkpoint",
                                                               "load_checkpoint")):
        return ("checkpoint: the target has no save_checkpoint / load_checkpoint hooks "
                "(subclass ddpcheck.Target for the defaults)")
    return target.supports(scenario)


def exercised(found: set[str] | frozenset[str]) -> str:
    """``"12/15 features (not exercised: float32, grads-kept, tied)"``, for reports."""
    missing = [f for f in FEATURES if f not in found]
    text = f"{len(FEATURES) - len(missing)}/{len(FEATURES)} features"
    return text + (f" (not exercised: {', '.join(missing)})" if missing else "")


#: (repr of a scenario, world size) -> its model-derived features; bounded.
_CACHE: dict[tuple[str, int], frozenset[str]] = {}


def _model_features(scenario: Scenario, world_size: int) -> frozenset[str]:
    key = (repr(scenario), world_size)
    found = _CACHE.get(key)
    if found is None:
        if len(_CACHE) > 1024:
            _CACHE.clear()
        found = _CACHE[key] = _inspect(scenario, world_size)
    return found


def _inspect(scenario: Scenario, world_size: int) -> frozenset[str]:
    model = build_model(scenario, scenario.seed)
    found = set()
    params = list(model.parameters())
    if any(not p.requires_grad for p in params):
        found.add("frozen")
    if len(list(model.named_parameters(remove_duplicate=False))) > len(params):
        found.add("tied")
    if any(True for _ in model.buffers()):
        found.add("buffers")
    if len({p.dtype for p in params if p.is_floating_point()}) > 1:
        found.add("mixed-dtypes")
    if any(not p.is_contiguous() for p in params):
        found.add("non-contiguous")
    spec = scenario.model
    if isinstance(spec, ModelSpec):
        tied_head = spec.tie_head and any(layer.kind == "embedding" and not layer.float32
                                          for layer in spec.layers)
        if tied_head or any(layer.kind == "reused" for layer in spec.layers):
            found.add("tied")  # used twice in forward, registered once
        if all(layer.use == "always" for layer in spec.layers):
            return frozenset(found)  # every parameter is used by every sample: nothing to probe
    return frozenset(found | _usage(scenario, model, world_size))


def _usage(scenario: Scenario, model: torch.nn.Module, world_size: int) -> set[str]:
    """Which trainable parameters each rank's shard leaves without a gradient, per step (on the
    initial weights: the usage the first step of every rank sees)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    found = set()
    for step in range(scenario.steps):
        x, y = global_batch(scenario, step)
        used_by = []
        for xs, ys in zip(torch.tensor_split(x, world_size), torch.tensor_split(y, world_size)):
            model.zero_grad(set_to_none=True)
            # as the runner does, an empty shard runs too: its used parameters get zeros, not None
            objective.micro_batch_loss(scenario, model, xs, ys).backward()
            used_by.append([p.grad is not None for p in trainable])
        for flags in zip(*used_by):
            if not any(flags):
                found.add("unused-everywhere")
            elif not all(flags):
                found.add("unused-on-some-ranks")
    model.zero_grad(set_to_none=True)
    return found
