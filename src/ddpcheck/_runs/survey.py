"""``survey``: a target's capability matrix -- every feature at every world size, nothing skipped.

``ddpcheck check`` is the fail-fast gate; a survey stops nowhere. The built-in battery runs at
every world size (each (scenario, W) passes, FAILS with its first divergence kind, or is declined);
then each (feature of ``ddpcheck.features.FEATURES``, W) cell runs up to ``examples`` random
examples drawn to exercise it (``ddpcheck.strategies.exercising``) and stops at its first failure,
shrunk by Hypothesis for at most ``shrink_seconds`` to a minimal counterexample and replay line:
each cell is a search of the engine (``_runs.engine.search``, :func:`cell_plan`).

Invariant: a failing example stops only its own cell, never the survey. What is not the target's
fault (a battery scenario the oracle cannot judge, a world that cannot start, a harness error)
stops it and propagates unchanged (exit 2); a random example the oracle cannot judge is rejected.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ddpcheck._base.errors import EquivalenceError, InvalidArgument, NothingChecked
from ddpcheck._base.options import DEFAULT_DEADLINE, DEFAULT_WORLD_SIZES, check_positive_number
from ddpcheck._language import features
from ddpcheck._language import strategies as dst
from ddpcheck._language.messages import scenario_line
from ddpcheck._language.scenario import Scenario
from ddpcheck._oracle.reference import Reference
from ddpcheck._runs.admission import Request, admit
from ddpcheck._runs.cells import NO_EXAMPLE_CAN, cell_plan, declined_cell, ended, feature_dtypes
from ddpcheck._runs.engine import Draws, search
from ddpcheck._runs.example import (
    check_example,
    prepare_reference,
)
from ddpcheck._runs.replay import target_spec
from ddpcheck._runs.settings import Settings
from ddpcheck._world.interrupts import interruptible

if TYPE_CHECKING:
    from ddpcheck._runs.option_survey import OptionSurvey
from ddpcheck.targets import support
from ddpcheck.targets.protocol import Target

__all__ = [
    "DEFAULT_EXAMPLES",
    "DEFAULT_SHRINK_SECONDS",
    "Cell",
    "Survey",
    "check_survey_meshes",
    "survey",
    "survey_admitted",
]

#: Random examples per (feature, world size) cell.
DEFAULT_EXAMPLES = 8
#: Seconds Hypothesis may spend shrinking one failing cell's counterexample.
DEFAULT_SHRINK_SECONDS = 3.0


@dataclasses.dataclass
class Cell:
    """One (row, world size) of a survey: a feature's random examples, or one battery scenario."""

    section: str  # "feature" or "battery"
    row: str  # the feature (ddpcheck.features.FEATURES) or the battery scenario's name
    world_size: int
    status: str  # "ok", "fail", "declined", or "n/a" (no example can exercise it at this W)
    examples: int = 0  # examples run in this cell, shrinking included
    kind: str | None = None  # fail: the first divergence's kind
    reason: str | None = None  # declined / n/a: why
    where: str | None = None  # fail: where it diverged first ("step 0, rank 1, l0.fc.weight")
    scenario: str | None = None  # fail: the (shrunk) failing scenario, as code
    summary: str | None = None  # fail: the same scenario in one line
    replay: str | None = None  # fail: the shell command that runs it again
    first_failure: int | None = None  # fail: how many examples ran until the first failure
    exercises: list[str] | None = None  # fail: the features the failing scenario exercises
    intermittent: bool = False  # fail: it passed when replayed (a race or other nondeterminism)
    seconds: float = 0.0

    @property
    def label(self) -> str:
        """As printed: ``ok N`` / ``passes``, ``FAIL <kind>`` / ``FAILS <kind>``, ``declined``,
        ``-``."""
        battery = self.section == "battery"
        if self.status == "ok":
            return "passes" if battery else f"ok {self.examples}"
        if self.status == "fail":
            return f"{'FAILS' if battery else 'FAIL'} {self.kind}"
        return "declined" if self.status == "declined" else "-"


@dataclasses.dataclass
class Survey:
    """What :func:`survey` found: one :class:`Cell` per (row, world size), battery then features.

    ``features`` are those the examples that ran exercised; ``exit_code`` is the command line's
    (0 every cell that ran passed, 1 some cell failed, 3 no cell ran)."""

    target: str  # the target's replay spec, e.g. "ddpcheck.targets:PARALLEL"
    world_sizes: tuple[int, ...]
    examples: int  # random examples asked per feature cell
    cells: list[Cell]
    features: set[str]
    seconds: float
    seed: int | None = None
    shrink_seconds: float = DEFAULT_SHRINK_SECONDS

    def section(self, name: str) -> list[Cell]:
        return [c for c in self.cells if c.section == name]

    def cell(self, row: str, world_size: int) -> Cell:
        return next(c for c in self.cells if c.row == row and c.world_size == world_size)

    @property
    def failures(self) -> list[Cell]:
        return [c for c in self.cells if c.status == "fail"]

    def counts(self, section: str) -> dict[str, int]:
        statuses = [c.status for c in self.section(section)]
        return {s: statuses.count(s) for s in ("ok", "fail", "declined", "n/a")}

    @property
    def exit_code(self) -> int:
        if self.failures:
            return 1
        return 0 if any(c.status == "ok" for c in self.cells) else 3

    def matrix(self) -> str:
        """Feature rows x world-size columns, then why cells are ``-`` or declined."""
        return _grid("feature", self.section("feature"), self.world_sizes)

    def battery_table(self) -> str:
        return _grid("battery", self.section("battery"), self.world_sizes)

    @property
    def common(self) -> list[str]:
        """The features every shrunk counterexample exercises: where to look first."""
        shrunk = [set(c.exercises or ()) for c in self.failures if c.section == "feature"]
        return features.named(set.intersection(*shrunk)) if shrunk else []

    def failure_lines(self) -> list[str]:
        lines = []
        for c in sorted(self.failures, key=lambda c: c.section != "feature"):
            how = "shrunk" if c.section == "feature" else "battery scenario, not shrunk"
            lines += [
                f"{c.row} W={c.world_size}: {c.kind} ({c.where}; example {c.first_failure} "
                f"failed, {how}{', intermittent' if c.intermittent else ''})",
                f"    scenario: {c.summary} (exercises {', '.join(c.exercises or ())})",
                f"    replay: {c.replay}",
            ]
        if self.common:
            lines.append(f"every shrunk counterexample exercises: {', '.join(self.common)}")
        return lines

    def summary(self) -> str:
        f, b = self.counts("feature"), self.counts("battery")
        ran = sum(c.examples for c in self.cells)
        return (
            f"survey {self.target}: features {f['ok']} ok, {f['fail']} FAIL, {f['declined']} "
            f"declined, {f['n/a']} n/a; battery {b['ok']} pass, {b['fail']} FAIL, "
            f"{b['declined']} declined; {ran} examples run, "
            f"{features.exercised(self.features)}; wall {self.seconds:.1f} s"
        )

    def __str__(self) -> str:
        failures = self.failure_lines()
        head = (
            "failures (each a proven counterexample; the replay line prints its divergence table):"
            if failures
            else "failures: none"
        )
        return "\n".join(
            [self.matrix(), "", head, *failures, "", self.battery_table(), "", self.summary()]
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain data for ``json``; :meth:`from_dict` reads it back."""
        data = dataclasses.asdict(self)
        data["world_sizes"] = list(self.world_sizes)
        data["features"] = [f for f in features.FEATURES if f in self.features]
        for cell, obj in zip(data["cells"], self.cells):
            cell["label"] = obj.label
        data["counts"] = {s: self.counts(s) for s in ("feature", "battery")}
        data["exit_code"] = self.exit_code
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Survey:
        names = {f.name for f in dataclasses.fields(Cell)}
        cells = [Cell(**{k: v for k, v in c.items() if k in names}) for c in data["cells"]]
        return cls(
            data["target"],
            tuple(data["world_sizes"]),
            data["examples"],
            cells,
            set(data["features"]),
            data["seconds"],
            data.get("seed"),
            data.get("shrink_seconds", DEFAULT_SHRINK_SECONDS),
        )


@interruptible
def survey(
    target: Target,
    *,
    world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
    examples: int = DEFAULT_EXAMPLES,
    without: Iterable[str] = (),
    deadline: float = DEFAULT_DEADLINE,
    seed: int | None = None,
    shrink_seconds: float = DEFAULT_SHRINK_SECONDS,
    progress: Callable[[int, int, str, float], None] | None = None,
    device: str = "cpu",
    backend: str | None = None,
    only: Iterable[str] = (),
    fuzz_config: bool = False,
    meshes: Iterable[object] | None = None,
) -> Survey | OptionSurvey:
    """Run the battery at every world size and ``examples`` random examples per (feature, world
    size), stopping nowhere; return the :class:`Survey` (``print`` it for the matrix).

    ``without`` names features never to exercise (on top of ``target.supported_features``); their
    cells are declined; ``only`` keeps the rows that exercise one of these features (the battery
    scenarios that do, and those features' cells). ``seed`` changes which random examples are drawn
    (default: the same every run). ``progress(done, total, what, seconds)`` is called before every
    cell.
    Raises what is not the target's fault (:class:`ddpcheck.InvalidArgument`,
    :class:`ddpcheck.SetupError` and its subclasses) instead of recording it.
    ``fuzz_config=True``: the option x feature matrix instead (``runs.option_survey``: an
    ``OptionSurvey``), refused for a target with no ``config_space()``. ``meshes``: as for
    :func:`ddpcheck.fuzz` (the world sizes are theirs).
    """
    request = admit(
        target,
        world_sizes=world_sizes,
        deadline=deadline,
        without=without,
        device=device,
        backend=backend,
        only=only,
        fuzz_config=fuzz_config,
        meshes=meshes,
    )
    return survey_admitted(
        request, examples=examples, seed=seed, shrink_seconds=shrink_seconds, progress=progress
    )


def check_survey_meshes(request: Request) -> None:
    """Refuse the meshes a survey cannot draw on (before any world starts: the command line
    calls this before it launches one): any, for the option survey, whose cells draw no
    tensor-parallel scenario yet; one with a ``pp`` axis, whose feature cells draw no pipeline.
    """
    if request.fuzz_config and request.meshes is not None:
        raise InvalidArgument(
            "a mesh (--mesh, meshes=) with the option survey (--fuzz-config): the option "
            "survey does not draw on meshes yet; run ddpcheck check --fuzz-config --mesh"
        )
    if any(pp > 1 for _, pp, _ in request.meshes or ()):
        raise InvalidArgument(
            "a mesh with a pp axis (--mesh, meshes=) in a survey: its feature cells do not draw "
            "pipelines on meshes yet; run ddpcheck check --mesh"
        )


def survey_admitted(
    request: Request,
    *,
    examples: int = DEFAULT_EXAMPLES,
    seed: int | None = None,
    shrink_seconds: float = DEFAULT_SHRINK_SECONDS,
    progress: Callable[[int, int, str, float], None] | None = None,
) -> Survey | OptionSurvey:
    """:func:`survey` of an admitted request (``runs.admission``): the command line's path."""
    check_positive_number("shrink_seconds", shrink_seconds)
    if isinstance(examples, bool) or not isinstance(examples, int) or examples < 1:
        raise InvalidArgument(f"examples={examples!r} must be a positive integer")
    check_survey_meshes(request)
    if request.fuzz_config:
        from ddpcheck._runs.option_survey import option_survey

        return option_survey(
            request, examples=examples, seed=seed, shrink_seconds=shrink_seconds, progress=progress
        )
    target, sizes, excluded, run = (
        request.target,
        request.world_sizes,
        request.battery_without,
        request.run,
    )
    unsupported = support.unsupported(target, excluded)
    started = time.perf_counter()
    exercised: set[str] = set()
    cells: list[Cell] = []
    focus = request.only  # only the rows that exercise one of these, when given
    rows: list[tuple[str, str, Scenario | None]] = [
        ("battery", name, sc)
        for name, sc in support.battery_for(target)
        if not focus or features.of(sc) & focus
    ]
    rows += [
        ("feature", feature, None) for feature in features.FEATURES if not focus or feature in focus
    ]
    for _, row, scenario in rows:
        for w in sizes:
            if progress is not None:
                progress(
                    len(cells),
                    len(rows) * len(sizes),
                    f"{row} W={w}",
                    time.perf_counter() - started,
                )
            off = None if scenario is None else request.off_mesh(scenario, w)
            if off is not None:  # a battery row off the meshes asked for (--mesh)
                cell = Cell("battery", row, w, "declined", reason=off)
            elif scenario is not None:  # a battery row
                cell = _battery_cell(target, row, scenario, w, excluded, run, exercised)
            else:
                cell = _feature_cell(
                    target,
                    row,
                    w,
                    examples=examples,
                    excluded=excluded,
                    unsupported=unsupported,
                    run=run,
                    seed=seed,
                    shrink_seconds=shrink_seconds,
                    exercised=exercised,
                    degrees=None if request.degrees is None else request.degrees[w],
                )
            cells.append(cell)
    return Survey(
        target_spec(target),
        sizes,
        examples,
        cells,
        exercised,
        time.perf_counter() - started,
        seed,
        shrink_seconds,
    )


# ---------------------------------------------------------------------------------------------
# One cell

#: repr of a battery scenario -> its full-batch reference, shared by every survey in a process.
_REFERENCES: dict[str, Reference] = {}


def _battery_cell(
    target: Target,
    name: str,
    scenario: Scenario,
    world_size: int,
    excluded: frozenset[str],
    run: Settings,
    exercised: set[str],
) -> Cell:
    why = support.declines(target, scenario, world_size, excluded)
    if why is not None:
        return Cell("battery", name, world_size, "declined", reason=why)
    key = repr(scenario)
    if key not in _REFERENCES:
        _REFERENCES[key] = prepare_reference(scenario)
    started = time.perf_counter()
    try:
        check_example(target, scenario, world_size, run, reference=_REFERENCES[key], name=name)
    except NothingChecked as exc:  # declined once running (a default hook cannot serve it)
        return Cell("battery", name, world_size, "declined", reason=str(exc))
    except EquivalenceError as error:
        exercised |= features.of(scenario, world_size)
        return _failed(
            Cell("battery", name, world_size, "fail", 1, first_failure=1), error, started
        )
    exercised |= features.of(scenario, world_size)
    return Cell("battery", name, world_size, "ok", 1, seconds=time.perf_counter() - started)


def _feature_cell(
    target: Target,
    feature: str,
    world_size: int,
    *,
    examples: int,
    excluded: frozenset[str],
    unsupported: frozenset[str],
    run: Settings,
    seed: int | None,
    shrink_seconds: float,
    exercised: set[str],
    degrees: tuple[int, ...] | None = None,
) -> Cell:
    cell = Cell("feature", feature, world_size, "ok")
    if not dst.can_exercise(feature, world_size):
        cell.status, cell.reason = "n/a", NO_EXAMPLE_CAN
        return cell
    dtypes = feature_dtypes(feature, unsupported)
    why = declined_cell(target, feature, excluded, unsupported, dtypes)
    if why is not None:
        cell.status, cell.reason = "declined", why
        return cell
    started = time.perf_counter()
    try:
        strategy = dst.exercising(
            feature,
            world_size=world_size,
            dtypes=dtypes,
            without=unsupported,
            opt_in=frozenset({"tensor-parallel"}) - unsupported,  # a mesh target's own kind
            tp_degrees=degrees,
        )
    except NothingChecked as exc:  # no scenario of this target's kind has the feature
        cell.status, cell.reason = "n/a", str(exc)
        return cell
    found = search(
        Draws(target, {world_size: strategy}),
        cell_plan(
            target,
            feature,
            excluded,
            run,
            examples,
            shrink_seconds,
            f"{seed}:{feature}:{world_size}",
        ),
    )
    exercised |= found.features
    cell.examples = found.examples
    return ended(cell, found, started, _failed)


def _failed(cell: Cell, error: EquivalenceError, started: float) -> Cell:
    first = error.divergences[0]
    where = [
        f"step {first.step}" if first.step != "-" else "",
        f"rank {first.rank}" if first.rank is not None else "",
        first.name if first.name not in ("-", None) else "",
    ]
    cell.status, cell.kind, cell.where = "fail", error.kinds[0], ", ".join(filter(None, where))
    cell.scenario, cell.summary = repr(error.scenario), scenario_line(error.scenario)
    cell.replay, cell.seconds = error.replay, time.perf_counter() - started
    cell.exercises = features.named(features.of(error.scenario, cell.world_size))
    return cell


def _grid(corner: str, cells: list[Cell], sizes: tuple[int, ...]) -> str:
    """Rows x ``W=`` columns of cell labels, then one line per reason a cell is ``-`` or
    declined (with the world sizes it applies to)."""
    rows = list(dict.fromkeys(c.row for c in cells))
    by = {(c.row, c.world_size): c for c in cells}
    table = [[corner] + [f"W={w}" for w in sizes]]
    table += [[row] + [by[row, w].label if (row, w) in by else "" for w in sizes] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes: dict[tuple[str, str, str], list[int]] = {}
    for c in cells:
        if c.status in ("declined", "n/a"):
            notes.setdefault((c.label, c.row, c.reason or ""), []).append(c.world_size)
    for (label, row, reason), at in notes.items():
        lines.append(f"{label}: {row} at W={','.join(map(str, at))}: {reason}")
    return "\n".join(lines)
