"""The battery (or one scenario) at every world size: what ``assert_equivalent``, ``ddpcheck
check``'s first phase and the pytest plugin's ``ddpcheck_run`` run once their door admitted the
request.

Per scenario, the full-batch reference is computed once in this process (the first time while
the ranks run the example); then, per world size, every rank of the persistent world runs the
example and the oracle compares what they recorded. Worlds are started smallest first, the next
one booting while this one runs its examples, so the first verdicts come from the world that is
up first.

Invariant: the first divergence is raised (a hang only once it hung twice: exit 1 promises a
replay line that reproduces it); a scenario the target declines is skipped, naming why; a run in
which every example was skipped raises :class:`ddpcheck.NothingChecked`, never passes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from ddpcheck._base.errors import EquivalenceError, NothingChecked
from ddpcheck._language import features
from ddpcheck._language.scenario import Scenario
from ddpcheck._oracle.reference import Reference
from ddpcheck._runs.admission import Request, check_target
from ddpcheck._runs.example import check_example_keeping_reference, refuse_unconfirmed_hang
from ddpcheck._runs.settings import Settings
from ddpcheck._world.registry import launch_worlds
from ddpcheck.targets import support
from ddpcheck.targets.option_space import described, drawn_options, label, space_of, vary
from ddpcheck.targets.protocol import Target

__all__ = ["Report", "assert_admitted", "run_battery"]


@dataclasses.dataclass
class Report:
    """What ``assert_equivalent`` checked: one row per (scenario, world size)."""

    examples: list[tuple[str, int, float]] = dataclasses.field(default_factory=list)
    #: (scenario, world size, why) for every example not run
    skipped: list[tuple[str, int, str]] = dataclasses.field(default_factory=list)
    #: the features (``ddpcheck.features``) the examples that ran exercised
    features: set[str] = dataclasses.field(default_factory=set)
    #: what examples left in the rank processes and ddpcheck put right (process groups
    #: destroyed, a world replaced): how the target lives in its process, never a verdict
    notes: dict[str, None] = dataclasses.field(default_factory=dict)

    @property
    def count(self) -> int:
        return len(self.examples)

    def __str__(self) -> str:
        seconds = sum(s for _, _, s in self.examples)
        sizes = sorted({w for _, w, _ in self.examples})
        text = (
            f"{self.count} examples equivalent (world sizes {sizes}) in {seconds:.2f} s, "
            f"{features.exercised(self.features)}"
        )
        return (
            text
            + "".join(f"\nskipped {line}" for line in self.skipped_lines())
            + "".join(f"\nnote: {note}" for note in self.notes)
        )

    def skipped_lines(self) -> list[str]:
        """One line per scenario and reason, with the world sizes it was skipped at."""
        grouped: dict[tuple[str, str], list[int]] = {}
        for name, world_size, why in self.skipped:
            grouped.setdefault((name, why), []).append(world_size)
        return [
            f"{name} (W={','.join(map(str, sizes))}): {why}"
            for (name, why), sizes in grouped.items()
        ]

    def declined_lines(self) -> list[str]:
        """One line per reason, naming the scenarios it was given for: when every scenario is
        declined for one reason (a target that cannot run on this machine), it is said once."""
        grouped: dict[str, dict[str, list[int]]] = {}
        for name, world_size, why in self.skipped:
            grouped.setdefault(why, {}).setdefault(name, []).append(world_size)
        return [
            ", ".join(f"{name} (W={','.join(map(str, sizes))})" for name, sizes in names.items())
            + f": {why}"
            for why, names in grouped.items()
        ]


def assert_admitted(request: Request, progress: Callable[[int, int], None] | None = None) -> Report:
    """``assert_equivalent`` of an admitted request (the API's and the pytest plugin's): the
    battery (or ``request.scenario``) at every world size; with ``fuzz_config``, then again under
    each single option its space draws (:func:`_under_each_option`; ``ddpcheck check`` draws
    whole configurations in its random examples instead, so its battery is :func:`run_battery`).
    ``progress(done, total)`` before the first example and after each (scenario, world size)."""
    if request.fuzz_config:
        return _under_each_option(request, progress)
    return run_battery(request, progress)


def _under_each_option(request: Request, progress: Callable[[int, int], None] | None) -> Report:
    """The battery of the target as given, then of it with each single option its space draws,
    in turn; the examples named ``name [option]``. The first divergence is raised."""
    target, merged = request.target, Report()
    for single in [{}, *drawn_options(space_of(target))]:
        variant = vary(target, single)
        check_target(variant, request.device)  # its replay line must build it, first
        tag = f" [{label(single)}]" if single else ""
        try:
            report = run_battery(dataclasses.replace(request, target=variant), progress)
        except NothingChecked as exc:
            merged.skipped.append((f"every scenario{tag}", 0, str(exc)))
            continue
        except EquivalenceError as error:
            error.args = (
                f"{error.args[0]}\n\nconfiguration (fuzz_config): {described(target, variant)}",
            )
            raise
        merged.examples += [(name + tag, w, s) for name, w, s in report.examples]
        merged.skipped += [(name + tag, w, why) for name, w, why in report.skipped]
        merged.features |= report.features
        merged.notes.update(report.notes)
    if not merged.examples:
        raise NothingChecked(
            f"{type(target).__name__} declined every scenario under every "
            "option: " + "; ".join(merged.declined_lines())
        )
    return merged


def run_battery(request: Request, progress: Callable[[int, int], None] | None = None) -> Report:
    """The battery (or ``request.scenario``) of the request's target as given, at every world
    size."""
    target, scenario, sizes = request.target, request.scenario, request.world_sizes
    device, backend, excluded = request.device, request.backend, request.battery_without
    named = support.battery_for(target) if scenario is None else [(None, scenario)]
    report = Report()
    references: dict[int, Reference] = {}  # battery index -> its reference, shared by every size
    total, done = len(named) * len(sizes), 0

    def one_more() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    if progress is not None:
        progress(0, total)
    # World by world, smallest first, the next one booting while this one runs its examples:
    # the first verdicts come from the world that is up first, and no world waits idle.
    launch_worlds(sizes[:1], device=device, backend=backend)
    for at, world_size in enumerate(sizes):
        launch_worlds(sizes[at + 1 : at + 2], device=device, backend=backend)
        for index, (name, given) in enumerate(named):
            sc = _within(given, sizes) if scenario is None else given
            why = request.off_mesh(sc, world_size) or support.declines(
                target, sc, world_size, excluded, request.only
            )
            if why is not None:
                report.skipped.append((name or "scenario", world_size, why))
                one_more()
                continue
            started = time.perf_counter()
            try:
                # the first time, the reference is computed while the ranks run the example
                notes, references[index] = _confirmed(
                    target, sc, world_size, references.get(index), request.run, name
                )
            except NothingChecked as exc:  # declined once running: a default hook cannot serve it
                report.skipped.append((name or "scenario", world_size, str(exc)))
                one_more()
                continue
            report.examples.append((name or "scenario", world_size, time.perf_counter() - started))
            report.features |= features.of(sc, world_size)
            report.notes.update(dict.fromkeys(notes))
            one_more()
    if not report.examples:
        raise NothingChecked(
            f"{type(target).__name__} declined every scenario: "
            + "; ".join(report.declined_lines())
        )
    return report


def _confirmed(
    target: Target,
    scenario: Scenario,
    world_size: int,
    reference: Reference | None,
    run: Settings,
    name: str | None,
) -> tuple[tuple[str, ...], Reference]:
    """One example; a hang is run once more before it is reported, since exit 1 promises a
    replay line that reproduces it: one that does not recur is :class:`ddpcheck.Inconclusive`."""
    try:
        return check_example_keeping_reference(
            target, scenario, world_size, run, reference=reference, name=name
        )
    except EquivalenceError as error:
        if set(error.kinds) != {"rank timed out"}:
            raise
        try:
            check_example_keeping_reference(
                target, scenario, world_size, run, reference=reference, name=name
            )
        except EquivalenceError:
            raise error from None  # it hung again (or failed otherwise): the first one stands
        refuse_unconfirmed_hang(error)
        raise


def _within(scenario: Scenario, sizes: tuple[int, ...]) -> Scenario:
    """A battery scenario that resumes at a world size the caller did not allow resumes in the
    world that saved it instead: the world sizes asked for are a promise (``--world-sizes 1``
    starts no world of 2). The same reference serves both: resuming elsewhere changes no number
    of the full-batch run."""
    if scenario.resume_world_size is None or scenario.resume_world_size in sizes:
        return scenario
    return dataclasses.replace(scenario, resume_world_size=None)
