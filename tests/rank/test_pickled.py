"""Objects carried between ranks as pickled byte tensors arrive whole, in rank order, on the
ranks they are meant for -- without numpy, which torch's ``*_object`` collectives need and
ddpcheck does not depend on."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from ddpcheck._rank.pickled import all_gathered, gathered_on_zero
from ddpcheck._world.registry import get_world


def _without_numpy_gather() -> tuple[list, list]:
    saved = sys.modules.get("numpy")
    sys.modules["numpy"] = None  # type: ignore[assignment]  # an import of numpy now fails
    try:
        rank = dist.get_rank()
        # unequal lengths per rank: the padding must be cut off again
        mine = {"rank": rank, "piece": torch.arange(rank + 1.0), "name": "x" * (10 * rank)}
        return all_gathered(mine), gathered_on_zero((rank, [None] * rank))
    finally:
        sys.modules["numpy"] = saved  # type: ignore[assignment]


def test_every_rank_gets_every_object_and_rank_0_the_gathered_ones_without_numpy():
    everywhere, on_zero = zip(*get_world(3).submit(_without_numpy_gather).collect())
    for gathered in everywhere:
        assert [g["rank"] for g in gathered] == [0, 1, 2]
        assert [g["piece"].tolist() for g in gathered] == [[0.0], [0.0, 1.0], [0.0, 1.0, 2.0]]
        assert [len(g["name"]) for g in gathered] == [0, 10, 20]
    assert on_zero[0] == [(0, []), (1, [None]), (2, [None, None])]
    assert on_zero[1] == on_zero[2] == []
