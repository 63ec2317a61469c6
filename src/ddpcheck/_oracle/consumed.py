"""The oracle's check of a framework's own data path (``Target.fit_epochs``): each step fed
exactly the samples of the epoch's step, each once, and the run took the epochs' steps.

Invariant: for a scenario with epochs (``ddpcheck._language.epochs``), :func:`data_path_rows`
returns no row exactly when every rank recorded step ``step`` and, where the ranks recorded what
they consumed (``StepRecord.consumed``), their micro-batches together hold each dataset index of
the step's samples exactly once and no other -- otherwise ``sample of another step`` (a batch not
split across the ranks brings the next steps' samples; a sampler's padding repeats earlier ones),
``sample duplicated``, ``sample dropped`` or ``steps differ``. How the framework weighs what it
consumed is the numbers' to judge (``ddpcheck._oracle.compare``), which this runs before: a step
fed other samples explains every number after it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from ddpcheck._base.errors import Divergence
from ddpcheck._language.epochs import step_samples
from ddpcheck._language.records import RankRecord
from ddpcheck._language.scenario import Scenario
from ddpcheck._oracle.sample_weights import DROPPED, DUPLICATED

__all__ = ["FOREIGN", "STEPS_DIFFER", "check_consumed", "data_path_rows", "step_counts"]

#: a framework's own data path fed a step samples the reference trains in another step
FOREIGN = "sample of another step"
#: a framework's own data path took another number of optimizer steps than the epochs make
STEPS_DIFFER = "steps differ"


def data_path_rows(
    step: int, records: Sequence[RankRecord], scenario: Scenario, total: int
) -> list[Divergence]:
    """Rows when the ranks ran out of steps before ``step`` (of the reference's ``total``) or
    fed it other samples than the epoch's step holds; empty otherwise."""
    short = step_counts(step, records, scenario, total)
    if short or scenario.epochs is None:
        return short
    consumed = [r.steps[step].consumed for r in records]
    if any(c is None for c in consumed):
        return []
    expected = step_samples(scenario.epochs, scenario.global_batch, step)
    return check_consumed(step, len(records), [c for c in consumed if c is not None], expected)


def step_counts(
    step: int, records: Sequence[RankRecord], scenario: Scenario, total: int
) -> list[Divergence]:
    """A row when some rank recorded no step ``step`` (the reference's ``total`` steps have it)
    or, at the end (``step == total``), recorded another number of steps than the reference."""
    wrong = [
        r for r in records if (len(r.steps) <= step if step < total else len(r.steps) != total)
    ]
    if not wrong:
        return []
    counts = ", ".join(f"rank {r.rank}: {len(r.steps)}" for r in records)
    epochs = scenario.epochs
    made = (
        ""
        if epochs is None
        else f" ({epochs.epochs} epoch(s) of {epochs.samples} samples in steps of the global "
        f"batch B={scenario.global_batch})"
    )
    return [
        Divergence(
            step=min(step, total),
            world_size=len(records),
            rank=wrong[0].rank if len(wrong) == 1 else None,
            name="optimizer steps",
            kind=STEPS_DIFFER,
            max_abs=float(abs(len(wrong[0].steps) - total)),
            detail=f"the ranks took {counts} optimizer step(s); the reference takes {total}{made}",
        )
    ]


def check_consumed(
    step: int, world_size: int, consumed: list[tuple[tuple[int, ...], ...]], expected: range
) -> list[Divergence]:
    """Rows for a step of a framework's own data path (``Target.fit_epochs``) whose ranks did
    not consume exactly the step's samples ``expected`` (dataset indices;
    ``ddpcheck._language.epochs``), each once: a sample held by no rank (``sample dropped``), by
    several micro-batches (``sample duplicated``: a sampler's padding, say), or a sample of
    another step (``sample of another step``: a batch not split across the ranks, a loader
    that ran ahead). ``consumed``: each rank's micro-batches of dataset indices, in rank order.
    How the framework weighs the samples is judged by the numbers that follow."""
    holders: dict[int, list[tuple[int, int]]] = {}
    for rank, micro_batches in enumerate(consumed):
        for m, indices in enumerate(micro_batches):
            for i in indices:
                holders.setdefault(i, []).append((rank, m))
    span = f"samples {expected.start}..{expected.stop - 1}" if expected else "no sample"
    row = functools.partial(Divergence, step=step, world_size=world_size, max_abs=1.0, max_rel=1.0)
    rows = []
    foreign = sorted(i for i in holders if i not in expected)
    if foreign:
        where = sorted({r for i in foreign for r, _ in holders[i]})
        rows.append(
            row(
                rank=where[0] if len(where) == 1 else None,
                kind=FOREIGN,
                name=f"sample {foreign[0]}",
                detail=f"rank(s) {_ranks(where)} consumed {len(foreign)} sample(s) "
                f"({_indices(foreign)}) that the reference trains in another step: step {step} "
                f"holds {span} of the dataset, and the ranks together took "
                f"{sum(len(h) for h in holders.values())} sample(s) (a batch not split across "
                "the ranks brings the next steps' samples; a sampler's padding repeats earlier "
                "ones; the global batch is per-device batch x W x accumulation)",
            )
        )
    for i in expected:
        held = holders.get(i, [])
        if len(held) == 1:
            continue
        holding = ", ".join(f"rank {r} micro-batch {m}" for r, m in held)
        rows.append(
            row(
                rank=None,
                kind=DROPPED if not held else DUPLICATED,
                name=f"sample {i}",
                detail=f"sample {i} of the dataset, which step {step} must train once, is in no "
                "rank's micro-batches: its loss is never back-propagated"
                if not held
                else f"sample {i} of the dataset is used {len(held)} times in step {step}: "
                f"{holding} (padding a sampler added to even out the ranks is weighed as a real "
                "sample)",
            )
        )
    return rows


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _indices(indices: list[int]) -> str:
    shown = ", ".join(map(str, indices[:8]))
    return shown + (", ..." if len(indices) > 8 else "")
