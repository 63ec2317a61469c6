"""``survey --fuzz-config``: a target's option x feature matrix.

Rows: the target as given, then each single option its ``config_space()`` draws
(``ddpcheck.targets.option_space.drawn_options``: ``static_graph=True``, ``config.key=value``);
columns: the features of ``ddpcheck.features.FEATURES``. Each cell runs up to ``examples`` random
examples of that row's target drawn to exercise that column's feature, at a world size drawn
among those asked (where one can exercise it), and stops at its first failure, shrunk by
Hypothesis for at most ``shrink_seconds`` -- the feature cells of ``_runs.survey`` (the same
engine search and plan, ``cells.cell_plan``), one world-size column folded into the draw. The
battery is not run here (``survey`` without ``--fuzz-config`` runs it for the target as given).

Invariant: as ``runs.survey``'s -- a failing example stops only its own cell; what is not the
target's fault (a world that cannot start, a harness error) stops the survey and propagates.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from ddpcheck._base.errors import EquivalenceError
from ddpcheck._language import features
from ddpcheck._language import strategies as dst
from ddpcheck._language.messages import scenario_line
from ddpcheck._language.scenario import Scenario
from ddpcheck._runs.admission import Request, check_target
from ddpcheck._runs.cells import NO_EXAMPLE_CAN, cell_plan, declined_cell, ended, feature_dtypes
from ddpcheck._runs.engine import Draws, search
from ddpcheck._runs.replay import target_spec
from ddpcheck._runs.settings import Settings
from ddpcheck.targets import support
from ddpcheck.targets.option_space import drawn_options, label, space_of, vary
from ddpcheck.targets.protocol import Target

__all__ = ["AS_GIVEN", "OptionCell", "OptionSurvey", "option_survey"]

#: The first row: the target with no option drawn.
AS_GIVEN = "(as given)"


@dataclasses.dataclass
class OptionCell:
    """One (option, feature) cell."""

    option: str  # the row: AS_GIVEN or one option, "static_graph=True"
    feature: str
    status: str  # "ok", "fail", "declined", or "n/a"
    examples: int = 0
    world_size: int | None = None  # fail: where
    kind: str | None = None
    reason: str | None = None  # declined / n/a: why
    summary: str | None = None  # fail: the shrunk scenario in one line
    replay: str | None = None
    first_failure: int | None = None
    intermittent: bool = False
    seconds: float = 0.0

    @property
    def label(self) -> str:
        return {"ok": f"ok {self.examples}", "fail": "FAIL", "declined": "declined"}.get(
            self.status, "-"
        )


@dataclasses.dataclass
class OptionSurvey:
    """What :func:`option_survey` found; ``print`` it for the matrix."""

    target: str
    world_sizes: tuple[int, ...]
    examples: int
    options: list[str]
    cells: list[OptionCell]
    seconds: float

    @property
    def failures(self) -> list[OptionCell]:
        return [c for c in self.cells if c.status == "fail"]

    @property
    def exit_code(self) -> int:
        if self.failures:
            return 1
        return 0 if any(c.status == "ok" for c in self.cells) else 3

    def matrix(self) -> str:
        columns = list(dict.fromkeys(c.feature for c in self.cells))
        by = {(c.option, c.feature): c for c in self.cells}
        table = [["option", *columns]]
        table += [
            [row, *(by[row, f].label if (row, f) in by else "" for f in columns)]
            for row in self.options
        ]
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
        lines.insert(1, "  ".join("-" * w for w in widths))
        notes: dict[tuple[str, str, str], list[str]] = {}
        for c in self.cells:
            if c.status in ("declined", "n/a"):
                notes.setdefault((c.label, c.feature, c.reason or ""), []).append(c.option)
        lines += [
            f"{cell} {feature} under "
            f"{'every row' if len(rows) == len(self.options) else ', '.join(rows)}: {why}"
            for (cell, feature, why), rows in notes.items()
        ]
        return "\n".join(lines)

    def failure_lines(self) -> list[str]:
        lines = []
        for c in self.failures:
            lines += [
                f"{c.option} x {c.feature}: {c.kind} at W={c.world_size} (example "
                f"{c.first_failure} failed, shrunk"
                f"{', intermittent' if c.intermittent else ''})",
                f"    scenario: {c.summary}",
                f"    replay: {c.replay}",
            ]
        return lines

    def summary(self) -> str:
        counts = {s: sum(c.status == s for c in self.cells) for s in ("ok", "fail", "declined")}
        return (
            f"survey {self.target} --fuzz-config: {len(self.options)} rows (the target as "
            f"given and {len(self.options) - 1} options) x features: {counts['ok']} ok, "
            f"{counts['fail']} FAIL, {counts['declined']} declined; "
            f"{sum(c.examples for c in self.cells)} examples run; wall {self.seconds:.1f} s"
        )

    def __str__(self) -> str:
        failures = self.failure_lines()
        head = (
            "failures (each a proven counterexample; the replay line builds the option):"
            if failures
            else "failures: none"
        )
        return "\n".join([self.matrix(), "", head, *failures, "", self.summary()])

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["world_sizes"] = list(self.world_sizes)
        data["exit_code"] = self.exit_code
        for cell, obj in zip(data["cells"], self.cells):
            cell["label"] = obj.label
        return data


def option_survey(
    request: Request,
    *,
    examples: int,
    seed: int | None,
    shrink_seconds: float,
    progress: Callable[[int, int, str, float], None] | None = None,
) -> OptionSurvey:
    """The option x feature matrix of an admitted request (``fuzz_config``; the module
    docstring)."""
    target, sizes, excluded = request.target, request.world_sizes, request.battery_without
    started = time.perf_counter()
    rows: list[tuple[str, Target]] = [(AS_GIVEN, target)]
    for single in drawn_options(space_of(target), seed=seed):
        variant = vary(target, single)
        check_target(variant, request.device)  # its replay line must build it, first
        rows.append((label(single), variant))
    columns = [f for f in features.FEATURES if not request.only or f in request.only]
    strategies: dict[
        tuple[str, int], st.SearchStrategy[Scenario]
    ] = {}  # built once: Hypothesis validates on first use
    cells: list[OptionCell] = []
    for row, variant in rows:
        for feature in columns:
            if progress is not None:
                progress(
                    len(cells),
                    len(rows) * len(columns),
                    f"{row} x {feature}",
                    time.perf_counter() - started,
                )
            cells.append(
                _cell(
                    variant,
                    row,
                    feature,
                    sizes,
                    excluded,
                    strategies,
                    examples=examples,
                    seed=seed,
                    shrink_seconds=shrink_seconds,
                    run=request.run,
                )
            )
    return OptionSurvey(
        target_spec(target),
        sizes,
        examples,
        [r for r, _ in rows],
        cells,
        time.perf_counter() - started,
    )


def _cell(
    target: Target,
    row: str,
    feature: str,
    sizes: tuple[int, ...],
    excluded: frozenset[str],
    strategies: dict[tuple[str, int], st.SearchStrategy[Scenario]],
    *,
    examples: int,
    seed: int | None,
    shrink_seconds: float,
    run: Settings,
) -> OptionCell:
    cell = OptionCell(row, feature, "ok")
    unsupported = support.unsupported(target, excluded)
    at = tuple(w for w in sizes if dst.can_exercise(feature, w))
    dtypes = feature_dtypes(feature, unsupported)
    if not at:
        cell.status, cell.reason = "n/a", NO_EXAMPLE_CAN
        return cell
    why = declined_cell(target, feature, excluded, unsupported, dtypes)
    if why is not None:
        cell.status, cell.reason = "declined", why
        return cell
    for w in at:
        if (feature, w) not in strategies:
            strategies[feature, w] = dst.exercising(
                feature, world_size=w, dtypes=dtypes, without=unsupported
            )
    started = time.perf_counter()
    found = search(
        Draws(target, {w: strategies[feature, w] for w in at}),
        cell_plan(
            target, feature, excluded, run, examples, shrink_seconds, f"{seed}:{row}:{feature}"
        ),
    )
    cell.examples = found.examples
    return ended(cell, found, started, _failed)


def _failed(cell: OptionCell, error: EquivalenceError, started: float) -> OptionCell:
    cell.status, cell.kind, cell.world_size = "fail", error.kinds[0], error.world_size
    cell.summary, cell.replay = scenario_line(error.scenario), error.replay
    cell.seconds = time.perf_counter() - started
    return cell
