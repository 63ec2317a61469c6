"""The evaluation metric: the number a user reads after an epoch, judged against the reference's.

A scenario with an evaluation set (``Epochs.evaluation``) is evaluated after every epoch's last
step: the one-process reference computes the mean of the objective's terms over the whole
evaluation set with its own model at that point (``StepRecord.metric``), and a target running
its framework's own data path reports what its evaluation loop computed (``EpochRun.evaluated``).
Every rank that reports a metric must report that number -- a metric gathered with a sampler's
padding duplicates counted, an evaluation whose last uneven batch is dropped on some ranks, each
rank logging its own mean, all differ from it while every parameter is right -- and must report
it after every epoch's last step and after no other: a metric read at the wrong point is no
number the reference can vouch for. The tolerance is the step's (a metric computed in a coarser
dtype than the model, a framework's float32 logged value, at that dtype's), widened by the
reference's own spread of the metric over its noise variants (``Reference.noise``).

A target that evaluates nothing reports nothing and is judged on nothing here; the closing line
of ``ddpcheck check`` says which targets report a metric (``Target.reports_metric``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ddpcheck._base.errors import Divergence
from ddpcheck._language.records import RankRecord
from ddpcheck._oracle.reference import Reference
from ddpcheck._oracle.rows import Named, scalar_row
from ddpcheck._oracle.tolerances import in_reported_dtype

__all__ = ["METRIC_DIFFERS", "check_metric"]

#: The kind of a row whose evaluation metric is not the reference's, or was reported at another
#: point than an epoch's end.
METRIC_DIFFERS = "metric differs"


def check_metric(
    step: int,
    records: list[RankRecord],
    reference: Reference,
    tol: tuple[float, float],
    checks: frozenset,
    noise: Callable[[], float | None],
) -> list[Divergence]:
    """The step's metric rows (empty: right, or nothing to judge): each rank that reports an
    evaluation metric at all, against the reference's after ``step`` (``"reference"`` in
    ``checks``). ``noise()``: the reference's spread of the metric over its variants, asked only
    when the tolerance alone is exceeded."""
    if "reference" not in checks:
        return []
    expected = reference.steps[step].metric
    out: list[Divergence] = []
    for record in records:
        if all(s.metric is None for s in record.steps):
            continue  # this rank reports no metric: nothing to judge
        got, dtype = record.steps[step].metric, record.steps[step].metric_dtype
        if got is None and expected is None:
            continue
        what = f"the evaluation metric rank {record.rank} reports"
        named = Named(f"metric rank {record.rank} reports", what, "metric")
        if got is None or expected is None:
            out.append(_misplaced(step, len(records), record.rank, named, got, expected))
            continue
        widened = in_reported_dtype(tol, reference.compute_dtype, dtype)
        row = scalar_row(
            (step, 0),
            len(records),
            record.rank,
            named,
            METRIC_DIFFERS,
            got,
            expected,
            widened,
            noise,
        )
        if row is not None:
            curve = _curve(reference, record, step)
            out.append(dataclasses.replace(row, detail=f"{row.detail}\n{curve}"))
    return out


def _misplaced(
    step: int,
    world_size: int,
    rank: int,
    named: Named,
    got: float | None,
    expected: float | None,
) -> Divergence:
    """The row of a rank that reports a metric after a step where no epoch ends, or none after
    an epoch's last step although it reports one elsewhere."""
    if expected is None:
        detail = (
            f"{named.what}: {got:.9g} after step {step}, where no epoch ends; the evaluation "
            "set is evaluated after each epoch's last step (EpochRun.evaluated, after that "
            "step's run.record)"
        )
    else:
        detail = (
            f"rank {rank} reports no evaluation metric after step {step}, the last of an "
            f"epoch (the reference's: {expected:.9g}), though it reports one after another "
            "step"
        )
    return Divergence(step, world_size, rank, named.name, METRIC_DIFFERS, detail=detail)


def _curve(reference: Reference, record: RankRecord, step: int) -> str:
    """The metric after every epoch up to ``step``, the reference's and the rank's side by side:
    what the user would have plotted."""
    lines = ["   step   reference   target"]
    for k in range(step + 1):
        expected, got = reference.steps[k].metric, record.steps[k].metric
        if expected is None and got is None:
            continue
        mark = "  <- differs" if k == step else ""
        lines.append(f"   {k:>4}   {_number(expected):>9}   {_number(got)}{mark}")
    return "\n".join(lines)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"
