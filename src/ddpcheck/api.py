"""``assert_equivalent``: run a target in real worlds and hold it to the oracle.

Per scenario, the full-batch reference is computed once in this process (which also validates
the scenario: a bad model factory or an optimizer kwarg the optimizer rejects fails here, once,
before any process is spawned); then, per world size, every rank of the persistent world runs the
example and the oracle compares what they recorded.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any

from ddpcheck._base.errors import EquivalenceError, NothingChecked
from ddpcheck._base.options import DEFAULT_DEADLINE, DEFAULT_WORLD_SIZES, check_world_size
from ddpcheck._language import features
from ddpcheck._language.battery import BATTERY
from ddpcheck._language.scenario import Scenario
from ddpcheck._runs import example
from ddpcheck._runs.admission import Request, admit
from ddpcheck._runs.example import check_example_keeping_reference, refuse_unconfirmed_hang
from ddpcheck._world.interrupts import interruptible
from ddpcheck._world.registry import launch_worlds
from ddpcheck.targets import Target

__all__ = ["Report", "assert_equivalent", "check_example"]


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


@interruptible
def check_example(
    target: Target,
    scenario: Scenario,
    world_size: int,
    *,
    deadline: float = DEFAULT_DEADLINE,
    reference: Any = None,
    name: str | None = None,
    checks: Any = None,
    device: str = "cpu",
    backend: str | None = None,
) -> tuple[str, ...]:
    """One example (``_runs.example.check_example``), admitted first (``_runs.admission``);
    returns what it left in the rank processes and ddpcheck put right: never a verdict."""
    check_world_size("world_size", world_size)
    request = admit(
        target,
        scenario=scenario,
        world_sizes=(world_size,),
        deadline=deadline,
        device=device,
        backend=backend,
    )
    return example.check_example(
        request.target,
        scenario,
        world_size,
        reference=reference,
        name=name,
        checks=checks,
        **request.run,
    )


@interruptible
def assert_equivalent(
    target: Target,
    scenario: Scenario | None = None,
    *,
    world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
    deadline: float = DEFAULT_DEADLINE,
    without: Iterable[str] = (),
    dtypes: Iterable[str] | None = None,
    only: Iterable[str] = (),
    device: str = "cpu",
    backend: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    fuzz_config: bool = False,
) -> Report:
    """Check ``target`` against the oracle on ``scenario`` (default: the built-in battery).

    ``device="cuda"`` runs every rank on its GPU (rank r on cuda:r, NCCL; ``backend="gloo"``
    lets ranks share GPUs); the reference stays the CPU run. Refused before any world starts
    when the machine cannot run it (``ddpcheck._base.devices.check_fits``).

    A scenario that needs a feature the target does not support (``Target.supported_features``)
    or that ``without`` excludes (names from ``ddpcheck.features.FEATURES``) is skipped at that
    world size, naming the feature; ``dtypes`` (``"float64"``, ``"float32"``; default: both)
    keeps only the scenarios in those dtypes, ``only`` (feature names) those that exercise one
    of them. The arguments are admitted as at every door
    (``ddpcheck._runs.admission``: the same rules, defaults and messages as the command
    line's).

    Raises :class:`ddpcheck.EquivalenceError` on the first divergence, with a table and a replay
    command; returns a :class:`Report` when every example holds. Not the target's fault, so never
    an EquivalenceError: :class:`ddpcheck.ScenarioError` (a scenario the oracle cannot judge),
    :class:`ddpcheck.WorldStartError`, :class:`ddpcheck.NothingChecked` (every example skipped or
    declined: passing would be a silent no-op), :class:`ddpcheck.InvalidArgument`.

    ``progress(done, total)`` is called before the first example (``done`` 0) and after each
    (scenario, world size), run or skipped: how ``ddpcheck check`` keeps its live line moving.

    ``fuzz_config=True``: then again under each single option the target's ``config_space()``
    draws (``ddpcheck.targets.option_space``; refused for a target with none), each verdict
    naming its option and its replay line building it (``fuzz`` draws whole configurations).
    """
    request = admit(
        target,
        scenario=scenario,
        world_sizes=world_sizes,
        deadline=deadline,
        without=without,
        dtypes=dtypes,
        device=device,
        backend=backend,
        only=only,
        fuzz_config=fuzz_config,
    )
    if request.fuzz_config:
        return _under_each_option(request, progress)
    return run_battery(request, progress)


def _under_each_option(request: Request, progress: Callable[[int, int], None] | None) -> Report:
    """:func:`run_battery` of the target as given, then of it with each single option its space
    draws, in turn; the examples named ``name [option]``. The first divergence is raised."""
    from ddpcheck._runs.admission import check_target
    from ddpcheck.targets.option_space import described, drawn_options, label, space_of, vary

    target, merged = request.target, Report()
    for single in [{}, *drawn_options(space_of(target))]:
        variant = vary(target, single)
        check_target(variant)  # its replay line must build it, before any of it runs
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
            "option: " + "; ".join(merged.skipped_lines())
        )
    return merged


def run_battery(request: Request, progress: Callable[[int, int], None] | None = None) -> Report:
    """:func:`assert_equivalent` of an admitted request (the command line's and the pytest
    plugin's path: their doors admitted it)."""
    target, scenario, sizes = request.target, request.scenario, request.world_sizes
    device, backend, excluded = request.device, request.backend, request.battery_without
    named = BATTERY if scenario is None else [(None, scenario)]
    report = Report()
    references: dict[int, Any] = {}  # battery index -> its reference, shared by every size
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
            why = features.declines(target, sc, world_size, excluded, request.only)
            if why is not None:
                report.skipped.append((name or "scenario", world_size, why))
                one_more()
                continue
            started = time.perf_counter()
            run = dict(request.run, name=name)
            try:
                # the first time, the reference is computed while the ranks run the example
                notes, references[index] = _confirmed(
                    target, sc, world_size, references.get(index), run
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
            f"{type(target).__name__} declined every scenario: " + "; ".join(report.skipped_lines())
        )
    return report


def _confirmed(
    target: Target, scenario: Scenario, world_size: int, reference: Any, run: dict
) -> tuple[tuple[str, ...], Any]:
    """One example; a hang is run once more before it is reported, since exit 1 promises a
    replay line that reproduces it: one that does not recur is :class:`ddpcheck.Inconclusive`."""
    try:
        return check_example_keeping_reference(
            target, scenario, world_size, reference=reference, **run
        )
    except EquivalenceError as error:
        if set(error.kinds) != {"rank timed out"}:
            raise
        try:
            check_example_keeping_reference(
                target, scenario, world_size, reference=reference, **run
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
