"""The communication budget: bugs that change no number, caught by what crossed the wire.

Invariant: :func:`check_budget` returns no divergence exactly when, on every rank, the bytes of
floating-point all-reduces in one step are at most the gradient bytes (each gradient crosses the
wire once, in its own dtype: as many elements in more bytes is reported as its own kind,
``communication in a wider dtype``, not as a double reduction; control traffic is allowed a
scalar per trainable parameter tensor, and a scenario that clips a scalar per parameter dtype
more, for a sharded global norm), and -- for a target that promises
``flattened_broadcasts`` -- the broadcasts per step
are at most W x parameter dtypes (one per owner and dtype). Only collectives issued through
``torch.distributed``'s Python API are seen (``ddpcheck._internal.rank.recorder``).
"""

from __future__ import annotations

import math

from ddpcheck._internal.oracle.reference import Reference
from ddpcheck._internal.records import RankRecord
from ddpcheck.errors import Divergence

__all__ = ["check_budget"]


def check_budget(step: int, world_size: int, records: list[RankRecord], reference: Reference,
                  flattened_broadcasts: bool) -> list[Divergence]:
    if world_size == 1:
        return []
    n_dtypes, grad_bytes = reference.n_dtypes, reference.gradient_bytes
    # Beyond the gradients: a scalar per trainable tensor for control traffic (a float vector
    # of "has a gradient here" flags, per-tensor norms) and, in a clipping scenario, a global
    # norm's scalars; float64 at most. A gradient reduced twice exceeds it unless every tensor
    # of the model is a single element.
    extra = reference.trainable_tensors + reference.norm_scalars
    budget_bytes = grad_bytes + 8 * extra
    budget_numel = reference.gradient_numel + extra
    norm = (f" (+ up to {extra} control scalar(s): one per trainable tensor"
            f"{', and the norm for clipping' if reference.norm_scalars else ''})")
    out = []
    for record in records:
        calls = record.steps[step].collectives
        floating = [c for c in calls if any(d.startswith(("float", "bfloat")) for d in c.dtypes)]
        reduced = sum(c.nbytes for c in floating if c.op == "all_reduce")
        elements = sum(_numel(c) for c in floating if c.op == "all_reduce")
        if reduced > budget_bytes and elements <= budget_numel:
            # no more elements than the gradients have, but more bytes: they travelled wider
            # (float32 gradients promoted by torch.cat into a float64 bucket, say)
            widened = sorted({d for c in floating if c.op == "all_reduce" for d in c.dtypes})
            out.append(Divergence(step, world_size, record.rank, "(all gradients)",
                                  "communication in a wider dtype",
                                  detail=f"all-reduced {elements} elements as {reduced} bytes "
                                         f"({'/'.join(widened)}); the gradients are "
                                         f"{reference.gradient_numel} elements in {grad_bytes} "
                                         f"bytes{norm}, so some were sent in a wider dtype than "
                                         "their own (promoted in a mixed-dtype bucket?)"))
        elif reduced > budget_bytes:
            out.append(Divergence(step, world_size, record.rank, "(all gradients)",
                                  "communication over budget",
                                  detail=f"all-reduced {reduced} bytes in one step; the gradients "
                                         f"are {grad_bytes} bytes{norm} (ratio "
                                         f"{reduced / max(grad_bytes, 1):.3g}), so some were "
                                         "reduced more than once"))
        broadcasts = [c for c in floating if c.op == "broadcast"]
        if flattened_broadcasts and len(broadcasts) > world_size * n_dtypes:
            out.append(Divergence(step, world_size, record.rank, "(all parameters)",
                                  "communication over budget",
                                  detail=f"{len(broadcasts)} broadcasts in one step; at most "
                                         f"{world_size} owners x {n_dtypes} dtypes = "
                                         f"{world_size * n_dtypes} are needed (one flattened "
                                         "broadcast per owner and dtype)"))
    return out


def _numel(collective) -> int:
    return sum(math.prod(shape) for shape in collective.shapes)
