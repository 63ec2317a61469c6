"""torch_2d declines a row-wise layer that leaves a tp rank no input feature: torch 2.13's FSDP2
loses that empty shard's shape and gathering it hangs (bench/fsdp2_empty_tp_shard.py)."""

from __future__ import annotations

import torch

from ddpcheck._language.battery import TENSOR_PARALLEL_BATTERY
from ddpcheck.targets.catalogue import TORCH_2D, TORCH_TP
from ddpcheck.targets.tensor_parallel import _holders, empty_shard


def test_holders_count_the_ranks_torch_chunk_feeds() -> None:
    for features in range(1, 13):
        for tp in range(1, 6):
            assert _holders(features, tp) == len(torch.chunk(torch.empty(features), tp))


def test_the_uneven_battery_scenario_is_declined_where_a_rank_holds_nothing() -> None:
    scenario = dict(TENSOR_PARALLEL_BATTERY)["tp-uneven-adam-clip"]
    # hidden width 5: tp=4 (W=4) chunks it 2, 2, 1 and nothing; tp=2 and tp=3 feed every rank
    assert "blocks.0.down" in (TORCH_2D.supports_at(scenario, 4) or "")
    assert empty_shard(scenario, 2) is None and empty_shard(scenario, 3) is None
    assert TORCH_TP.supports_at(scenario, 4) is None  # without FSDP2 it trains right
