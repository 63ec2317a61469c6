"""Examples one behind the other: while the ranks run the next example, this process judges the
last one and computes the next one's reference.

Why: run one at a time, an example's checking-process work -- admitting it, submitting it,
unpacking and comparing what came back -- ran while the ranks waited, a third of a random
example's wall time at W=2 (``bench/throughput.py``). Here example k+1 is queued in the ranks'
pipes before example k is judged (``World.submit`` queues one task), so each rank starts it as
soon as it has answered k; an example of another world size runs beside it, in its own world.

Invariant: every example gets the verdict :func:`check_example` would give it, in the order the
examples came, and nothing is judged from a process a previous example left unfit: an example
queued in a world that was then replaced (``TaskLost``) runs again, alone, in a fresh one. An
example whose world must first warm up for the target (``_runs.warmup``) waits until the one
before is judged: nothing runs elsewhere during a warm-up. A
scenario that resumes from a checkpoint runs in two halves, the second needing the first's
checkpoint: its first half is queued like any example, and its second is submitted
(``example.resume``) once its reference is computed, so the next example runs behind it (or
beside it, in a world of another size) while it is judged. The caller stops at the first
failure by closing the generator: what is still queued is let finish and dropped (or its world
killed, if it takes longer than ``DISCARD_WAIT``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Generic, TypeVar

from ddpcheck._base.errors import EquivalenceError, NothingChecked, ScenarioError
from ddpcheck._language.scenario import Scenario
from ddpcheck._oracle.reference import Reference
from ddpcheck._runs import warmup
from ddpcheck._runs.admission import Settings
from ddpcheck._runs.example import (
    Launched,
    _beside_the_ranks,
    check_example,
    judge,
    launch,
    prepare_reference,
    resume,
)
from ddpcheck._world.failures import WorldFailure
from ddpcheck._world.worlds import Pending, TaskLost
from ddpcheck.targets.protocol import Target

__all__ = ["Outcome", "one_behind_the_other"]

K = TypeVar("K")
#: ``(key, world_size, scenario)``: one example to run, and the caller's key for it
Item = tuple[K, int, Scenario]
#: the example being run: its item, how it was launched, and its reference (or the
#: ScenarioError computing it raised: collected, then skipped)
_Running = tuple[Item[K], Launched, "Reference | ScenarioError"]


@dataclasses.dataclass
class Outcome:
    """What one example came to: its notes (``World.notes``), the target's error, or why it was
    not checked (``skipped``: the oracle cannot judge it, or the target declined it in the
    ranks)."""

    notes: tuple[str, ...] = ()
    error: EquivalenceError | None = None
    skipped: str | None = None
    unjudgeable: bool = False


def one_behind_the_other(
    items: Iterable[Item[K]],
    run: Settings,
    *,
    target_of: Callable[[K], Target],
) -> Generator[tuple[Item[K], Outcome], None, None]:
    """``(item, outcome)`` for every ``item = (key, world_size, scenario)`` of ``items``, in
    their order, each example queued behind the one before (see the module's invariant), under
    the run's settings. ``target_of(key)``: the target an item runs."""
    line: _Line[K] = _Line(run, target_of)
    iterator = iter(items)
    try:
        with _beside_the_ranks():
            while True:
                if line.running is not None and line.running[1].pending.lost:
                    # its world was replaced as the one before was judged: it runs again now,
                    # alone, before anything else is queued behind it
                    yield from line.judge_running()
                try:
                    item = next(iterator, None)
                except Exception:  # the next draw failed: the example before is judged first
                    yield from line.judge_running()
                    raise
                if item is None:
                    break
                yield from line.add(item)
            yield from line.judge_running()
    except GeneratorExit:  # the caller stopped (a failure): what is queued is let finish
        for launched in line.queued:
            _discard(launched.pending)
        raise
    finally:
        for launched in line.queued:
            launched.pending.abandon()


class _Line(Generic[K]):
    """The examples in flight: the one running (launched, its reference computed), and those
    launched and not yet judged -- abandoned if the caller stops."""

    def __init__(self, run: Settings, target_of: Callable[[K], Target]):
        self.run, self.target_of = run, target_of
        self.running: _Running[K] | None = None
        self.queued: list[Launched] = []

    def of(self, item: Item[K]) -> Target:
        return self.target_of(item[0])

    def judge_running(self) -> Iterator[tuple[Item[K], Outcome]]:
        if self.running is not None:
            finished, self.running = self.running, None
            yield finished[0], _judged(self.of(finished[0]), finished, self.run)
            self.queued.remove(finished[1])

    def add(self, item: Item[K]) -> Iterator[tuple[Item[K], Outcome]]:
        """Launch ``item`` behind the one running, then judge that one while it runs."""
        _, world_size, scenario = item
        run = self.run
        if self.running is not None and warmup.needed(
            self.of(item), world_size, device=run.device, backend=run.backend
        ):
            # its world's ranks warm up first (minutes, possibly): nothing in flight
            # meanwhile, whose deadline would count
            yield from self.judge_running()
        try:
            launched = launch(self.of(item), scenario, world_size, run)
        except Exception as exc:  # refused before any world ran
            yield from self.judge_running()  # ... the example before is judged first
            if not isinstance(exc, (ScenarioError, NothingChecked)):
                raise
            yield item, _skipped(exc)
            return
        self.queued.append(launched)
        yield from self.judge_running()  # judged while the ranks run the one just launched
        try:
            reference: Reference | ScenarioError = prepare_reference(scenario)
        except ScenarioError as exc:  # collected, then skipped: the world stays usable
            reference = exc
        else:  # a checkpoint's second half, now: the next example queues behind it
            resume(launched)
        self.running = (item, launched, reference)


#: Seconds an example queued behind a failure may take to finish before its world is killed
#: instead: collecting and dropping it keeps the world for the failure's shrinking (a new world
#: costs ~0.3 s); an example that would hang does not hold the caller up longer than this.
DISCARD_WAIT = 2.0


def _discard(pending: Pending) -> None:
    """Collect a queued example nobody will judge, within :data:`DISCARD_WAIT`."""
    if pending.lost or pending.done:
        return
    pending.end = min(pending.end, time.monotonic() + DISCARD_WAIT)
    try:
        pending.collect()
    except (WorldFailure, TaskLost):  # its world was replaced: nothing left to drop
        pass


def _judged(target: Target, running: _Running[K], run: Settings) -> Outcome:
    item, launched, reference = running
    if isinstance(reference, ScenarioError):
        try:
            launched.pending.collect()
        except (WorldFailure, TaskLost):
            pass
        return _skipped(reference)
    try:
        return Outcome(notes=judge(launched, reference))
    except TaskLost:  # its world was replaced before it ran there: again, alone, in a new one
        _, world_size, scenario = item
        return _alone(target, scenario, world_size, run)
    except EquivalenceError as error:
        return Outcome(error=error)
    except (ScenarioError, NothingChecked) as exc:
        return _skipped(exc)


def _alone(target: Target, scenario: Scenario, world_size: int, run: Settings) -> Outcome:
    try:
        return Outcome(notes=check_example(target, scenario, world_size, run))
    except EquivalenceError as error:
        return Outcome(error=error)
    except (ScenarioError, NothingChecked) as exc:
        return _skipped(exc)


def _skipped(exc: Exception) -> Outcome:
    return Outcome(skipped=str(exc), unjudgeable=isinstance(exc, ScenarioError))
