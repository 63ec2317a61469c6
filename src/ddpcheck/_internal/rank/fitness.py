"""Is this rank process still fit to run the next task? Checked by the rank after every task.

Why: worlds are persistent, so whatever a task leaves behind in a rank process -- a destroyed or
replaced default process group, a global module hook, a thread still running, a changed thread
count, a process group or file descriptor per example -- would make the *next* example (often
another target's) fail, and be blamed for it. A rank that finds itself changed reports it, the
task fails with the kind ``"contaminated"`` naming the rank and what changed, and the world is
replaced; so the example that did the damage is the culprit.

What is compared with the rank's :func:`baseline` (taken once, at the end of the rank's start-up,
after the warm-up that imports what the built-in targets use):

* the default process group: still initialised, the same object;
* the ``torch.distributed`` collectives: still the recorder's wrappers (a target that replaced
  one would blind the recorder for every later example);
* global hooks: ``torch.nn.modules.module``'s forward/backward/pre hooks and the module,
  parameter and buffer registration hooks, ``torch.optim``'s global step hooks;
* ``threading.active_count()``, ``torch.get_num_threads()``, ``torch.get_num_interop_threads()``,
  grad mode and the default dtype;
* the number of process groups (``new_group``: each gloo group holds sockets; one per example
  exhausts the descriptors of a long run) and of open file descriptors -- counted again after a
  ``gc.collect()`` before a rank is blamed, because a group a target destroyed may still be held
  by a reference cycle (only then: a collection costs milliseconds).

Measured with torch 2.13: torch's DistributedDataParallel (with ``find_unused_parameters``),
ZeroRedundancyOptimizer and ``parallel.DDP``/``ShardedOptimizer`` running the battery at W=1-4
change none of these after the rank's start-up (file descriptors stay at 15/16/17/18 at
W=1/2/3/4, one Python thread, one process group), so no allowance is needed (:data:`FD_SLACK` is
0; ``tests/world/test_harness.py::test_builtin_targets_pass_the_battery`` keeps it so). Cost: 14-26 us
per task in a lone process, 20-90 us with W ranks sharing 2 busy cores; more than half of it is
listing ``/proc/self/fd``.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import threading
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.modules.module as module
import torch.optim.optimizer as optimizer

__all__ = ["Baseline", "FD_SLACK", "baseline", "problems"]

#: Open file descriptors a task may add without being blamed. Measured: none of the built-in
#: targets adds any, so none may.
FD_SLACK = 0

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

    default_group: Any
    collectives: tuple[tuple[str, Any], ...]  # (name, the function torch.distributed holds)
    hooks: tuple[int, ...]  # entries per registry, in the order of _MODULE_HOOKS + _OPTIMIZER_HOOKS
    threads: int
    thread_ids: frozenset[int]
    num_threads: int
    interop_threads: int
    grad_enabled: bool
    default_dtype: Any
    groups: int
    fds: int


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
        groups=_group_count(),
        fds=_fd_count(),
    )


def problems(base: Baseline) -> list[str]:
    """What changed since ``base``, one phrase each (empty: the process is fit)."""
    out = []
    group = _default_group()
    if group is None:
        out.append("destroyed the default process group")
    elif group is not base.default_group:
        out.append("replaced the default process group")
    for name, fn in base.collectives:
        if getattr(dist, name, None) is not fn:
            out.append(f"replaced torch.distributed.{name}")
    now = _hook_counts()
    if now != base.hooks:
        for (_, what), before, after in zip(_MODULE_HOOKS + _OPTIMIZER_HOOKS, base.hooks, now):
            if after > before:
                out.append(f"registered {after - before} {what}{'s' if after - before > 1 else ''}")
            elif after < before:
                out.append(f"removed {before - after} {what}{'s' if before - after > 1 else ''}")
    threads = threading.active_count()
    if threads != base.threads:
        out.append(f"left {threads - base.threads} thread(s) running "
                   f"({_new_thread_names(base)})" if threads > base.threads
                   else f"Python threads {base.threads} -> {threads}")
    for what, before, after in (
            ("torch.get_num_threads()", base.num_threads, torch.get_num_threads()),
            ("torch.get_num_interop_threads()", base.interop_threads,
             torch.get_num_interop_threads()),
            ("grad mode (torch.is_grad_enabled())", base.grad_enabled, torch.is_grad_enabled()),
            ("torch.get_default_dtype()", base.default_dtype, torch.get_default_dtype())):
        if after != before:
            out.append(f"changed {what} {before} -> {after}")
    groups, fds = _group_count(), _fd_count()
    if groups > base.groups or fds > base.fds + FD_SLACK:
        # A destroyed group (or a closed-over file) may still wait in a reference cycle -- a
        # wrapper's hooks refer to the wrapper -- for the collector: collect before blaming.
        gc.collect()
        groups, fds = _group_count(), _fd_count()
    if groups > base.groups:
        out.append(f"process groups {base.groups} -> {groups} (a group created with "
                   "dist.new_group must be destroyed with dist.destroy_process_group(group))")
    if fds > base.fds + FD_SLACK:
        out.append(f"file descriptors {base.fds} -> {fds}")
    return out


def _default_group() -> Any:
    if not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_group()


def _hook_counts() -> tuple[int, ...]:
    return (tuple(len(getattr(module, name, ())) for name, _ in _MODULE_HOOKS)
            + tuple(len(getattr(optimizer, name, ())) for name, _ in _OPTIMIZER_HOOKS))


def _group_count() -> int:
    try:
        return len(dist.distributed_c10d._world.pg_map)
    except Exception:  # the default group is gone, or torch moved its bookkeeping
        return 0


def _fd_count() -> int:
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # minus the one listdir itself opened
    except OSError:  # no /proc (not Linux): descriptors are not checked
        return 0


def _new_thread_names(base: Baseline) -> str:
    names = sorted(t.name for t in threading.enumerate() if t.ident not in base.thread_ids)
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
