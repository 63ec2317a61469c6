"""The user's own framework configuration, and the one rule that reconciles it with a scenario.

Every ready-made framework target takes the framework's own configuration, verbatim, in one
field, ``config``: the keyword arguments of ``Accelerator``, of Lightning's ``Trainer``, of
``Fabric``, of ``TrainingArguments``, a DeepSpeed config -- a dict, or the path of a JSON file
holding one (:func:`load_config`). In JSON, a key whose value the framework wants as an object
may be given as a dict of that object's keyword arguments; the target builds the object.

**Who sets what** (:func:`reconcile`; docs/frameworks.md, "Your own configuration"). The scenario
owns the batch size, the accumulation count, the steps, the dtype and precision, the optimizer
and its schedule, the clipping and the loss: keys setting them are refused whatever their value,
since the scenario's changes from example to example (a target's ``SCENARIO_KEYS``). The harness
fixes how the run is driven -- its world, its loader, no checkpoints: those keys are accepted
only with the value ddpcheck sets, or one that changes nothing (``HARNESS_KEYS``). Every other
key reaches the framework as given. The refusal happens when the target is built, before any
process starts (:class:`InvalidArgument`, exit 2), naming every refused key at once; nothing is
silently overridden.

A key may be dotted (``zero_optimization.stage``, ``gradient_accumulation_plugin.num_steps``): it
names a key of a nested dict, or a field of a nested dataclass object (an accelerate plugin) that
differs from the field's default -- an object's default was never "given".
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, TypeAlias, TypeVar

from ddpcheck._base.errors import InvalidArgument
from ddpcheck._base.options import did_you_mean

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T")

#: A target's ``config=``: the framework's keyword arguments as a dict, or the path of a JSON file
#: holding one (None: none given).
Config: TypeAlias = "Mapping[str, object] | str | os.PathLike[str] | None"

__all__ = [
    "RULE",
    "Config",
    "build",
    "construct",
    "described",
    "has",
    "keywords_of",
    "load_config",
    "lookup",
    "reconcile",
    "same",
]

#: Where the rule is documented, as every refusal says.
RULE = 'docs/frameworks.md, "Your own configuration"'

_ABSENT = object()


def load_config(config: object, *, target: str) -> dict[str, object]:
    """``config`` as a dict: None -> ``{}``; a mapping -> a copy; a path (``str`` or
    ``os.PathLike``) -> the JSON object in that file. :class:`InvalidArgument` naming ``target``
    and the file for a missing or unreadable file, invalid JSON (with its line) or a value that is
    no object of string keys."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        given, where = dict(config), f"{target}: config"
    elif isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        where = f"{target}: the JSON file {path!r}"
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise InvalidArgument(
                f"{where} cannot be read ({exc.strerror or exc}); config= "
                "takes a dict or the path of a JSON file holding one"
            ) from None
        try:
            given = json.loads(text)
        except ValueError as exc:
            line = getattr(exc, "lineno", None)
            raise InvalidArgument(
                f"{where} is not valid JSON"
                + (
                    f" (line {line}: {exc.msg})"  # type: ignore[attr-defined]
                    if line is not None
                    else f" ({exc})"
                )
            ) from None
    else:
        raise InvalidArgument(
            f"{target}(config={config!r}) must be a dict of the framework's "
            "keyword arguments or the path of a JSON file holding one"
        )
    if not isinstance(given, dict) or not all(isinstance(k, str) for k in given):
        raise InvalidArgument(
            f"{where} must hold an object of keyword arguments (names to "
            f"values), not {type(given).__name__}"
        )
    return given


def reconcile(
    given: Mapping[str, object],
    *,
    target: str,
    scenario_keys: Mapping[str, str],
    harness_keys: Mapping[str, tuple[tuple[object, ...], str]],
    known: Collection[str] | None = None,
    known_as: str = "keyword argument",
) -> None:
    """Refuse what of ``given`` ddpcheck cannot honour (the module docstring), naming every key
    at once: a key of ``scenario_keys`` (key -> what of the scenario sets it), whatever its
    value; a key of ``harness_keys`` (key -> (the values accepted, why)) with another value; and,
    where ``known`` (the framework's keyword names) is given, a top-level key outside it, with the
    closest name. ``target`` names the target (and the file) in the message."""
    problems = []
    for key, owner in scenario_keys.items():
        if lookup(given, key) is not _ABSENT:
            problems.append(
                f"{key!r} is the scenario's (set from Scenario.{owner}, example by example)"
            )
    for key, (accepted, why) in harness_keys.items():
        value = lookup(given, key)
        if value is not _ABSENT and not any(same(value, ok) for ok in accepted):
            problems.append(
                f"{key!r}={_brief(value)} contradicts the run ddpcheck drives ({why})"
                + (f"; only {accepted[0]!r} is accepted" if accepted else "")
            )
    if known is not None:
        owned = {k.split(".", 1)[0] for k in (*scenario_keys, *harness_keys)}
        names = sorted(set(known) | owned)
        problems += [
            f"{key!r} is no {known_as}{did_you_mean(key, names)}"
            for key in given
            if key not in known and key not in owned
        ]
    if problems:
        raise InvalidArgument(
            f"{target} cannot be used: " + "; ".join(problems) + f". Leave these keys out ({RULE})"
        )


def has(given: Mapping[str, object], key: str) -> bool:
    """Whether ``given`` sets the dotted ``key`` (:func:`lookup`)."""
    return lookup(given, key) is not _ABSENT


def lookup(given: object, key: str) -> object:
    """The value of the dotted ``key`` in ``given``, or ``_ABSENT``: a nested mapping's key, or a
    nested dataclass object's field whose value differs from its default (the module
    docstring)."""
    value = given
    for depth, part in enumerate(key.split(".")):
        if isinstance(value, Mapping):
            value = value.get(part, _ABSENT)
        elif depth and dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = _set_field(value, part)
        else:
            return _ABSENT
        if value is _ABSENT:
            return _ABSENT
    return value


def _set_field(obj: DataclassInstance, name: str) -> object:
    field = next((f for f in dataclasses.fields(obj) if f.name == name), None)
    if field is None:
        return _ABSENT
    value = getattr(obj, name, _ABSENT)
    if field.default is not dataclasses.MISSING:
        default = field.default
    elif field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    else:
        return value
    return _ABSENT if same(value, default) else value


def same(value: object, accepted: object) -> bool:
    """``value`` is ``accepted``: equal and of the same type (``1`` is not ``True``)."""
    if value is accepted:
        return True
    try:
        return type(value) is type(accepted) and bool(value == accepted)
    except Exception:  # an object whose == is not a bool
        return False


def build(value: object, factory: type[T], *, target: str, key: str) -> T:
    """The object ``key`` wants: ``value`` itself (an instance of the class ``factory``), or
    ``factory(**value)`` for its JSON form (a dict of keyword arguments); anything else, and a
    keyword ``factory`` rejects, is an :class:`InvalidArgument` naming the key."""
    if not isinstance(value, Mapping):
        if not isinstance(value, factory):
            raise InvalidArgument(
                f"{target}: {key!r}={_brief(value)} must be a "
                f"{factory.__qualname__} or the dict of its keyword arguments"
            )
        return value
    try:
        return factory(**value)
    except (TypeError, ValueError) as exc:
        name = getattr(factory, "__qualname__", repr(factory))
        raise InvalidArgument(
            f"{target}: {key!r}={_brief(value)} cannot build {name}: {type(exc).__name__}: {exc}"
        ) from None


def construct(
    factory: Callable[..., T],
    kwargs: Mapping[str, object],
    *,
    target: str,
    errors: tuple[type[BaseException], ...] = (TypeError, ValueError),
) -> T:
    """``factory(**kwargs)`` in a rank, the user's configuration among ``kwargs``: a value the
    framework itself rejects (``errors``) is the configuration's problem, an
    :class:`InvalidArgument` naming it (exit 2), not the framework's failure."""
    try:
        return factory(**kwargs)
    except errors as exc:
        name = getattr(factory, "__qualname__", repr(factory))
        raise InvalidArgument(
            f"{target}: {name}(...) with the configuration, as ddpcheck "
            f"completed it, raised {type(exc).__name__}: {exc}"
        ) from exc


def keywords_of(
    callable_: Callable[..., object], *, without: Collection[str] = ()
) -> frozenset[str] | None:
    """The keyword names ``callable_`` (a class: its ``__init__``) takes, or None when it takes
    any (``**kwargs``): the names :func:`reconcile` calls known."""
    parameters = inspect.signature(callable_).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(
        p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ) - set(without)


def described(name: str, config: object) -> str:
    """How messages name a target's configuration: ``AccelerateTarget(config='acc.json')`` for a
    file, ``AccelerateTarget(config={...})`` for a dict."""
    if isinstance(config, (str, os.PathLike)):
        return f"{name}(config={os.fspath(config)!r})"
    return f"{name}(config={{...}})"


def _brief(value: object, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
