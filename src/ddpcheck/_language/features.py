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

from collections.abc import Callable

import torch

from ddpcheck._base.errors import InvalidArgument, ScenarioError
from ddpcheck._base.options import BEYOND_TORCH, DEFAULT_FEATURES, FEATURES, OPT_IN
from ddpcheck._base.options import parse_features as parse
from ddpcheck._language import objective, torch_limits
from ddpcheck._language.messages import code_name, exception_text
from ddpcheck._language.models import ModelSpec, SpecData
from ddpcheck._language.scenario import (
    Scenario,
    batch_size_of,
    build_model,
    data_parallel_degree,
    global_batch,
)
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
    if world_size is not None and any(
        batch_size_of(scenario, step) % data_parallel(scenario, world_size)
        for step in range(scenario.steps)
    ):
        found.add("uneven-batches")
    resumed_at = scenario.resume_world_size
    if world_size is not None and resumed_at not in (None, world_size):
        found |= of(scenario, resumed_at)  # the resumed run's world shards the batch its way
    return frozenset(found | _model_features(scenario, world_size or 1))


#: The features a scenario's fields alone show: name -> whether the scenario exercises it.
_FIELD_FEATURES: dict[str, Callable[[Scenario], bool]] = {
    "accumulation": lambda s: s.accumulation > 1,
    "param-groups": lambda s: s.param_groups is not None,
    "lr-schedule": lambda s: s.lr_decay is not None,
    "clipping": lambda s: s.max_grad_norm is not None,
    "broadcast": lambda s: s.rank_seeds,
    "grads-kept": lambda s: not s.set_to_none,
    "rank-orders": lambda s: s.rank_orders,
    "checkpoint": lambda s: s.checkpoint_after is not None,
    "tokens": lambda s: s.loss in objective.TOKEN_LOSSES,
    "tensor-parallel": lambda s: s.tensor_parallel is not None,
    "pipeline-parallel": lambda s: s.pipeline is not None,
    "epochs": lambda s: s.epochs is not None,
    "autocast": lambda s: s.autocast is not None,
    "param-dtype": lambda s: s.param_dtype is not None,
}


def data_parallel(scenario: Scenario, world_size: int) -> int:
    """The ranks the global batch is split among: W, or the mesh's ``dp`` (tensor parallelism;
    a world that cannot hold the mesh counts as W, and is declined elsewhere)."""
    try:
        return data_parallel_degree(scenario, world_size)
    except InvalidArgument:
        return world_size


def _fields(scenario: Scenario) -> set[str]:
    """The features read from the scenario's fields alone (cheap: no model is built)."""
    return {scenario.dtype} | {name for name, shows in _FIELD_FEATURES.items() if shows(scenario)}


def exercised(found: set[str] | frozenset[str]) -> str:
    """``"12/15 features (not exercised: float32, grads-kept, tied)"``, for reports; then why
    what the installed torch cannot run is never drawn (``"float16 autocast: not available on
    torch 2.1.2"``)."""
    missing = [f for f in FEATURES if f not in found]
    text = f"{len(FEATURES) - len(missing)}/{len(FEATURES)} features"
    text += f" (not exercised: {', '.join(missing)})" if missing else ""
    return "; ".join([text, *torch_limits.unavailable()])  # what this torch cannot run, and why


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
    if getattr(spec, "uses_every_parameter", False):  # a factory that says so (TitanLlama)
        return frozenset(found)
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
        for rows in _rank_rows(scenario, len(x), world_size):
            for i in sampled:
                used = [bool((x[r, i % spec.width] > 0).any()) for r in rows]
                if not any(used):
                    found.add("unused-everywhere")
                elif not all(used):
                    found.add("unused-on-some-ranks")
    return found


def _rank_rows(scenario: Scenario, n: int, world_size: int) -> list[list[torch.Tensor]]:
    """The ways a step's ``n`` samples are dealt to the ranks, each as the rows every rank
    takes: the batch rule's contiguous shards of the step; and, over epochs, each micro-batch
    (``B / accumulation`` samples) as a framework's own data path deals it -- contiguous pieces
    (accelerate's, the HF Trainer's loader) or every W-th sample (``DistributedSampler`` in index
    order: torch's, Lightning's, DeepSpeed's) -- where a framework that reduces at a
    micro-batch (ZeRO) needs every rank to use the parameter."""
    rows = torch.arange(n)
    ways = [list(torch.tensor_split(rows, world_size))]
    if scenario.epochs is not None:
        micro = max(1, scenario.global_batch // scenario.accumulation)
        for chunk in torch.split(rows, micro):
            ways.append(list(torch.tensor_split(chunk, world_size)))
            ways.append([chunk[r::world_size] for r in range(world_size)])
    # each deal once: without accumulation the contiguous pieces of the one micro-batch are the
    # step's shards, and one sample per rank deals alike both ways (a forward per rank each)
    seen: set[tuple[tuple[int, ...], ...]] = set()
    unique = []
    for way in ways:
        key = tuple(tuple(r.tolist()) for r in way)
        if key not in seen:
            seen.add(key)
            unique.append(way)
    return unique


def _usage(scenario: Scenario, model: torch.nn.Module, world_size: int) -> set[str]:
    """Which trainable parameters each rank's shard leaves without a gradient, per step (on the
    initial weights: the usage the first step of every rank sees)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    found = set()
    for step in range(scenario.steps):
        x, y = global_batch(scenario, step)
        # a mesh's tp ranks share their dp group's rows: the batch is dealt over dp
        for ranks in _rank_rows(scenario, len(x), data_parallel(scenario, world_size)):
            used_by = []
            for rows in ranks:
                model.zero_grad(set_to_none=True)
                # as the runner does, an empty shard runs too: its used parameters get zeros
                loss = objective.micro_batch_loss(scenario, model, x[rows], y[rows])
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
