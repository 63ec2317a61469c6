"""Isolation between examples (``ddpcheck._internal.fitness``).

A target that leaves its rank processes unfit for the next example is the one blamed ("rank left
unfit", naming what changed), and the next, correct example runs in a fresh world.

Targets travel to rank processes by pickle, so they are module-level classes here.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import ddpcheck
from ddpcheck import targets
from ddpcheck.api import check_example
from ddpcheck.scenario import Scenario
from ddpcheck._internal.world import get_world

SCENARIO = Scenario(steps=1)

# ---------------------------------------------------------------------------------------------
# Targets that damage the rank process (each on every rank, as a careless target would)

_KEEP: list = []  # what the leaky targets keep alive in the rank process


def _noop_hook(module, inputs, output):
    return None


@dataclasses.dataclass(frozen=True)
class RegistersGlobalHook(targets.ParallelTarget):
    def wrap(self, module):
        torch.nn.modules.module.register_module_forward_hook(_noop_hook)
        return super().wrap(module)


@dataclasses.dataclass(frozen=True)
class DestroysDefaultGroup(targets.ParallelDDPTarget):
    def after_backward(self, model, optimizer):
        model.finish_gradient_sync()
        dist.barrier()
        dist.destroy_process_group()


@dataclasses.dataclass(frozen=True)
class NewGroupPerExample(targets.ParallelTarget):
    def wrap(self, module):
        _KEEP.append(dist.new_group(list(range(dist.get_world_size()))))
        return super().wrap(module)


@dataclasses.dataclass(frozen=True)
class ChangesThreadCount(targets.ParallelTarget):
    def wrap(self, module):
        torch.set_num_threads(2)
        return super().wrap(module)


@dataclasses.dataclass(frozen=True)
class LeavesThreadRunning(targets.ParallelTarget):
    def wrap(self, module):
        stop = threading.Event()
        threading.Thread(target=stop.wait, name="leftover-worker", daemon=True).start()
        _KEEP.append(stop)
        return super().wrap(module)


@dataclasses.dataclass(frozen=True)
class LeaksFile(targets.ParallelTarget):
    def wrap(self, module):
        _KEEP.append(open(os.devnull))
        return super().wrap(module)


@dataclasses.dataclass(frozen=True)
class StartsSubprocess(targets.ParallelTarget):
    """Starts a long-lived child on every rank and records its pid in ``marker``.<rank>."""

    marker: str = ""

    def wrap(self, module):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(f"{self.marker}.{dist.get_rank()}", "w") as f:
            f.write(str(child.pid))
        return super().wrap(module)


CONTAMINATIONS = {
    "global forward hook": (RegistersGlobalHook, "registered 1 global forward hook"),
    "destroyed default group": (DestroysDefaultGroup, "destroyed the default process group"),
    "new_group per example": (NewGroupPerExample, "process groups 1 -> 2"),
    "set_num_threads": (ChangesThreadCount, "changed torch.get_num_threads() 1 -> 2"),
    "thread left running": (LeavesThreadRunning, "left 1 thread(s) running (leftover-worker)"),
    "file left open": (LeaksFile, "file descriptors {fds} -> {fds_after}"),
}


def _fd_count():
    from ddpcheck._internal import fitness

    return fitness.baseline().fds


@pytest.mark.parametrize("case", list(CONTAMINATIONS))
def test_a_target_that_leaves_its_ranks_unfit_is_blamed_not_the_next(case):
    make, fragment = CONTAMINATIONS[case]
    check_example(targets.PARALLEL, SCENARIO, 2)  # a warm world
    old_pids = get_world(2).pids
    fds = get_world(2).run(_fd_count)[0]
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        check_example(make(), SCENARIO, 2, deadline=30)
    err, text = info.value, str(info.value)
    assert err.kinds == ["rank left unfit"], text
    assert [d.rank for d in err.divergences] == [0, 1], text
    assert fragment.format(fds=fds, fds_after=fds + 1) in text, text
    assert "left its process unfit for the next task" in text, text
    # The world was replaced, and the next, correct example passes in it.
    check_example(targets.PARALLEL, SCENARIO, 2)
    assert set(get_world(2).pids).isdisjoint(old_pids)


def test_the_fitness_check_is_cheap():
    """It runs after every task: it must cost well under a millisecond."""
    assert max(get_world(2).run(_fitness_check_seconds)) < 1e-3


def _fitness_check_seconds(n=500):
    from ddpcheck._internal import fitness, recorder

    base = fitness.baseline(tuple(recorder.wrapped()))
    started = time.perf_counter()
    for _ in range(n):
        assert not fitness.problems(base)
    return (time.perf_counter() - started) / n


def test_processes_a_target_starts_die_with_the_world(tmp_path):
    marker = str(tmp_path / "child")
    check_example(StartsSubprocess(marker=marker), SCENARIO, 2, deadline=30)
    pids = [int(open(f"{marker}.{r}").read()) for r in range(2)]
    assert all(_alive(p) for p in pids)
    get_world(2).kill()  # what a failure does: every rank's process group goes
    _wait_until(lambda: not any(_alive(p) for p in pids), 10)
    assert not any(_alive(p) for p in pids)


# ---------------------------------------------------------------------------------------------
# Helpers


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_until(condition, seconds: float) -> None:
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.05)
