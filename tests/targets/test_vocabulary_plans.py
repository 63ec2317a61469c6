"""Who runs a vocabulary-parallel embedding or a tied head, and who declines it naming why
(no world runs): parallel_tp has no embedding layer and unties what it shards, hf_tp does not
drive transformers' re-tie, torch_2d declines an embedding that leaves a rank no word."""

from __future__ import annotations

from ddpcheck import Scenario
from ddpcheck._language.sharded_models import ShardedBlock, ShardedSpec, id_tokens
from ddpcheck._language.tensor_parallel import TensorParallel
from ddpcheck.targets.catalogue import PARALLEL_TP, TORCH_2D, TORCH_TP
from ddpcheck.targets.hf_tp import uniform_plan
from ddpcheck.targets.tensor_parallel import first_empty_shard, tied_parameters

TIED = ShardedSpec((ShardedBlock("mlp", 2),), embedding=True, tokens=True, tied=True)


def _scenario(plan, tp=None):
    return Scenario(
        TIED,
        data=id_tokens,
        loss="token_cross_entropy",
        global_batch=4,
        tensor_parallel=TensorParallel(plan, tp),
    )


def test_a_tied_weight_is_found_under_both_names():
    assert tied_parameters(TIED()) == [[("inp", "weight"), ("head", "weight")]]
    assert tied_parameters(ShardedSpec(embedding=True, tokens=True)()) == []


def test_who_declines_an_embedding_or_a_tied_head():
    vocab = _scenario((("inp", "vocab"), ("head", "colwise-replicate")))
    assert TORCH_TP.supports_at(vocab, 2) is None
    assert "vocabulary-parallel embedding" in PARALLEL_TP.supports_at(vocab, 2)
    head = _scenario((("head", "colwise-replicate"),))
    assert "untie" in PARALLEL_TP.supports_at(head, 2)
    assert "tie_weights" in uniform_plan(head)
    assert PARALLEL_TP.supports_at(_scenario(()), 2) is None  # tied, nothing sharded


def test_an_embedding_leaving_a_rank_no_word_is_found():
    at_four = _scenario((("inp", "vocab"),))  # 5 words over 4 ranks: 2, 2, 1, nothing
    found = first_empty_shard(at_four, 4)
    assert found is not None and found.features == 5 and found.dimension == "vocabulary"
    assert "inp" in TORCH_2D.supports_at(_scenario((("inp", "vocab"),), tp=4), 4)
    assert first_empty_shard(at_four, 3) is None  # 2, 2, 1
