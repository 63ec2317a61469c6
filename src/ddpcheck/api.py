"""``assert_equivalent``: run a target in real worlds and hold it to the oracle.

Per scenario, the full-batch reference is computed once in this process (which also validates
the scenario: a bad model factory or an optimizer kwarg the optimizer rejects fails here, once,
before any process is spawned); then, per world size, every rank of the persistent world runs the
example and the oracle compares what they recorded.
"""

from __future__ import annotations

import dataclasses
import pickle
import shlex
import sys
import time
from typing import Any, Iterable

from ddpcheck._internal.options import DEFAULT_DEADLINE, DEFAULT_WORLD_SIZES
from ddpcheck._internal.validation import InvalidArgument, check_deadline, check_world_sizes
from ddpcheck.errors import Divergence, EquivalenceError
from ddpcheck.scenario import Scenario, import_path
from ddpcheck.targets import Target

__all__ = ["Report", "assert_equivalent", "check_example", "note_example", "replay_command",
           "target_spec"]

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
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (scenario, why)

    @property
    def count(self) -> int:
        return len(self.examples)

    def __str__(self) -> str:
        seconds = sum(s for _, _, s in self.examples)
        sizes = sorted({w for _, w, _ in self.examples})
        text = f"{self.count} examples equivalent (world sizes {sizes}) in {seconds:.2f} s"
        for name, why in self.skipped:
            text += f"\nskipped {name}: {why}"
        return text


def assert_equivalent(target: Target, scenario: Scenario | None = None, *,
                      world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES, deadline: float = DEFAULT_DEADLINE) -> Report:
    """Check ``target`` against the oracle on ``scenario`` (default: the built-in battery).

    Raises :class:`ddpcheck.EquivalenceError` on the first divergence, with a table and a replay
    command; returns a :class:`Report` when every example holds.
    """
    _check_target(target)
    sizes = check_world_sizes("world_sizes", world_sizes)
    check_deadline("deadline", deadline)
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
        reference = prepare_reference(sc)
        why = target.supports(sc)
        if why is not None:
            report.skipped.append((name or "scenario", why))
            continue
        for world_size in sizes:
            started = time.perf_counter()
            check_example(target, sc, world_size, deadline=deadline, reference=reference,
                          name=name)
            report.examples.append((name or "scenario", world_size,
                                    time.perf_counter() - started))
    return report


def check_example(target: Target, scenario: Scenario, world_size: int, *, deadline: float = DEFAULT_DEADLINE,
                  reference: Any = None, name: str | None = None, checks: Any = None) -> None:
    """One example: run on every rank of the persistent world, compare, raise on divergence.

    ``checks``: a subset of ``ddpcheck.oracle.CHECKS`` (default: all of them)."""
    from ddpcheck.oracle import CHECKS, compare
    from ddpcheck._internal.runner import run_example_packed
    from ddpcheck._internal.transport import unpack
    from ddpcheck._internal.world import WorldFailure, get_world

    if reference is None:
        reference = prepare_reference(scenario)

    def failed(divergences: list[Divergence], failure: Any = None) -> EquivalenceError:
        # The replay line is built only on failure: the passing path is the hot one.
        return EquivalenceError(divergences, scenario=scenario, world_size=world_size,
                                target=target, replay=replay_command(target, scenario, world_size),
                                failure=failure, name=name)

    world = get_world(world_size)  # a world that cannot start raises WorldStartError
    try:
        packed = world.run(run_example_packed, target, scenario, deadline=deadline,
                           what=f"example {name or 'scenario'}")
    except WorldFailure as failure:
        raise failed(_failure_rows(failure), failure) from None
    note_example()
    records = [unpack(p) for p in packed]
    mismatched = _mismatched_collectives(world.collective_sequences(), world_size)
    if mismatched:  # ranks paired different collectives, yet nothing hung: numbers are garbage
        world.kill()  # and gloo's pairs may hold stray bytes: the next example gets a new world
        raise failed(mismatched)
    divergences = compare(records, reference, scenario, target.configure(scenario),
                          CHECKS if checks is None else frozenset(checks))
    if divergences:
        raise failed(divergences)


def prepare_reference(scenario: Scenario) -> Any:
    """The full-batch reference; user mistakes in the scenario surface here, once."""
    from ddpcheck.oracle import reference_run

    try:
        return reference_run(scenario)
    except InvalidArgument:
        raise
    except TypeError as exc:
        if "__init__()" in str(exc) or "unexpected keyword" in str(exc):
            raise InvalidArgument(
                f"optimizer_kwargs={scenario.optimizer_kwargs!r} were rejected by "
                f"{import_path(scenario.optimizer)}: {exc}") from exc
        raise
    except ValueError as exc:  # e.g. torch.optim's "Invalid learning rate: -1"
        raise InvalidArgument(
            f"the scenario could not be trained in a single process, so there is no reference: "
            f"{exc} (optimizer={scenario.optimizer.__qualname__}, "
            f"optimizer_kwargs={scenario.optimizer_kwargs!r})") from exc


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

    if sequences.same_texts(texts):
        return []
    disagreement = sequences.diagnose([sequences.parse(t) for t in texts],
                                      finished=range(world_size))
    if disagreement is None:  # different texts, same signatures (e.g. all_gather shapes)
        return []
    where = disagreement.describe()
    return [Divergence("-", world_size, rank, "-", "collectives mismatched",
                       detail=f"rank {rank} {_at_disagreement(disagreement, rank)}\n{where}")
            for rank in disagreement.deviants]


def _check_target(target: Any) -> None:
    if isinstance(target, type):
        raise InvalidArgument(f"target={target.__qualname__} is a class; pass an instance, "
                              f"such as {target.__qualname__}()")
    missing = [m for m in ("configure", "supports", "wrap", "make_optimizer", "after_backward", "no_sync",
                           "optimizer_state") if not callable(getattr(target, m, None))]
    if missing:
        raise InvalidArgument(f"target={target!r} lacks {missing}; subclass ddpcheck.Target")
    try:
        pickle.dumps(target)
    except Exception as exc:
        raise InvalidArgument(
            f"target={target!r} cannot be pickled ({exc}); targets travel to every rank by "
            "pickle, so define the class at module level of an importable module") from exc


def target_spec(target: Any) -> str:
    """``MODULE:NAME`` (or ``MODULE:EXPR``) that rebuilds ``target`` in another process."""
    module_name = type(target).__module__
    module = sys.modules.get(module_name)
    for attr, value in vars(module).items() if module else ():
        if value is target:
            return f"{module_name}:{attr}"
    if dataclasses.is_dataclass(target):
        return f"{module_name}:{target!r}"
    return f"{module_name}:{type(target).__qualname__}()"


def replay_command(target: Any, scenario: Scenario, world_size: int) -> str:
    return (f"python -m ddpcheck replay {shlex.quote(target_spec(target))} "
            f"--world-size {world_size} --scenario {shlex.quote(repr(scenario))}")
