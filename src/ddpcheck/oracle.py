"""The oracle: a single-process full-batch reference, and the comparisons against it.

Invariant: :func:`compare` returns no divergence exactly when, after every step,

1. every rank's parameters, buffers and gradients are **bitwise identical** to rank 0's (replicas
   are exact after an all-reduce or a broadcast from an owner -- no tolerance);
2. they match the reference within :func:`tolerance` for the dtype and world size, with the same
   gradients missing (``None``) as in the reference;
3. the optimizer state the ranks hold matches the reference's, every parameter with reference
   state has it on some rank, and -- for a target that shards optimizer state -- on exactly one;
4. communication stays within budget: bytes all-reduced per step <= the gradient bytes (each
   gradient crosses the wire once), and -- for a target that promises ``flattened_broadcasts`` --
   broadcasts per step <= W x parameter dtypes (one per owner and dtype). Only collectives
   issued through ``torch.distributed``'s Python API are seen.

Checks 3 and 4 catch bugs that change no number: every rank stepping every parameter, or a second
average of gradients that are already identical.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ddpcheck._internal.records import RankRecord, StepRecord, initial_state, snapshot
from ddpcheck._internal.train import Loop, train
from ddpcheck.errors import Divergence
from ddpcheck.scenario import Scenario, build_model, global_batch, make_param_groups

__all__ = ["CHECKS", "TOLERANCES", "Reference", "compare", "reference_run", "scaled_atol",
           "tolerance"]

#: The oracle's checks, each selectable on its own (one property per invariant).
CHECKS = frozenset({"replicas", "reference", "state", "budget"})

# {dtype: (rtol, atol)} for a rank against the full-batch reference, per step of training.
# float64: DDP and the reference differ by ~1e-16 relative (platform-notes.md, "Numerics"), real
# bugs by >= 1e-3; 1e-9 leaves six orders of margin on each side.
# float32: single-step gradients differ by up to ~9e-8 absolute (platform-notes.md), Adam
# amplifies differences where its second moment is near zero; see bench/tolerance.py.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-12),
    torch.float32: (2e-4, 2e-5),
}


def tolerance(dtype: torch.dtype, world_size: int, step: int) -> tuple[float, float]:
    """(rtol, atol) after ``step`` (0-based) steps at ``world_size``.

    Rounding differences come from summation order, which changes more with more shards, and
    compound over steps; both factors grow slowly so the bound stays far below real bugs.
    """
    rtol, atol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    factor = (1 + math.log2(max(world_size, 1))) * (1 + step)
    return rtol * factor, atol * factor


# ---------------------------------------------------------------------------------------------
# The reference


@dataclasses.dataclass
class Reference:
    initial: dict[str, torch.Tensor]  # parameters and buffers before the first step
    steps: list[StepRecord]
    gradient_bytes: int  # bytes of all trainable parameters' gradients: the all-reduce budget
    n_dtypes: int  # parameter dtypes: the broadcast budget is W x n_dtypes
    compute_dtype: torch.dtype  # the least precise parameter dtype: it sets the tolerance


def reference_run(scenario: Scenario) -> Reference:
    """Train the scenario in this process on the whole batch: the plain optimizer, rank 0's
    initial weights, one backward per step of the global objective."""
    model = build_model(scenario, scenario.seed)
    names = {p: n for n, p in model.named_parameters()}
    initial = initial_state(model)
    optimizer = scenario.optimizer(make_param_groups(scenario, model), **scenario.optimizer_kwargs)
    steps = []
    train(scenario, model, optimizer, Loop(
        batches=lambda step: [global_batch(scenario, step)],
        scale=1.0 / scenario.global_batch if scenario.reduction == "mean" else 1.0,
        after_step=lambda step: steps.append(snapshot(model, names, optimizer.state))))
    trainable = [p for p in model.parameters() if p.requires_grad]
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return Reference(initial, steps,
                     gradient_bytes=sum(p.numel() * p.element_size() for p in trainable),
                     n_dtypes=len(dtypes) or 1,
                     # a float64 layer fed by a float32 one inherits float32 rounding
                     compute_dtype=min(dtypes, key=lambda d: torch.finfo(d).eps * -1,
                                       default=scenario.torch_dtype))


# ---------------------------------------------------------------------------------------------
# Comparisons


def compare(records: list[RankRecord], reference: Reference, scenario: Scenario,
            target: Any, checks: frozenset = CHECKS) -> list[Divergence]:
    """Every divergence of the ranks from each other and from the reference (empty: all good).

    ``checks`` selects a subset of :data:`CHECKS`."""
    world_size = len(records)
    replicas, against_ref = "replicas" in checks, "reference" in checks
    out: list[Divergence] = []
    # Start: all replicas hold rank 0's initialisation.
    out += _compare_maps("init", world_size, records, lambda r: r.initial, reference.initial,
                         "initial state", tolerance(reference.compute_dtype, 1, 0),
                         replicas, against_ref)
    if out:
        return out
    for step, ref in enumerate(reference.steps):
        tol = tolerance(reference.compute_dtype, world_size, step)
        found = []
        for kind, field in (("gradient", "grads"), ("parameter", "params"),
                            ("buffer", "buffers")):
            found += _compare_maps(step, world_size, records,
                                   lambda r, f=field: getattr(r.steps[step], f),
                                   getattr(ref, field), kind, tol, replicas, against_ref)
        if "state" in checks:
            found += _compare_state(step, world_size, records, ref, tol,
                                    getattr(target, "shards_optimizer_state", False))
        if "budget" in checks:
            found += _check_budget(step, world_size, records, reference,
                                   getattr(target, "flattened_broadcasts", False))
        if found:
            return out + found  # later steps only repeat the damage
    return out


def _compare_maps(step: Any, world_size: int, records: list[RankRecord], get: Any,
                  reference: dict, kind: str, tol: tuple[float, float], replicas: bool = True,
                  against_reference: bool = True) -> list[Divergence]:
    out = []
    maps = [get(r) for r in records]
    # 1. replicas against rank 0, bitwise
    replicas_differ = False
    for rank in range(1, world_size if replicas else 1):
        for name, value in maps[0].items():
            other = maps[rank].get(name)
            if (value is None) != (other is None):
                out.append(Divergence(step, world_size, rank, name, f"replicas differ ({kind})",
                                      detail=f"None on rank {0 if value is None else rank} only"))
                replicas_differ = True
            elif value is not None and not torch.equal(value, other):
                out.append(Divergence.of(step, world_size, rank, name, f"replicas differ ({kind})",
                                         other, value, ("rank", rank), ("rank", 0)))
                replicas_differ = True
    # 2. against the reference: rank 0 stands for all when the replicas agree
    ranks = range(world_size) if replicas_differ else range(1 if against_reference else 0)
    rtol, atol = tol
    for rank in ranks:
        for name, ref in reference.items():
            got = maps[rank].get(name, "missing")
            if isinstance(got, str):
                out.append(Divergence(step, world_size, rank, name, f"{kind} missing",
                                      detail="present in the reference, absent on the rank"))
            elif (got is None) != (ref is None):
                out.append(Divergence(step, world_size, rank, name,
                                      f"reference differs ({kind})",
                                      detail=("None on the rank, " if got is None else
                                              "a value on the rank, ") +
                                      ("None in the reference" if ref is None else
                                       "a value in the reference")))
            elif got is not None and not _close(got, ref, rtol, atol):
                out.append(Divergence.of(step, world_size, rank, name,
                                         f"reference differs ({kind})", got, ref,
                                         ("rank", rank), ("reference", None), rtol,
                                         scaled_atol(ref, rtol, atol)))
    return out


def scaled_atol(ref: torch.Tensor, rtol: float, atol: float) -> float:
    """The absolute tolerance for one tensor: ``atol + rtol * max|ref|``.

    Rounding noise on an element that is zero in exact arithmetic (the key bias under softmax,
    say) scales with the magnitudes summed to produce the tensor, not with the element itself;
    a floor tied to the tensor's scale keeps such elements from false alarms, while real bugs
    -- errors comparable to the values -- exceed it by orders of magnitude.
    """
    if ref.numel() == 0 or not ref.is_floating_point():
        return atol
    return atol + rtol * float(ref.detach().abs().nan_to_num(0.0, 0.0, 0.0).max())


def _close(got: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> bool:
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return False
    if not got.is_floating_point():
        return torch.equal(got, ref)
    return bool(torch.allclose(got, ref, rtol=rtol, atol=scaled_atol(ref, rtol, atol),
                               equal_nan=True))


def _compare_state(step: int, world_size: int, records: list[RankRecord], ref: StepRecord,
                   tol: tuple[float, float], shards_state: bool) -> list[Divergence]:
    out = []
    rtol, atol = tol
    for name, ref_state in ref.state.items():
        holders = [r.rank for r in records if name in r.steps[step].state]
        if not holders:
            out.append(Divergence(step, world_size, None, name, "optimizer state missing",
                                  detail="no rank holds state for this parameter; the reference "
                                         f"has {sorted(ref_state)}"))
            continue
        if shards_state and len(holders) != 1:
            out.append(Divergence(step, world_size, None, name, "optimizer state misplaced",
                                  detail=f"held by ranks {holders}; a sharded optimizer keeps "
                                         "each parameter's state on exactly one rank"))
        if not shards_state and len(holders) != world_size:
            missing = sorted(set(range(world_size)) - set(holders))
            out.append(Divergence(step, world_size, missing[0], name, "optimizer state missing",
                                  detail=f"ranks {missing} hold no state for it"))
        for rank in holders:
            state = records[rank].steps[step].state[name]
            for key, ref_value in ref_state.items():
                got = state.get(key)
                if not torch.is_tensor(ref_value):
                    if got != ref_value:
                        out.append(Divergence(step, world_size, rank, f"{name}[{key!r}]",
                                              "optimizer state differs",
                                              detail=f"{got!r} != reference {ref_value!r}"))
                elif not torch.is_tensor(got) or not _close(got, ref_value, rtol, atol):
                    if torch.is_tensor(got) and got.shape == ref_value.shape:
                        out.append(Divergence.of(step, world_size, rank, f"{name}[{key!r}]",
                                                 "optimizer state differs", got, ref_value,
                                                 ("rank", rank), ("reference", None), rtol,
                                                 scaled_atol(ref_value, rtol, atol)))
                    else:
                        out.append(Divergence(step, world_size, rank, f"{name}[{key!r}]",
                                              "optimizer state differs",
                                              detail=f"{_brief(got)} != reference "
                                                     f"{_brief(ref_value)}"))
    extra = {n for r in records for n in r.steps[step].state} - set(ref.state)
    for name in sorted(extra):
        out.append(Divergence(step, world_size, None, name, "optimizer state differs",
                              detail="a rank holds state for a parameter the reference optimizer "
                                     "never stepped (was its gradient zero-filled?)"))
    return out


def _brief(value: Any) -> str:
    if torch.is_tensor(value):
        return f"tensor{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    return repr(value)


def _check_budget(step: int, world_size: int, records: list[RankRecord], reference: Reference,
                  flattened_broadcasts: bool) -> list[Divergence]:
    if world_size == 1:
        return []
    grad_bytes, n_dtypes = reference.gradient_bytes, reference.n_dtypes
    out = []
    for record in records:
        calls = record.steps[step].collectives
        floating = [c for c in calls if any(d.startswith(("float", "bfloat")) for d in c.dtypes)]
        reduced = sum(c.nbytes for c in floating if c.op == "all_reduce")
        if reduced > grad_bytes:
            out.append(Divergence(step, world_size, record.rank, "(all gradients)",
                                  "communication over budget",
                                  detail=f"all-reduced {reduced} bytes in one step; the gradients "
                                         f"are {grad_bytes} bytes (ratio "
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
