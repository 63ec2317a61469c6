"""A target's once-per-process set-up, run in a world's ranks before its first example there.

Why: what a framework does once per process is no part of any example -- DeepSpeed builds a C++ op
the first time it runs after an install (100-285 s measured on 2 loaded cores, 155-189 s in issue
37) and importing it costs seconds -- and inside the first example's deadline (60 s) it was "rank
timed out", exit 1, on correct code; a framework whose import fails (Lightning 2.0.0 here) failed
inside the framework's code, "rank failed", where the warm-up says set-up (exit 2).
``Target.warm_up`` holds that work; :func:`warm_up` runs it as a task of its own, under
:data:`WARM_UP_DEADLINE`.

Invariant: a world's ranks run a target's ``warm_up`` once per set of rank processes (a replaced
world warms up again) and per ``warm_up`` function, before the first example of such a target is
submitted there, while no other task is in flight -- its wait is long, and the deadline of a task
in flight elsewhere would count meanwhile (``_runs.pipeline`` judges the example before first:
:func:`needed`). Its failure is never a verdict: the framework's exception or the deadline is a
:class:`SetupError` (exit 2), the glue's own failure an ``InternalError`` (exit 4).
"""

from __future__ import annotations

import weakref
from typing import Any

from ddpcheck._base.errors import SetupError
from ddpcheck._base.options import WARM_UP_DEADLINE
from ddpcheck._rank.runner import run_warm_up
from ddpcheck._world.failures import Failure, WorldFailure
from ddpcheck._world.registry import world_of
from ddpcheck._world.worlds import World
from ddpcheck.targets import Target

__all__ = ["needed", "warm_up"]

#: world -> (its ranks' pids when they warmed up, the warm_up functions they ran)
_DONE: weakref.WeakKeyDictionary[World, tuple[tuple[int, ...], set]] = weakref.WeakKeyDictionary()


def warm_up(world: World, target: Target) -> None:
    """Run ``target.warm_up()`` in every rank of ``world`` unless they ran it (see the module's
    invariant)."""
    hook = _hook(target)
    if hook is None or _warm(world, hook):
        return
    name = type(target).__name__
    try:
        world.run(run_warm_up, target, deadline=WARM_UP_DEADLINE, what=f"{name}.warm_up")
    except WorldFailure as failure:
        if failure.kind == Failure.REFUSED:  # the glue's InternalError, or a decline
            raise failure.refusal() from None
        raise SetupError(
            f"{name}.warm_up -- what its framework does once per rank process, such as building "
            f"its C++ ops -- failed; nothing was checked. A failure there is the set-up's, never "
            f"a verdict on the target.\n{failure}"
        ) from None
    pids, done = _DONE.get(world, ((), set()))
    if pids != tuple(world.pids):  # replaced since: what its old ranks ran is gone
        done = set()
    _DONE[world] = (tuple(world.pids), done | {hook})


def needed(
    target: Target, world_size: int, *, device: str = "cpu", backend: str | None = None
) -> bool:
    """Would an example of ``target`` in the persistent world of ``world_size`` wait for a
    warm-up first? Never for a target without ``warm_up``; True when its world cannot start
    (launching it says why)."""
    hook = _hook(target)
    if hook is None:
        return False
    try:
        world = world_of(world_size, backend=backend, device=device)
    except Exception:
        return True
    return not _warm(world, hook)


def _hook(target: Target) -> Any:
    """The target's own ``warm_up`` function; None for the default, which does nothing."""
    hook = getattr(type(target), "warm_up", None)
    return None if hook is None or hook is Target.warm_up else hook


def _warm(world: World, hook: Any) -> bool:
    pids, done = _DONE.get(world, ((), set()))
    return world.alive and pids == tuple(world.pids) and hook in done
