"""The ``strategy`` of a user's Lightning ``Trainer`` or ``Fabric`` configuration (``config``).

Lightning and Fabric take a strategy as an object (``DDPStrategy(static_graph=True)``) or a name
of their registry (``"ddp"``, ``"ddp_find_unused_parameters_true"``); in JSON it may also be the
dict ``{"name": "ddp", "static_graph": true, ...}`` -- the registry's strategy of that name built
with the other keys as its keyword arguments (``name`` defaults to ``"ddp"``). The targets check
Lightning over torch DDP: a strategy must be a ``DDPStrategy`` (or a subclass) that joins the
processes ddpcheck started (``start_method="popen"``), and the keyword arguments it passes to
``DistributedDataParallel`` must be torch's (a misspelt one would otherwise fail in every rank,
read as the framework's failure). Which of them the scenario or the harness owns is the rule's
(``configuration``): :data:`SCENARIO_KEYS`, :data:`HARNESS_KEYS`, as dotted ``strategy.`` keys.

A strategy object is copied for every run (:func:`make`): a strategy keeps the model, the
accelerator and the launcher it was set up with, and the next example must not inherit them.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeVar

from ddpcheck._base.errors import InvalidArgument
from ddpcheck._base.options import did_you_mean
from ddpcheck.targets.configuration import keywords_of, reconcile

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

S = TypeVar("S")

__all__ = ["HARNESS_KEYS", "SCENARIO_KEYS", "checked", "make", "options_of", "space", "view"]

_WORLD = "ddpcheck's world: the process group exists, on the world's device"
#: ``DistributedDataParallel`` keywords a strategy passes that the scenario sets (refused).
SCENARIO_KEYS: dict[str, str] = {
    "strategy.mixed_precision": "autocast and dtype (DDP's mixed_precision casts what the "
    "scenario keeps)",
}
#: What of a strategy ddpcheck's harness fixes: key -> (the values accepted, why).
HARNESS_KEYS: dict[str, tuple[tuple[object, ...], str]] = {
    "strategy.start_method": (
        ("popen",),
        "ddpcheck started the processes: the strategy joins "
        "them ('popen', the name 'ddp'), it starts none",
    ),
    "strategy.device_ids": ((), _WORLD),
    "strategy.output_device": ((), _WORLD),
    "strategy.process_group": ((), _WORLD),
    "strategy.device_mesh": ((), _WORLD),
}


def space(*, static_graph: bool = True) -> SearchStrategy[dict[str, object]]:
    """The values ``config_space()`` draws for ``strategy``: the JSON form of the targets' own
    ``DDPStrategy(find_unused_parameters=True)`` with torch DDP's options drawn over it
    (``static_graph`` left out where the target's field sets it); what DDP cannot train under
    them is declined (``ddp_options``). Imports hypothesis: only where a space is built."""
    from ddpcheck.targets.option_space import nested

    keys: dict[str, tuple[object, ...]] = {
        "find_unused_parameters": (False,),
        "gradient_as_bucket_view": (True,),
    }
    if static_graph:
        keys["static_graph"] = (True,)
    return nested(keys, base={"name": "ddp", "find_unused_parameters": True})


def make(value: object, *, registry: Mapping[str, dict], ddp_cls: type[S], where: str) -> S:
    """A fresh strategy object from ``value`` (an object, a registry name, or its JSON form),
    refused -- naming why -- where it is no ``ddp_cls``."""
    if isinstance(value, (str, Mapping)):
        kwargs = {} if isinstance(value, str) else {k: v for k, v in value.items() if k != "name"}
        name = value if isinstance(value, str) else value.get("name", "ddp")
        if name not in registry:
            names = [n for n, e in registry.items() if e["strategy"] is ddp_cls]
            raise InvalidArgument(
                f"{where}: 'strategy' {name!r} is no strategy Lightning "
                f"registers{did_you_mean(str(name), names)} (this target "
                f"takes a DDP one: {', '.join(sorted(names))})"
            )
        entry = registry[name]
        if entry["strategy"] is not ddp_cls:
            raise InvalidArgument(
                f"{where}: 'strategy' {name!r} is {entry['strategy'].__name__}"
                f"; this target checks torch DDP (a "
                f"{ddp_cls.__name__}, such as 'ddp')"
            )
        try:
            return entry["strategy"](**{**entry["init_params"], **kwargs})
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(
                f"{where}: 'strategy'={value!r} cannot build "
                f"{entry['strategy'].__name__}: {type(exc).__name__}: "
                f"{exc}"
            ) from None
    if not isinstance(value, ddp_cls) or _lightnings(type(value)) is not ddp_cls:
        raise InvalidArgument(
            f"{where}: 'strategy' is a {type(value).__name__}; this target "
            f"checks torch DDP (a {ddp_cls.__module__}."
            f"{ddp_cls.__name__}, or a name such as 'ddp')"
        )
    return copy.deepcopy(value)


def _lightnings(cls: type) -> type | None:
    """The first of ``cls``'s classes that is Lightning's own: a user's subclass of
    ``DDPStrategy`` is a DDP strategy, Lightning's ``DeepSpeedStrategy`` (a subclass too) is
    not."""
    return next(
        (
            c
            for c in cls.__mro__
            if c.__module__.split(".")[0] in ("lightning", "pytorch_lightning")
        ),
        None,
    )


def view(strategy: object, where: str) -> dict[str, object]:
    """What the rule judges of a built ``strategy``: its ``start_method`` and the keyword
    arguments it passes to ``DistributedDataParallel``, which must be torch's."""
    from torch.nn.parallel import DistributedDataParallel

    kwargs = dict(getattr(strategy, "_ddp_kwargs", {}))
    known = keywords_of(DistributedDataParallel, without=("module",)) or frozenset(kwargs)
    wrong = [f"{key!r}{did_you_mean(key, known)}" for key in kwargs if key not in known]
    if wrong:
        raise InvalidArgument(
            f"{where}: the strategy passes {', '.join(wrong)} to torch's "
            "DistributedDataParallel, which takes no such keyword argument"
        )
    return {"start_method": getattr(strategy, "_start_method", "popen"), **kwargs}


def options_of(strategy: object) -> dict[str, bool]:
    """The DDP options of ``strategy`` that decide what it can train (``ddp_options``)."""
    kwargs = getattr(strategy, "_ddp_kwargs", {})
    return {
        "find_unused_parameters": bool(kwargs.get("find_unused_parameters", False)),
        "static_graph": bool(kwargs.get("static_graph", False)),
    }


def checked(
    given: dict[str, object],
    where: str,
    *,
    owner: type,
    registry: Mapping[str, dict],
    ddp_cls: type[object],
    keys: tuple[Mapping[str, str], Mapping[str, tuple[tuple[object, ...], str]]],
) -> dict[str, bool] | None:
    """Refuse what the rule refuses (``configuration.reconcile``) in a Trainer's or Fabric's
    (``owner``'s) keyword arguments, naming the keys, the strategy built to be read; the DDP
    options of the config's strategy, None where it names none. ``keys``: the target's
    ``(SCENARIO_KEYS, HARNESS_KEYS)``."""
    shown, ddp = dict(given), None
    if "strategy" in given:
        strategy = make(given["strategy"], registry=registry, ddp_cls=ddp_cls, where=where)
        shown["strategy"] = view(strategy, where)
        ddp = options_of(strategy)
    reconcile(
        shown,
        target=where,
        scenario_keys=keys[0],
        harness_keys=keys[1],
        known=keywords_of(owner),
        known_as=f"{owner.__name__} keyword argument",
    )
    return ddp
