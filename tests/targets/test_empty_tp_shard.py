"""torch_2d declines a row-wise layer that leaves a tp rank no input feature: torch 2.13's FSDP2
loses that empty shard's shape and gathering it hangs (bench/fsdp2_empty_tp_shard.py)."""

from __future__ import annotations

import dataclasses

import torch

from ddpcheck._language.battery import TENSOR_PARALLEL_BATTERY
from ddpcheck._language.sharded_models import ShardedBlock, ShardedSpec, holders
from ddpcheck.targets.catalogue import TORCH_2D, TORCH_TP
from ddpcheck.targets.tensor_parallel import empty_shard


def test_holders_count_the_ranks_torch_chunk_feeds() -> None:
    for features in range(1, 13):
        for tp in range(1, 6):
            assert holders(features, tp) == len(torch.chunk(torch.empty(features), tp))


def test_a_row_wise_layer_leaving_a_rank_nothing_is_declined_under_fsdp2() -> None:
    battery = dict(TENSOR_PARALLEL_BATTERY)["tp-uneven-adam-clip"]
    assert all(empty_shard(battery, w) is None for w in (2, 3, 4))  # 7 feeds every rank
    # hidden width 5: tp=4 (W=4) chunks it 2, 2, 1 and nothing; tp=2 and tp=3 feed every rank
    five = dataclasses.replace(
        battery, model=ShardedSpec(blocks=(ShardedBlock("mlp", 5), ShardedBlock("norm")), width=3)
    )
    assert "blocks.0.down" in (TORCH_2D.supports_at(five, 4) or "")
    assert empty_shard(five, 2) is None and empty_shard(five, 3) is None
    assert TORCH_TP.supports_at(five, 4) is None  # without FSDP2 it trains right


def test_torch_2d_and_parallel_tp_find_the_empty_shard_alike() -> None:
    """One finder (``first_empty_shard``): torch_2d asks it of the row-wise layers alone (the
    FSDP2 bug), parallel_tp of every layer of the plan (its layers need a feature per rank)."""
    from ddpcheck._language.tensor_parallel import TensorParallel
    from ddpcheck.targets.catalogue import PARALLEL_TP
    from ddpcheck.targets.parallel_tp import shard_missing
    from ddpcheck.targets.tensor_parallel import first_empty_shard

    battery = dict(TENSOR_PARALLEL_BATTERY)["tp-uneven-adam-clip"]
    five = dataclasses.replace(
        battery, model=ShardedSpec(blocks=(ShardedBlock("mlp", 5), ShardedBlock("norm")), width=3)
    )
    found = first_empty_shard(five, 4)
    assert found is not None and (found.name, found.features, found.empty) == (
        "blocks.0.up",  # column-wise first: its 5 output features, 2, 2, 1 and nothing
        5,
        1,
    )
    assert first_empty_shard(five, 4, rowwise_only=True).name == "blocks.0.down"
    assert shard_missing(five, 4) == (
        "blocks.0.up: 5 features over tp=4 leave the last rank none (torch.chunk); "
        "parallel.tensor_parallel needs a feature on every rank"
    )
    assert PARALLEL_TP.supports_at(five, 4) == shard_missing(five, 4)
    assert shard_missing(five, 2) is None and first_empty_shard(five, 3) is None
    norm = dataclasses.replace(
        five, tensor_parallel=TensorParallel((("blocks.1", "colwise-replicate"),))
    )
    assert shard_missing(norm, 2) == "the plan names 'blocks.1', which is not an nn.Linear"
    assert empty_shard(norm, 2) is None  # not row-wise: torch's own to refuse
