"""The oracle: the comparisons of every rank against each other and the full-batch reference.

The reference itself is ``ddpcheck._oracle.reference``; the communication budget (check 4)
is ``ddpcheck._oracle.budget``; how one tensor is judged and its difference said is
``ddpcheck._oracle.rows``.

Invariant: :func:`compare` returns one of three verdicts, never a mix --

* no divergence: after every step, 1-5 below hold;
* divergences that are all the target's fault (``Divergence.target_fault``): the target has a bug;
* divergences that are all *not* the target's fault, kind :data:`NON_FINITE` or :data:`CHAOTIC`:
  the reference itself went non-finite at some step k (6 below), or cannot pin down an element at
  step k (7 below), 1-5 hold before k, and nothing from k on is judged. :func:`cannot_judge`
  tells this verdict apart; a row that is the target's fault at step k outranks them.

1. every rank's parameters, buffers and gradients are **bitwise identical** to rank 0's (replicas
   are exact after an all-reduce or a broadcast from an owner -- no tolerance). Bitwise means the
   raw bits: identical NaNs are identical, while a NaN with another payload, or -0.0 against 0.0,
   is a difference (same shape and dtype required; integer and bool tensors compare exactly);
   sharded tensors are compared gathered, and each rank's local shard must be its slice of the
   gathered parameter (``ddpcheck._oracle.shards``);
2. they match the reference within :func:`tolerance` for the dtype and world size, with the same
   gradients missing (``None``) as in the reference -- on every rank: rank 0 stands for the others
   only when check 1 ran and found them bitwise identical to it. First, at every step (even one 6
   cannot judge), the ranks' batch plans weigh each sample as the reference (``sample_weights``);
   and the step's loss -- every rank's micro-batch losses summed over W, and each loss a target
   reports -- is the reference's (``ddpcheck._oracle.losses``), and so is the evaluation metric a
   target reports after an epoch (``ddpcheck._oracle.metrics``);
3. the optimizer state the ranks hold matches the reference's, every parameter with reference
   state has it on some rank, and -- for a target that shards optimizer state -- on exactly one;
   so does the LR schedule (``ddpcheck._oracle.compare``);
4. communication stays within budget: bytes all-reduced per step <= the gradient bytes (each
   gradient crosses the wire once), no reduction in a dtype narrower than the gradients' (a
   ``param_dtype`` policy promises float32 reductions), and -- for a target that promises
   ``flattened_broadcasts`` --
   broadcasts per step <= W x parameter dtypes (one per owner and dtype). Only collectives
   issued through ``torch.distributed``'s Python API are seen;
5. no rank holds NaN/inf where the reference is finite. A violation is reported as kind
   :data:`NON_FINITE` (the target's fault) by check 2 for parameters, buffers and gradients and by
   check 3 for optimizer state, instead of as a numeric difference;
6. the reference is judged before the ranks: when it holds NaN/inf at step k where it held none
   at the start (NaN/inf present from initialisation -- an additive ``-inf`` mask buffer, say --
   are ordinary values, compared like any other), the scenario diverges numerically and the
   ranks cannot be judged from step k on, whatever they hold and whichever checks were asked
   for: the rows name step k and every reference tensor that went non-finite there, with
   ``target_fault=False``;
7. where a rank is beyond the tolerance, the reference is asked what it cannot pin down
   (``Reference.noise``: its spread over equally valid ways to compute the run) and each element's
   allowance widened by ``NOISE_FACTOR`` times it; where that widening exceeds both the tolerance
   and ``RESOLUTION`` of the largest value of its kind at that step (every gradient, every
   parameter...) at an element beyond the tolerance, the reference is chaotic there
   (``tolerances.noise_verdict``): no bug of the size ddpcheck promises to catch could be told
   apart, so the row is :data:`CHAOTIC` with ``target_fault=False``.

Checks 3 and 4 catch bugs that change no number: every rank stepping every parameter, or a second
average of gradients that are already identical. :func:`validate_checks` turns a user's ``checks``
into a subset of :data:`CHECKS`, rejecting strings, typos and the empty set.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import SupportsFloat

import torch

from ddpcheck._base.errors import Divergence, InvalidArgument
from ddpcheck._language.records import RankRecord, StepRecord
from ddpcheck._language.scenario import Scenario, batch_size_of
from ddpcheck._oracle.budget import check_budget, check_reduce_dtypes
from ddpcheck._oracle.consumed import STEPS_DIFFER as STEPS_DIFFER
from ddpcheck._oracle.consumed import data_path_rows, step_counts
from ddpcheck._oracle.losses import check_grad_norm, check_losses
from ddpcheck._oracle.mesh_axes import along_axes
from ddpcheck._oracle.metrics import check_metric
from ddpcheck._oracle.reference import Reference, reference_run
from ddpcheck._oracle.rows import (
    CHAOTIC,
    NON_FINITE,
    At,
    Largest,
    Named,
    bitwise_equal,
    brief,
    count_of,
    non_finite,
    reference_row,
    replica_row,
    when,
)
from ddpcheck._oracle.sample_weights import check_sample_weights
from ddpcheck._oracle.shards import compare_shards
from ddpcheck._oracle.tolerances import (
    TOLERANCES,
    all_close,
    scaled_atol,
    tolerance,
)
from ddpcheck._oracle.window import check_window
from ddpcheck.targets.protocol import Target

__all__ = [
    "CHAOTIC",
    "CHECKS",
    "NON_FINITE",
    "TOLERANCES",
    "Reference",
    "bitwise_equal",
    "cannot_judge",
    "compare",
    "reference_run",
    "scaled_atol",
    "tolerance",
    "validate_checks",
]

#: The oracle's checks, each selectable on its own (one property per invariant).
CHECKS = frozenset({"replicas", "reference", "state", "budget"})


def validate_checks(checks: object) -> frozenset:
    """``checks`` as a non-empty subset of :data:`CHECKS` (``None``: all of them).

    Raises :class:`InvalidArgument` for a string (``"replicas"`` would otherwise be read as a set
    of letters), a value that is not an iterable of names, an unknown name, or the empty set
    (nothing would be checked)."""
    valid = ", ".join(repr(c) for c in sorted(CHECKS))
    if checks is None:
        return CHECKS
    if isinstance(checks, (str, bytes)):
        hint = f", such as {{{checks!r}}}" if checks in CHECKS else ""
        raise InvalidArgument(
            f"checks={checks!r} is a string; pass a set of check names{hint} "
            f"from {valid}, or None for all of them"
        )
    try:
        if not isinstance(checks, Iterable):
            raise TypeError
        names = frozenset(checks)
    except TypeError:
        raise InvalidArgument(
            f"checks={checks!r} must be a set of check names from {valid}, or None for all of them"
        ) from None
    unknown = sorted((n for n in names if n not in CHECKS), key=repr)
    if unknown:
        raise InvalidArgument(
            f"checks={checks!r} contains unknown check "
            f"{', '.join(repr(n) for n in unknown)}; the checks are {valid}"
        )
    if not names:
        raise InvalidArgument(
            f"checks={checks!r} is empty, so nothing would be checked; name "
            f"at least one of {valid}, or pass None for all of them"
        )
    return names


def cannot_judge(divergences: list[Divergence]) -> bool:
    """True when ``compare``'s verdict is "cannot be judged": rows, none the target's fault."""
    return bool(divergences) and not any(d.target_fault for d in divergences)


def _one_verdict(rows: list[Divergence]) -> list[Divergence]:
    """The rows the target is at fault for when there are any (a bug beside a chaotic element is
    still a bug), else all of them (none, or rows saying what cannot be judged)."""
    faults = [row for row in rows if row.target_fault]
    return faults or rows


# ---------------------------------------------------------------------------------------------
# Comparisons


def compare(
    records: list[RankRecord],
    reference: Reference,
    scenario: Scenario,
    target: Target,
    checks: frozenset = CHECKS,
    *,
    earlier_steps: int = 0,
    earlier_world_size: int = 1,
) -> list[Divergence]:
    """Every divergence of the ranks from each other and from the reference (empty: all good).

    ``checks`` selects a subset of :data:`CHECKS`. The rows are all the target's fault, or all
    not (:func:`cannot_judge`: the reference went non-finite); see the module's invariant.
    ``earlier_steps``: steps trained before these records' first, at ``earlier_world_size`` (a
    resumed run: they widen the tolerance as they would have -- the state loaded is as far from
    the reference as that world left it -- and the reference is the part from there on)."""
    checks = validate_checks(checks)
    if scenario.tensor_parallel is not None or scenario.pipeline is not None:
        # activations cross the wire: no gradient budget
        checks -= {"budget"}
    world_size = len(records)
    replicas, against_ref = "replicas" in checks, "reference" in checks
    unjudgeable = _reference_non_finite(reference, world_size)
    out: list[Divergence] = []
    # Start: all replicas hold rank 0's initialisation.
    # (after a resume, the state loaded is the reference's after the step before it)
    out += _compare_maps(
        "init",
        world_size,
        records,
        lambda r: r.initial,
        reference.initial,
        "initial state",
        tolerance(
            reference.compute_dtype,
            earlier_world_size if earlier_steps else 1,
            max(earlier_steps - 1, 0),
        ),
        replicas,
        against_ref,
        _noise(reference, earlier_steps - 1, "params", "buffers") if earlier_steps else None,
    )
    if out:
        return along_axes(_one_verdict(out), records, scenario)
    for step, ref in enumerate(reference.steps):
        # what a framework's own data path fed the step first: it explains any number
        data = data_path_rows(step, records, scenario, len(reference.steps))
        if data:
            return out + data
        plans = [p for r in records if (p := r.steps[step].batch_plan) is not None]
        # the objective first: it explains any number
        if against_ref and len(plans) == len(records):
            wrong = check_sample_weights(
                step,
                world_size,
                plans,
                batch_size_of(scenario, step),
                scenario.reduction,
                ref.tokens,
            )
            if wrong:
                return out + wrong
        if unjudgeable and unjudgeable[0].step == step:
            return unjudgeable  # nothing from here on can be judged
        if against_ref:  # a framework stepping inside the window explains every number after
            moved = check_window(step, world_size, records, bitwise_equal)
            if moved:
                return out + moved
        tol = tolerance(
            reference.compute_dtype, max(world_size, earlier_world_size), earlier_steps + step
        )
        found = _compare_step(
            step, records, reference, scenario, target, checks, tol, earlier_steps
        )
        if found:  # later steps only repeat the damage (or inherit the chaos)
            return out + along_axes(_one_verdict(found), records, scenario)
    return out + step_counts(len(reference.steps), records, scenario, len(reference.steps))


def _compare_step(
    step: int,
    records: list[RankRecord],
    reference: Reference,
    scenario: Scenario,
    target: Target,
    checks: frozenset,
    tol: tuple[float, float],
    earlier_steps: int,
) -> list[Divergence]:
    """One step's numbers (``compare``, once the objective and the window were found right):
    gradients, parameters and buffers, the step's loss (``ddpcheck._oracle.losses``) and
    evaluation metric (``ddpcheck._oracle.metrics``), the shards, the optimizer state and the
    schedule, the communication budget."""
    world_size, ref = len(records), reference.steps[step]
    replicas, against_ref = "replicas" in checks, "reference" in checks
    # a reduction narrower than promised first: it explains the numbers it rounded
    found = check_reduce_dtypes(step, world_size, records, reference) if "budget" in checks else []
    for kind, field in (("gradient", "grads"), ("parameter", "params"), ("buffer", "buffers")):
        found += _compare_maps(
            step,
            world_size,
            records,
            functools.partial(_field, field, step),
            getattr(ref, field),
            kind,
            tol,
            replicas,
            against_ref,
            _noise(reference, earlier_steps + step, field),
        )
    found += check_losses(
        step,
        records,
        reference,
        scenario,
        tol,
        checks,
        lambda: None if (n := reference.noise(earlier_steps + step)) is None else n.loss,
        earlier_steps,
    )
    if against_ref:  # the global gradient norm, on a mesh
        found += check_grad_norm(
            step,
            records,
            reference,
            scenario,
            tol,
            lambda: None if (n := reference.noise(earlier_steps + step)) is None else n.grad_norm,
        )
    found += check_metric(
        step,
        records,
        reference,
        tol,
        checks,
        lambda: None if (n := reference.noise(earlier_steps + step)) is None else n.metric,
    )
    if replicas:
        found += compare_shards(step, world_size, records)
    if "state" in checks:
        found += _compare_state(
            step,
            world_size,
            records,
            ref,
            tol,
            getattr(target, "shards_optimizer_state", False),
            _noise(reference, earlier_steps + step, "state"),
        )
        found += compare_schedule(step, world_size, records, ref, tol, earlier_steps > 0)
    if "budget" in checks:
        found += check_budget(
            step,
            world_size,
            records,
            reference,
            getattr(target, "flattened_broadcasts", False),
            getattr(target, "reduces_every_micro_batch", False),
        )
    return found


def _reference_non_finite(reference: Reference, world_size: int) -> list[Divergence]:
    """Rows (``target_fault=False``) for the first step at which the reference holds NaN/inf
    that it did not hold from initialisation; empty when it stays finite."""
    inherent = {}  # NaN/inf the reference starts with are values, not numerical divergence
    for name, value in reference.initial.items():
        mask = non_finite(value)
        if mask is not None:
            inherent[name] = mask
    for step, ref in enumerate(reference.steps):
        # (what, label, value, NaN/inf mask it started with)
        tensors: list[tuple[str, str, object, torch.Tensor | None]] = [
            (f"gradient {name}", f"{name}.grad", ref.grads.get(name), None) for name in ref.grads
        ]
        tensors += [
            (f"parameter {name}", name, value, inherent.get(name))
            for name, value in ref.params.items()
        ]
        tensors += [
            (f"buffer {name}", name, value, inherent.get(name))
            for name, value in ref.buffers.items()
        ]
        tensors += [
            (f"optimizer state {key!r} of {name}", f"{name}[{key!r}]", value, None)
            for name, state in ref.state.items()
            for key, value in state.items()
        ]
        rows = []
        for what, label, held, before in tensors:
            mask = non_finite(held)
            if mask is not None and before is not None and before.shape == mask.shape:
                mask = mask & ~before
                if not bool(mask.any()):
                    continue
            if mask is not None:
                rows.append(
                    Divergence(
                        step,
                        world_size,
                        None,
                        label,
                        NON_FINITE,
                        target_fault=False,
                        detail=f"the reference itself produced NaN/inf {when(step)} in {what} "
                        f"({count_of(mask)}): the scenario diverges numerically, so no rank can "
                        "be judged from this step on (not the target's fault); lower the "
                        "learning rate or the number of steps",
                    )
                )
        if rows:
            return rows
    return []


def _compare_maps(
    step: int | str,
    world_size: int,
    records: list[RankRecord],
    get: Callable[[RankRecord], Mapping[str, torch.Tensor | None]],
    reference: Mapping[str, torch.Tensor | None],
    kind: str,
    tol: tuple[float, float],
    replicas: bool = True,
    against_reference: bool = True,
    noise: Noisy | None = None,
) -> list[Divergence]:
    """Replicas bitwise, then every rank against ``reference`` (a name -> tensor map) within
    ``tol``; ``noise(name)``: the reference's rounding spread of that tensor, or None."""
    maps = [get(r) for r in records]
    # 1. replicas against rank 0, bitwise
    out = _replica_rows(step, world_size, maps, kind) if replicas else []
    # 2. against the reference, every rank; rank 0 stands for all only when check 1 ran and
    # found the others bitwise identical to it (then they would get exactly its verdict)
    if not against_reference:
        ranks: Iterable[int] = ()
    elif replicas and not out:
        ranks = range(1)
    else:
        ranks = range(world_size)
    rtol, atol = tol
    largest = Largest(reference.values())
    for rank in ranks:
        if _all_close_map(maps[rank], reference, rtol, atol):
            continue  # the usual case, in one pass: every row below would be None
        out += _reference_rows(
            At(step, world_size, rank), maps[rank], reference, kind, tol, noise, largest
        )
    return out


def _replica_rows(
    step: int | str, world_size: int, maps: list[Mapping[str, torch.Tensor | None]], kind: str
) -> list[Divergence]:
    """Every rank's tensors (``maps``, by rank) against rank 0's, bitwise."""
    out = []
    for rank in range(1, world_size):
        at = At(step, world_size, rank)
        names = list(maps[0]) + [n for n in maps[rank] if n not in maps[0]]
        for name in names:
            row = _replica_row(at, name, maps[0], maps[rank], kind)
            if row is not None:
                out.append(row)
    return out


def _replica_row(
    at: At,
    name: str,
    first: Mapping[str, torch.Tensor | None],
    mine: Mapping[str, torch.Tensor | None],
    kind: str,
) -> Divergence | None:
    """Rank ``at.rank``'s tensor ``name`` (in ``mine``) against rank 0's (in ``first``)."""
    step, world_size, rank = at.step, at.world_size, at.rank
    if name not in first or name not in mine:
        return Divergence(
            step,
            world_size,
            rank,
            name,
            f"replicas differ ({kind})",
            detail=f"present on rank {0 if name in first else rank} only",
        )
    value, other = first[name], mine[name]
    if (value is None) != (other is None):
        return Divergence(
            step,
            world_size,
            rank,
            name,
            f"replicas differ ({kind})",
            detail=f"None on rank {0 if value is None else rank} only",
        )
    if value is not None and other is not None and not bitwise_equal(value, other):
        return replica_row(at, name, f"replicas differ ({kind})", value, other)
    return None


def _reference_rows(
    at: At,
    got_map: Mapping[str, torch.Tensor | None],
    reference: Mapping[str, torch.Tensor | None],
    kind: str,
    tol: tuple[float, float],
    noise: Noisy | None,
    largest: Largest,
) -> list[Divergence]:
    """Rank ``at.rank``'s tensors (``got_map``) against the reference's, name by name."""
    step, world_size, rank = at.step, at.world_size, at.rank
    out = []
    for name, ref in reference.items():
        got = got_map.get(name, "missing")
        if isinstance(got, str):
            out.append(
                Divergence(
                    step,
                    world_size,
                    rank,
                    name,
                    f"{kind} missing",
                    detail="present in the reference, absent on the rank",
                )
            )
        elif (got is None) != (ref is None):
            out.append(
                Divergence(
                    step,
                    world_size,
                    rank,
                    name,
                    f"reference differs ({kind})",
                    detail=("None on the rank, " if got is None else "a value on the rank, ")
                    + ("None in the reference" if ref is None else "a value in the reference"),
                )
            )
        elif got is not None:
            label = f"{name}.grad" if kind == "gradient" else name
            row = reference_row(
                at,
                Named(name, f"{kind} {name}", label),
                f"reference differs ({kind})",
                got,
                ref,
                tol,
                None if noise is None else functools.partial(_scaled, noise, name, largest),
            )
            if row is not None:
                out.append(row)
    return out


def _all_close_map(
    got: Mapping[str, torch.Tensor | None],
    reference: Mapping[str, torch.Tensor | None],
    rtol: float,
    atol: float,
) -> bool:
    """True only when every tensor of ``reference`` is in ``got``, close (``all_close``), and
    every None there is None here: ``_compare_maps`` would find nothing."""
    pairs = []
    for name, ref in reference.items():
        value = got.get(name, "missing")  # missing: no tensor, so all_close says no
        if (value is None) != (ref is None):
            return False
        if ref is not None:
            pairs.append((value, ref))
    return all_close(pairs, rtol, atol)


#: name -> the reference's rounding spread of that tensor (None: none known).
Noisy = Callable[[str], "torch.Tensor | None"]


def _field(field: str, step: int, record: RankRecord) -> Mapping[str, torch.Tensor | None]:
    """A rank's map of ``field`` (grads, params, buffers) after ``step``."""
    found: Mapping[str, torch.Tensor | None] = getattr(record.steps[step], field)
    return found


def _scaled(
    noise: Noisy, name: str, largest: Callable[[], float]
) -> tuple[torch.Tensor | None, float]:
    """What ``reference_row`` asks once the tolerance is exceeded: ``(spread, scale)``."""
    return noise(name), largest()


def _largest_state(ref: StepRecord, key: str) -> Largest:
    """The largest magnitude of the reference's ``key`` optimizer state, over its parameters."""
    return Largest(s.get(key) for s in ref.state.values())


def _noise(reference: Reference, step: int, *fields: str) -> Noisy:
    """``name -> the reference's rounding spread of that tensor after step`` (or None), looked
    up in ``fields`` of ``reference.noise(step)``; the noise is computed on the first call."""

    def lookup(name: str) -> torch.Tensor | None:
        noise = reference.noise(step) if hasattr(reference, "noise") else None
        if noise is None:
            return None
        for field in fields:
            found = getattr(noise, field).get(name)
            if found is not None:
                return found
        return None

    return lookup


def _compare_state(
    step: int,
    world_size: int,
    records: list[RankRecord],
    ref: StepRecord,
    tol: tuple[float, float],
    shards_state: bool,
    noise: Noisy | None = None,
) -> list[Divergence]:
    out = []
    rtol, atol = tol
    # the usual case, in one pass: every tensor below is close, so no row compares one
    tensors_close = all_close(
        [
            (r.steps[step].state[name].get(key), value)
            for name, ref_state in ref.state.items()
            for r in records
            if name in r.steps[step].state
            for key, value in ref_state.items()
            if torch.is_tensor(value)
        ],
        rtol,
        atol,
    )
    for name, ref_state in ref.state.items():
        holders = [r.rank for r in records if name in r.steps[step].state]
        if not holders:
            out.append(
                Divergence(
                    step,
                    world_size,
                    None,
                    name,
                    "optimizer state missing",
                    detail="no rank holds state for this parameter; the reference "
                    f"has {sorted(ref_state)}",
                )
            )
            continue
        if shards_state and len(holders) != 1:
            out.append(
                Divergence(
                    step,
                    world_size,
                    None,
                    name,
                    "optimizer state misplaced",
                    detail=f"held by ranks {holders}; a sharded optimizer keeps "
                    "each parameter's state on exactly one rank",
                )
            )
        if not shards_state and len(holders) != world_size:
            missing = sorted(set(range(world_size)) - set(holders))
            out.append(
                Divergence(
                    step,
                    world_size,
                    missing[0],
                    name,
                    "optimizer state missing",
                    detail=f"ranks {missing} hold no state for it",
                )
            )
        for rank in holders:
            state = records[rank].steps[step].state[name]
            for key, ref_value in ref_state.items():
                got = state.get(key)
                if not torch.is_tensor(ref_value):
                    if torch.is_tensor(got) or got != ref_value:
                        out.append(
                            Divergence(
                                step,
                                world_size,
                                rank,
                                f"{name}[{key!r}]",
                                "optimizer state differs",
                                detail=f"{brief(got)} != reference {brief(ref_value)}",
                            )
                        )
                    continue
                if tensors_close:
                    continue
                where = f"{name}[{key!r}]"
                row = reference_row(
                    At(step, world_size, rank),
                    Named(where, f"optimizer state {key!r} of {name}", where),
                    "optimizer state differs",
                    got,
                    ref_value,
                    tol,
                    noise=None
                    if noise is None
                    else functools.partial(_scaled, noise, where, _largest_state(ref, key)),
                )
                if row is not None:
                    out.append(row)
    extra = {n for r in records for n in r.steps[step].state} - set(ref.state)
    for name in sorted(extra):
        out.append(
            Divergence(
                step,
                world_size,
                None,
                name,
                "optimizer state differs",
                detail="a rank holds state for a parameter the reference optimizer "
                "never stepped (was its gradient zero-filled?)",
            )
        )
    return out


def compare_schedule(
    step: int,
    world_size: int,
    records: list[RankRecord],
    ref: StepRecord,
    tol: tuple[float, float],
    resumed: bool,
) -> list[Divergence]:
    """Rows for ranks whose schedule after ``step`` differs from the reference's; ``resumed``:
    the ranks loaded a checkpoint (the details then name the likely cause)."""
    rtol, atol = tol
    out = []
    for record in records:
        held = record.steps[step].schedule
        for key, expected in ref.schedule.items():
            got = held.get(key)
            if key.startswith("lr "):
                same = (
                    isinstance(got, (int, float))
                    and isinstance(expected, SupportsFloat)
                    and math.isclose(got, expected, rel_tol=rtol, abs_tol=atol)
                )
            else:
                same = got == expected
            if same:
                continue
            why = ""
            if resumed and not key.startswith("lr "):
                why = (
                    "; the resumed run's scheduler did not get the saved state (ExponentialLR "
                    "continues from the optimizer's lr, but its count restarted: a closed-form "
                    "schedule such as StepLR or cosine would jump back)"
                )
            out.append(
                Divergence(
                    step,
                    world_size,
                    record.rank,
                    key,
                    "LR schedule differs",
                    detail=f"{got!r} on rank {record.rank}, {expected!r} in the reference{why}",
                )
            )
    return out


# ---------------------------------------------------------------------------------------------
# A run resumed from a checkpoint


def compare_resumed(
    parts: tuple[list, list],
    reference: Reference,
    scenario: Scenario,
    target: Target,
    checks: frozenset = CHECKS,
) -> list[Divergence]:
    """Every divergence of the two parts (``(records before, records after)``) from the
    uninterrupted reference; rows name steps of the whole run."""
    before, after = parts
    saved_at = scenario.checkpoint_after
    assert saved_at is not None  # only a scenario that saves a checkpoint is resumed
    rows = compare(
        before,
        dataclasses.replace(reference, steps=reference.steps[: saved_at + 1]),
        scenario,
        target,
        checks,
    )
    if rows:
        return rows
    last = reference.steps[saved_at]
    rest = dataclasses.replace(
        reference, initial={**last.params, **last.buffers}, steps=reference.steps[saved_at + 1 :]
    )
    rows = compare(
        after,
        rest,
        scenario,
        target,
        checks,
        earlier_steps=saved_at + 1,
        earlier_world_size=len(before),
    )
    return [_renumbered(row, saved_at + 1) for row in rows]


def _renumbered(row: Divergence, offset: int) -> Divergence:
    if row.step == "init":
        return dataclasses.replace(
            row,
            step="resume",
            detail=f"after load_checkpoint (the state saved after step "
            f"{offset - 1}): {row.detail}".rstrip(": "),
        )
    if isinstance(row.step, int):
        return dataclasses.replace(row, step=row.step + offset)
    return row
