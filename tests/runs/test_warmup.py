"""A target's once-per-process set-up (``Target.warm_up``) runs in every rank before the first
example there, once per rank process, as a task of its own: no example's deadline pays for it,
not even one running in another world meanwhile (``_runs.pipeline``); its failure is a
``SetupError``, never a verdict. Issue 37: DeepSpeed's first C++ op build ran inside the first
example's deadline: "rank timed out", exit 1, on correct code.

Every test starts from no world alive: a rank process warms up once for the life of the process.
Each costs ~7-10 s of CPU (fresh worlds, examples): marked slow."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch.distributed as dist

import ddpcheck
from ddpcheck import targets, zoo
from ddpcheck._runs import warmup
from ddpcheck._runs.admission import Settings
from ddpcheck._runs.pipeline import one_behind_the_other
from ddpcheck.scenario import Scenario
from tests.patience import patience

SCENARIO = Scenario(zoo.MLP, global_batch=4, steps=1)
pytestmark = pytest.mark.slow

#: Logs of the warm-ups this rank process ran (a rank imports this module).
_WARMED: set[str] = set()


@dataclasses.dataclass(frozen=True)
class WarmingTarget(targets.ParallelTarget):
    """``parallel``, with a warm-up that takes ``seconds`` (in worlds of ``slow_from`` ranks or
    more), appends its rank's pid to ``log`` and fails when ``fails``; an example run before the
    warm-up in its process fails."""

    log: str = ""
    seconds: float = 0.0
    slow_from: int = 1
    fails: bool = False

    def warm_up(self) -> None:
        if dist.get_world_size() >= self.slow_from:
            time.sleep(self.seconds)
        if self.fails:
            raise RuntimeError("the C++ op did not build: no compiler")
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")
        _WARMED.add(self.log)

    def wrap(self, module):
        assert self.log in _WARMED, "an example ran before its warm-up in this process"
        return super().wrap(module)


@pytest.fixture(autouse=True)
def fresh_worlds():
    ddpcheck.shutdown_worlds()
    yield
    ddpcheck.shutdown_worlds()


def _pids(log) -> list[int]:
    return [int(line) for line in log.read_text().split()]


def test_warm_up_runs_once_per_rank_process_before_its_first_example(tmp_path):
    log = tmp_path / "warmed"
    target = WarmingTarget(log=str(log))
    assert warmup.needed(target, 2)
    for seed in (0, 1):
        ddpcheck.check_example(target, dataclasses.replace(SCENARIO, seed=seed), 2)
    world = ddpcheck.get_world(2)
    assert sorted(_pids(log)) == sorted(world.pids)  # each rank once, none twice
    assert not warmup.needed(target, 2)
    world.kill()  # a replaced world's new ranks warm up again
    assert warmup.needed(target, 2)
    ddpcheck.check_example(target, SCENARIO, 2)
    assert len(_pids(log)) == 4


def test_no_examples_deadline_pays_for_a_warm_up_even_one_in_another_world(tmp_path):
    deadline = patience(2.0)  # an MLP step at W<=2 takes ~0.05 s on a quiet machine
    target = WarmingTarget(log=str(tmp_path / "warmed"), seconds=deadline + 0.5, slow_from=2)
    # the first example's world warms up, then the second's -- while the first would be in
    # flight, had it not been judged first
    items = [(0, 1, SCENARIO), (1, 2, SCENARIO), (2, 2, dataclasses.replace(SCENARIO, seed=1))]
    outcomes = [
        outcome
        for _, outcome in one_behind_the_other(
            items, Settings(deadline=deadline), target_of=lambda _: target
        )
    ]
    assert [o.error for o in outcomes] == [None] * 3, [str(o.error) for o in outcomes]
    assert [o.skipped for o in outcomes] == [None] * 3
    assert len(_pids(tmp_path / "warmed")) == 3  # one rank at W=1, two at W=2


def test_a_failing_or_endless_warm_up_is_a_setup_error_never_a_verdict(tmp_path, monkeypatch):
    failing = WarmingTarget(log=str(tmp_path / "warmed"), fails=True)
    with pytest.raises(ddpcheck.SetupError, match=r"the C\+\+ op did not build") as info:
        ddpcheck.check_example(failing, SCENARIO, 2)
    assert not isinstance(info.value, ddpcheck.EquivalenceError)
    assert "WarmingTarget.warm_up" in str(info.value)
    monkeypatch.setattr(warmup, "WARM_UP_DEADLINE", patience(1.0))
    endless = WarmingTarget(log=str(tmp_path / "warmed"), seconds=patience(1.0) + 60)
    with pytest.raises(ddpcheck.SetupError, match="the deadline passed"):
        ddpcheck.check_example(endless, SCENARIO, 2)
