"""The step's loss: the number a user reads, judged against the reference's.

Every rank records its micro-batch losses as it back-propagated them (``StepRecord.losses``: the
summed terms times the batch plan's scale), and the loss its target reports for the step, if it
reports one (``Target.reported_loss``). With the plan's scales -- which the sample-weight rule has
already found right (``ddpcheck._oracle.sample_weights``) -- every rank's losses summed over the
world and divided by W are the objective over the global batch, which is what the one-process
reference computes (``Reference.steps[k].reported_loss``): a model whose forward is wrong under
the target shows here, before any gradient. A reported loss must be that same number, on every
rank that reports one -- a loss averaged per micro-batch where the objective weighs tokens,
rank 0's own loss logged as the global one, a SUM all-reduce not divided by W all differ from it
while every gradient is right. Under tensor parallelism the ranks of one ``tp`` group compute the
same loss from the same samples, so it must be bitwise identical along ``tp``.

The tolerance is the step's -- a reported loss computed in a coarser dtype than the model (a
framework's float32 running loss) at that dtype's -- with the reference's own spread over its
noise variants (``Reference.noise``) widening it where a correct target rounds differently.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from ddpcheck._base.errors import Divergence
from ddpcheck._language.records import RankRecord
from ddpcheck._language.scenario import Scenario
from ddpcheck._language.tensor_parallel import mesh_shape
from ddpcheck._oracle.reference import Reference
from ddpcheck._oracle.rows import Named, scalar_row
from ddpcheck._oracle.tolerances import in_reported_dtype

__all__ = [
    "GRAD_NORM_DIFFERS",
    "LOSS_DIFFERS",
    "LOSS_REPLICAS",
    "check_grad_norm",
    "check_losses",
    "ranks_loss",
    "step_loss",
]

#: The kind of a row whose global gradient norm -- what the step's clipping returned -- is not
#: the reference's.
GRAD_NORM_DIFFERS = "gradient norm differs"

#: The kind of a row whose loss -- the ranks' objective or a reported one -- is not the reference's.
LOSS_DIFFERS = "loss differs"
#: The kind of a row whose loss differs between the ranks of one tensor-parallel group.
LOSS_REPLICAS = "replicas differ along tp (loss)"
#: How many steps of the two curves a row shows before the one that differs.
_CURVE = 6


def step_loss(record: RankRecord, step: int) -> float | None:
    """One rank's part of the step's objective: its micro-batch losses summed (None: unknown)."""
    losses = record.steps[step].losses
    return None if losses is None else math.fsum(losses)


def ranks_loss(records: list[RankRecord], step: int) -> float | None:
    """The step's objective as the ranks computed it: every rank's part summed, over W."""
    parts = [step_loss(r, step) for r in records]
    if not records or any(p is None for p in parts):
        return None
    return math.fsum(p for p in parts if p is not None) / len(records)


def check_losses(
    step: int,
    records: list[RankRecord],
    reference: Reference,
    scenario: Scenario,
    tol: tuple[float, float],
    checks: frozenset,
    noise: Callable[[], float | None],
    earlier_steps: int = 0,
) -> list[Divergence]:
    """The step's loss rows (empty: right): the ranks' objective and each reported loss against
    the reference's (``"reference"`` in ``checks``), and the loss of every rank of a ``tp`` group
    against its first rank's, bitwise (``"replicas"``). ``noise()``: the reference's spread of the
    step's loss over its variants, asked only when the tolerance alone is exceeded.
    ``earlier_steps``: the steps before these records' first (a resumed run), for the text."""
    world_size = len(records)
    out: list[Divergence] = []
    if "replicas" in checks and scenario.tensor_parallel is not None:
        out += _along_tp(step, records, scenario)
    expected = reference.steps[step].reported_loss
    if "reference" not in checks or expected is None:
        return out
    # (whose, what, its value at a step, the dtype it was computed in if coarser than the model's)
    judged: list[tuple[int | None, str, Callable[[int], float | None], str | None]] = [
        (
            None,
            "the step's loss (every rank's micro-batch losses, summed over W)",
            lambda k: ranks_loss(records, k),
            None,
        )
    ]
    judged += [
        (r.rank, f"the loss rank {r.rank} reports", _reported_by(r), r.steps[step].reported_dtype)
        for r in records
        if r.steps[step].reported_loss is not None
    ]
    for rank, what, value_of, dtype in judged:
        got = value_of(step)
        if got is None:
            continue
        widened = in_reported_dtype(tol, reference.compute_dtype, dtype)
        at = (step, earlier_steps)
        label = "loss" if rank is None else f"loss rank {rank} reports"
        row = scalar_row(
            at,
            world_size,
            rank,
            Named(label, what, label),
            LOSS_DIFFERS,
            got,
            expected,
            widened,
            noise,
        )
        if row is not None:
            curve = _curves(reference, at, value_of)
            out.append(dataclasses.replace(row, detail=f"{row.detail}\n{curve}"))
    return out


def _reported_by(record: RankRecord) -> Callable[[int], float | None]:
    return lambda step: record.steps[step].reported_loss


def _curves(
    reference: Reference, at: tuple[int, int], value_of: Callable[[int], float | None]
) -> str:
    """Both loss curves up to the step ``at`` (these records' step, the steps before them),
    side by side: what the user would have plotted (of a resumed run, its part)."""
    step, earlier = at
    lines = ["   step   reference   target"]
    for k in range(max(0, step - _CURVE + 1), step + 1):
        mark = "  <- differs" if k == step else ""
        expected, got = reference.steps[k].reported_loss, value_of(k)
        lines.append(f"   {earlier + k:>4}   {_number(expected):>9}   {_number(got)}{mark}")
    return "\n".join(lines)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def _along_tp(step: int, records: list[RankRecord], scenario: Scenario) -> list[Divergence]:
    """Every rank's micro-batch losses bitwise its ``tp`` group's first rank's: one group, one
    batch, one replicated output (a loss placed ``Replicate``)."""
    assert scenario.tensor_parallel is not None
    _, tp = mesh_shape(scenario.tensor_parallel, len(records))
    out = []
    for record in records:
        first = records[record.rank - record.rank % tp]
        mine, theirs = record.steps[step].losses, first.steps[step].losses
        if scenario.pipeline is not None:  # a schedule's loss: reported by the last stage's
            mine, theirs = _reported(record, step), _reported(first, step)
        if record is first or mine is None or theirs is None:
            continue
        if [v.hex() for v in mine] != [v.hex() for v in theirs]:
            out.append(
                Divergence(
                    step,
                    len(records),
                    record.rank,
                    "loss",
                    LOSS_REPLICAS,
                    detail=f"rank {record.rank} and rank {first.rank} train one tensor-parallel "
                    f"group's samples, so their losses must be bitwise equal: micro-batch "
                    f"losses {_values(mine)} on rank {record.rank}, {_values(theirs)} on rank "
                    f"{first.rank}",
                )
            )
    return out


def _reported(record: RankRecord, step: int) -> tuple[float, ...] | None:
    """The loss ``record``'s rank reported at ``step`` (a pipeline's last stage), as a tuple."""
    loss = record.steps[step].reported_loss
    return None if loss is None else (loss,)


def _values(losses: tuple[float, ...]) -> str:
    return "[" + ", ".join(f"{v:.9g}" for v in losses) + "]"


def check_grad_norm(
    step: int,
    records: list[RankRecord],
    reference: Reference,
    scenario: Scenario,
    tol: tuple[float, float],
    noise: Callable[[], float | None],
) -> list[Divergence]:
    """Each rank's global gradient norm -- what its clipping returned at ``step``, a DTensor's
    as its full value -- against the reference's ``clip_grad_norm_``, on a mesh (a norm over
    DTensors, or over a plan's shards: replicated gradients counted once, every shard's part
    combined). The number a user logs, and the one clipping scales by: a norm counting the ``tp``
    replicas of a gradient tp times clips too hard, and is wrong in the log even where it does not
    clip at all. A norm sums every gradient's rounding: the tolerance is the step's times the
    square root of the gradients' elements. Data-parallel targets' clipping is judged by the
    gradients it leaves, as before (what ``Target.clip_grad_norm`` returns was never promised)."""
    expected = reference.steps[step].grad_norm
    if expected is None or (scenario.tensor_parallel is None and scenario.pipeline is None):
        return []
    widen = math.sqrt(max(reference.gradient_numel, 1))
    norm_tol = (tol[0] * widen, tol[1] * widen)
    out = []
    for record in records:
        got = record.steps[step].grad_norm
        if got is None:
            continue
        what = f"the gradient norm rank {record.rank}'s clipping returned"
        row = scalar_row(
            (step, 0),
            len(records),
            record.rank,
            Named("grad norm", what, "grad norm"),
            GRAD_NORM_DIFFERS,
            got,
            expected,
            norm_tol,
            noise,
        )
        if row is not None:
            out.append(row)
    return out
