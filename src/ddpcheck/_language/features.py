"""The capability vocabulary: the features a scenario can exercise, and which ones it does.

A target declares the features it supports (``Target.supported_features``; ``None``: everything
within torch DDP's contract, :data:`DEFAULT_FEATURES` -- features beyond it are opt-in, and the
:data:`OPT_IN` ones need the target's own attribute besides); the battery, the random examples
and the command line honour it -- a declined feature is not generated, and a scenario that needs
one is skipped with the feature named (those decisions read the target, so they live beside the
targets: ``ddpcheck.targets.support``). :func:`of` says which
features a scenario exercises at a world size, so nobody reads ``ModelSpec`` fields again.

Invariant: :func:`of` is a pure function of (scenario, world size). The model-derived features
are read from the model the scenario builds (frozen, tied, buffers, mixed dtypes, non-contiguous)
and, for parameter usage, from one forward/backward per rank shard and step on the initial
weights -- what every rank of a world would see at step 0 -- cached per scenario.
"""

from __future__ import annotations

from typing import Any

import torch

from ddpcheck._base.errors import ScenarioError
from ddpcheck._base.options import BEYOND_TORCH, DEFAULT_FEATURES, FEATURES, OPT_IN
from ddpcheck._base.options import parse_features as parse
from ddpcheck._language import objective
from ddpcheck._language.messages import code_name, exception_text
from ddpcheck._language.models import ModelSpec, SpecData
from ddpcheck._language.scenario import Scenario, build_model, global_batch
from ddpcheck._language.zoo import GPTConfig, token_data

__all__ = [
    "BEYOND_TORCH",
    "DEFAULT_FEATURES",
    "FEATURES",
    "OPT_IN",
    "exercised",
    "named",
    "of",
    "parse",
]


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


# ---------------------------------------------------------------------------------------------
# TEMPORARY, down to `unsupported`: moved to ddpcheck.targets.support (typed with Target; the
# scenario language reads no target). Duplicated only for the callers in _runs/ and api.py, which
# switch in the one-engine change; then this section goes. Not in __all__: ddpcheck.features
# hands on the targets.support versions.


def declines(
    target: Any,
    scenario: Scenario,
    world_size: int | None = None,
    without: frozenset[str] = frozenset(),
    only: frozenset[str] = frozenset(),
) -> str | None:
    """Why ``target`` does not run ``scenario`` -- a feature it does not support, a feature the
    user excluded (``without``), its own ``supports()`` reason, or none of the features to focus
    on (``only``, ``--only``) -- or None when it does."""
    needed = of(scenario, world_size)
    missing = sorted(needed - supported_by(target))
    opted_out = [
        f"{f} (opt-in: {type(target).__name__}.{OPT_IN[f]} is not set)"
        for f in missing
        if f in OPT_IN
    ]
    if opted_out:
        return f"needs {', '.join(opted_out)}"
    if missing:
        reasons: dict[str, list[str]] = {}  # features sharing a reason are named together
        for feature in missing:
            reasons.setdefault(why_unsupported(target, feature), []).append(feature)
        return "needs " + "; ".join(f"{', '.join(fs)} ({why})" for why, fs in reasons.items())
    if without:
        dtypes = sorted(needed & without & {"float64", "float32"})
        others = sorted(needed & without - {"float64", "float32"})
        if others:
            return f"needs {', '.join(others)} (excluded with --without)"
        if dtypes:  # ddpcheck check runs float64 alone unless --dtypes adds float32
            return (
                f"needs {', '.join(dtypes)} (a dtype not checked: --dtypes is float64 alone "
                "by default, or --without excludes it)"
            )
    if scenario.checkpoint_after is not None and not all(
        callable(getattr(target, hook, None)) for hook in ("save_checkpoint", "load_checkpoint")
    ):
        return (
            "checkpoint: the target has no save_checkpoint / load_checkpoint hooks "
            "(subclass ddpcheck.Target for the defaults)"
        )
    if only and not needed & only:
        return f"exercises none of only={','.join(sorted(only))}"
    return target.supports(scenario)


def why_unsupported(target: Any, feature: str) -> str:
    """Why ``target`` is not checked on ``feature`` (in :func:`supported_by`'s terms)."""
    where = f"not in {type(target).__name__}.supported_features"
    declared = getattr(target, "supported_features", None)
    own = getattr(target, "declined_reason", None)  # Target's; a duck-typed target's table
    reason = own(feature) if callable(own) else None
    reason = reason or (getattr(target, "declined_features", None) or {}).get(feature)
    if reason is not None:  # declined with a reason (an opt-in feature: its flag unset)
        return f"{type(target).__name__} declines it: {reason}"
    if feature == "tokens" and (declared is None or "tokens" in declared):
        return (
            f"{where}: its own shard_batch may weigh samples only; declare 'tokens' with it "
            "once it weighs tokens"
        )
    if declared is None:
        return f"{where}: beyond torch DDP's contract, checked only when declared"
    return where


def supported_by(target: Any) -> frozenset[str]:
    """The features ``target`` is checked on: its ``supported_features``, or -- when it declares
    nothing -- :data:`DEFAULT_FEATURES`, everything within torch DDP's own contract (features
    beyond it, :data:`BEYOND_TORCH`, are opt-in, and ``tokens`` is when the target owns its
    batch plan); less the :data:`OPT_IN` features whose attribute it does not set, whatever it
    declares."""
    declared = getattr(target, "supported_features", None)
    found = frozenset(FEATURES) - BEYOND_TORCH if declared is None else frozenset(declared)
    if owns_batch_plan(target) and not _declared_with_its_plan(target):
        found -= {"tokens"}  # its plan may weigh samples only: a token loss must be declared
    return found - {f for f, flag in OPT_IN.items() if not getattr(target, flag, False)}


def owns_batch_plan(target: Any) -> bool:
    """True when ``target`` plans its own micro-batches: ``Target.owns_batch_plan`` where it
    has one, else (a duck-typed target) whether it has a ``shard_batch`` at all."""
    owns = getattr(target, "owns_batch_plan", None)
    return bool(owns) if owns is not None else callable(getattr(target, "shard_batch", None))


def _declared_with_its_plan(target: Any) -> bool:
    """Whether ``supported_features`` was declared where the batch plan was written -- on the
    instance (``Target.from_wrappers(supports=..., shard_batch=...)``), or on the class that
    defines ``shard_batch`` or a subclass of it -- and not inherited from a base whose plan
    was the batch rule (a subclass of a ready-made target overriding ``shard_batch`` does not
    declare ``tokens`` by inheriting ``FEATURES - {...}``)."""
    if "supported_features" in getattr(target, "__dict__", {}):
        return target.supported_features is not None
    mro = type(target).__mro__
    plan = next((i for i, cls in enumerate(mro) if "shard_batch" in vars(cls)), None)
    features = next((i for i, cls in enumerate(mro) if "supported_features" in vars(cls)), None)
    return (
        plan is not None
        and features is not None
        and features <= plan
        and mro[features].__dict__["supported_features"] is not None
    )


def unsupported(target: Any, without: frozenset[str] = frozenset()) -> frozenset[str]:
    """The features never to generate for ``target``: those it is not checked on, and
    ``without`` (what the user excluded)."""
    return (frozenset(FEATURES) - supported_by(target)) | without


# (end of the temporary section)
# ---------------------------------------------------------------------------------------------


def exercised(found: set[str] | frozenset[str]) -> str:
    """``"12/15 features (not exercised: float32, grads-kept, tied)"``, for reports."""
    missing = [f for f in FEATURES if f not in found]
    text = f"{len(FEATURES) - len(missing)}/{len(FEATURES)} features"
    return text + (f" (not exercised: {', '.join(missing)})" if missing else "")


def named(found: set[str] | frozenset[str]) -> list[str]:
    """``found`` in the order of :data:`FEATURES` (the order of reports): what a counterexample
    exercises, as ``ddpcheck check`` and ``ddpcheck survey`` print it."""
    return [f for f in FEATURES if f in found]


#: (repr of a scenario, world size) -> its model-derived features; bounded.
_CACHE: dict[tuple[str, int], frozenset[str]] = {}


def _model_features(scenario: Scenario, world_size: int) -> frozenset[str]:
    key = (repr(scenario), world_size)
    found = _CACHE.get(key)
    if found is None:
        if len(_CACHE) > 1024:
            _CACHE.clear()
        try:
            found = _inspect(scenario, world_size)
        except ScenarioError:
            raise
        except Exception as exc:  # the user's model or data, not the target: exit 2, one line
            raise ScenarioError(
                f"the scenario's model or data failed while ddpcheck read which features it "
                f"exercises (model={code_name(scenario.model)}, data={code_name(scenario.data)}, "
                f"the batches of {world_size} rank(s)): {exception_text(exc)}"
            ) from exc
        _CACHE[key] = found
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
        tied_head = spec.tie_head and any(
            layer.kind == "embedding" and not layer.float32 for layer in spec.layers
        )
        if tied_head or any(layer.kind == "reused" for layer in spec.layers):
            found.add("tied")  # used twice in forward, registered once
        if isinstance(scenario.data, SpecData) and scenario.data.width == spec.width:
            # which samples take a layer is decided by their own inputs (ddpcheck.models): read
            # it from the data, with no forward or backward (the measured third of a random
            # example's cost in the checking process)
            return frozenset(found | _spec_usage(scenario, spec, world_size))
    if isinstance(spec, GPTConfig) and scenario.data is token_data:
        # every parameter of a TinyGPT takes part in every forward, and every sample has a real
        # token: no shard leaves one without a gradient (held to _usage by
        # tests/language/test_tokens.py), so no backward per rank is needed to say so
        return frozenset(found)
    return frozenset(found | _usage(scenario, model, world_size))


def _spec_usage(scenario: Scenario, spec: ModelSpec, world_size: int) -> set[str]:
    """:func:`_usage` for a :class:`ModelSpec` model on its own data: a layer used ``"sample"``
    runs on the samples whose input feature ``index % width`` is positive, ``"never"`` on none,
    ``"always"`` on all (as the head, and a tied embedding, which the head uses); a frozen layer
    has nothing to use. ``tests/language/test_strategies.py`` holds the two to the same answer."""
    tied = next(
        (
            i
            for i, layer in enumerate(spec.layers)
            if spec.tie_head and layer.kind == "embedding" and not layer.float32
        ),
        None,
    )
    gated = [
        (i, layer.use)
        for i, layer in enumerate(spec.layers)
        if not layer.frozen and layer.use != "always" and i != tied
    ]
    found: set[str] = set()
    if any(use == "never" for _, use in gated):
        found.add("unused-everywhere")
    sampled = [i for i, use in gated if use == "sample"]
    for step in range(scenario.steps if sampled else 0):
        x, _ = global_batch(scenario, step)
        shards = torch.tensor_split(x, world_size)
        for i in sampled:
            used = [bool((shard[:, i % spec.width] > 0).any()) for shard in shards]
            if not any(used):
                found.add("unused-everywhere")
            elif not all(used):
                found.add("unused-on-some-ranks")
    return found


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
            loss = objective.micro_batch_loss(scenario, model, xs, ys)
            if loss.requires_grad:  # else no parameter is used: the reference says why
                loss.backward()
            used_by.append([p.grad is not None for p in trainable])
        for flags in zip(*used_by):
            if not any(flags):
                found.add("unused-everywhere")
            elif not all(flags):
                found.add("unused-on-some-ranks")
    model.zero_grad(set_to_none=True)
    return found
