"""What the oracle compares: one rank's (or the reference's) state after every step.

Invariant: a :class:`StepRecord` holds *copies* (never views) of every gradient (as the
optimizer step received it), parameter and buffer (after the step) by name, the optimizer state this
process holds by parameter name, and the collectives it issued during the step -- so a later step,
or the target, cannot change what was recorded. Tensors a rank holds only a shard of (FSDP2's
DTensors) are recorded whole, through the ``gather`` the runner passes (``Target.full_tensor``: a
collective, called in the same order on every rank), and each sharded parameter's local shard beside
it (``StepRecord.shards``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from ddpcheck._language.batches import BatchPlan
from ddpcheck._language.training import OptimizerLike, SchedulerLike

__all__ = [
    "Collective",
    "RankRecord",
    "StepRecord",
    "gradients",
    "initial_state",
    "placements_of",
    "schedule_state",
    "snapshot",
]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective call as a rank issued it."""

    op: str
    nbytes: int
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    root: int | None
    group: tuple[int, ...] | None  # global ranks of the group; None for the default group
    reduce_op: str | None
    async_op: bool
    launched: float  # time.perf_counter() at the call
    completed: float | None = None  # perf_counter() when the collective finished on this rank
    waited: float | None = None  # perf_counter() when wait() returned (async_op=True only)
    site: str = ""  # "file:line in function" of the caller (see `call_site`); not in the signature
    #: issued through torch's functional collectives (DTensor's redistributions, FSDP2's norm):
    #: shown and paired like the others, left out of the data-parallel budget, which predates them
    functional: bool = False

    def signature(self) -> tuple:
        """What every rank of the group must agree on for the collective to pair correctly."""
        shapes = self.shapes if self.op in ("all_reduce", "broadcast", "reduce") else ()
        return (
            self.op,
            self.dtypes if shapes else (),
            shapes,
            self.root,
            self.group,
            self.reduce_op,
        )

    def brief(self) -> str:
        parts = [self.op]
        if self.reduce_op:
            parts.append(self.reduce_op)
        if self.shapes:
            parts.append("+".join("x".join(map(str, s)) or "scalar" for s in self.shapes))
        if self.dtypes:
            parts.append("/".join(sorted(set(self.dtypes))))
        if self.root is not None:
            parts.append(f"root={self.root}")
        if self.group is not None:
            parts.append(f"group={list(self.group)}")
        if self.site:
            parts.append(f"(at {self.site})")
        return " ".join(parts)


#: A tensor a rank may hold only a shard of -> the whole of it (``Target.full_tensor``).
Gather = Callable[[torch.Tensor], torch.Tensor]


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclasses.dataclass
class StepRecord:
    """What one rank (or the reference) holds right after one optimizer step."""

    grads: dict[str, torch.Tensor | None]
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    state: dict[str, dict[str, object]]  # optimizer state held here, by parameter name
    collectives: list[Collective] = dataclasses.field(default_factory=list)
    #: the rank's ``ddpcheck.batches.BatchPlan`` of the step (None in the reference)
    batch_plan: BatchPlan | None = None
    #: parameter name -> (dim, this rank's local shard) for parameters sharded over the world:
    #: the shard must be chunk ``rank`` of ``torch.chunk(params[name], W, dim)`` (dim None: the
    #: whole); see ``Target.local_shard`` and ``ddpcheck._oracle.shards``
    shards: dict[str, tuple[int | None, torch.Tensor]] = dataclasses.field(default_factory=dict)
    #: the LR schedule after the step (``schedule_state``; empty without one)
    schedule: dict[str, object] = dataclasses.field(default_factory=dict)
    #: a target that ``steps_every_micro_batch``: the parameters after each gated step inside
    #: the accumulation window, ``(micro-batch index, {name: parameter})`` -- each must still be
    #: the parameters the step started from (``ddpcheck._oracle.window``)
    window: list[tuple[int, dict[str, torch.Tensor]]] = dataclasses.field(default_factory=list)
    #: the reference's only: each sample's terms of the objective in the step's global batch --
    #: its non-padding tokens under a token loss -- None for a per-sample loss (one term each);
    #: the batch plans are judged per term (``ddpcheck._oracle.sample_weights``)
    tokens: tuple[int, ...] | None = None
    #: a target running its framework's own data path (``Target.fit_epochs``): the dataset
    #: indices of each micro-batch this rank consumed in the step, judged against the step's
    #: samples (``ddpcheck._oracle.sample_weights.check_consumed``); None otherwise
    consumed: tuple[tuple[int, ...], ...] | None = None
    #: this rank's micro-batch losses in the step, each as back-propagated (its summed terms
    #: times its plan's scale: the ranks' sum over W is the step's objective); None where the
    #: target computes its losses out of the harness's sight (a framework's own data path)
    losses: tuple[float, ...] | None = None
    #: the step's loss as the target reports it (``Target.reported_loss``); None: not reported
    reported_loss: float | None = None
    #: the dtype the reported loss was computed in ("float32": a framework's float32 running
    #: loss), which bounds its precision; None: exact as far as float64 goes
    reported_dtype: str | None = None
    #: the evaluation metric after the step -- the mean of the objective's terms over the
    #: scenario's evaluation set (``ddpcheck._language.epochs``) -- at an epoch's last step:
    #: the reference's own, or what the target reported (``EpochRun.evaluated``); None: none
    metric: float | None = None
    #: the dtype the reported metric was computed in (as ``reported_dtype``)
    metric_dtype: str | None = None
    #: the global gradient norm the step's clipping returned (``Target.clip_grad_norm``; the
    #: reference's ``clip_grad_norm_``), a DTensor's as its full value; None: no clipping, or
    #: no number returned
    grad_norm: float | None = None


@dataclasses.dataclass
class RankRecord:
    rank: int
    initial: dict[str, torch.Tensor]  # parameters and buffers right after wrapping
    steps: list[StepRecord]
    seconds: float
    #: each DTensor parameter's placement per mesh axis after set-up, ``{"tp": "Replicate()",
    #: "dp": "Shard(dim=0)"}``: what the oracle names when replicas along an axis differ
    placements: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)


def placements_of(module: torch.nn.Module) -> dict[str, dict[str, str]]:
    """Each DTensor parameter's placement per named mesh axis (plain tensors: none)."""
    found = {}
    for name, p in module.named_parameters():
        mesh, placements = getattr(p, "device_mesh", None), getattr(p, "placements", None)
        if mesh is None or placements is None:
            continue
        axes = mesh.mesh_dim_names or tuple(f"axis {i}" for i in range(len(placements)))
        found[name] = {axis: repr(placement) for axis, placement in zip(axes, placements)}
    return found


def initial_state(module: torch.nn.Module, gather: Gather = _whole) -> dict[str, torch.Tensor]:
    """Copies of the parameters and buffers, by name (the state every replica must start from)."""
    with torch.no_grad():
        return {
            **{n: gather(p.detach()).clone() for n, p in module.named_parameters()},
            **{n: gather(b.detach()).clone() for n, b in module.named_buffers()},
        }


def gradients(model: torch.nn.Module, gather: Gather = _whole) -> dict[str, torch.Tensor | None]:
    """Copies of the gradients, by name (None where there is none)."""
    with torch.no_grad():
        return {
            n: None if p.grad is None else gather(p.grad.detach()).clone()
            for n, p in model.named_parameters()
        }


def schedule_state(optimizer: OptimizerLike, scheduler: SchedulerLike | None) -> dict[str, object]:
    """The scheduler's step count and every group's lr (empty without a scheduler): a schedule
    that restarts its count after a resume is a bug even where the lr happens to continue."""
    if scheduler is None:
        return {}
    # state_dict() is what every scheduler, and a framework's wrapper of one, passes through
    # (accelerate's AcceleratedScheduler has no last_epoch attribute of its own)
    return {
        "step count (last_epoch)": scheduler.state_dict().get("last_epoch"),
        **{f"lr of param group {i}": group["lr"] for i, group in enumerate(optimizer.param_groups)},
    }


def snapshot(
    model: torch.nn.Module,
    names: Mapping[torch.Tensor, str],
    state: Mapping[torch.Tensor, Mapping[str, object]],
    collectives: list | None = None,
    grads: dict[str, torch.Tensor | None] | None = None,
    gather: Gather = _whole,
    local_shard: Callable[[torch.Tensor], tuple[int | None, torch.Tensor] | None] | None = None,
    schedule: dict[str, object] | None = None,
) -> StepRecord:
    """Copies of everything the oracle compares; ``state`` maps parameter -> state dict;
    ``grads``, when given, are the gradients recorded earlier (before the optimizer step);
    ``gather`` makes a sharded tensor whole, ``local_shard`` says which shard of a parameter
    this rank holds (``Target.full_tensor`` / ``Target.local_shard``)."""
    if grads is None:
        grads = gradients(model, gather)
    with torch.no_grad():
        params = {n: gather(p.detach()).clone() for n, p in model.named_parameters()}
        buffers = {n: gather(b.detach()).clone() for n, b in model.named_buffers()}
        held = {}
        for p, entries in state.items():
            if entries:
                held[names.get(p, "?")] = {
                    k: gather(v.detach()).clone() if torch.is_tensor(v) else v
                    for k, v in entries.items()
                }
        shards = {}
        if local_shard is not None:
            for n, p in model.named_parameters():
                found = local_shard(p.detach())
                if found is not None:
                    shards[n] = (found[0], found[1].clone())
    return StepRecord(
        grads, params, buffers, held, collectives or [], shards=shards, schedule=schedule or {}
    )
