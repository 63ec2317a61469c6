"""The oracle's check of the LR schedule: each rank's scheduler step count and group lrs.

Invariant: :func:`compare_schedule` returns a row for every rank whose recorded schedule
(``_internal.records.schedule_state``: the scheduler's ``last_epoch`` and every param group's
``lr``, after the step) differs from the reference's -- the step count exactly, the lrs within
the step's tolerance. Why the step count: after a resume whose scheduler state was not restored,
``ExponentialLR`` still continues from the optimizer's lr, but its count restarts, and any
closed-form schedule (StepLR, cosine, warm-up) would jump back: the bug exists before any
number shows it.
"""

from __future__ import annotations

import math

from ddpcheck._internal.records import RankRecord, StepRecord
from ddpcheck.errors import Divergence

__all__ = ["compare_schedule"]


def compare_schedule(step: int, world_size: int, records: list[RankRecord], ref: StepRecord,
                     tol: tuple[float, float], resumed: bool) -> list[Divergence]:
    """Rows for ranks whose schedule after ``step`` differs from the reference's; ``resumed``:
    the ranks loaded a checkpoint (the details then name the likely cause)."""
    rtol, atol = tol
    out = []
    for record in records:
        held = record.steps[step].schedule
        for key, expected in ref.schedule.items():
            got = held.get(key)
            if key.startswith("lr "):
                same = isinstance(got, (int, float)) and math.isclose(got, expected, rel_tol=rtol,
                                                                      abs_tol=atol)
            else:
                same = got == expected
            if same:
                continue
            why = ""
            if resumed and not key.startswith("lr "):
                why = ("; the resumed run's scheduler did not get the saved state (ExponentialLR "
                       "continues from the optimizer's lr, but its count restarted: a closed-form "
                       "schedule such as StepLR or cosine would jump back)")
            out.append(Divergence(step, world_size, record.rank, key, "LR schedule differs",
                                  detail=f"{got!r} on rank {record.rank}, {expected!r} in the "
                                         f"reference{why}"))
    return out
