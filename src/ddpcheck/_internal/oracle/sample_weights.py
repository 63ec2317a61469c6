"""The oracle's check of the ranks' batch plans: every sample weighed as in the full batch.

Invariant: :func:`check_sample_weights` returns no row exactly when, for every sample i of the
global batch of B, ``(1/W) * sum of the scales of the micro-batches holding i`` (over every rank's
``ddpcheck.batches.BatchPlan``; a sample held twice counts twice; data-parallel code averages
gradients over W) equals the full-batch objective's weight -- ``1/B`` for ``reduction="mean"``,
``1`` for ``"sum"`` -- up to a relative ``RTOL`` (float rounding of the scales). Otherwise one row
per wrong sample, the target's fault, named by cause: ``sample dropped`` (no micro-batch holds
it), ``sample duplicated`` (several do, on which ranks), ``sample misweighted`` (one does, with a
scale that gives it the wrong weight: which rank's, expected against got). Causes come first.

It runs before the numbers are compared at each step (``ddpcheck._internal.oracle.compare``), because a sample
weighed wrongly changes every gradient: the verdict should name the sample, not a parameter.
"""

from __future__ import annotations

from typing import Any

from ddpcheck.errors import Divergence

__all__ = ["DROPPED", "DUPLICATED", "MISWEIGHTED", "RTOL", "check_sample_weights"]

DROPPED = "sample dropped"
DUPLICATED = "sample duplicated"
MISWEIGHTED = "sample misweighted"

#: Relative tolerance on a sample's weight: scales computed in float32 (a ``.item()`` of a
#: float32 mean) are off by ~1e-7; a misweighted sample is off by at least ~1/B.
RTOL = 1e-6


def check_sample_weights(step: int, world_size: int, plans: list[Any], batch_size: int,
                         reduction: str) -> list[Divergence]:
    """Rows for every sample the ranks' ``plans`` (one per rank, in rank order) weigh otherwise
    than the full-batch objective does (see the module's invariant); empty when they all agree."""
    expected = 1.0 / batch_size if reduction == "mean" else 1.0
    holders: list[list[tuple[int, int, float]]] = [[] for _ in range(batch_size)]
    for rank, plan in enumerate(plans):
        for m, (indices, scale) in enumerate(zip(plan.micro_batches, plan.scales)):
            for i in indices:
                holders[i].append((rank, m, scale))
    objective = f"1/{batch_size} = {expected:.3g}" if reduction == "mean" else "1"
    causes, misweighted = [], []
    for i, held in enumerate(holders):
        weight = sum(scale for _, _, scale in held) / world_size
        error = abs(weight - expected)
        if error <= RTOL * expected:
            continue
        where = ", ".join(f"rank {r} micro-batch {m} (scale {s:.3g})" for r, m, s in held)
        common = dict(step=step, world_size=world_size, name=f"sample {i}",
                      max_abs=error, max_rel=error / expected)
        if not held:
            causes.append(Divergence(
                rank=None, kind=DROPPED, **common,
                detail=f"sample {i} of the global batch (B={batch_size}) is in no rank's "
                       f"micro-batches: its loss is never back-propagated (weight 0; the "
                       f"full-batch objective, reduction={reduction!r}, gives it {objective})"))
        elif len(held) > 1:
            causes.append(Divergence(
                rank=None, kind=DUPLICATED, **common,
                detail=f"sample {i} is used {len(held)} times: {where}; weight {weight:.3g} "
                       f"(1/W times the sum of those scales) where the full-batch objective, "
                       f"reduction={reduction!r}, gives it {objective}"))
        else:
            rank, m, scale = held[0]
            misweighted.append(Divergence(
                rank=rank, kind=MISWEIGHTED, **common,
                detail=f"rank {rank} scales micro-batch {m} (sample {i}'s) by {scale:.3g}: "
                       f"weight {weight:.3g} after the average over W={world_size}, where the "
                       f"full-batch objective, reduction={reduction!r}, gives {objective} "
                       f"(a scale of {expected * world_size:.3g})"))
    return causes + misweighted
