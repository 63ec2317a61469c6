"""A framework target's own configuration: read it, and hold it to the one rule of who sets what.

Every ready-made framework target takes the framework's configuration verbatim, in one field named
``config``: a mapping, or the path of a JSON file holding one object (DeepSpeed's ds_config.json
as it is). :func:`load_config` reads it; :func:`reconcile` applies the rule (docs/frameworks.md,
"Your own configuration"):

* the scenario owns the batch size, the accumulation count, the steps, the dtype and precision,
  the optimizer and its schedule, the clipping and the loss -- keys setting them are refused
  whatever their value, since the scenario's value changes from example to example;
* the harness fixes how the run is driven (its world, its loader, no checkpoints) -- those keys
  are accepted only with the value ddpcheck sets (or one that changes nothing);
* every other key reaches the framework as given.

A refusal is an :class:`InvalidArgument` (exit 2) raised when the target is built, before any
process starts, naming every refused key -- never a key overridden in silence.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from ddpcheck._base.errors import InvalidArgument
from ddpcheck._base.options import did_you_mean

__all__ = ["load_config", "reconcile"]


def load_config(config: Any, *, target: str) -> dict[str, Any]:
    """``config`` as a dict: None -> ``{}``; a mapping -> a copy; a path (``str`` or
    ``os.PathLike``) -> the JSON object in that file. :class:`InvalidArgument` naming ``target``
    and the file for a missing file, invalid JSON (with its line) or anything but an object."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, os.PathLike)):
        raise InvalidArgument(f"{target}(config={config!r}) must be a dict of the framework's "
                              "configuration or the path of a JSON file holding one")
    path = os.fspath(config)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise InvalidArgument(f"{target}(config={path!r}): cannot read the file "
                              f"({exc.strerror or exc})") from None
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{target}(config={path!r}): the file is not valid JSON "
                              f"(line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if not isinstance(loaded, dict):
        raise InvalidArgument(f"{target}(config={path!r}): the file must hold one JSON object "
                              f"of the framework's configuration, not a {type(loaded).__name__}")
    return loaded


def reconcile(given: Mapping[str, Any], *, target: str, scenario_keys: Mapping[str, str],
              harness_keys: Mapping[str, tuple[tuple[Any, ...], str]],
              known: Iterable[str] | None = None) -> None:
    """Refuse, in one :class:`InvalidArgument`, every key of ``given`` the rule refuses.

    ``scenario_keys``: key -> the scenario field that sets it, and how (refused whatever its
    value).
    ``harness_keys``: key -> (the values accepted, why); ``()`` accepts none. A key is a
    top-level name or a dotted path into nested mappings (``"zero_optimization.stage"``).
    ``known``: the names the framework takes at the top level (its signature); when given, any
    other top-level key is refused too, with the closest known name."""
    problems = []
    for key, owner in scenario_keys.items():
        if _lookup(given, key)[0]:
            problems.append(f"{key!r} is the scenario's (set from Scenario.{owner}, example by "
                            "example)")
    for key, (accepted, why) in harness_keys.items():
        found, value = _lookup(given, key)
        if found and not any(_same(value, ok) for ok in accepted):
            problems.append(f"{key!r}={value!r} contradicts the run ddpcheck drives ({why})"
                            + (f"; only {_choices(accepted)} accepted" if accepted else ""))
    if known is not None:
        names = set(known)
        owned = {k.split(".", 1)[0] for k in (*scenario_keys, *harness_keys)}
        problems += [f"{key!r} is no option of the framework{did_you_mean(key, names)}"
                     for key in given if key not in names and key not in owned]
    if problems:
        raise InvalidArgument(f"{target}: the configuration cannot be used: "
                              + "; ".join(problems) + ". Leave these keys out (docs/frameworks.md,"
                              " \"Your own configuration\": who sets what)")


def _lookup(given: Mapping[str, Any], key: str) -> tuple[bool, Any]:
    """``(found, value)`` of a top-level or dotted ``key`` in nested mappings."""
    node: Any = given
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _same(value: Any, accepted: Any) -> bool:
    # True == 1 and 1.0 == 1, but a config giving True where 1 is meant says something else
    return (type(value) is type(accepted) and value == accepted) or value is accepted


def _choices(accepted: tuple[Any, ...]) -> str:
    shown = " or ".join(repr(v) for v in accepted)
    return f"{shown} is" if len(accepted) == 1 else f"{shown} are"
