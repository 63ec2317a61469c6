"""A target's option space: the configurations ``--fuzz-config`` draws beside each scenario.

Why: a framework's bug often lives behind one option (accelerate's ``sync_each_batch``,
Lightning's manual optimization with a static graph), and a check of the default configuration
never reaches it. ``Target.config_space()`` returns a Hypothesis strategy of keyword arguments for
``dataclasses.replace(target, **drawn)`` -- the target's own dataclass fields that bear on
equivalence -- or None (nothing to fuzz; ``--fuzz-config`` is then refused, exit 2). With
``fuzz_config=True`` every random example draws one configuration together with its scenario, in
one Hypothesis draw, so a failure shrinks in both: towards the fewest options differing from the
target as given, then towards the simplest scenario.

The rules a space keeps (:func:`options` keeps them for you):

* every key is optional, and drawn only with a value that differs from the field's default:
  Hypothesis shrinks towards leaving keys out, i.e. towards the framework's defaults, so a shrunk
  failure names the fewest options that matter;
* values are plain data whose ``repr`` evaluates back (numbers, strings, booleans, module-level
  functions): the failing variant's replay line is its fields, ``MODULE:Cls(field=value)``;
* a dict-valued field -- ``config`` (the framework's own keyword arguments or ds_config dict,
  ``docs/frameworks.md``), ``training_args`` -- is one more entry: its keys are drawn the same
  way and merged over the dict the target already holds (a key the target holds stays as given);
  each of its keys counts as one option, named ``field.key``.

The extension point: a target's ``config`` keys are one more argument of :func:`options`::

    def config_space(self):
        return options(fields={"manual": (True,)},
                       config={"strategy": ({"name": "ddp", "gradient_as_bucket_view": True},),
                               "sync_batchnorm": (True,)})

(A key the scenario owns -- batch, accumulation, precision, clipping -- is refused in ``config``,
so it does not belong here.) Only options under which the framework's *documented* behaviour is the
reference's belong in a ready-made target's space: one documented to differ (transformers'
per-micro-batch loss with ``loss_kwargs=False``, per-rank token counts with
``average_tokens_across_devices=False``) would fail a correct framework on every run -- check
those by naming the variant (``ddpcheck check 'ddpcheck.targets:HfTrainerTarget(loss_kwargs=
False)'``) -- unless the target declines what the option changes by design (accelerate's
``split_batches=False`` declines LR schedules). Imports hypothesis only when a space is built:
the ranks import this module with the targets, and draw nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, cast

from ddpcheck._base.errors import InvalidArgument
from ddpcheck.targets.configuration import load_config

if TYPE_CHECKING:
    from hypothesis import strategies as st

    from ddpcheck.targets.protocol import Target

    #: How :func:`options` takes a key's values: a strategy, or the values to sample from
    #: (shrinking towards the first).
    Values = st.SearchStrategy[object] | Sequence[object]

__all__ = [
    "DRAWS",
    "configurations",
    "described",
    "differences",
    "drawn_options",
    "label",
    "nested",
    "options",
    "single_options",
    "space_of",
    "vary",
]


def _strategy(values: Values, where: str) -> st.SearchStrategy[object]:
    from hypothesis import strategies as st

    if isinstance(values, st.SearchStrategy):
        return values
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise InvalidArgument(
            f"options({where}=...) must be a SearchStrategy or a non-empty "
            f"sequence of values, not {values!r}"
        )
    return st.sampled_from(tuple(values))


def options(
    *,
    fields: Mapping[str, Values] | None = None,
    config: Mapping[str, Values] | None = None,
    **dicts: Mapping[str, Values],
) -> st.SearchStrategy[dict[str, object]]:
    """The strategy of a target's options (see the module docstring): ``fields`` -- field name
    to its non-default values -- each drawn or left out; ``config`` (and any other dict-valued
    field given by name, e.g. ``training_args={...}``) -- key to its values -- drawn as a dict of
    optional keys, left out when it holds none."""
    optional: dict[str, st.SearchStrategy[object]] = {
        name: _strategy(values, name) for name, values in (fields or {}).items()
    }
    for name, keys in {**({"config": config} if config else {}), **dicts}.items():
        if name in optional:
            raise InvalidArgument(f"options: {name!r} is given as a field and as a dict")
        optional[name] = _optional_keys(
            {key: _strategy(values, f"{name}.{key}") for key, values in keys.items()}
        )
    return _optional_keys(optional)


def nested(
    keys: Mapping[str, Values], *, base: Mapping[str, object] | None = None
) -> st.SearchStrategy[dict[str, object]]:
    """The values of one ``config`` key that is itself a dict (a strategy's keyword arguments,
    ``zero_optimization``): its ``keys`` each drawn or left out, merged over ``base`` (what the
    target passes without the key) when any is drawn, and ``{}`` -- the key left out -- when none
    is, so the key shrinks towards absent like every other."""
    inner = _optional_keys({key: _strategy(values, key) for key, values in keys.items()})
    return inner.map(functools.partial(_Nested.over, dict(base or {}), len(keys)))


#: The most keys a :func:`nested` option may hold and still be surveyed as the combinations of
#: its keys drawn (at most 7 rows, torch DDP's three options in a strategy: combinations are where
#: the costly bugs live). A larger one is surveyed a key per row, over its base: DeepSpeed's six
#: ``zero_optimization`` keys drew 103 combinations, about 2,000 cells, hours of a survey. Its
#: combinations are still drawn, by ``--fuzz-config``.
COMBINED_KEYS = 3


class _Nested(dict):
    """A drawn :func:`nested` value that remembers its base and how many keys its space holds,
    so :func:`single_options` can split a large one a key per row. Only the drawing sees it:
    :func:`vary` hands the target plain dicts (a framework's config parser need not know it)."""

    base: dict[str, object]
    size: int

    @classmethod
    def over(
        cls, base: dict[str, object], size: int, drawn: dict[str, object]
    ) -> dict[str, object]:
        if not drawn:
            return {}
        value = cls({**base, **drawn})
        value.base, value.size = base, size
        return value

    def rows(self) -> list[dict[str, object]]:
        """Itself, or a key per row over its base when its space is large."""
        if self.size <= COMBINED_KEYS:
            return [dict(self)]
        return [
            {**self.base, key: value}
            for key, value in self.items()
            if key not in self.base or self.base[key] != value
        ]


def _plain(value: object) -> object:
    """``value`` with every :class:`_Nested` inside it a plain dict."""
    if isinstance(value, Mapping):
        return {key: _plain(inner) for key, inner in value.items()}
    if isinstance(value, list):
        return [_plain(inner) for inner in value]
    return value


#: A key left out (the first branch of each key's ``one_of``: what shrinking moves towards).
_ABSENT = object()


def _optional_keys(
    strategies: Mapping[str, st.SearchStrategy[object]],
) -> st.SearchStrategy[dict[str, object]]:
    """Dicts of some of ``strategies``' keys. Each key is ``one_of(absent, its values)``, not
    ``fixed_dictionaries(optional=...)``: Hypothesis 6.170 does not shrink an optional key of
    those away (tests/runs/test_fuzz_config.py), and this shrinks each towards absent; an empty
    dict value is left out too."""
    from hypothesis import strategies as st

    return st.fixed_dictionaries(
        {key: st.one_of(st.just(_ABSENT), values) for key, values in strategies.items()}
    ).map(_present)


def _present(drawn: dict[str, object]) -> dict[str, object]:
    return {
        k: v for k, v in drawn.items() if v is not _ABSENT and not (isinstance(v, dict) and not v)
    }


def space_of(target: object) -> st.SearchStrategy[dict[str, object]] | None:
    """``target.config_space()``, checked: None, or a strategy (anything else is refused)."""
    from hypothesis import strategies as st

    method = getattr(target, "config_space", None)
    space = method() if callable(method) else None
    if space is not None and not isinstance(space, st.SearchStrategy):
        raise InvalidArgument(
            f"{type(target).__name__}.config_space() returned {space!r}; it "
            "must return a hypothesis SearchStrategy of dicts (e.g. "
            "ddpcheck.targets.option_space.options(...)) or None"
        )
    return space


def vary(target: Target, drawn: Mapping[str, object]) -> Target:
    """``target`` with the drawn options: ``dataclasses.replace``, a dict-valued field merged
    (the target's own keys win); ``target`` itself when nothing was drawn."""
    if not drawn:
        return target
    name = type(target).__name__
    instance: object = target  # a Target, and the dataclass replace() needs
    if not dataclasses.is_dataclass(instance) or isinstance(instance, type):
        raise InvalidArgument(
            f"{name}.config_space() drew {dict(drawn)!r}, but {name} is no "
            "dataclass: the drawn options are applied by dataclasses.replace"
        )
    fields = {f.name for f in dataclasses.fields(instance) if f.init}
    change: dict[str, object] = {}
    for key, value in drawn.items():
        if key not in fields:
            raise InvalidArgument(
                f"{name}.config_space() drew {key!r}, which is no field of "
                f"{name} (its fields: {', '.join(sorted(fields))})"
            )
        own = getattr(target, key)
        if isinstance(value, Mapping) and isinstance(own, (str, os.PathLike)):
            # a JSON file of the dict (config="ds_config.json", --config): the variant holds
            # its contents, so its replay line needs no file
            own = load_config(own, target=f"{name}({key}={own!r})")
        if isinstance(value, Mapping) and own is not None:
            if not isinstance(own, Mapping):
                raise InvalidArgument(
                    f"{name}({key}={own!r}): the drawn {key} options are merged over a dict, "
                    f"and this is none; give {key} as a dict to fuzz its options"
                )
            value = {**value, **own}
        change[key] = _plain(value)
    try:
        varied = dataclasses.replace(instance, **change)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(
            f"{name}.config_space() drew {dict(drawn)!r}, which {name} refuses: {exc}"
        ) from exc
    return cast("Target", varied)  # replace() keeps the class


def configurations(target: Target) -> st.SearchStrategy[Target]:
    """Configured copies of ``target``, what ``fuzz_config=True`` draws beside each scenario:
    ``vary(target, drawn)`` for each draw of its ``config_space()``, shrinking towards ``target``
    itself. For your own ``@given`` test, with :func:`ddpcheck.strategies.examples` drawn against
    the configured copy (``st.data()``: what it declines depends on the configuration). Refused
    when the target has no options to draw."""
    space = space_of(target)
    if space is None:
        raise InvalidArgument(
            f"{type(target).__name__} has no options to draw ({type(target).__name__}"
            ".config_space() returns None): define config_space() returning "
            "ddpcheck.targets.option_space.options(fields={...})"
        )
    return space.map(functools.partial(vary, target))


def differences(base: object, variant: object) -> list[tuple[str, object]]:
    """The options ``variant`` holds that differ from ``base``'s: ``(name, value)``, a
    dict-valued field's keys as ``field.key`` (the module docstring), in field order."""
    if (
        variant is base
        or not (dataclasses.is_dataclass(base) and dataclasses.is_dataclass(variant))
        or type(base) is not type(variant)
    ):
        return []
    found: list[tuple[str, object]] = []
    for field in dataclasses.fields(variant):
        if not field.init:
            continue
        mine, theirs = getattr(variant, field.name), getattr(base, field.name)
        if isinstance(mine, Mapping) and isinstance(theirs, (str, os.PathLike)):
            theirs = load_config(theirs, target=type(base).__name__)  # as vary() read it
        if isinstance(mine, Mapping) and (theirs is None or isinstance(theirs, Mapping)):
            theirs = theirs or {}
            found += [
                (f"{field.name}.{k}", v)
                for k, v in mine.items()
                if k not in theirs or theirs[k] != v
            ]
        elif mine != theirs:
            found.append((field.name, mine))
    return found


def described(base: object, variant: object) -> str:
    """``"with static_graph=True, manual=True"``, or ``"with the target as given"``."""
    found = differences(base, variant)
    if not found:
        return "with the target as given (no option drawn)"
    return "with " + ", ".join(f"{name}={_shown(value)}" for name, value in found)


def single_options(drawn: Mapping[str, object]) -> list[dict[str, object]]:
    """``drawn`` split into one option each: ``{field: value}``, ``{field: {key: value}}`` per
    key of a dict-valued field, and per key of a :func:`nested` value larger than
    :data:`COMBINED_KEYS` (over its base)."""
    singles: list[dict[str, object]] = []
    for key, value in drawn.items():
        if isinstance(value, _Nested):  # a field drawn by nested() itself
            singles += [{key: row} for row in value.rows()]
            continue
        if not isinstance(value, Mapping):
            singles.append({key: value})
            continue
        for inner, option in value.items():
            rows = option.rows() if isinstance(option, _Nested) else [_plain(option)]
            singles += [{key: {inner: row}} for row in rows]
    return singles


#: Configurations drawn to list a space's single options (no process runs: drawing is cheap).
DRAWS = 200


def drawn_options(
    space: st.SearchStrategy[dict[str, object]] | None,
    *,
    draws: int = DRAWS,
    seed: int | None = None,
) -> list[dict[str, object]]:
    """Every single option (:func:`single_options`) ``draws`` configurations of ``space`` hold,
    each once, ordered by name then value: the rows of ``survey(fuzz_config=True)`` and what
    ``assert_equivalent(fuzz_config=True)`` runs the battery under. The same every call unless
    ``seed`` is given; none for no space."""
    if space is None:
        return []
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    seen: dict[str, dict[str, object]] = {}

    @settings(
        max_examples=draws,
        database=None,
        derandomize=seed is None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(space)
    def collect(chosen: dict[str, object]) -> None:
        for single in single_options(chosen):
            seen.setdefault(repr(_canonical(single)), single)

    if seed is not None:
        collect = hypothesis_seed(seed)(collect)
    collect()
    return [seen[key] for key in sorted(seen, key=lambda k: _order(seen[k], k))]


def _canonical(value: object) -> object:
    """``value`` with every dict's keys sorted: one option drawn with its keys in another order
    (a nested strategy's keyword arguments) is the same option, one row of the survey."""
    if isinstance(value, Mapping):
        return sorted((str(k), _canonical(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def _order(single: Mapping[str, object], text: str) -> tuple[str, float, str]:
    """By name, then numbers by value, then anything else by its repr."""
    key, value = _named(single)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return key, float(value), text
    return key, float("inf"), text


def label(single: Mapping[str, object]) -> str:
    """One option as a row label: ``static_graph=True``, ``config.strategy='ddp'``."""
    key, value = _named(single)
    return f"{key}={_shown(value)}"


def _named(single: Mapping[str, object]) -> tuple[str, object]:
    """One option's name and value: ``field``, or ``field.key`` for one key of a dict-valued
    field (a field drawn whole by :func:`nested` keeps its name: its value is the dict)."""
    ((key, value),) = single.items()
    if isinstance(value, Mapping) and len(value) == 1:
        ((inner, value),) = value.items()
        key = f"{key}.{inner}"
    return key, value


def _shown(value: object) -> str:
    """A value as a reader names it: a function or class by its name, else its repr."""
    name = getattr(value, "__qualname__", None)
    return name if isinstance(name, str) and callable(value) else repr(value)
