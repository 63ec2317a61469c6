"""The communication budget: bugs that change no number, caught by what crossed the wire.

Invariant: :func:`check_budget` returns no divergence exactly when, on every rank, the bytes of
floating-point all-reduces in one step are at most the gradient bytes (each gradient crosses the
wire once, in its own dtype: as many elements in more bytes is reported as its own kind,
``communication in a wider dtype``, not as a double reduction; a scenario that clips allows a
scalar per parameter dtype more, for a sharded global norm), and -- for a target that promises
``flattened_broadcasts`` -- the broadcasts per step
are at most W x parameter dtypes (one per owner and dtype). Only collectives issued through
``torch.distributed``'s Python API are seen (``ddpcheck._internal.rank.recorder``).

:func:`check_reduce_dtypes` holds the other side of "in its own dtype": no floating-point
reduction (all-reduce, reduce, reduce-scatter) in a dtype narrower than the narrowest gradient --
the master weights' float32 under a ``param_dtype`` policy, whose promise is float32 reduction
-- or it is ``communication in a narrower dtype`` (gradients reduced in bfloat16 where float32 was
promised: FSDP2's ``reduce_dtype`` misconfigured, a compression hook). Parameters all-gathered in
``param_dtype`` are the policy, not a reduction, and pass.
"""

from __future__ import annotations

import math

from ddpcheck._internal.oracle.reference import Reference
from ddpcheck._internal.records import RankRecord
from ddpcheck.errors import Divergence

__all__ = ["NARROWER", "REDUCTIONS", "check_budget", "check_reduce_dtypes"]

NARROWER = "communication in a narrower dtype"
#: The collectives that sum gradients (what a narrower dtype rounds).
REDUCTIONS = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor",
              "reduce_scatter_single")
_BITS = {"float64": 64, "float32": 32, "bfloat16": 16, "float16": 16, "float8_e4m3fn": 8,
         "float8_e5m2": 8}


def check_reduce_dtypes(step: int, world_size: int, records: list[RankRecord],
                        reference: Reference) -> list[Divergence]:
    """Rows for ranks that reduced floating-point tensors in a dtype narrower than the
    narrowest gradient of the reference (see the module docstring); one per rank."""
    promised = reference.gradient_dtype
    if world_size == 1 or promised is None:
        return []
    want = str(promised).replace("torch.", "")
    out = []
    for record in records:
        narrow = [c for c in record.steps[step].collectives if c.op in REDUCTIONS
                  and any(_BITS.get(d, 64) < _BITS.get(want, 64) for d in c.dtypes)]
        if narrow:
            first, dtypes = narrow[0], sorted({d for c in narrow for d in c.dtypes})
            out.append(Divergence(step, world_size, record.rank, "(all gradients)", NARROWER,
                                  detail=f"{len(narrow)} reduction(s) in {'/'.join(dtypes)}, "
                                         f"first {first.brief()}; the gradients are {want}, "
                                         f"and reductions were promised in {want} (rounding "
                                         "every sum to the narrower dtype changes the numbers)"))
    return out


def check_budget(step: int, world_size: int, records: list[RankRecord], reference: Reference,
                  flattened_broadcasts: bool) -> list[Divergence]:
    if world_size == 1:
        return []
    n_dtypes, grad_bytes = reference.n_dtypes, reference.gradient_bytes
    # a clipping scenario may add a global norm's scalars (float64 at most) to the gradients
    budget_bytes = grad_bytes + 8 * reference.norm_scalars
    budget_numel = reference.gradient_numel + reference.norm_scalars
    norm = (f" (+ up to {reference.norm_scalars} norm scalar(s) for clipping)"
            if reference.norm_scalars else "")
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
