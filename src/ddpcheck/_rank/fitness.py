"""Is this rank process still fit to run the next task? Checked, and put right, after every task.

Why: worlds are persistent, so whatever a task leaves behind in a rank process would make the
*next* example (often another target's) compute something else, or fail, and be blamed for it.
But leaving things behind is how real frameworks live in their process -- a process-group manager
builds dp/tp/pp groups at set-up, FSDP2 builds a ``DeviceMesh`` per ``fully_shard`` call with an
int ``reshard_after_forward`` -- and none of that is a data-parallel bug. So :func:`restore`
sorts what changed since the rank's :func:`baseline` into three piles:

* **put right** (noted in the report, the world kept): process groups the example created are
  destroyed; ``torch.get_num_threads()``, grad mode and the default dtype are set back; a
  ``torch.distributed`` collective the target replaced gets the recorder's wrapper back (its own
  calls went unrecorded: noted). Put right without a note, since drawing random numbers is what
  targets do: the global random states -- torch's CPU generator back to the rank's start-up
  state, numpy's and ``random``'s reseeded from fresh entropy, as a new rank's are. A target
  that seeds them (transformers' ``Trainer`` calls ``set_seed(42)`` on every rank) would
  otherwise hand every later example of the world ranks that draw alike, which its replay line,
  in a fresh world, would not reproduce;
* **cannot be put right** (noted, the world replaced before the next task): a destroyed or
  replaced default process group, Python threads still running, a changed inter-op thread count
  (torch refuses to change it once used), and more than :data:`FD_HEADROOM` open file
  descriptors over the start-up count -- fewer are noted and accepted, since libraries keep
  some open for good (FSDP2's meshes);
* **changes what later code computes** (exit 1 when the numbers themselves hold, "rank left
  unfit"): a global forward/backward hook or registration hook on every ``nn.Module``, a global
  optimizer step hook -- in a real training script it would run on every later model and step.

Only the last is a verdict on the target, and only after its numbers were judged: a rank sends its
record whatever it finds here (``serve``), and the oracle compares numbers first.

What is compared with the baseline (taken once, at the end of the rank's start-up, after the
warm-up that imports what the built-in targets use): the default process group (initialised, the
same object), the ``torch.distributed`` collectives (the recorder's wrappers), the global hook
registries of ``torch.nn.modules.module`` and ``torch.optim.optimizer``, ``threading`` threads,
``torch.get_num_threads()`` / ``get_num_interop_threads()``, grad mode, the default dtype, the
process groups (``pg_map``) and the open file descriptors -- counted again after a
``gc.collect()`` before anything is reported, because a group a target destroyed may still be held
by a reference cycle (what start-up created is frozen, ``serve``: the collection scans only what
tasks created). Measured with torch 2.13: torch's DistributedDataParallel, ZeroRedundancy
Optimizer and ``parallel.DDP``/``ShardedOptimizer`` change none of these (file descriptors stay at
15/16/17/18 at W=1/2/3/4). Cost of a clean check: 14-26 us per task in a lone process, 20-90 us
with W ranks sharing 2 busy cores; more than half of it is listing ``/proc/self/fd``.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn.modules.module as module_hooks
import torch.optim.optimizer as optimizer_hooks

from ddpcheck._rank import meshes

__all__ = ["Baseline", "FD_HEADROOM", "Fitness", "baseline", "restore"]

T = TypeVar("T")

#: Open file descriptors a rank may gain over its start-up count before it is replaced. Libraries
#: keep some open for good, in amounts that depend on the model: FSDP2 with an int
#: ``reshard_after_forward`` leaves 20 more after an MLP's first example and 30 after a tied
#: model's (torch 2.13, gloo, W=4), then exactly as many after every later example. A leak grows
#: without end; past this headroom (a quarter of the usual 1,024 limit) the world is replaced.
FD_HEADROOM = 256

# (registry, what one entry is called in a report)
_MODULE_HOOKS = (
    ("_global_forward_hooks", "global forward hook"),
    ("_global_forward_pre_hooks", "global forward pre-hook"),
    ("_global_backward_hooks", "global backward hook"),
    ("_global_backward_pre_hooks", "global backward pre-hook"),
    ("_global_module_registration_hooks", "global module registration hook"),
    ("_global_parameter_registration_hooks", "global parameter registration hook"),
    ("_global_buffer_registration_hooks", "global buffer registration hook"),
)
_OPTIMIZER_HOOKS = (
    ("_global_optimizer_pre_hooks", "global optimizer step pre-hook"),
    ("_global_optimizer_post_hooks", "global optimizer step post-hook"),
)


@dataclasses.dataclass(frozen=True)
class Baseline:
    """What a fit rank process looks like (see the module docstring)."""

    default_group: dist.ProcessGroup | None
    collectives: tuple[tuple[str, object], ...]  # (name, the function torch.distributed holds)
    hooks: tuple[int, ...]  # entries per registry, in the order of _MODULE_HOOKS + _OPTIMIZER_HOOKS
    threads: int
    thread_ids: frozenset[int | None]
    num_threads: int
    interop_threads: int
    grad_enabled: bool
    default_dtype: torch.dtype
    groups: frozenset[int]  # id() of every process group in pg_map
    torch_rng: torch.Tensor  # torch's CPU generator state (torch.random.get_rng_state())
    #: open file descriptors accepted so far: the start-up count, raised to each new high-water
    #: mark up to :data:`FD_HEADROOM` above it (libraries keep descriptors open for good)
    fds: int
    start_fds: int


@dataclasses.dataclass
class Fitness:
    """What :func:`restore` found: ``unfit`` changes later computations (the target's fault),
    ``replace`` could not be put right (a new process is needed), ``cleaned`` was put right."""

    unfit: list[str] = dataclasses.field(default_factory=list)
    replace: list[str] = dataclasses.field(default_factory=list)
    cleaned: list[str] = dataclasses.field(default_factory=list)

    @property
    def notes(self) -> list[str]:
        """What the report mentions: everything that was not the process as it started."""
        return self.cleaned + self.replace

    def __bool__(self) -> bool:
        return bool(self.unfit or self.replace or self.cleaned)


def baseline(collective_names: tuple[str, ...] = ()) -> Baseline:
    """The state of this rank process now; ``collective_names``: the recorder's wrapped ops."""
    return Baseline(
        default_group=_default_group(),
        collectives=tuple((n, getattr(dist, n, None)) for n in collective_names),
        hooks=_hook_counts(),
        threads=threading.active_count(),
        thread_ids=frozenset(t.ident for t in threading.enumerate()),
        num_threads=torch.get_num_threads(),
        interop_threads=torch.get_num_interop_threads(),
        grad_enabled=torch.is_grad_enabled(),
        default_dtype=torch.get_default_dtype(),
        groups=frozenset(id(g) for g in _groups()),
        torch_rng=torch.random.get_rng_state(),
        fds=(fds := _fd_count()),
        start_fds=fds,
    )


def restore(base: Baseline) -> tuple[Fitness, Baseline]:
    """Put this process back to ``base`` where that is possible; say what changed, one phrase
    each, sorted by consequence (see the module docstring), and the baseline for the next task
    (``base`` itself, unless file descriptors grew for the first time: see :data:`Baseline`).
    The :class:`Fitness` is empty when the process is fit."""
    found = Fitness()
    group = _default_group()
    if group is None:
        found.replace.append("destroyed the default process group")
    elif group is not base.default_group:
        found.replace.append("replaced the default process group")
    for name, fn in base.collectives:
        if getattr(dist, name, None) is not fn:
            setattr(dist, name, fn)
            found.cleaned.append(
                f"replaced torch.distributed.{name} (its calls went "
                "unrecorded; the recorder's wrapper is back)"
            )
    now = _hook_counts()
    if now != base.hooks:
        for (_, what), before, after in zip(_MODULE_HOOKS + _OPTIMIZER_HOOKS, base.hooks, now):
            if after > before:
                found.unfit.append(
                    f"registered {after - before} {what}{'s' if after - before > 1 else ''}"
                )
            elif after < before:
                found.unfit.append(
                    f"removed {before - after} {what}{'s' if before - after > 1 else ''}"
                )
    _set_back(
        found,
        "torch.get_num_threads()",
        base.num_threads,
        torch.get_num_threads(),
        torch.set_num_threads,
    )
    _set_back(
        found,
        "grad mode (torch.is_grad_enabled())",
        base.grad_enabled,
        torch.is_grad_enabled(),
        torch.set_grad_enabled,
    )
    _set_back(
        found,
        "torch.get_default_dtype()",
        base.default_dtype,
        torch.get_default_dtype(),
        torch.set_default_dtype,
    )
    _fresh_randomness(base)
    interop = torch.get_num_interop_threads()
    if interop != base.interop_threads:
        found.replace.append(
            f"changed torch.get_num_interop_threads() {base.interop_threads} -> {interop}"
        )
    return found, _leftovers(base, found)


def _set_back(
    found: Fitness, what: str, before: T, after: T, put_back: Callable[[T], object]
) -> None:
    """A setting the task changed, set back to ``before``."""
    if after != before:
        put_back(before)
        found.cleaned.append(f"changed {what} {before} -> {after} (set back)")


def _fresh_randomness(base: Baseline) -> None:
    """The global random states as a new rank holds them (see the module docstring). Every
    task pays this: numpy is seeded from 32 bits of ``random``'s fresh state (11 us), not from the
    OS's entropy pool itself (``numpy.random.seed()``: 123 us)."""
    torch.random.set_rng_state(base.torch_rng)
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(random.getrandbits(32))


def _leftovers(base: Baseline, found: Fitness) -> Baseline:
    """Process groups the task created (destroyed here), then threads and descriptors."""
    harness = meshes.harness_groups()  # the world's meshes: kept, like the default group
    expected_fds = base.fds + meshes.opened_fds()
    if (
        len(_groups()) > len(base.groups | harness)
        or _fd_count() > expected_fds
        or threading.active_count() > base.threads
    ):
        # A destroyed group (or a closed-over file, a finished thread) may still wait in a
        # reference cycle -- a wrapper's hooks refer to the wrapper -- for the collector.
        gc.collect()
    created = [g for g in _groups() if id(g) not in base.groups | harness]
    if created and _default_group() is not None:
        for g in created:
            dist.destroy_process_group(g)
        found.cleaned.append(
            f"created {len(created)} process group(s) and left them (destroyed after the example)"
        )
        created.clear()  # the last references: a group's sockets close when it is freed
        gc.collect()
    threads = threading.active_count()
    if threads > base.threads:
        found.replace.append(
            f"left {threads - base.threads} thread(s) running ({_new_thread_names(base)})"
        )
    fds = _settled_fd_count(expected_fds)
    if fds > base.start_fds + meshes.opened_fds() + FD_HEADROOM:
        found.replace.append(
            f"file descriptors {base.start_fds} -> {fds} since the world "
            f"started (more than {FD_HEADROOM} kept open)"
        )
    elif fds > expected_fds and not found.replace:
        found.cleaned.append(
            f"file descriptors {base.fds} -> {fds}, kept open by a library "
            f"(accepted up to {base.start_fds + FD_HEADROOM}; a new world past "
            "that)"
        )
        return dataclasses.replace(base, fds=fds)
    return base


def _default_group() -> dist.ProcessGroup | None:
    if not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_group()


def _groups() -> list[dist.ProcessGroup]:
    try:
        return list(dist.distributed_c10d._world.pg_map)
    except Exception:  # the default group is gone, or torch moved its bookkeeping
        return []


def _hook_counts() -> tuple[int, ...]:
    return tuple(len(getattr(module_hooks, name, ())) for name, _ in _MODULE_HOOKS) + tuple(
        len(getattr(optimizer_hooks, name, ())) for name, _ in _OPTIMIZER_HOOKS
    )


def _settled_fd_count(expected: int) -> int:
    """Open descriptors once those being closed are closed: gloo closes a destroyed group's
    sockets from its own threads, so a count right after the destroy can be one or two high
    (measured: FSDP2 at W=4, 1 in 4 examples). Re-counted only while above ``expected``, for
    at most ~0.2 s."""
    fds = _fd_count()
    for pause in (0.005, 0.02, 0.05, 0.1):
        if fds <= expected:
            break
        time.sleep(pause)
        fds = _fd_count()
    return fds


def _fd_count() -> int:
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # minus the one listdir itself opened
    except OSError:  # no /proc (not Linux): descriptors are not checked
        return 0


def _new_thread_names(base: Baseline) -> str:
    names = sorted(t.name for t in threading.enumerate() if t.ident not in base.thread_ids)
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
