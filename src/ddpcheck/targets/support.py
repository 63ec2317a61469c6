"""Which features a target is checked on, and whether it runs a scenario.

The scenario language says what a scenario exercises (``ddpcheck.features.of``); what a target
supports is the target's business, so the decisions that read a target -- its
``supported_features``, its opt-in flags, its own batch plan, its ``supports()`` -- live here,
beside the protocol they read (``Target``), and the language below stays free of targets. A
duck-typed target (no ``Target`` base) is read with the same defaults, attribute by attribute.
``ddpcheck.features`` and ``ddpcheck.strategies`` hand these names on to users.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from ddpcheck._base.errors import InvalidArgument, NothingChecked
from ddpcheck._base.options import (
    DEFAULT_WORLD_SIZES,
    MeshShape,
    check_mesh_target,
    check_meshes,
    check_world_sizes,
    mesh_degrees,
    mesh_layouts,
)
from ddpcheck._language.battery import BATTERY, PIPELINE_BATTERY, TENSOR_PARALLEL_BATTERY
from ddpcheck._language.features import BEYOND_TORCH, FEATURES, OPT_IN, of, parse
from ddpcheck._language.scenario import Scenario
from ddpcheck.targets.protocol import Target
from ddpcheck.targets.reasons import OPT_IN_REASONS

if TYPE_CHECKING:  # hypothesis loads only when examples are drawn: never in a rank
    from hypothesis import strategies as st

__all__ = [
    "battery_for",
    "checked_through_defaults",
    "declined_mesh",
    "declines",
    "example_strategies",
    "examples",
    "owns_batch_plan",
    "supported_by",
    "unsupported",
    "why_unsupported",
]


def declines(
    target: Target,
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
    why = target.supports(scenario)
    at = getattr(target, "supports_at", None)  # duck-typed targets may have none
    if why is None and world_size is not None and callable(at):
        why = at(scenario, world_size)
    return why


def declined_mesh(target: Target, shape: MeshShape) -> str | None:
    """Why ``target`` runs nothing on the ``(dp, pp, tp)`` mesh ``shape`` (``--mesh``), or None:
    its answer for a plain scenario on that mesh -- one MLP block (or as many as a stage each
    needs), nothing sharded, a sample per ``dp`` group, and for a pipeline target or ``pp > 1``
    GPipe over ``pp`` stages -- which only the mesh itself can make it decline (``torch_tp``:
    ``dp > 1``; ``torch_pp``: ``tp > 1``; a target of plans alone: ``pp > 1``)."""
    dp, pp, tp = shape
    scenario, size = _plain_scenario(target, shape), dp * pp * tp
    if _own_space(target, (size,), ("float64", "float32"), frozenset(), {size: (tp,)}) is not None:
        at = getattr(target, "supports_at", None)  # models of its own: the mesh alone decides
        return at(scenario, size) if callable(at) else None
    return declines(target, scenario, size)


def _plain_scenario(target: Target, shape: MeshShape) -> Scenario:
    """:func:`declined_mesh`'s scenario on ``shape``."""
    from ddpcheck._language.pipeline_parallel import PipelineParallel
    from ddpcheck._language.sharded_models import ShardedBlock, ShardedSpec, sequence_data
    from ddpcheck._language.tensor_parallel import TensorParallel

    dp, pp, tp = shape
    if pp == 1 and not getattr(target, OPT_IN["pipeline-parallel"], False):
        return Scenario(
            ShardedSpec(),
            data=sequence_data,
            global_batch=dp,
            steps=1,
            rank_seeds=False,
            tensor_parallel=TensorParallel((), None if dp == 1 else tp),
        )
    stage_plans = getattr(target, OPT_IN["tensor-parallel"], False) or tp > 1
    return Scenario(
        ShardedSpec(blocks=(ShardedBlock("mlp"),) * max(1, pp - 2)),
        data=sequence_data,
        global_batch=dp,
        steps=1,
        rank_seeds=False,
        tensor_parallel=TensorParallel((), tp) if stage_plans else None,
        pipeline=PipelineParallel("GPipe", tuple(range(1, pp)), 1, pp if dp > 1 else None),
    )


def why_unsupported(target: Target, feature: str) -> str:
    """Why ``target`` is not checked on ``feature`` (in :func:`supported_by`'s terms)."""
    where = f"not in {type(target).__name__}.supported_features"
    declared = getattr(target, "supported_features", None)
    own = getattr(target, "declined_reason", None)  # Target's; a duck-typed target's table
    reason = own(feature) if callable(own) else None
    reason = reason or (getattr(target, "declined_features", None) or {}).get(feature)
    if reason is None and feature in OPT_IN and not getattr(target, OPT_IN[feature], False):
        reason = OPT_IN_REASONS[feature]  # its flag unset: the reason every such target shares
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


def battery_for(target: Target) -> list[tuple[str, Scenario]]:
    """The built-in battery ``target`` is checked on: the tensor-parallel one for a target that
    applies plans (``Target.parallelizes``), the data-parallel one otherwise."""
    own = target.own_battery()
    if own is not None:
        return own
    if getattr(target, OPT_IN["pipeline-parallel"], False):  # (of tensor-parallel stages too)
        return PIPELINE_BATTERY
    if getattr(target, OPT_IN["tensor-parallel"], False):
        return TENSOR_PARALLEL_BATTERY
    return BATTERY


def supported_by(target: Target) -> frozenset[str]:
    """The features ``target`` is checked on: its ``supported_features``, or -- when it declares
    nothing -- ``ddpcheck.features.DEFAULT_FEATURES``, everything within torch DDP's own contract
    (features beyond it, ``BEYOND_TORCH``, are opt-in, and ``tokens`` is when the target owns its
    batch plan); less the ``OPT_IN`` features whose attribute it does not set, whatever it
    declares."""
    declared = getattr(target, "supported_features", None)
    found = frozenset(FEATURES) - BEYOND_TORCH if declared is None else frozenset(declared)
    if owns_batch_plan(target) and not _declared_with_its_plan(target):
        found -= {"tokens"}  # its plan may weigh samples only: a token loss must be declared
    return found - {f for f, flag in OPT_IN.items() if not getattr(target, flag, False)}


def owns_batch_plan(target: Target) -> bool:
    """True when ``target`` plans its own micro-batches: ``Target.owns_batch_plan`` where it
    has one, else (a duck-typed target) whether it has a ``shard_batch`` at all."""
    owns = getattr(target, "owns_batch_plan", None)
    return bool(owns) if owns is not None else callable(getattr(target, "shard_batch", None))


def _declared_with_its_plan(target: Target) -> bool:
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


def checked_through_defaults(target: Target, without: frozenset[str] = frozenset()) -> list[str]:
    """What a default hook means for what is checked, one line each, where a user could believe
    their own code is checked: a target that shards optimizer state but keeps the default
    ``clip_grad_norm`` has clipping checked through torch's ``clip_grad_norm_`` over the model,
    never through a sharded optimizer's own clipping (issue 50: a bug there went unseen)."""
    own = getattr(type(target), "clip_grad_norm", None)
    if (
        not getattr(target, "shards_optimizer_state", False)
        or own is not Target.clip_grad_norm
        or "clipping" in unsupported(target, without)
    ):
        return []
    optimizer = getattr(target, "optimizer", None)  # Target.from_wrappers(optimizer=...)
    who = type(target).__name__ + (
        f" (optimizer={optimizer.__name__})" if isinstance(optimizer, type) else ""
    )
    return [
        f"{who} shards optimizer state but keeps the default clip_grad_norm "
        "hook: clipping is checked through torch.nn.utils.clip_grad_norm_, not your optimizer's "
        "own clipping; override Target.clip_grad_norm to check yours"
    ]


def unsupported(target: Target, without: frozenset[str] = frozenset()) -> frozenset[str]:
    """The features never to generate for ``target``: those it is not checked on, and
    ``without`` (what the user excluded)."""
    return (frozenset(FEATURES) - supported_by(target)) | without


def examples(
    target: Target,
    *,
    world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
    dtypes: Sequence[str] = ("float64",),
    without: Iterable[str] = (),
    only: Iterable[str] = (),
    meshes: Iterable[object] | None = None,
) -> st.SearchStrategy[tuple[Scenario, int]]:
    """``(scenario, world_size)`` pairs that ``target`` runs, the random examples ``ddpcheck
    check`` draws for it: a world size of ``world_sizes``, then ``ddpcheck.strategies.scenarios``
    without the features ``target`` does not support (``supported_features``, its ``OPT_IN``
    attributes) nor those of ``without`` -- at that world size, so ``uneven-batches`` and
    ``unused-on-some-ranks`` are honoured too -- and resumed checkpoints at one of
    ``world_sizes``. The rare pair still declined (its ``supports()``, a feature only its model
    reveals) is filtered out. So ``check_example`` never refuses a drawn pair as
    :class:`ddpcheck.NothingChecked` for what the target declines, as it refuses a scenario of
    ``scenarios`` that needs a declined feature. Raises ``NothingChecked`` when the target
    supports none of ``dtypes``. ``only``: every pair exercises one of these features (as
    ``ddpcheck check --only``). ``meshes``: ``(dp, pp, tp)`` shapes, as ``(dp, tp)`` pairs,
    triples or as ``--mesh`` spells them (``"dp=2xtp=2"``, ``"pp=2xtp=2"``), for a target that
    applies plans or runs pipelines: the world sizes are theirs (``world_sizes`` beside them is
    refused) and every pair is on one of them. Shrinks towards the first world size and the
    simplest scenario."""
    from hypothesis import strategies as st

    from ddpcheck._language import strategies as dst

    focus = parse(only, "only")
    degrees = layouts = None
    if meshes is not None:
        if world_sizes is not DEFAULT_WORLD_SIZES:
            raise InvalidArgument(
                "meshes and world_sizes together: each mesh shape fixes its world size "
                "(dp x pp x tp); give meshes alone"
            )
        check_mesh_target("meshes", target)
        from ddpcheck._language.plans import check_degrees

        shapes = check_meshes("meshes", meshes)
        check_degrees(shapes, meshes, "meshes")
        degrees, layouts = mesh_degrees(shapes), mesh_layouts(shapes)
        world_sizes = tuple(layouts)
    sizes, per_size, excluded = example_strategies(
        target, world_sizes, dtypes, without, focus, degrees, layouts
    )
    runs = {
        w: per_size[w].filter(functools.partial(_runs, target, w, excluded, focus)) for w in sizes
    }
    return dst.paired(st.sampled_from(sizes), runs)


def _runs(
    target: Target,
    world_size: int,
    excluded: frozenset[str],
    focus: frozenset[str],
    scenario: Scenario,
) -> bool:
    return declines(target, scenario, world_size, excluded, focus) is None


def example_strategies(
    target: Target,
    world_sizes: Iterable[int],
    dtypes: Sequence[str],
    without: Iterable[str],
    only: Iterable[str] = (),
    degrees: Mapping[int, tuple[int, ...]] | None = None,
    layouts: Mapping[int, tuple[tuple[int, int], ...]] | None = None,
) -> tuple[tuple[int, ...], dict[int, st.SearchStrategy[Scenario]], frozenset[str]]:
    """``(world sizes, {W: scenarios target runs at W}, the features without excludes)``: one
    definition of what a target is drawn, for :func:`examples` and ``ddpcheck check``'s own
    random examples (``_runs.fuzz``), which tallies the declined draws itself. ``only``: drawn
    to exercise one of these features, at the world sizes where one can be
    (``ddpcheck.strategies.per_world_size`` builds the strategies from the feature sets).
    ``degrees``: ``{W: tensor-parallel degrees}`` drawn at each W (``--mesh``); ``layouts``:
    ``{W: (pp, tp) layouts}`` a pipeline target is drawn at each W (``--mesh``). A world size
    no mesh asked for serves the target is left out (``NothingChecked`` when none is left)."""
    from ddpcheck._language import strategies as dst

    sizes = check_world_sizes("world_sizes", world_sizes)
    excluded = parse(without, "without")
    focus = parse(only, "only")
    never = unsupported(target, excluded)
    own = _own_space(target, sizes, tuple(dtypes), never, degrees)
    if own is not None:
        return sizes, own, excluded
    models = target.own_plan_models() if target.parallelizes else None
    per_size = dst.per_world_size(
        sizes, dtypes, never, focus, type(target).__name__, degrees, layouts, models
    )
    return tuple(per_size), per_size, excluded


def _own_space(
    target: Target,
    sizes: tuple[int, ...],
    dtypes: tuple[str, ...],
    never: frozenset[str],
    degrees: Mapping[int, tuple[int, ...]] | None,
) -> dict[int, st.SearchStrategy[Scenario]] | None:
    """The target's own scenarios at each world size (``Target.drawn_scenarios``: a target
    training models of its own kind, torchtitan's or transformers'), or None where it draws
    ddpcheck's (a duck-typed target has no such hook)."""
    space = getattr(target, "drawn_scenarios", None)
    if not callable(space) or space(sizes[0], dtypes, never, None) is None:
        return None
    kept = tuple(d for d in dtypes if d not in never)
    if not kept:
        raise NothingChecked(
            f"{type(target).__name__} supports none of the dtypes {', '.join(dtypes)} once "
            "`without` (--without) is applied"
        )
    asked = sizes if degrees is None else tuple(w for w in sizes if w in degrees)
    if not asked:
        raise NothingChecked(f"no mesh asked for (--mesh) is one {type(target).__name__} runs on")
    return {w: space(w, kept, never, None if degrees is None else degrees[w]) for w in asked}
