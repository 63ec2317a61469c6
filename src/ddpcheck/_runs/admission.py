"""One admission step for every front door: what a caller passes becomes one validated
:class:`Request` before any process starts, and nothing below re-checks it.

The doors -- ``assert_equivalent``, ``check_example``, ``fuzz``, ``survey``, the command line's
commands, the pytest plugin, torchrun -- differ in what they run, not in what they accept: an
argument is refused by one rule with one message, naming it as the door spells it (``world_sizes=``
in Python, ``--world-sizes`` on the command line, ``--ddpcheck-world-sizes`` in pytest;
:class:`Spelling`). Cheap checks come first, so a mistyped flag is answered before a slow import
(this module imports no torch; the scenario and the target load it): the device, the world sizes
(against the machine too), the deadline, the features and dtypes, the scenario (parsed and judged),
and last the target (resolved, checked, its framework release).

One set of defaults, the same at every door: world sizes 1,2,3,4 (1: the wrapper is a no-op; 2: the
cheapest world where replicas can disagree; 3: divisor and ordering bugs 2 hides), a 60 s deadline,
the CPU over gloo, and ``dtypes`` unset -- the battery runs whole (its float32 scenario too:
``python check_my_ddp.py`` and ``ddpcheck check`` run the same battery) and random examples are
float64, whose rounding is 2^29 times finer than float32's, so a small bug is not lost in it.
Naming dtypes restricts both.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import sys
import traceback
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ddpcheck._base.devices import check_fits
from ddpcheck._base.errors import DdpcheckError, InvalidArgument
from ddpcheck._base.options import (
    DEFAULT_DEADLINE,
    DEFAULT_WORLD_SIZES,
    MeshShape,
    check_deadline,
    check_fits_machine,
    check_mesh_target,
    check_meshes,
    check_world_sizes,
    did_you_mean,
    mesh_degrees,
    mesh_layouts,
    mesh_size,
    mesh_text,
    parse_features,
    parse_meshes,
    parse_world_sizes,
)
from ddpcheck._base.scripts import load
from ddpcheck._runs.settings import Settings

if TYPE_CHECKING:
    from ddpcheck._language.scenario import Scenario

__all__ = [
    "API",
    "COMMAND_LINE",
    "DTYPES",
    "NO_TARGET",
    "PYTEST",
    "RANDOM_DTYPES",
    "Request",
    "Spelling",
    "admit",
    "admit_target",
    "check_target",
    "config_value",
    "configured",
    "resolve_rule",
    "resolve_target",
]

#: The dtypes a run can be restricted to.
DTYPES = ("float64", "float32")
#: The dtypes of random examples when none are named (see the module's docstring).
RANDOM_DTYPES = ("float64",)


@dataclasses.dataclass(frozen=True)
class Spelling:
    """How a door names each argument in its messages."""

    target: str = "target"
    scenario: str = "scenario"
    world_sizes: str = "world_sizes"
    deadline: str = "deadline"
    without: str = "without"
    dtypes: str = "dtypes"
    device: str = "device"
    only: str = "only"
    fuzz_config: str = "fuzz_config=True"
    #: the door passes text (a command line's flags): numbers, lists, a scenario's repr and a
    #: target's name are read from it; in Python, a string where a number belongs is refused
    text: bool = False
    config: str = "config"
    meshes: str = "meshes"


API = Spelling()
COMMAND_LINE = Spelling(
    "MODULE:TARGET",
    "--scenario",
    "--world-sizes",
    "--deadline",
    "--without",
    "--dtypes",
    "--device",
    "--only",
    "--fuzz-config",
    text=True,
    config="--config",
    meshes="--mesh",
)
PYTEST = Spelling(
    "target",
    "scenario",
    "--ddpcheck-world-sizes",
    "--ddpcheck-deadline",
    "--ddpcheck-without",
    "--ddpcheck-dtypes",
    "--ddpcheck-device",
    "--ddpcheck-only",
    "--ddpcheck-fuzz-config",
    text=True,
    config="--ddpcheck-config",
    meshes="--ddpcheck-mesh",
)

#: ``admit``'s target when a door admits its options alone (the pytest plugin for its session,
#: ``ddpcheck mutants``, ``ddpcheck fuzz-rule``): None is a target, and a wrong one.
NO_TARGET: Any = object()


@dataclasses.dataclass(frozen=True)
class Request:
    """A run, admitted: every field checked, defaults filled in. ``target`` is None where a door
    admits its options before it knows the target (the pytest plugin, for the session)."""

    target: Any
    world_sizes: tuple[int, ...] = DEFAULT_WORLD_SIZES
    deadline: float = DEFAULT_DEADLINE
    without: frozenset[str] = frozenset()
    #: the dtypes named, or None: the battery whole and random examples in RANDOM_DTYPES
    dtypes: tuple[str, ...] | None = None
    device: str = "cpu"
    backend: str | None = None
    scenario: Scenario | None = None
    #: features every example must exercise one of (none: no focus)
    only: frozenset[str] = frozenset()
    #: every random example draws a configuration of the target too (``Target.config_space``)
    fuzz_config: bool = False
    #: a framework configuration given apart from the target (``--config FILE``), applied to
    #: the target when it is admitted (:func:`configured`)
    config: str | None = None
    #: the ``(dp, pp, tp)`` mesh shapes every example runs on (``--mesh``), or None: any the
    #: world sizes hold; ``world_sizes`` is then theirs (``dp * pp * tp`` each)
    meshes: tuple[MeshShape, ...] | None = None

    @property
    def degrees(self) -> dict[int, tuple[int, ...]] | None:
        """``{W: the tensor-parallel degrees drawn at W}`` under ``meshes`` (their shapes
        without a pipeline: a target that applies plans), else None."""
        if self.meshes is None:
            return None
        return mesh_degrees(self.meshes)

    @property
    def layouts(self) -> dict[int, tuple[tuple[int, int], ...]] | None:
        """``{W: the (pp, tp) layouts drawn at W}`` under ``meshes`` (a pipeline target's),
        else None."""
        if self.meshes is None:
            return None
        return mesh_layouts(self.meshes)

    def off_mesh(self, scenario: Scenario, world_size: int) -> str | None:
        """Why ``scenario`` is not run at ``world_size`` under the meshes asked for: its mesh
        there is none of them (None: it is one, or none were asked for, or the world cannot
        hold its mesh at all -- the target declines that, naming why)."""
        from ddpcheck._language.scenario import mesh_of

        if self.meshes is None:
            return None
        shape = mesh_of(scenario, world_size)
        if shape is None or shape in self.meshes:
            return None
        asked = ",".join(map(mesh_text, self.meshes))
        return f"its mesh {mesh_text(shape)} is not among the meshes asked for ({asked})"

    @property
    def run(self) -> Settings:
        """What every example of the run is given (``_runs.example.check_example``'s)."""
        return Settings(self.deadline, self.device, self.backend)

    @property
    def battery_without(self) -> frozenset[str]:
        """Features the battery leaves out: ``without``, and the dtypes not named."""
        if self.dtypes is None:
            return self.without
        return self.without | (frozenset(DTYPES) - set(self.dtypes))

    @property
    def random_dtypes(self) -> tuple[str, ...]:
        """The dtypes random examples are drawn in: those named, else float64 -- or, for a
        target that declines float64 (torchtitan's float32 RoPE, DeepSpeed's float32 masters),
        the dtypes it does check, so that its own name alone checks it."""
        if self.dtypes is not None:
            return self.dtypes
        from ddpcheck.targets import support

        declined = support.unsupported(self.target)  # by the target; --without is the user's
        if self.target is NO_TARGET or not all(d in declined for d in RANDOM_DTYPES):
            return RANDOM_DTYPES
        kept = declined | self.without
        return tuple(d for d in DTYPES if d not in kept) or RANDOM_DTYPES


def admit(
    target: Any = NO_TARGET,
    *,
    scenario: Any = None,
    world_sizes: Any = DEFAULT_WORLD_SIZES,
    deadline: Any = DEFAULT_DEADLINE,
    without: Any = (),
    dtypes: Any = None,
    device: str = "cpu",
    backend: str | None = None,
    only: Any = (),
    spelling: Spelling = API,
    workers: int = 1,
    fits_machine: bool = True,
    fuzz_config: bool = False,
    config: str | None = None,
    meshes: Any = None,
) -> Request:
    """``Request`` from what a door was given, or :class:`InvalidArgument` naming the argument.

    Where the door passes text (``spelling.text``): ``world_sizes`` ("1,2,3"), ``deadline`` ("60"),
    ``scenario`` (its repr, as a replay line prints it), ``target`` (a built-in name,
    ``MODULE:EXPR`` or ``path/to/FILE.py:EXPR``); ``without`` and ``dtypes`` ("a,b") anywhere.
    ``target=NO_TARGET`` (the default) admits the options alone. ``workers``: processes that will
    run worlds at once (pytest-xdist's), for the machine's limit; ``fits_machine=False`` leaves that
    limit to the caller (the plugin checks it only for world sizes a user asked for).
    ``fuzz_config``: a target with no options to fuzz (``Target.config_space`` None) is refused.
    ``config``: a framework configuration given apart from the target (``--config FILE``:
    :func:`configured`). ``meshes`` (``--mesh``: text such as ``"tp=2,dp=2xtp=2,pp=2xtp=2"``,
    ``(dp, tp)`` pairs or ``(dp, pp, tp)`` triples): every example on one of these mesh shapes,
    the world sizes theirs -- refused beside ``world_sizes`` (a shape fixes its world size; any
    value but the default object, ``DEFAULT_WORLD_SIZES`` itself, counts as given), for a target
    that neither applies plans nor runs pipelines, and for a ``tp`` no drawn model can use (that
    check imports torch)."""
    text = spelling.text
    shapes = _meshes(meshes, world_sizes, spelling)
    if shapes is not None:
        sizes = tuple(dict.fromkeys(map(mesh_size, shapes)))
    else:
        sizes = (
            parse_world_sizes(world_sizes, spelling.world_sizes)
            if text and isinstance(world_sizes, str)
            else check_world_sizes(spelling.world_sizes, world_sizes)
        )
    sizes_flag = spelling.world_sizes if shapes is None else spelling.meshes
    if fits_machine:
        check_fits_machine(sizes, workers=workers, flag=sizes_flag)
    check_fits(device, sizes, backend, flag=spelling.device)
    if shapes is not None:
        from ddpcheck._language.plans import check_degrees

        check_degrees(shapes, meshes, spelling.meshes)
    seconds = check_deadline(
        spelling.deadline, _number(deadline) if text else deadline, shown=deadline
    )
    excluded = parse_features(without, spelling.without)
    named = _dtypes(dtypes, spelling.dtypes)
    focus = parse_features(only, spelling.only)
    for feature in sorted(focus & excluded):
        raise InvalidArgument(
            f"{spelling.only}: {feature!r} is also in {spelling.without}; "
            "an example cannot both exercise it and not"
        )
    for feature in sorted(focus):
        needs = _dtype_needed(feature)
        if named is not None and needs is not None and needs not in named:
            raise InvalidArgument(
                f"{spelling.only}: {feature!r} needs {needs}, not among "
                f"{spelling.dtypes}={','.join(named)}"
            )
    if scenario is not None:
        scenario = _scenario(scenario, spelling.scenario, text)
    options = Request(
        None,
        sizes,
        seconds,
        excluded,
        named,
        device,
        backend,
        scenario,
        focus,
        bool(fuzz_config),
        config,
        shapes,
    )
    if target is NO_TARGET:
        return options
    return dataclasses.replace(options, target=_target(target, options, spelling))


def _meshes(meshes: Any, world_sizes: Any, spelling: Spelling) -> tuple[MeshShape, ...] | None:
    """The mesh shapes asked for, parsed and checked (None: none asked for); refused with world
    sizes beside them: each shape fixes its world size, so one of the two says it all."""
    if meshes is None:
        return None
    if world_sizes is not DEFAULT_WORLD_SIZES:  # the default itself: not given
        raise InvalidArgument(
            f"{spelling.meshes} and {spelling.world_sizes} together: each mesh shape fixes its "
            f"world size (dp x pp x tp); give {spelling.meshes} alone"
        )
    if spelling.text and isinstance(meshes, str):
        return parse_meshes(meshes, spelling.meshes)
    return check_meshes(spelling.meshes, meshes)


def admit_target(
    request: Request,
    target: Any,
    *,
    scenario: Any = None,
    world_sizes: Any = None,
    spelling: Spelling = API,
) -> Request:
    """``request`` -- its options admitted without a target (the pytest plugin's session) --
    with ``target``, and where given a scenario and other world sizes, admitted by the rules of
    :func:`admit`: the options are not admitted again."""
    sizes = request.world_sizes
    if world_sizes is not None and request.meshes is not None:
        raise InvalidArgument(
            f"world_sizes={world_sizes!r} with {spelling.meshes}: each mesh shape fixes its "
            "world size (dp x pp x tp); leave world_sizes out"
        )
    if world_sizes is not None:
        sizes = check_world_sizes(spelling.world_sizes, world_sizes)
        check_fits_machine(sizes, flag=spelling.world_sizes)
        check_fits(request.device, sizes, request.backend, flag=spelling.device)
    if scenario is not None:
        scenario = _scenario(scenario, spelling.scenario, spelling.text)
    return dataclasses.replace(
        request,
        target=_target(target, request, spelling),
        scenario=scenario,
        world_sizes=sizes,
    )


def _target(target: Any, options: Request, spelling: Spelling) -> Any:
    """The target, resolved where named as text, configured (``config``), and checked against
    the admitted options: it must travel and replay, and serve what they focus on."""
    named = target if spelling.text and isinstance(target, str) else None
    if named is not None:
        target = resolve_target(target, options.config, flag=spelling.config)
    elif options.config is not None:
        target = configured(target, options.config, flag=spelling.config)
    if options.meshes is not None:
        check_mesh_target(spelling.meshes, target, named)
    check_target(target, options.device)
    _check_focus(target, options.only, options.without, spelling.only)
    if options.fuzz_config:
        _check_config_space(target, spelling.fuzz_config)
    return target


def _check_config_space(target: Any, name: str) -> None:
    """Refuse fuzzing the options of a target that declares none, before any process starts."""
    from ddpcheck.targets.option_space import space_of

    if space_of(target) is None:
        cls = type(target).__name__
        raise InvalidArgument(
            f"{name}: {cls} has no options to fuzz ({cls}.config_space() returns None); "
            f"define config_space() returning ddpcheck.targets.option_space.options(fields="
            "{...}) to draw its options, or check it without it"
        )


def _dtype_needed(feature: str) -> str | None:
    """The dtype an example exercising ``feature`` is in, where only one can."""
    if feature in ("float64", "float32"):
        return feature
    from ddpcheck._language.strategies import (
        FLOAT32_ONLY,  # the precision policies: float32 masters
    )

    return "float32" if feature in FLOAT32_ONLY else None


def _check_focus(target: Any, focus: frozenset[str], excluded: frozenset[str], name: str) -> None:
    """A feature to focus on that the target does not support would leave nothing to draw:
    refused, naming why, instead of a run that checks nothing."""
    from ddpcheck.targets import support

    for feature in sorted(focus & support.unsupported(target, excluded)):
        raise InvalidArgument(
            f"{name}: {type(target).__name__} does not support {feature!r} "
            f"({support.why_unsupported(target, feature)})"
        )


def _number(value: Any) -> Any:
    """A flag's text as a number, or as it was (refused as not one, shown as written)."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _dtypes(dtypes: Any, name: str) -> tuple[str, ...] | None:
    if dtypes is None:
        return None
    given = dtypes.split(",") if isinstance(dtypes, str) else list(dtypes)
    named = tuple(sorted({str(d).strip() for d in given if str(d).strip()}))
    wrong = [d for d in named if d not in DTYPES]
    if not named or wrong:
        hint = did_you_mean(wrong[0], DTYPES) if wrong else ""
        raise InvalidArgument(f"{name}={dtypes!r} must name float64, float32 or both{hint}")
    return named


def _scenario(scenario: Any, name: str, text: bool) -> Scenario:
    """The scenario, read from its repr where given as text, and judged: one the oracle cannot
    judge (``ScenarioError``) or the target's model cannot build is refused here."""
    from ddpcheck._language.scenario import Scenario
    from ddpcheck._oracle.judgeable import check_scenario
    from ddpcheck._runs.replay import from_repr

    if text and isinstance(scenario, str):
        written = scenario
        try:
            scenario = from_repr(written)
        except InvalidArgument as exc:  # e.g. Scenario(steps=0): say which argument held it
            raise InvalidArgument(f"{name} {written!r}: {exc}") from exc
        except Exception as exc:
            raise InvalidArgument(f"{name} could not be read: {type(exc).__name__}: {exc}") from exc
    if not isinstance(scenario, Scenario):
        raise InvalidArgument(
            f"{name}={scenario!r} must be a ddpcheck.Scenario (or None for the built-in battery)"
        )
    from ddpcheck._runs.example import _beside_the_ranks

    with _beside_the_ranks():  # as every computation of this process beside the ranks
        check_scenario(scenario)
    return scenario


def check_target(target: Any, device: str = "cpu") -> None:
    """Refuse, before any world runs, a target the ranks could not use or a failure could not
    replay, or whose framework or torch is older than it supports on ``device``; name what is
    wrong and how to fix it."""
    from ddpcheck._runs.replay import verify_replayable
    from ddpcheck.targets.framework import check_requirements

    if isinstance(target, type):
        raise InvalidArgument(
            f"target={target.__qualname__} is a class; pass an instance, "
            f"such as {target.__qualname__}()"
        )
    missing = [
        m
        for m in (
            "configure",
            "supports",
            "wrap",
            "make_optimizer",
            "before_step",
            "after_backward",
            "after_step",
            "no_sync",
            "optimizer_state",
        )
        if not callable(getattr(target, m, None))
    ]
    if missing:
        raise InvalidArgument(f"target={target!r} lacks {missing}; subclass ddpcheck.Target")
    supported = getattr(target, "supported_features", None)
    if supported is not None:  # a typo would silently decline nothing
        parse_features(supported, f"{type(target).__name__}.supported_features")
    try:
        pickled = pickle.dumps(target)
    except Exception as exc:
        raise InvalidArgument(
            f"target={target!r} cannot be pickled ({exc}); targets travel to every rank by "
            "pickle, so define the class at module level of an importable module or of the "
            "script you run, and give it functions defined with def at module level (not a "
            "lambda, not a function defined inside another)"
        ) from exc
    verify_replayable(target, pickled)  # a failure's replay line must rebuild exactly this target
    check_requirements(target, device)  # a framework or torch older than supported: exit 2


# ---------------------------------------------------------------------------------------------
# Names to objects: a target or a sharding rule given as text


def resolve_target(spec: str, config: str | None = None, *, flag: str = "--config") -> Any:
    """``parallel`` / ``MODULE:ATTR`` / ``MODULE:EXPR`` / ``path/to/FILE.py:EXPR`` -> a target
    instance; with ``config`` (``--config FILE``), that target built with it
    (:func:`configured`)."""
    target = _resolve_target(spec)
    return target if config is None else configured(target, config, flag=flag, shown=spec)


def configured(
    target: Any, config: str, *, flag: str = "--config", shown: str | None = None
) -> Any:
    """``target`` -- a ready-made framework target, without a configuration -- built with
    ``config=`` (``dataclasses.replace``): ``config`` is the path of a JSON file, which the
    target reads, or ``MODULE:NAME`` / ``path/to/FILE.py:NAME`` naming a dict (so that plugin
    objects can be objects). Refused, naming why, for any other target, or one that has a
    configuration already (docs/frameworks.md, "Your own configuration")."""
    from ddpcheck.targets import READY_MADE

    shown = shown or type(target).__name__
    if not _configurable(target):
        names = [e.name for e in READY_MADE if _configurable(e.target)]
        raise InvalidArgument(
            f"{flag} {config!r}: {shown} takes no configuration; {flag} "
            f"configures a ready-made framework target ({', '.join(names)})"
        )
    if (
        getattr(target, "config", None) is not None
        or getattr(target, "training_args", None) is not None
    ):
        raise InvalidArgument(
            f"{flag} {config!r}: {shown} has a configuration already "
            f"(config=...); give it one way, {flag} or the expression's "
            "config="
        )
    return dataclasses.replace(target, config=config_value(config, flag=flag))


def config_value(config: str, *, flag: str = "--config") -> Any:
    """What ``--config`` gives a target's ``config``: the dict ``MODULE:NAME`` names, or the path
    of a JSON file as it is (the target reads it, checked here: an object, readable)."""
    from ddpcheck.targets.configuration import load_config

    if ":" in config and not os.path.exists(config):  # MODULE:NAME, not a file
        value = _resolve(config, "config")
        if not isinstance(value, Mapping):
            raise InvalidArgument(
                f"{flag} {config!r} is a {type(value).__name__}, not a dict "
                "of the framework's keyword arguments"
            )
        return value
    load_config(config, target=flag)
    return config


def _configurable(target: Any) -> bool:
    """A target instance with a ``config`` field: a ready-made framework target's class."""
    return (
        dataclasses.is_dataclass(target)
        and not isinstance(target, type)
        and any(f.name == "config" for f in dataclasses.fields(target))
    )


def _resolve_target(spec: str) -> Any:
    from ddpcheck.targets import BUILTIN, READY_MADE

    if spec in BUILTIN:
        return BUILTIN[spec]
    missing = next((e for e in READY_MADE if e.name == spec), None)
    if missing is not None:  # a framework's target, the framework not installed
        raise InvalidArgument(
            f"target {spec!r} drives {missing.framework}, which is not "
            f"installed here: {missing.install} (docs/frameworks.md lists the "
            "releases tried)"
        )
    from ddpcheck.targets.surveyed import surveyed

    stack = surveyed(spec)
    if stack is not None:  # a stack surveyed and left without a target: why, not "no such"
        raise InvalidArgument(stack.message())
    if ":" not in spec:  # a built-in name, mistyped
        names = [*BUILTIN, *(e.name for e in READY_MADE)]
        raise InvalidArgument(
            f"target {spec!r} is not a built-in target"
            f"{did_you_mean(spec, names)} (`ddpcheck targets` lists them: "
            f"{', '.join(dict.fromkeys(names))}), nor MODULE:NAME or "
            "path/to/FILE.py:NAME for your own"
        )
    return _resolve(spec, "target")


def resolve_rule(spec: str) -> Any:
    """``MODULE:NAME`` / ``path/to/FILE.py:NAME`` -> a sharding rule (a function)."""
    rule = _resolve(spec, "rule")
    if not callable(rule):
        raise InvalidArgument(
            f"rule {spec!r} is a {type(rule).__name__}, not a function "
            "rule(params, world_size) -> owners"
        )
    return rule


def _resolve(spec: str, what: str) -> Any:
    if ":" not in spec:
        raise InvalidArgument(
            f"{what} {spec!r} must look like MODULE:NAME or "
            f"path/to/FILE.py:NAME (for example mypkg.checks:MY_{what.upper()} "
            f"or check_my_ddp.py:MY_{what.upper()})"
        )
    module_name, expr = spec.split(":", 1)
    sys.path.insert(0, os.getcwd())  # like `python -m`, modules in the current directory count
    try:  # a FILE.py is imported under its own name: its `if __name__ == "__main__":` stays shut
        module = load(module_name)
    except InvalidArgument as exc:  # not a file, or a name that cannot be its module's
        raise InvalidArgument(f"{what} {spec!r}: {exc}") from None
    except Exception as exc:  # ImportError, and whatever the module raises while importing
        where = ""
        if isinstance(exc, SyntaxError) and exc.filename:
            where = f" ({exc.filename}, line {exc.lineno})"
        raise InvalidArgument(
            f"cannot import {module_name!r} for {what} {spec!r}: {type(exc).__name__}: {exc}{where}"
        ) from None
    from ddpcheck._runs.replay import evaluate_in  # as replay lines are verified

    try:
        return evaluate_in(module, expr)
    except DdpcheckError:  # the target refusing its own arguments says what is wrong: as is
        raise
    except Exception as exc:
        missing = re.match(r"name '(\w+)' is not defined", str(exc))
        if not (isinstance(exc, NameError) and missing):  # the expression ran, and raised
            raise InvalidArgument(
                f"{what} {spec!r}: {expr} raised {type(exc).__name__}: {exc}{_raised_at(exc)}"
            ) from exc
        hint = did_you_mean(missing.group(1), [n for n in vars(module) if n[:1] != "_"])
        raise InvalidArgument(
            f"{what} {spec!r}: {expr!r} is not defined in {module_name}"
            f"{hint} ({type(exc).__name__}: {exc})"
        ) from exc


def _raised_at(exc: BaseException) -> str:
    """`` (file, line N, in function)`` of the frame that raised ``exc`` -- a target's
    constructor, say -- or nothing when no frame outside ddpcheck is on its traceback."""
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith(os.path.dirname(os.path.dirname(__file__)))
    ]
    if not frames:
        return ""
    last = frames[-1]
    return f" ({os.path.basename(last.filename)}, line {last.lineno}, in {last.name})"
