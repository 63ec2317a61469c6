"""The oracle's check of the ranks' batch plans: every term of the objective weighed as in the
full batch -- every sample, or under a token loss every non-padding token.

Invariant: :func:`check_sample_weights` returns no row exactly when, for every sample i of the
global batch of B, ``(1/W) * sum of the scales of the micro-batches holding i`` (over every rank's
``ddpcheck.batches.BatchPlan``; a sample held twice counts twice; data-parallel code averages
gradients over W) -- the weight each of sample i's terms gets -- equals the full-batch objective's
weight of a term: ``1/T`` for ``reduction="mean"`` (T: the B samples, or the global batch's
non-padding tokens under ``loss="token_cross_entropy"``), ``1`` for ``"sum"`` -- up to a relative
``RTOL`` (float rounding of the scales). A sample without terms (only padding) weighs nothing
either way and is not judged. Otherwise one row per wrong sample, the target's fault, named by
cause: ``sample dropped`` (no micro-batch holds it), ``sample duplicated`` (several do, on which
ranks), ``sample misweighted`` (one does, with a scale that gives it the wrong weight: which
rank's micro-batch, expected against got) -- ``token dropped|duplicated|misweighted`` under a token
loss, naming the sample's tokens, the micro-batch and the rank. Causes come first.

It runs before the numbers are compared at each step (``ddpcheck._oracle.compare``),
because a sample weighed wrongly changes every gradient: the verdict should name the sample, not a
parameter.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from ddpcheck._base.errors import Divergence
from ddpcheck._language.batches import BatchPlan

__all__ = [
    "DROPPED",
    "DUPLICATED",
    "MISWEIGHTED",
    "RTOL",
    "TOKEN_DROPPED",
    "TOKEN_DUPLICATED",
    "TOKEN_MISWEIGHTED",
    "check_sample_weights",
]

DROPPED = "sample dropped"
DUPLICATED = "sample duplicated"
MISWEIGHTED = "sample misweighted"

TOKEN_DROPPED = "token dropped"
TOKEN_DUPLICATED = "token duplicated"
TOKEN_MISWEIGHTED = "token misweighted"

#: Relative tolerance on a sample's weight: scales computed in float32 (a ``.item()`` of a
#: float32 mean) are off by ~1e-7; a misweighted sample is off by at least ~1/B (a misweighted
#: token by ~1/T).
RTOL = 1e-6


def check_sample_weights(
    step: int,
    world_size: int,
    plans: list[BatchPlan],
    batch_size: int,
    reduction: str,
    tokens: Sequence[int] | None = None,
) -> list[Divergence]:
    """Rows for every sample the ranks' ``plans`` (one per rank, in rank order) weigh otherwise
    than the full-batch objective does (see the module's invariant); empty when they all agree.
    ``tokens``: each sample's non-padding tokens under a token loss (None: a per-sample loss)."""
    total = batch_size if tokens is None else sum(tokens)
    expected = 1.0 / total if reduction == "mean" else 1.0
    holders: list[list[tuple[int, int, float]]] = [[] for _ in range(batch_size)]
    for rank, plan in enumerate(plans):
        for m, (indices, scale) in enumerate(zip(plan.micro_batches, plan.scales)):
            for i in indices:
                holders[i].append((rank, m, scale))
    if tokens is None:
        kinds = (DROPPED, DUPLICATED, MISWEIGHTED)
        objective = f"1/{batch_size} = {expected:.3g}" if reduction == "mean" else "1"
    else:
        kinds = (TOKEN_DROPPED, TOKEN_DUPLICATED, TOKEN_MISWEIGHTED)
        objective = (
            f"1/T = 1/{total} = {expected:.3g} (T: the global batch's non-padding tokens)"
            if reduction == "mean"
            else "1"
        )
    causes, misweighted = [], []
    for i, held in enumerate(holders):
        if tokens is not None and not tokens[i]:
            continue  # only padding: no term of the objective, whoever holds it
        weight = sum(scale for _, _, scale in held) / world_size
        error = abs(weight - expected)
        if error <= RTOL * expected:
            continue
        if tokens is None:
            what, whose, verb, losses, gets = (
                f"sample {i}",
                f"sample {i}'s",
                "is",
                "its loss is",
                "gives it",
            )
        else:
            what = whose = f"the {_tokens(tokens[i])} of sample {i}"
            verb, losses, gets = "are", "their losses are", "gives each token"
        where = ", ".join(f"rank {r} micro-batch {m} (scale {s:.3g})" for r, m, s in held)
        name = f"sample {i}" if tokens is None else f"sample {i} ({_tokens(tokens[i])})"
        row = functools.partial(
            Divergence,
            step=step,
            world_size=world_size,
            name=name,
            max_abs=error,
            max_rel=error / expected,
        )
        if not held:
            causes.append(
                row(
                    rank=None,
                    kind=kinds[0],
                    detail=f"{what} of the global batch (B={batch_size}) {verb} in no rank's "
                    f"micro-batches: {losses} never back-propagated (weight 0; the full-batch "
                    f"objective, reduction={reduction!r}, {gets} {objective})",
                )
            )
        elif len(held) > 1:
            causes.append(
                row(
                    rank=None,
                    kind=kinds[1],
                    detail=f"{what} {verb} used {len(held)} times: "
                    f"{where}; weight {weight:.3g} (1/W times the sum of those scales) where "
                    f"the full-batch objective, reduction={reduction!r}, {gets} {objective}",
                )
            )
        else:
            rank, m, scale = held[0]
            misweighted.append(
                row(
                    rank=rank,
                    kind=kinds[2],
                    detail=f"rank {rank} scales micro-batch {m} ({whose}) by {scale:.3g}: "
                    f"weight {weight:.3g} after the average over W={world_size}, where the "
                    f"full-batch objective, reduction={reduction!r}, {gets} {objective} (a "
                    f"scale of {expected * world_size:.3g})",
                )
            )
    return causes + misweighted


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"
