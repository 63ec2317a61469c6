"""One example, from a target and a scenario to a verdict: the path every front door shares.

Invariant: :func:`check_example` refuses what is not the target's fault before any world runs (a
target that cannot travel or be replayed, a declined scenario, a malformed batch plan, a scenario
the oracle cannot judge), runs the example on every rank of the persistent world -- or, for a
scenario with ``checkpoint_after``, saves in one world and resumes in another (:func:`launch`,
then :func:`resume`) -- and hands what came back to :func:`verdict`, the one judgement spawned
worlds and torchrun share: collective sequences first, then the oracle against the
full-batch reference. It raises :class:`ddpcheck.EquivalenceError` (with its replay line) only for
the target's fault.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ddpcheck._base.devices import check_fits
from ddpcheck._base.errors import (
    Divergence,
    EquivalenceError,
    Inconclusive,
    InvalidArgument,
    NothingChecked,
    ScenarioError,
)
from ddpcheck._base.options import check_fits_machine
from ddpcheck._language.batches import check_plans
from ddpcheck._language.scenario import Scenario
from ddpcheck._oracle.communication import step_report
from ddpcheck._oracle.compare import (
    CHAOTIC,
    cannot_judge,
    compare,
    compare_resumed,
    validate_checks,
)
from ddpcheck._oracle.judgeable import check_scenario, explain_reference_failure
from ddpcheck._oracle.reference import Reference, reference_run
from ddpcheck._rank.runner import run_example_packed
from ddpcheck._rank.transport import unpack
from ddpcheck._runs import alone
from ddpcheck._runs.replay import replay_command
from ddpcheck._runs.settings import DEFAULT_SETTINGS, Settings
from ddpcheck._runs.warmup import warm_up
from ddpcheck._world import sequences
from ddpcheck._world.failures import Failure, Status, WorldFailure
from ddpcheck._world.registry import world_of
from ddpcheck._world.worlds import Pending, TaskLost, World
from ddpcheck.targets import Target
from ddpcheck.targets.support import declines

__all__ = [
    "Launched",
    "admit",
    "check_batch_plans",
    "check_example",
    "check_example_keeping_reference",
    "judge",
    "launch",
    "note_example",
    "prepare_reference",
    "refuse_unconfirmed_hang",
    "resume",
    "verdict",
]

#: Examples run in this process (the pytest plugin prints the total at the end of a session).
EXAMPLES_RUN = 0


def note_example() -> None:
    """Count one example (for properties that drive worlds themselves)."""
    global EXAMPLES_RUN
    EXAMPLES_RUN += 1


def check_example(
    target: Target,
    scenario: Scenario,
    world_size: int,
    run: Settings = DEFAULT_SETTINGS,
    *,
    reference: Reference | None = None,
    name: str | None = None,
    checks: Iterable[str] | None = None,
) -> tuple[str, ...]:
    """One example (see :func:`check_example_keeping_reference`); returns what it left in the
    rank processes and ddpcheck put right (``World.notes``): never a verdict."""
    return check_example_keeping_reference(
        target, scenario, world_size, run, reference=reference, name=name, checks=checks
    )[0]


def check_example_keeping_reference(
    target: Target,
    scenario: Scenario,
    world_size: int,
    run: Settings = DEFAULT_SETTINGS,
    *,
    reference: Reference | None = None,
    name: str | None = None,
    checks: Iterable[str] | None = None,
) -> tuple[tuple[str, ...], Reference]:
    """One example: run on every rank of the persistent world, compare, raise on divergence.

    Returns the notes of what the example left behind in the rank processes and ddpcheck put
    right (process groups destroyed, settings restored, a world replaced; ``World.notes``) --
    never a verdict -- and the reference it was judged against (computed while the ranks ran,
    when not given), for the next example of the same scenario. ``checks``: a subset of
    ``ddpcheck._oracle.compare.CHECKS`` (default: all of them). An example the target
    declines (``supports``, ``supported_features``, or a default hook that cannot serve it, found in
    the ranks) raises :class:`NothingChecked`. A scenario with ``checkpoint_after`` saves in this
    world and resumes in the persistent world of ``resume_world_size`` (:func:`resume`), judged
    by ``compare_resumed``. ``run``: the run's deadline and where the ranks compute, as admitted
    (``_runs.admission.Settings``).

    Numbers first: the records are compared before anything the ranks report about their
    processes, so a rank left unfit (a global module hook: ``World.unfit``) is reported only
    when every number holds -- a bug in the numbers is never hidden behind it."""
    with _beside_the_ranks():  # inline, not a frame more in every traceback
        checked = admit(target, scenario, world_size, run, checks=checks)
        # inline, as above: a world that cannot start raises WorldStartError
        world = world_of(world_size, backend=run.backend, device=run.device)
        launched = _submit(world, target, scenario, world_size, run, name, checked)
        reference = _reference_meanwhile(launched.pending, reference, scenario)
        return judge(launched, reference), reference


@dataclasses.dataclass
class Launched:
    """An example admitted and submitted to its world's ranks (:func:`launch`), to be judged
    by :func:`judge` once they answer.

    A scenario with ``checkpoint_after`` runs in two halves: ``pending`` is first the steps up to
    the checkpoint in ``world``; :func:`resume` collects them (``saved``) and makes ``pending``
    the rest, submitted to ``resumed_world``."""

    target: Target
    scenario: Scenario
    world_size: int
    world: World
    pending: Pending
    checks: frozenset[str]
    name: str | None
    run: Settings
    #: the first half's (records, collective sequences) once resumed, or the WorldFailure or
    #: TaskLost collecting it raised -- raised again when the example is judged
    saved: Any = None
    resumed_world: World | None = None

    @property
    def resumes(self) -> bool:
        return self.scenario.checkpoint_after is not None


def admit(
    target: Target,
    scenario: Scenario,
    world_size: int,
    run: Settings,
    *,
    checks: Iterable[str] | None = None,
) -> frozenset[str]:
    """What this scenario adds to its run's admission (``_runs.admission``: the target, the
    world sizes, the device were checked there), refused before any world runs; the checks to
    run. A drawn scenario is new input, judged here; a given one was judged at the door (a
    cache hit)."""
    checks = validate_checks(checks)  # a typo must not turn every check off
    check_scenario(scenario)  # the user's model and data first: their errors read best here
    why = declines(target, scenario, world_size)
    if why is not None:  # running it would blame the target for what it never claimed
        raise NothingChecked(f"{type(target).__name__} declines this example: {why}")
    resumed_at = scenario.resume_world_size or world_size
    if scenario.checkpoint_after is not None:
        check_fits_machine((resumed_at,), flag="resume_world_size")
        check_fits(run.device, (resumed_at,), run.backend)  # GPUs for the resumed world too
    for size in dict.fromkeys((world_size, resumed_at)):
        check_batch_plans(target, scenario, size)  # a resumed world's plans too
    return checks


def launch(
    target: Target,
    scenario: Scenario,
    world_size: int,
    run: Settings,
    *,
    name: str | None = None,
    checks: Iterable[str] | None = None,
) -> Launched:
    """Admit an example and submit it to the persistent world's ranks -- queued behind a task
    still running there (``World.submit``); for a scenario with ``checkpoint_after``, its steps
    up to the checkpoint (:func:`resume` submits the rest)."""
    checked = admit(target, scenario, world_size, run, checks=checks)
    # a world that cannot start raises WorldStartError
    world = world_of(world_size, backend=run.backend, device=run.device)
    return _submit(world, target, scenario, world_size, run, name, checked)


def _submit(
    world: World,
    target: Target,
    scenario: Scenario,
    world_size: int,
    run: Settings,
    name: str | None,
    checks: frozenset[str],
) -> Launched:
    warm_up(world, target)  # once per rank process, outside the example's deadline
    pending = (
        _submit_part(world, target, scenario, run.deadline, name, "until checkpoint", None)
        if scenario.checkpoint_after is not None
        else world.enqueue(
            run_example_packed,
            target,
            scenario,
            deadline=run.deadline,
            what=f"example {name or 'scenario'}",
        )
    )
    return Launched(target, scenario, world_size, world, pending, checks, name, run)


def _submit_part(
    world: Any,
    target: Target,
    scenario: Scenario,
    deadline: float,
    name: str | None,
    part: str,
    checkpoint: Any,
) -> Pending:
    """Submit one half of a scenario with ``checkpoint_after`` (``run_example_packed``'s
    ``part``)."""
    when = "until its checkpoint" if part == "until checkpoint" else "resumed from its checkpoint"
    return world.enqueue(
        run_example_packed,
        target,
        scenario,
        part,
        checkpoint,
        deadline=deadline,
        what=f"example {name or 'scenario'} {when}",
    )


def resume(launched: Launched) -> None:
    """For a scenario with ``checkpoint_after``: collect the steps up to the checkpoint and submit
    the rest to the persistent world of ``resume_world_size``, which loads rank 0's checkpoint.
    Once; nothing for any other example. A failure collecting the first half is kept for
    :func:`judge` (the verdict is judged in order, with the example's other evidence)."""
    if not launched.resumes or launched.saved is not None:
        return
    try:
        saved = [unpack(p) for p in launched.pending.collect()]
    except (WorldFailure, TaskLost) as exc:
        launched.saved = exc
        return
    launched.saved = ([record for record, _ in saved], launched.world.collective_sequences())
    scenario = launched.scenario
    launched.resumed_world = world_of(
        scenario.resume_world_size or launched.world_size,
        backend=launched.run.backend,
        device=launched.run.device,
    )
    warm_up(launched.resumed_world, launched.target)
    launched.pending = _submit_part(
        launched.resumed_world,
        launched.target,
        scenario,
        launched.run.deadline,
        launched.name,
        "resumed",
        saved[0][1],
    )


def judge(launched: Launched, reference: Reference) -> tuple[str, ...]:
    """Collect a launched example and judge it against ``reference``: raise the target's
    :class:`EquivalenceError`, or return the notes of what it left behind (``World.notes``).
    ``TaskLost`` (a queued example whose world was replaced first) passes through: it never
    ran in a fit world."""
    world = launched.world

    def collected() -> tuple[Any, Any, list, Any]:
        if not launched.resumes:
            records = [unpack(p) for p in launched.pending.collect()]
            return records, world.collective_sequences(), [world], reference
        return (*_both_halves(launched), reference)

    try:
        return _judged(
            launched.target,
            launched.scenario,
            launched.world_size,
            collected,
            launched.checks,
            [world],
            name=launched.name,
            device=launched.run.device,
            backend=launched.run.backend,
        )[0]
    except EquivalenceError as error:
        broken = _fails_alone(launched, error)
        if broken is None:
            raise
        raise broken from None


def _fails_alone(launched: Launched, error: EquivalenceError) -> alone.TargetSetupError | None:
    """``error``, a rank that raised, as the target's set-up error when it needs no second rank
    (``_runs.alone``): raised at W=1, or -- asked here, in the one-process world -- raised the
    same way by the same scenario at W=1; where the example cannot run at W=1 (declined, not
    admissible there), raised on every rank in a set-up hook before any collective. Anything
    else the W=1 run says (it passes, differs, hangs) leaves the verdict as it was: a failure
    that needs W > 1 is a data-parallel bug, set-up hook or not."""
    failure = error.failure
    if not isinstance(failure, WorldFailure) or failure.kind != Failure.RAISED:
        return None
    if failure.world_size == 1:
        return alone.setup_error(launched.target, launched.scenario, failure)
    one = dataclasses.replace(launched.scenario, resume_world_size=None)
    try:
        check_example(launched.target, one, 1, launched.run, name=launched.name)
    except alone.TargetSetupError as at_one:
        return alone.without_data_parallelism(failure, at_one, launched.target, launched.scenario)
    except (NothingChecked, InvalidArgument):  # it cannot run at W=1: the set-up hooks say
        return alone.setup_error(launched.target, launched.scenario, failure)
    except Exception:  # it failed otherwise, hung, or could not start: the verdict at W stands
        return None
    return None


def _judged(
    target: Target,
    scenario: Scenario,
    world_size: int,
    collected: Callable[[], tuple[Any, Any, list, Any]],
    checks: frozenset,
    worlds: list,
    **common: Any,
) -> tuple[tuple[str, ...], Any]:
    """The verdict on what ``collected()`` returns -- ``(records, sequences, worlds,
    reference)`` -- or on the ``WorldFailure`` it raises: raise the target's error, else
    return the worlds' notes and the reference."""
    reference = None
    try:
        records, texts, worlds, reference = collected()
    except WorldFailure as failure:
        if failure.kind == Failure.REFUSED:  # ddpcheck's own outcome, raised in the ranks
            raise failure.refusal() from None
        if failure.kind == Failure.SLOW:  # still working when the wait ended: no verdict at all
            replay = replay_command(
                target,
                scenario,
                world_size,
                device=common.get("device", "cpu"),
                backend=common.get("backend"),
            )
            raise Inconclusive(
                f"{failure}\n\nno verdict on this example: slowness is not a bug; raise the "
                "deadline (--deadline, deadline=) or run where the machine is quieter\n"
                f"scenario: {scenario!r}\nreplay with more time: {replay} --deadline SECONDS"
            ) from None
        error = verdict(target, scenario, world_size, failure=failure, **common)
    else:
        note_example()
        error = verdict(
            target,
            scenario,
            world_size,
            records=records,
            sequences=texts,
            reference=reference,
            checks=checks,
            **common,
        )
        error = _after_the_numbers(error, target, scenario, world_size, worlds, common)
    if error is not None:
        raise error
    return tuple(dict.fromkeys(note for used in worlds for note in used.notes)), reference


def _after_the_numbers(
    error: EquivalenceError | None,
    target: Target,
    scenario: Scenario,
    world_size: int,
    worlds: list,
    common: dict,
) -> EquivalenceError | None:
    """What the worlds report once the numbers were judged: gloo's pairs after a mismatch
    that completed (the next example gets new worlds), or a rank left unfit."""
    if error is not None and "collectives mismatched" in error.kinds:
        # ranks paired different collectives, yet nothing hung: gloo's pairs may hold
        # stray bytes, so the next example gets a new world
        for used in worlds:
            used.kill()
    elif error is None and any(used.unfit for used in worlds):
        error = verdict(target, scenario, world_size, unfit=worlds, **common)
    return error


@contextlib.contextmanager
def _beside_the_ranks() -> Iterator[None]:
    """One intra-op thread in this process while it checks an example, then the caller's number
    again. The reference and the oracle compute here while the ranks train on the same cores;
    a second thread of every small op here waits for a core a rank holds (with two threads, an
    example's CPU here was 1.3x on a quiet 2-core machine, 3.5x on a loaded one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _reference_meanwhile(
    pending: Pending, reference: Reference | None, scenario: Scenario
) -> Reference:
    """The reference, computed while the ranks train (it is needed only to judge them): one
    example costs the slower of the two, not their sum. A scenario the reference cannot train
    lets the ranks finish first, so the world stays usable."""
    if reference is not None:
        return reference
    try:
        return prepare_reference(scenario)
    except KeyboardInterrupt:
        pending.abandon()
        raise
    except BaseException:
        try:
            pending.collect()
        except WorldFailure:
            pass
        raise


def refuse_unconfirmed_hang(error: EquivalenceError) -> None:
    """``error`` failed once and passed when its example ran again. Numbers that differ between
    runs are still a counterexample (a race); a hang that did not recur is no verdict -- nothing
    could prove it --: raised here as :class:`ddpcheck.Inconclusive`."""
    if set(error.kinds) == {"rank timed out"}:
        raise Inconclusive(
            f"{error.args[0]}\n\nno verdict: this example hung once (its ranks waiting, not "
            "working), then passed when it ran again, so no replay line can prove a hang; run "
            "it again, and if it hangs again it is reported"
        ) from None


def verdict(
    target: Target,
    scenario: Scenario,
    world_size: int,
    *,
    records: Any = None,
    sequences: Any = (),
    failure: Any = None,
    unfit: Any = (),
    reference: Any = None,
    checks: Any = None,
    name: str | None = None,
    device: str = "cpu",
    backend: str | None = None,
) -> EquivalenceError | None:
    """The one judgement of an example, for spawned worlds and torchrun alike: None when it holds.

    Give either ``failure`` (a ``WorldFailure``: a rank raised, died, hung or mismatched), or
    ``records`` (every rank's ``RankRecord``) with ``sequences`` (every rank's collective-sequence
    text: ranks that paired different collectives are wrong even when the numbers look fine) --
    for a scenario with ``checkpoint_after``, both as pairs (before the checkpoint, resumed) --,
    or ``unfit`` (the worlds of an example whose numbers held but whose ranks left a change that
    alters later computations, ``World.unfit``).
    Raises :class:`ddpcheck.ScenarioError` when the oracle cannot judge the example (the
    reference itself went non-finite, or is chaotic): that is nobody's bug, so never an
    EquivalenceError.
    ``device``/``backend`` (the run's) go into the replay line.
    """
    resumed = scenario.checkpoint_after is not None
    if failure is not None:
        divergences = _failure_rows(failure)
    elif unfit:
        divergences = [
            Divergence(
                "-",
                used.world_size,
                rank,
                "-",
                "rank left unfit",
                detail=f"{changed}: every later model or step in this process "
                "would run it (the numbers of this example held)",
            )
            for used in unfit
            for rank, changed in sorted(used.unfit.items())
        ]
    else:
        # a resumed example: (before, after) records and sequences, at W and resume_world_size
        parts = (
            zip(sequences, (len(part) for part in records))
            if resumed
            else [(sequences, world_size)]
        )
        divergences = [
            row for texts, size in parts for row in _mismatched_collectives(list(texts), size)
        ]
        if not divergences:
            if reference is None:
                reference = prepare_reference(scenario)
            divergences = (compare_resumed if resumed else compare)(
                records, reference, scenario, target.configure(scenario), checks
            )
    if not divergences:
        return None
    if cannot_judge(divergences):
        first = divergences[0]
        why = (
            "the full-batch reference is chaotic there, so no rank can be judged from this "
            "step on (another seed, or SGD, may judge cleanly)"
            if first.kind == CHAOTIC
            else "the full-batch reference itself diverges numerically, so no target could match "
            "it -- lower the learning rate or the number of steps"
        )
        raise ScenarioError(
            f"the oracle cannot judge {scenario!r} at world size {world_size}: {first.detail} "
            f"({first.kind} at step {first.step}, {first.name}); {why}. Steps before it were "
            "judged and held."
        )
    # The replay line is built only on failure: the passing path is the hot one.
    shown = ""
    if records and not resumed and (scenario.tensor_parallel or scenario.pipeline):
        shown = step_report(records, scenario, divergences[0].step)
    return EquivalenceError(
        divergences,
        scenario=scenario,
        world_size=world_size,
        target=target,
        replay=replay_command(target, scenario, world_size, device=device, backend=backend),
        failure=failure,
        name=name,
        communication=shown,
    )


def prepare_reference(scenario: Scenario) -> Reference:
    """The full-batch reference; user mistakes in the scenario surface here, once, as a
    :class:`ScenarioError` naming the cause (``ddpcheck._oracle.judgeable``), before any
    world runs."""
    check_scenario(scenario)
    try:
        return reference_run(scenario)
    except InvalidArgument:
        raise
    except Exception as exc:  # the backward, param groups, the optimizer's step, a later step
        raise explain_reference_failure(scenario, exc) from exc


def _failure_rows(failure: WorldFailure) -> list[Divergence]:
    kind = {Failure.TIMEOUT: "rank timed out", Failure.MISMATCH: "collectives mismatched"}.get(
        failure.kind, "rank failed"
    )
    rows = []
    # a mismatch singles out no rank: every rank of the disagreement is a row, saying its side
    named = (
        set(failure.disagreement.entries)
        if failure.kind == Failure.MISMATCH and failure.disagreement is not None
        else set(failure.guilty)
    )
    for state in failure.ranks:
        if state.rank in named:
            if failure.kind == Failure.MISMATCH:
                detail = _at_disagreement(failure.disagreement, state.rank)
            elif state.detail.strip():
                detail = state.detail.strip().splitlines()[-1]
            else:
                detail = str(state.status)
            rows.append(
                Divergence(
                    "-",
                    failure.world_size,
                    state.rank,
                    "-",
                    kind,
                    detail=detail
                    if state.status != Status.STUCK or failure.kind == Failure.MISMATCH
                    else "stuck",
                )
            )
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
    if not texts or sequences.same_texts(texts):
        return []
    disagreement = sequences.diagnose(
        [sequences.parse(t) for t in texts], finished=range(world_size)
    )
    if disagreement is None:  # different texts, same signatures (e.g. all_gather shapes)
        return []
    where = disagreement.describe()
    return [
        Divergence(
            "-",
            world_size,
            rank,
            "-",
            "collectives mismatched",
            detail=f"rank {rank} {_at_disagreement(disagreement, rank)}\n{where}",
        )
        for rank in sorted(disagreement.entries)  # no side singled out: each says its own
    ]


def check_batch_plans(target: Target, scenario: Scenario, world_size: int) -> None:
    """A target's own ``shard_batch`` answers every step and rank with a valid plan -- checked
    here, before any world runs, so a malformed answer is an :class:`InvalidArgument` naming the
    rank and the step, not a rank failure (``ddpcheck.batches``). The default needs no check."""
    configured = target.configure(scenario)
    if getattr(type(configured), "shard_batch", Target.shard_batch) is not Target.shard_batch:
        check_plans(
            configured.shard_batch, scenario, world_size, f"{type(configured).__name__}.shard_batch"
        )


def _both_halves(launched: Launched) -> tuple[tuple[list, list], tuple[list, list], list]:
    """``((records before, records after), (their collective sequences), the two worlds)`` of a
    launched scenario with ``checkpoint_after``, resumed here if it was not yet."""
    resume(launched)
    if isinstance(launched.saved, BaseException):
        raise launched.saved
    (saved, sequences), resumed_world = launched.saved, launched.resumed_world
    assert resumed_world is not None  # resume() chose it
    resumed = [unpack(p) for p in launched.pending.collect()]
    return (
        (saved, resumed),
        (sequences, resumed_world.collective_sequences()),
        [launched.world, resumed_world],
    )
