"""The communication budget: bugs that change no number, caught by what crossed the wire.

Invariant: :func:`check_budget` returns no divergence exactly when, on every rank, the bytes of
floating-point *reductions* in one step -- all-reduces, reduces and reduce-scatters, each counted
by its input, so a gradient reduced twice is caught whichever shape either reduction takes -- are
at most the gradient bytes (each gradient crosses the wire once, in its own dtype: as many
elements in more bytes is reported as its own kind, ``communication in a wider dtype``, not as a
double reduction), plus the padding a target that shards parameters along dim 0 reduce-scatters
with them (FSDP2 pads each such gradient to ``ceil(rows / W) * W`` rows; read from the local
shards the ranks record), plus a scalar per trainable parameter tensor of control traffic, and a
scenario that clips a scalar per parameter dtype more, for a sharded global norm; the bytes a
rank contributes to floating-point all-gathers are at most the parameter bytes (one re-gather of
updated parameters, ZeRO style) -- for targets that do not shard parameters (FSDP2 all-gathers
each layer in every forward and backward, which this budget does not model); and -- for a target
that promises ``flattened_broadcasts`` -- the broadcasts per step are at most W x parameter
dtypes (one per owner and dtype). Only collectives issued through ``torch.distributed``'s Python
API count (``ddpcheck._rank.recorder``; DTensor's functional ones, recorded since, do not: the
budget was measured without them).

:func:`check_reduce_dtypes` holds the other side of "in its own dtype": no floating-point
reduction (all-reduce, reduce, reduce-scatter) in a dtype narrower than the narrowest gradient
(the master weights' float32 under a ``param_dtype`` policy, whose promise is float32 reduction),
beyond the control scalars the budget allows (a float64 model's norm, or a vector of a flag per
trainable tensor, reduced in float32 is not gradient traffic; a tensor shaped like a gradient is),
or it is ``communication in a narrower dtype`` (gradients reduced in bfloat16
where float32 was promised: FSDP2's ``reduce_dtype`` misconfigured, a compression hook).
Parameters all-gathered in ``param_dtype`` are the policy, not a reduction, and pass.
"""

from __future__ import annotations

import math

from ddpcheck._base.errors import Divergence
from ddpcheck._language.records import Collective, RankRecord, StepRecord
from ddpcheck._oracle.reference import Reference

__all__ = ["GATHERS", "NARROWER", "REDUCTIONS", "check_budget", "check_reduce_dtypes"]

NARROWER = "communication in a narrower dtype"
_BITS = {
    "float64": 64,
    "float32": 32,
    "bfloat16": 16,
    "float16": 16,
    "float8_e4m3fn": 8,
    "float8_e5m2": 8,
}


def check_reduce_dtypes(
    step: int, world_size: int, records: list[RankRecord], reference: Reference
) -> list[Divergence]:
    """Rows for ranks that reduced floating-point tensors in a dtype narrower than the
    narrowest gradient of the reference (see the module docstring); one per rank."""
    promised = reference.gradient_dtype
    if world_size == 1 or promised is None:
        return []
    want = str(promised).replace("torch.", "")
    # control scalars (a norm, a flag per trainable tensor, a logged loss) may travel narrower:
    # a narrowing is a tensor shaped like a gradient, or more elements than that allowance
    allowance = reference.trainable_tensors + reference.norm_scalars
    control = {(), (1,), (reference.trainable_tensors,)}
    gradient_shapes = {shape for shape, _ in reference.trainable_shapes.values()} - control
    out = []
    for record in records:
        narrow = [
            c
            for c in record.steps[step].collectives
            if c.op in REDUCTIONS
            and not c.functional
            and any(_BITS.get(d, 64) < _BITS.get(want, 64) for d in c.dtypes)
        ]
        if (
            any(tuple(shape) in gradient_shapes for c in narrow for shape in c.shapes)
            or sum(_numel(c) for c in narrow) > allowance
        ):
            first, dtypes = narrow[0], sorted({d for c in narrow for d in c.dtypes})
            out.append(
                Divergence(
                    step,
                    world_size,
                    record.rank,
                    "(all gradients)",
                    NARROWER,
                    detail=f"{len(narrow)} reduction(s) in {'/'.join(dtypes)}, "
                    f"first {first.brief()}; the gradients are {want}, "
                    f"and reductions were promised in {want} (rounding "
                    "every sum to the narrower dtype changes the numbers)",
                )
            )
    return out


def _micro_batches(record: StepRecord) -> int:
    """The micro-batches a rank's step trained: its batch plan's, or, through a framework's
    own data path, those it consumed (0: unknown)."""
    plan = record.batch_plan
    if plan is not None and plan.micro_batches:
        return len(plan.micro_batches)
    return len(record.consumed or ())


def check_budget(
    step: int,
    world_size: int,
    records: list[RankRecord],
    reference: Reference,
    flattened_broadcasts: bool,
    reduces_every_micro_batch: bool = False,
) -> list[Divergence]:
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
    norm = (
        f" (+ up to {extra} control scalar(s): one per trainable tensor"
        f"{', and the norm for clipping' if reference.norm_scalars else ''})"
    )
    out = []
    for record in records:
        # DTensor's functional collectives (FSDP2's norm in clipping): the budget predates them
        calls = [c for c in record.steps[step].collectives if not c.functional]
        floating = [c for c in calls if any(d.startswith(("float", "bfloat")) for d in c.dtypes)]
        reductions = [c for c in floating if c.op in REDUCTIONS]
        padding, padded_numel = _padding(record.steps[step].shards, reference, world_size)
        reduced = sum(c.nbytes for c in reductions)
        elements = sum(_numel(c) for c in reductions)
        micro_batches = _micro_batches(record.steps[step])
        if reduces_every_micro_batch and micro_batches:
            # declared: each micro-batch's gradient crosses the wire once (ZeRO-2), so the step
            # may reduce as many gradients' worth as it has micro-batches
            reduced //= micro_batches
            elements //= micro_batches
        if reduced > budget_bytes + padding and elements <= budget_numel + padded_numel:
            # no more elements than the gradients have, but more bytes: they travelled wider
            # (float32 gradients promoted by torch.cat into a float64 bucket, say)
            widened = sorted({d for c in reductions for d in c.dtypes})
            out.append(
                Divergence(
                    step,
                    world_size,
                    record.rank,
                    "(all gradients)",
                    "communication in a wider dtype",
                    detail=f"all-reduced {elements} elements as {reduced} bytes "
                    f"({'/'.join(widened)}); the gradients are "
                    f"{reference.gradient_numel} elements in {grad_bytes} "
                    f"bytes{norm}, so some were sent in a wider dtype than "
                    "their own (promoted in a mixed-dtype bucket?)",
                )
            )
        elif reduced > budget_bytes + padding:
            how = "/".join(sorted({c.op for c in reductions}))
            pad = f" (+ {padding} bytes of dim-0 shard padding)" if padding else ""
            out.append(
                Divergence(
                    step,
                    world_size,
                    record.rank,
                    "(all gradients)",
                    "communication over budget",
                    detail=f"reduced {reduced} bytes in one step ({how}); the "
                    f"gradients are {grad_bytes} bytes{pad}{norm} (ratio "
                    f"{reduced / max(grad_bytes, 1):.3g}), so some were "
                    "reduced more than once",
                )
            )
        gathered = sum(c.nbytes for c in floating if c.op in GATHERS)
        if not record.steps[step].shards and gathered > reference.parameter_bytes:
            out.append(
                Divergence(
                    step,
                    world_size,
                    record.rank,
                    "(all parameters)",
                    "communication over budget",
                    detail=f"contributed {gathered} bytes to all-gathers in one "
                    f"step; the parameters are {reference.parameter_bytes} "
                    "bytes, all a re-gather of updated parameters needs "
                    "(a gradient gathered to be reduced locally?)",
                )
            )
        broadcasts = [c for c in floating if c.op == "broadcast"]
        if flattened_broadcasts and len(broadcasts) > world_size * n_dtypes:
            out.append(
                Divergence(
                    step,
                    world_size,
                    record.rank,
                    "(all parameters)",
                    "communication over budget",
                    detail=f"{len(broadcasts)} broadcasts in one step; at most "
                    f"{world_size} owners x {n_dtypes} dtypes = "
                    f"{world_size * n_dtypes} are needed (one flattened "
                    "broadcast per owner and dtype)",
                )
            )
    return out


#: Collectives that reduce: each counted by its input, which holds the whole gradient it reduces.
REDUCTIONS = frozenset(
    {"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single"}
)
#: Collectives that gather: each counted by what this rank contributes.
GATHERS = frozenset({"all_gather", "all_gather_into_tensor", "all_gather_single"})


def _padding(shards: dict, reference: Reference, world_size: int) -> tuple[int, int]:
    """(bytes, elements) of the padding a dim-0 sharding of the trainable parameters this rank
    records shards of adds to their reduce-scatter: ``ceil(rows / W) * W`` rows each."""
    nbytes = numel = 0
    for name, (dim, _) in shards.items():
        shape, itemsize = reference.trainable_shapes.get(name, ((), 0))
        if dim is None or not shape:
            continue
        rows = shape[dim]
        padded_rows = math.ceil(rows / world_size) * world_size
        extra = (padded_rows - rows) * (math.prod(shape) // max(rows, 1))
        numel += extra
        nbytes += extra * itemsize
    return nbytes, numel


def _numel(collective: Collective) -> int:
    return sum(math.prod(shape) for shape in collective.shapes)
