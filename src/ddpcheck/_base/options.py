"""What a user can pass, and how it is checked: defaults, argument validators, world-size text
and the names of the capability vocabulary.

One place for the numbers a user can change and for every misuse message -- each names the
argument, the value and the rule -- so the API, the command line and the pytest plugin cannot
drift apart, and a bad argument fails before the first process spawn or collective instead of
hanging half a world. Imports no torch: the pytest plugin and ``ddpcheck --help`` load it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import numbers
import os
from collections.abc import Iterable
from typing import TypeGuard, TypeVar

from ddpcheck._base.errors import InvalidArgument

__all__ = [
    "BEYOND_TORCH",
    "DEFAULT_DEADLINE",
    "DEFAULT_FEATURES",
    "DEFAULT_WORLD_SIZES",
    "FEATURES",
    "MAX_RANKS_PER_CORE",
    "MESH_AXES",
    "OPT_IN",
    "STARTUP_DEADLINE",
    "WARM_UP_DEADLINE",
    "check_deadline",
    "check_fits_machine",
    "check_positive_number",
    "check_world_size",
    "check_world_sizes",
    "check_mesh_target",
    "check_meshes",
    "did_you_mean",
    "MeshShape",
    "mesh_degrees",
    "mesh_layouts",
    "mesh_size",
    "mesh_text",
    "named_fields",
    "parse_features",
    "parse_meshes",
    "parse_world_sizes",
]

#: World sizes checked when none are given: 1 (the wrapper is a no-op), 2 (the cheapest world
#: where replicas can disagree), 3 (divisor and ordering bugs 2 hides), 4.
DEFAULT_WORLD_SIZES = (1, 2, 3, 4)
#: Seconds one example may take before its world is declared hung.
DEFAULT_DEADLINE = 60.0
#: Seconds a freshly spawned world may take to import torch and rendezvous (W=8 took 11.4 s on
#: our 2-core machines; see docs/platform.md).
STARTUP_DEADLINE = 120.0
#: Seconds a target's once-per-process set-up (``Target.warm_up``) may take in a world's ranks:
#: DeepSpeed's first C++ op build took up to ~285 s here (2 loaded cores), 155-189 s in issue 37.
WARM_UP_DEADLINE = 900.0
#: More rank processes than this per core are refused: they would mostly wait for each other.
MAX_RANKS_PER_CORE = 16


def parse_world_sizes(text: str, flag: str = "--world-sizes") -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``; anything else is an :class:`InvalidArgument` naming
    ``flag``."""
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise InvalidArgument(
            f"{flag}={text!r} must be comma-separated integers, such as 1,2,3,4"
        ) from None
    return check_world_sizes(flag, sizes, shown=text)  # then the rules every door shares


#: A mesh's axes as ``--mesh`` spells them, outermost first, as ``init_device_mesh`` lays out
#: a pipeline of tensor-parallel stages (``_language.pipeline_parallel.ND_AXES``).
MESH_AXES = ("dp", "pp", "tp")
#: How a mesh shape is written: ``AXIS=N`` joined by ``x``, each axis at most once.
_MESH_EXAMPLE = "such as tp=2, dp=2xtp=2 or pp=2xtp=2"

#: A mesh shape: ``(dp, pp, tp)``.
MeshShape = tuple[int, int, int]


def mesh_text(shape: tuple[int, ...]) -> str:
    """``(dp, pp, tp)`` as ``--mesh`` spells it: ``tp=2``, ``dp=2xtp=2``, ``pp=2``,
    ``dp=2xpp=2xtp=2``, ``dp=4`` (an axis of 1 left out; one rank is ``tp=1``)."""
    dp, pp, tp = _triple(shape)
    parts = [f"dp={dp}"] if dp > 1 else []
    parts += [f"pp={pp}"] if pp > 1 else []
    parts += [f"tp={tp}"] if tp > 1 or not parts else []
    return "x".join(parts)


def _triple(shape: tuple[int, ...]) -> MeshShape:
    """A ``(dp, tp)`` pair (the shapes before a ``pp`` axis) or a ``(dp, pp, tp)`` triple."""
    if len(shape) == 2:
        return shape[0], 1, shape[1]
    dp, pp, tp = shape
    return dp, pp, tp


def _mesh_shape(text: str, name: str, shown: object) -> MeshShape:
    """One shape, ``tp=2`` / ``dp=2xpp=2xtp=2``, as ``(dp, pp, tp)``; an axis not named is 1."""
    degrees: dict[str, int] = {}
    for part in text.strip().split("x"):
        axis, sep, value = part.strip().partition("=")
        axis, value = axis.strip(), value.strip()
        if not sep or not axis or not value:
            raise InvalidArgument(
                f"{name}={shown!r}: {text.strip()!r} is not a mesh shape; write AXIS=N joined "
                f"by x, {_MESH_EXAMPLE}"
            )
        if axis not in MESH_AXES:
            raise InvalidArgument(
                f"{name}={shown!r}: unknown axis {axis!r}{did_you_mean(axis, MESH_AXES)}; "
                f"the axes are {', '.join(MESH_AXES[:-1])} and {MESH_AXES[-1]}, {_MESH_EXAMPLE}"
            )
        if axis in degrees:
            raise InvalidArgument(f"{name}={shown!r}: {text.strip()!r} names {axis} twice")
        try:
            degree = int(value)
        except ValueError:
            raise InvalidArgument(
                f"{name}={shown!r}: {axis}={value!r} is not an integer, {_MESH_EXAMPLE}"
            ) from None
        if degree < 1:
            raise InvalidArgument(f"{name}={shown!r}: {axis}={degree} must be at least 1")
        degrees[axis] = degree
    return degrees.get("dp", 1), degrees.get("pp", 1), degrees.get("tp", 1)


def mesh_size(shape: MeshShape) -> int:
    """The world size a mesh shape fixes: ``dp * pp * tp``."""
    dp, pp, tp = shape
    return dp * pp * tp


def mesh_degrees(shapes: Iterable[MeshShape]) -> dict[int, tuple[int, ...]]:
    """``{W: the tensor-parallel degrees of the shapes at W}`` for the shapes without a pipeline
    (``pp = 1``): what the draws of a target that applies plans may pick at each W."""
    found: dict[int, tuple[int, ...]] = {}
    for dp, pp, tp in shapes:
        if pp == 1:
            found[dp * tp] = (*found.get(dp * tp, ()), tp)
    return found


def mesh_layouts(shapes: Iterable[MeshShape]) -> dict[int, tuple[tuple[int, int], ...]]:
    """``{W: the (pp, tp) layouts of the shapes at W}``: what the draws of a pipeline target may
    pick at each W (``dp`` is what is left)."""
    found: dict[int, tuple[tuple[int, int], ...]] = {}
    for shape in shapes:
        _, pp, tp = shape
        found[mesh_size(shape)] = (*found.get(mesh_size(shape), ()), (pp, tp))
    return found


def check_mesh_target(name: str, target: object, named: str | None = None) -> None:
    """Refuse a mesh for a target that opts into neither tensor nor pipeline parallelism: it
    would be drawn no example on one (``Target.parallelizes``, ``Target.pipelines``).
    ``named``: the target as the user named it."""
    flags = (OPT_IN["tensor-parallel"], OPT_IN["pipeline-parallel"])
    if not any(getattr(target, flag, False) for flag in flags):
        cls = type(target).__name__
        who = f"{named} ({cls})" if named and named != cls else cls
        raise InvalidArgument(
            f"{name}: {who} opts into neither tensor nor pipeline parallelism "
            f"({cls}.{flags[0]} and {cls}.{flags[1]} are not set), so it runs on no mesh; a "
            "mesh is for a target that applies tensor-parallel plans or runs pipeline stages "
            f"(torch_tp, torch_2d, parallel_tp, hf_tp, torch_pp, torch_nd, or your own with "
            f"{flags[0]} = True or {flags[1]} = True)"
        )


def parse_meshes(text: str, flag: str = "--mesh") -> tuple[MeshShape, ...]:
    """``"tp=2,pp=2xtp=2"`` -> ``((1, 1, 2), (1, 2, 2))``; anything else is an
    :class:`InvalidArgument` naming ``flag`` and the problem (a malformed shape, an unknown axis,
    a degree below 1)."""
    return check_meshes(flag, text)  # (a text is split at its commas there)


def check_meshes(name: str, values: object, shown: object = None) -> tuple[MeshShape, ...]:
    """Mesh shapes as distinct ``(dp, pp, tp)`` triples, smallest world first (then smallest
    ``pp``, then ``tp``: a failure shrinks towards the first): each given as its text
    (``"dp=2xtp=2"``), as a ``(dp, tp)`` pair or as a ``(dp, pp, tp)`` triple of positive
    integers."""
    shown = values if shown is None else shown
    if isinstance(values, str):
        values = [p for p in values.split(",") if p.strip()]
    if not isinstance(values, Iterable):
        raise InvalidArgument(
            f"{name}={shown!r} must be mesh shapes, {_MESH_EXAMPLE} (or (dp, tp) pairs, "
            "(dp, pp, tp) triples)"
        )
    shapes: list[MeshShape] = []
    for value in values:
        if isinstance(value, str):
            shapes.append(_mesh_shape(value, name, shown))
            continue
        given = tuple(value) if isinstance(value, Iterable) else ()
        if len(given) not in (2, 3) or not all(_is_int(d) for d in given):
            raise InvalidArgument(
                f"{name}={shown!r} contains {value!r}; a mesh shape is text, {_MESH_EXAMPLE}, "
                "a (dp, tp) pair or a (dp, pp, tp) triple of integers"
            )
        shape = _triple(tuple(int(d) for d in given))
        for axis, degree in zip(MESH_AXES, shape):
            if degree < 1:
                raise InvalidArgument(f"{name}={shown!r}: {axis}={degree} must be at least 1")
        shapes.append(shape)
    if not shapes:
        raise InvalidArgument(
            f"{name}={shown!r} is empty; give at least one shape, {_MESH_EXAMPLE}"
        )
    return tuple(sorted(set(shapes), key=lambda s: (mesh_size(s), s[1], s[2])))


def check_fits_machine(
    world_sizes: tuple[int, ...], *, workers: int = 1, flag: str = "--world-sizes"
) -> None:
    """Refuse worlds that cannot fit this machine: ``workers`` processes each keep a world of the
    largest size alive, and more than :data:`MAX_RANKS_PER_CORE` ranks per core would spend the
    deadline waiting for each other (and a 64-rank world needs ~10 GB just to import torch)."""
    cores = os.cpu_count() or 1
    ranks = workers * max(world_sizes)
    if ranks > MAX_RANKS_PER_CORE * cores:
        who = f"{workers} workers with " if workers > 1 else ""
        raise InvalidArgument(
            f"{who}{flag} up to {max(world_sizes)} would start {ranks} rank processes on "
            f"{cores} core(s) (at most {MAX_RANKS_PER_CORE} per core); lower the largest world "
            "size" + (" or the number of workers" if workers > 1 else "")
        )


# ---------------------------------------------------------------------------------------------
# Argument validators


def _is_int(value: object) -> TypeGuard[numbers.Integral]:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_world_size(name: str, value: object) -> int:
    if not _is_int(value):
        raise InvalidArgument(f"{name}={value!r} must be a positive integer (a number of ranks)")
    if value < 1:
        raise InvalidArgument(f"{name}={value!r} must be at least 1")
    return int(value)


def check_world_sizes(name: str, values: object, shown: object = None) -> tuple[int, ...]:
    """World sizes as a tuple of distinct positive integers, in the order given; ``shown``: the
    value as the user wrote it, for the message (the text of a command-line flag)."""
    shown = values if shown is None else shown
    if _is_int(values):
        values = (values,)
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidArgument(
            f"{name}={shown!r} must be a sequence of positive integers, such as (1, 2, 3, 4)"
        )
    values = tuple(values)
    if not values:
        raise InvalidArgument(f"{name}={shown!r} is empty; give at least one world size")
    for v in values:
        if not _is_int(v) or v < 1:
            raise InvalidArgument(
                f"{name}={shown!r} contains {v!r}; every world size must be a positive integer"
            )
    return tuple(dict.fromkeys(int(v) for v in values))


def check_positive_number(name: str, value: object, shown: object = None) -> float:
    """A positive number; ``shown``: the value as the user wrote it, for the message."""
    shown = value if shown is None else shown
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) > 0:
        raise InvalidArgument(f"{name}={shown!r} must be a positive number")
    return float(value)


def check_deadline(name: str, value: object, shown: object = None) -> float:
    """Seconds to wait: positive and finite (every wait has a deadline)."""
    seconds = check_positive_number(name, value, shown)
    if seconds == float("inf"):
        raise InvalidArgument(
            f"{name}={value if shown is None else shown!r} must be finite: "
            "every wait has a deadline; use a large number of seconds, such "
            "as 3600"
        )
    return seconds


# ---------------------------------------------------------------------------------------------
# The capability vocabulary's names (``ddpcheck.features`` says what each scenario exercises)


#: Every feature a scenario can exercise, with what it means (the order of reports).
FEATURES: dict[str, str] = {
    "float64": "float64 scenarios",
    "float32": "float32 scenarios (calibrated tolerance)",
    "accumulation": "several micro-batches per step, all but the last under no_sync()",
    "unused-on-some-ranks": "a trainable parameter with a gradient on some ranks but None on "
    "others (its layer is used by some samples only)",
    "unused-everywhere": "a trainable parameter no rank uses in a step (its grad stays None)",
    "frozen": "parameters with requires_grad=False",
    "tied": "one parameter used twice in a step (tied or reused weights)",
    "buffers": "buffers, which must start as rank 0's",
    "mixed-dtypes": "float32 and float64 parameters in one model",
    "non-contiguous": "a parameter created non-contiguous (a transposed view)",
    "param-groups": "several param groups with their own hyperparameters",
    "lr-schedule": "an LR schedule stepped after every optimizer step",
    "clipping": "the synchronised gradients clipped to a global norm before every step "
    "(max_grad_norm, grad_norm_type)",
    "uneven-batches": "a global batch not divisible by W (some ranks get fewer, or no, samples)",
    "epochs": "a dataset of N samples passed over in epochs: a short last batch and a short last "
    "accumulation window where the global batch does not divide N (Scenario.epochs)",
    "broadcast": "ranks initialised differently: the target must broadcast rank 0's state",
    "grads-kept": "zero_grad(set_to_none=False): gradients kept (zeroed) between steps",
    "rank-orders": "each rank registers parameters and buffers in its own order (same names and "
    "shapes)",
    "checkpoint": "a checkpoint saved after a step and the run resumed from it, possibly at "
    "another world size (save_checkpoint / load_checkpoint)",
    "tokens": "a language model trained on padded token sequences: the loss is the mean (or "
    "sum) over the global batch's non-padding tokens (loss='token_cross_entropy' or another token "
    "loss: label smoothing, a KL term, an entropy bonus, a policy gradient)",
    "autocast": "the forward under torch.autocast in bfloat16 or float16 (float32 parameters)",
    "param-dtype": "float32 master weights, forward and backward in bfloat16 or float16, "
    "gradients accumulated and reduced in float32 (FSDP2's MixedPrecisionPolicy); "
    "opt-in",
    "tensor-parallel": "a (dp, tp) device mesh: layers sharded over tp by a tensor-parallel plan, "
    "the batch split over dp (Scenario.tensor_parallel); opt-in",
    "pipeline-parallel": "a (dp, pp) device mesh: the model cut into stages run by a pipeline "
    "schedule over pp, the batch split over dp (Scenario.pipeline); opt-in",
}

#: Features beyond torch's own contract, by the target attribute that opts in to each: a target
#: supports one only when that attribute is true, whatever its ``supported_features`` say (so
#: ``FEATURES.keys() - {...}`` never opts in by accident). A ``param_dtype`` policy is the
#: target's to apply (FSDP2's ``MixedPrecisionPolicy``); one that does not would train in float32
#: and be blamed for it.
OPT_IN: dict[str, str] = {
    "param-dtype": "applies_param_dtype",
    # the target's parallelize(module, mesh) hook applies a plan: data-parallel code has none
    "tensor-parallel": "parallelizes",
    # the target runs the model's stages with a pipeline schedule: data-parallel code does not
    "pipeline-parallel": "pipelines",
}


#: Features beyond the contract of torch's own DistributedDataParallel, which requires "the exact
#: same parameter registration order" on every process: checked only on targets that declare
#: them in ``supported_features``, so that a new default never turns a correct target red.
BEYOND_TORCH = frozenset({"rank-orders"})
#: What a target that declares nothing (``supported_features = None``) and sets no
#: :data:`OPT_IN` attribute is checked on.
DEFAULT_FEATURES = frozenset(FEATURES) - BEYOND_TORCH - OPT_IN.keys()


def parse_features(text: str | Iterable[str], flag: str = "--without") -> frozenset[str]:
    """``"accumulation,buffers"`` (or an iterable of names) -> a validated set of features."""
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text)]
    names = [n for n in names if n]
    unknown = [n for n in names if n not in FEATURES]
    if unknown:
        raise InvalidArgument(
            f"{flag}: {', '.join(map(repr, unknown))} "
            f"{'is not a feature' if len(unknown) == 1 else 'are not features'}"
            f"{did_you_mean(unknown[0], FEATURES)}; known: {', '.join(FEATURES)}"
        )
    return frozenset(names)


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` to a mistyped ``name``, or ``""``
    (``difflib``'s ratio, as Python's own NameError suggestions)."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class UnknownField(InvalidArgument, TypeError):
    """A keyword that is no field of the class called: the scenario language's own error (exit
    2), and still the ``TypeError`` Python raises for an unexpected keyword argument."""


C = TypeVar("C", bound=type)


def named_fields(cls: C) -> C:
    """The dataclass ``cls``, whose constructor answers a mistyped keyword (``widht=3``) with the
    closest field, as Python 3.11 does for a mistyped name but not for a keyword argument: a
    scenario field misspelt in a replay line or a test is the first thing a user trips on."""
    init = cls.__init__  # type: ignore[misc]
    names = [f.name for f in dataclasses.fields(cls) if f.init]

    @functools.wraps(init)
    def __init__(self: object, *args: object, **kwargs: object) -> None:
        for name in kwargs.keys() - set(names):
            raise UnknownField(
                f"{cls.__name__} has no field {name!r}{did_you_mean(name, names)}; "
                f"its fields: {', '.join(names)}"
            )
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]
    return cls
