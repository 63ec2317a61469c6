"""A world runs one task and queues one (``World.submit``): the ranks start the queued task as
soon as they answered the first, each task keeps its own collective sequences and deadline, and
a queued task whose world is replaced first is lost, never judged."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from ddpcheck._world.failures import WorldFailure
from ddpcheck._world.worlds import TaskLost, World, _empty
from tests.patience import patience


def _rank_sum(value: float, pause: float = 0.0) -> float:
    """One all_reduce of ``value``, after ``pause`` seconds."""
    time.sleep(pause)
    t = torch.tensor([value])
    dist.all_reduce(t)
    return float(t)


def _two_all_reduces() -> int:
    for _ in range(2):
        dist.all_reduce(torch.zeros(1))
    return os.getpid()


def _raise_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 fails the first task")


@pytest.fixture
def world():
    started = World(2).start()
    yield started
    started.close()


def test_a_queued_task_runs_after_the_first_with_its_own_sequences(world):
    first = world.submit(_rank_sum, 1.0, 0.3)
    second = world.submit(_two_all_reduces)  # queued while the first still sleeps
    assert first.collect() == [2.0, 2.0]
    one = world.collective_sequences()
    assert second.collect() == world.pids
    two = world.collective_sequences()
    assert [text.count("('all_reduce'") for text in one] == [1, 1]
    assert [text.count("('all_reduce'") for text in two] == [2, 2]


def test_tasks_are_collected_in_order_and_one_is_queued_at_most(world):
    first = world.submit(_rank_sum, 1.0)
    second = world.submit(_rank_sum, 2.0)
    with pytest.raises(RuntimeError, match="queues one"):
        world.submit(_rank_sum, 3.0)
    with pytest.raises(RuntimeError, match="out of order"):
        second.collect()
    assert first.collect() == [2.0, 2.0]
    assert second.collect() == [4.0, 4.0]


def test_a_queued_tasks_deadline_counts_from_the_first_ones_collection(world):
    # the first takes twice the second's deadline: queued, the second must not time out
    deadline = patience(1.0)
    first = world.submit(_rank_sum, 1.0, 2 * deadline)
    second = world.submit(_rank_sum, 2.0, deadline=deadline)
    assert first.collect() == [2.0, 2.0]
    assert second.collect() == [4.0, 4.0]


def test_a_queued_task_is_lost_when_the_first_fails(world):
    first = world.submit(_raise_on_rank_1)
    second = world.submit(_rank_sum, 1.0)
    with pytest.raises(WorldFailure, match="rank 1 fails the first task"):
        first.collect()
    with pytest.raises(TaskLost):
        second.collect()
    assert world.submit(_rank_sum, 1.0).collect() == [2.0, 2.0]  # a new world


def test_emptying_a_worlds_sequence_files_creates_none(tmp_path):
    """The emptying thread ran while a kill removed the world's directory: a sequence file it
    created again after the removal's listing left the directory behind (seen once in a test
    run: ddpcheck-w2-*/rank0.collectives, empty)."""
    written = tmp_path / "rank1.collectives"
    written.write_text("all_reduce\n")
    _empty([str(tmp_path / "rank0.collectives"), str(written)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank1.collectives"]
    assert written.read_text() == ""
