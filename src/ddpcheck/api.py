"""``assert_equivalent``: run a target in real worlds and hold it to the oracle.

Per scenario, the full-batch reference is computed once in this process (which also validates
the scenario: a bad model factory or an optimizer kwarg the optimizer rejects fails here, once,
before any process is spawned); then, per world size, every rank of the persistent world runs the
example and the oracle compares what they recorded.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from typing import Any, Iterable

from ddpcheck._internal.devices import check_fits
from ddpcheck._internal.options import DEFAULT_DEADLINE, DEFAULT_WORLD_SIZES, check_fits_machine
from ddpcheck._internal.validation import InvalidArgument, check_deadline, check_world_sizes
from ddpcheck.errors import Divergence, EquivalenceError, NothingChecked, ScenarioError
from ddpcheck.replay import replay_command, target_spec, verify_replayable
from ddpcheck.scenario import Scenario
from ddpcheck.targets import Target

__all__ = ["Report", "assert_equivalent", "check_example", "note_example", "replay_command",
           "target_spec", "verdict"]

#: Examples run in this process (the pytest plugin prints the total at the end of a session).
EXAMPLES_RUN = 0


def note_example() -> None:
    """Count one example (for properties that drive worlds themselves)."""
    global EXAMPLES_RUN
    EXAMPLES_RUN += 1


@dataclasses.dataclass
class Report:
    """What ``assert_equivalent`` checked: one row per (scenario, world size)."""

    examples: list[tuple[str, int, float]] = dataclasses.field(default_factory=list)
    #: (scenario, world size, why) for every example not run
    skipped: list[tuple[str, int, str]] = dataclasses.field(default_factory=list)
    #: the features (``ddpcheck.features``) the examples that ran exercised
    features: set[str] = dataclasses.field(default_factory=set)

    @property
    def count(self) -> int:
        return len(self.examples)

    def __str__(self) -> str:
        from ddpcheck.features import exercised

        seconds = sum(s for _, _, s in self.examples)
        sizes = sorted({w for _, w, _ in self.examples})
        text = (f"{self.count} examples equivalent (world sizes {sizes}) in {seconds:.2f} s, "
                f"{exercised(self.features)}")
        return text + "".join(f"\nskipped {line}" for line in self.skipped_lines())

    def skipped_lines(self) -> list[str]:
        """One line per scenario and reason, with the world sizes it was skipped at."""
        grouped: dict[tuple[str, str], list[int]] = {}
        for name, world_size, why in self.skipped:
            grouped.setdefault((name, why), []).append(world_size)
        return [f"{name} (W={','.join(map(str, sizes))}): {why}"
                for (name, why), sizes in grouped.items()]


def assert_equivalent(target: Target, scenario: Scenario | None = None, *,
                      world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
                      deadline: float = DEFAULT_DEADLINE, without: Iterable[str] = (),
                      device: str = "cpu", backend: str | None = None) -> Report:
    """Check ``target`` against the oracle on ``scenario`` (default: the built-in battery).

    ``device="cuda"`` runs every rank on its GPU (rank r on cuda:r, NCCL; ``backend="gloo"``
    lets ranks share GPUs); the reference stays the CPU run. Refused before any world starts
    when the machine cannot run it (``ddpcheck._internal.devices.check_fits``).

    A scenario that needs a feature the target does not support (``Target.supported_features``)
    or that ``without`` excludes (names from ``ddpcheck.features.FEATURES``) is skipped at that
    world size, naming the feature.

    Raises :class:`ddpcheck.EquivalenceError` on the first divergence, with a table and a replay
    command; returns a :class:`Report` when every example holds. Not the target's fault, so never
    an EquivalenceError: :class:`ddpcheck.ScenarioError` (a scenario the oracle cannot judge),
    :class:`ddpcheck.WorldStartError`, :class:`ddpcheck.NothingChecked` (every example skipped or
    declined: passing would be a silent no-op), :class:`ddpcheck.InvalidArgument`.
    """
    from ddpcheck import features

    check_target(target)
    sizes = check_world_sizes("world_sizes", world_sizes)
    check_fits_machine(sizes, flag="world_sizes")
    check_fits(device, sizes, backend)
    check_deadline("deadline", deadline)
    excluded = features.parse(without, "without")
    if scenario is None:
        from ddpcheck.battery import BATTERY

        named = BATTERY
    elif isinstance(scenario, Scenario):
        named = [(None, scenario)]
    else:
        raise InvalidArgument(f"scenario={scenario!r} must be a ddpcheck.Scenario (or None for "
                              "the built-in battery)")
    report = Report()
    for name, sc in named:
        reference = None
        for world_size in sizes:
            why = features.declines(target, sc, world_size, excluded)
            if why is not None:
                report.skipped.append((name or "scenario", world_size, why))
                continue
            if reference is None:
                reference = prepare_reference(sc)
            started = time.perf_counter()
            check_example(target, sc, world_size, deadline=deadline, reference=reference,
                          name=name, device=device, backend=backend)
            report.examples.append((name or "scenario", world_size,
                                    time.perf_counter() - started))
            report.features |= features.of(sc, world_size)
    if not report.examples:
        raise NothingChecked(f"{type(target).__name__} declined every scenario: "
                             + "; ".join(report.skipped_lines()))
    return report


def check_example(target: Target, scenario: Scenario, world_size: int, *,
                  deadline: float = DEFAULT_DEADLINE, reference: Any = None,
                  name: str | None = None, checks: Any = None, device: str = "cpu",
                  backend: str | None = None) -> None:
    """One example: run on every rank of the persistent world, compare, raise on divergence.

    ``checks``: a subset of ``ddpcheck.oracle.CHECKS`` (default: all of them). An example the
    target declines (``supports``, ``supported_features``) raises :class:`NothingChecked`. A
    scenario with ``checkpoint_after`` saves in this world and resumes in the persistent world
    of ``resume_world_size`` (``ddpcheck.resuming``), judged by ``ddpcheck.resumed``.
    ``device``/``backend``: where the ranks compute (as for :func:`assert_equivalent`)."""
    from ddpcheck._internal.runner import run_example_packed
    from ddpcheck._internal.transport import unpack
    from ddpcheck._internal.world import WorldFailure, get_world
    from ddpcheck.features import declines
    from ddpcheck.oracle import validate_checks
    from ddpcheck.resuming import run_in_two_worlds

    checks = validate_checks(checks)  # a typo must not turn every check off
    check_fits(device, (world_size,), backend)  # no GPU, or too few for NCCL: before spawning
    check_target(target)  # cached: a pickle and a dict look-up once the target is verified
    why = declines(target, scenario, world_size)
    if why is not None:  # running it anyway would blame the target for what it never claimed
        raise NothingChecked(f"{type(target).__name__} declines this example: {why}")
    for size in dict.fromkeys((world_size, scenario.resume_world_size or world_size)):
        check_batch_plans(target, scenario, size)  # a resumed world's plans too
    if reference is None:
        reference = prepare_reference(scenario)
    # a world that cannot start raises WorldStartError
    world = get_world(world_size, backend=backend, device=device)
    worlds = [world]
    try:
        if scenario.checkpoint_after is None:
            packed = world.run(run_example_packed, target, scenario, deadline=deadline,
                               what=f"example {name or 'scenario'}")
            records, sequences = [unpack(p) for p in packed], world.collective_sequences()
        else:  # save in this world, resume in one of resume_world_size (ddpcheck.resuming)
            records, sequences, worlds = run_in_two_worlds(
                target, scenario, world_size, deadline=deadline,
                what=f"example {name or 'scenario'}", device=device, backend=backend)
    except WorldFailure as failure:
        error = verdict(target, scenario, world_size, failure=failure, name=name,
                        device=device, backend=backend)
    else:
        note_example()
        error = verdict(target, scenario, world_size, records=records, sequences=sequences,
                        reference=reference, checks=checks, name=name, device=device,
                        backend=backend)
        if error is not None and "collectives mismatched" in error.kinds:
            # ranks paired different collectives, yet nothing hung: gloo's pairs may hold stray
            # bytes, so the next example gets a new world
            for used in worlds:
                used.kill()
    if error is not None:
        raise error


def verdict(target: Any, scenario: Scenario, world_size: int, *, records: Any = None,
            sequences: Any = (), failure: Any = None, reference: Any = None, checks: Any = None,
            name: str | None = None, device: str = "cpu",
            backend: str | None = None) -> EquivalenceError | None:
    """The one judgement of an example, for spawned worlds and torchrun alike: None when it holds.

    Give either ``failure`` (a ``WorldFailure``: a rank raised, died, hung or mismatched) or
    ``records`` (every rank's ``RankRecord``) with ``sequences`` (every rank's collective-sequence
    text: ranks that paired different collectives are wrong even when the numbers look fine);
    for a scenario with ``checkpoint_after``, both as pairs (before the checkpoint, resumed).
    Raises :class:`ddpcheck.ScenarioError` when the oracle cannot judge the example (the
    reference itself went non-finite): that is nobody's bug, so never an EquivalenceError.
    ``device``/``backend`` (the run's) go into the replay line.
    """
    from ddpcheck.oracle import cannot_judge, compare

    from ddpcheck.resumed import compare_resumed

    resumed = scenario.checkpoint_after is not None
    if failure is not None:
        divergences = _failure_rows(failure)
    else:
        # a resumed example: (before, after) records and sequences, at W and resume_world_size
        parts = zip(sequences, (len(part) for part in records)) if resumed else [
            (sequences, world_size)]
        divergences = [row for texts, size in parts
                       for row in _mismatched_collectives(list(texts), size)]
        if not divergences:
            if reference is None:
                reference = prepare_reference(scenario)
            divergences = (compare_resumed if resumed else compare)(
                records, reference, scenario, target.configure(scenario), checks)
    if not divergences:
        return None
    if cannot_judge(divergences):
        first = divergences[0]
        raise ScenarioError(
            f"the oracle cannot judge {scenario!r} at world size {world_size}: {first.detail} "
            f"(step {first.step}, {first.name}); the full-batch reference itself diverges "
            "numerically, so no target could match it -- lower the learning rate or the number "
            "of steps. Steps before it were judged and held.")
    # The replay line is built only on failure: the passing path is the hot one.
    return EquivalenceError(divergences, scenario=scenario, world_size=world_size, target=target,
                            replay=replay_command(target, scenario, world_size, device=device,
                                                  backend=backend),
                            failure=failure, name=name)


def prepare_reference(scenario: Scenario) -> Any:
    """The full-batch reference; user mistakes in the scenario surface here, once, as a
    :class:`ScenarioError` naming the cause (``ddpcheck.validity``), before any world runs."""
    from ddpcheck.reference import reference_run
    from ddpcheck.validity import check_scenario, explain_reference_failure

    check_scenario(scenario)
    try:
        return reference_run(scenario)
    except InvalidArgument:
        raise
    except Exception as exc:  # the backward, param groups, the optimizer's step, a later step
        raise explain_reference_failure(scenario, exc) from exc


def _failure_rows(failure: Any) -> list[Divergence]:
    kind = {"timeout": "rank timed out", "mismatch": "collectives mismatched",
            "contaminated": "rank left unfit"}.get(failure.kind, "rank failed")
    rows = []
    for state in failure.ranks:
        if state.rank in failure.guilty:
            if failure.kind == "mismatch":
                detail = _at_disagreement(failure.disagreement, state.rank)
            elif state.detail.strip():
                detail = state.detail.strip().splitlines()[-1]
            else:
                detail = state.status
            rows.append(Divergence("-", failure.world_size, state.rank, "-", kind,
                                   detail=detail if state.status != "stuck" or
                                   failure.kind == "mismatch" else "stuck"))
    return rows


def _at_disagreement(disagreement: Any, rank: int) -> str:
    entry = disagreement.entries.get(rank)
    if entry is None:
        return f"issued nothing at collective index {disagreement.index}"
    return f"issued {entry.brief()} at collective index {disagreement.index}"


def _mismatched_collectives(texts: list[str], world_size: int) -> list[Divergence]:
    """Rows for ranks whose collective sequences disagree in an example that completed.

    Identical sequence files (the usual case) are accepted without parsing them, so the check
    costs a few file reads per example."""
    from ddpcheck._internal import sequences

    if not texts or sequences.same_texts(texts):
        return []
    disagreement = sequences.diagnose([sequences.parse(t) for t in texts],
                                      finished=range(world_size))
    if disagreement is None:  # different texts, same signatures (e.g. all_gather shapes)
        return []
    where = disagreement.describe()
    return [Divergence("-", world_size, rank, "-", "collectives mismatched",
                       detail=f"rank {rank} {_at_disagreement(disagreement, rank)}\n{where}")
            for rank in disagreement.deviants]


def check_batch_plans(target: Any, scenario: Scenario, world_size: int) -> None:
    """A target's own ``shard_batch`` answers every step and rank with a valid plan -- checked
    here, before any world runs, so a malformed answer is an :class:`InvalidArgument` naming the
    rank and the step, not a rank failure (``ddpcheck.batches``). The default needs no check."""
    from ddpcheck.batches import check_plans

    configured = target.configure(scenario)
    if getattr(type(configured), "shard_batch", Target.shard_batch) is not Target.shard_batch:
        check_plans(configured.shard_batch, scenario, world_size,
                    f"{type(configured).__name__}.shard_batch")


def check_target(target: Any) -> None:
    """Refuse, before any world runs, a target the ranks could not use or a failure could not
    replay; name what is wrong and how to fix it."""
    if isinstance(target, type):
        raise InvalidArgument(f"target={target.__qualname__} is a class; pass an instance, "
                              f"such as {target.__qualname__}()")
    missing = [m for m in ("configure", "supports", "wrap", "make_optimizer", "before_step",
                           "after_backward", "after_step", "no_sync", "optimizer_state")
               if not callable(getattr(target, m, None))]
    if missing:
        raise InvalidArgument(f"target={target!r} lacks {missing}; subclass ddpcheck.Target")
    supported = getattr(target, "supported_features", None)
    if supported is not None:  # a typo would silently decline nothing
        from ddpcheck._internal.vocabulary import parse

        parse(supported, f"{type(target).__name__}.supported_features")
    try:
        pickled = pickle.dumps(target)
    except Exception as exc:
        raise InvalidArgument(
            f"target={target!r} cannot be pickled ({exc}); targets travel to every rank by "
            "pickle, so define the class at module level of an importable module") from exc
    verify_replayable(target, pickled)  # a failure's replay line must rebuild exactly this target
