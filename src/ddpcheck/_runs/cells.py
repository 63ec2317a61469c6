"""A survey's cell, searched: which dtype its examples are drawn in, why it runs nothing, the
engine's plan for it (examples that exercise its feature, the first failure shrunk within a
budget), and the cell as the search ended. Shared by the survey's feature cells
(``_runs.survey``) and the option survey's (``_runs.option_survey``).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from typing import Protocol, TypeVar

from ddpcheck._base.errors import EquivalenceError
from ddpcheck._language import features
from ddpcheck._language import strategies as dst
from ddpcheck._runs.engine import Example, Found, Plan, settings_check
from ddpcheck._runs.example import refuse_unconfirmed_hang
from ddpcheck._runs.replay import possibly_racy
from ddpcheck._runs.settings import Settings
from ddpcheck.targets import support
from ddpcheck.targets.protocol import Target

__all__ = [
    "DRAWN_WITHOUT",
    "NO_EXAMPLE_CAN",
    "SurveyCell",
    "cell_plan",
    "declined_cell",
    "ended",
    "feature_dtypes",
]


#: Why a cell at W=1 is ``-``: a feature only several ranks show.
NO_EXAMPLE_CAN = "one rank holds every sample: no example can exercise it"


def feature_dtypes(feature: str, unsupported: frozenset[str]) -> tuple[str, ...]:
    """The dtype a cell's examples are drawn in: float32 for the precision features, else the
    finest the target supports (none: the cell is declined)."""
    if feature in dst.FLOAT32_ONLY:
        return ("float32",)
    return tuple(d for d in ("float64", "float32") if d not in unsupported)[:1]


def declined_cell(
    target: Target,
    feature: str,
    excluded: frozenset[str],
    unsupported: frozenset[str],
    dtypes: tuple[str, ...],
) -> str | None:
    """Why a cell of ``feature`` runs nothing for ``target``, or None."""
    if feature not in unsupported and dtypes:
        return None
    if feature in excluded:
        return "excluded with --without"
    if feature in features.OPT_IN:
        return f"opt-in: {type(target).__name__}.{features.OPT_IN[feature]} is not set"
    if dtypes:
        return support.why_unsupported(target, feature)
    return f"{type(target).__name__} supports neither float64 nor float32"


def cell_plan(
    target: Target,
    feature: str,
    excluded: frozenset[str],
    run: Settings,
    examples: int,
    shrink_seconds: float,
    seed_text: str,
) -> Plan:
    """How a cell searches: up to ``examples`` examples that exercise ``feature``, stopping at
    the first failure, shrunk for at most ``shrink_seconds``, its seed from ``seed_text``."""

    def accept(example: Example) -> str | None:
        why = support.declines(example.target, example.scenario, example.world_size, excluded)
        if why is None and feature not in features.of(example.scenario, example.world_size):
            why = DRAWN_WITHOUT
        return why

    return Plan(
        examples=examples,
        seed=zlib.crc32(seed_text.encode()),
        check=settings_check(run),
        accept=accept,
        give_up_after=5 * examples + 10,  # Hypothesis would draw 1,000 before giving up
        shrink_seconds=shrink_seconds,
    )


#: A drawn example that does not exercise its cell's feature: passed over, not declined.
DRAWN_WITHOUT = "drawn without the feature"


class SurveyCell(Protocol):
    """What :func:`ended` fills in, in a survey's cell and an option survey's alike."""

    examples: int
    status: str
    reason: str | None
    intermittent: bool
    first_failure: int | None
    seconds: float


CellT = TypeVar("CellT", bound=SurveyCell)


def ended(
    cell: CellT,
    found: Found,
    started: float,
    failed: Callable[[CellT, EquivalenceError, float], CellT],
) -> CellT:
    """The cell as its search ended: failed (its first or shrunk failure), or ok, or -- no
    example ran -- declined with the most frequent reason, or n/a."""
    if found.error is not None:
        if found.flaky:
            refuse_unconfirmed_hang(found.error)  # a hang that did not recur is no verdict
            possibly_racy(found.error)  # its replay line repeats the example
            cell.intermittent = True
        cell.first_failure = found.first_failure
        return failed(cell, found.error, started)
    if not cell.examples:  # no drawn example could run
        declined = {why: n for why, n in found.declined.items() if why != DRAWN_WITHOUT}
        cell.status = "declined" if declined else "n/a"
        cell.reason = (
            max(declined, key=lambda why: declined[why])
            if declined
            else "none of the drawn examples exercised it"
        )
    cell.seconds = time.perf_counter() - started
    return cell
