"""Vocabulary-parallel embeddings, tied heads and grouped-query attention in the drawn
tensor-parallel models: a tied matrix gets one placement in every drawn plan, attention is split
only along whole kv heads, and the grouped-query forward is multi-head attention with each kv
head repeated (no world runs: plan data and one-process forwards)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpcheck import InvalidArgument
from ddpcheck._language.plans import plans, sharded_models
from ddpcheck._language.sharded_models import (
    SHARD0_HEADS,
    VOCABULARY,
    VOCABULARY_STYLES,
    ShardedBlock,
    ShardedSpec,
    id_tokens,
    plan_choices,
)


@settings(max_examples=30, deadline=None, database=None)
@given(data=st.data(), tp=st.sampled_from((2, 3, 4)))
def test_a_tied_matrix_gets_one_placement_in_every_drawn_plan(data, tp):
    spec = dataclasses.replace(data.draw(sharded_models()), embedding=True, tokens=True, tied=True)
    styles = dict(data.draw(plans(spec, tp)))
    model = spec()
    assert model.head.weight is model.inp.weight
    if styles.get("inp") in VOCABULARY_STYLES:  # the embedding's rows: Shard(0)
        assert styles.get("head") in SHARD0_HEADS  # the head's output features: Shard(0)
    else:
        assert "head" not in styles  # both replicated


def test_every_tied_choice_of_a_small_model_and_what_tp_4_leaves():
    spec = ShardedSpec((ShardedBlock("mlp", 2),), embedding=True, tokens=True, tied=True)
    first = plan_choices(spec, 2)[0]  # the embedding's and the head's group, joined
    assert first[0] == () and {dict(f).get("head") for f in first[1:]} <= SHARD0_HEADS
    assert all(dict(f)["inp"] == "vocab" for f in first[1:])
    # 5 words over 4 ranks leave one none: neither use of the matrix is sharded
    assert plan_choices(spec, 4)[0] == [()]
    assert {
        s for g in plan_choices(spec, 4) for f in g for n, s in f if n in ("inp", "head")
    } == set()


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_attention_is_split_only_along_whole_kv_heads(tp):
    for heads in range(1, 7):
        for kv in [d for d in range(1, heads + 1) if heads % d == 0]:
            spec = ShardedSpec((ShardedBlock("attention", heads, kv_heads=kv),))
            styles = {s for g in plan_choices(spec, tp) for f in g for n, s in f if ".q" in n}
            assert (styles == {"colwise"}) == (kv % tp == 0), (heads, kv, tp)


def test_grouped_query_attention_is_attention_with_each_kv_head_repeated():
    torch.manual_seed(0)
    gqa = ShardedSpec((ShardedBlock("attention", 6, kv_heads=2),), width=4, head_dim=2)()
    mha = ShardedSpec((ShardedBlock("attention", 6),), width=4, head_dim=2)()
    same = {k: v for k, v in gqa.state_dict().items() if ".k." not in k and ".v." not in k}
    mha.load_state_dict(same, strict=False)
    a, b = gqa.blocks[0], mha.blocks[0]
    with torch.no_grad():  # kv head j serves q heads 3j..3j+2: its rows repeated 3 times
        for name in "kv":
            rows = getattr(a, name).weight.view(2, 2, 4).repeat_interleave(3, dim=0)
            getattr(b, name).weight.copy_(rows.reshape(12, 4))
            bias = getattr(a, name).bias.view(2, 2).repeat_interleave(3, dim=0)
            getattr(b, name).bias.copy_(bias.reshape(12))
    x = torch.randn(3, 3, 4)
    assert torch.allclose(a(x), b(x), atol=1e-6)  # (assert_close imports DTensor: 3 CPU-s)


def test_token_ids_in_and_bad_specs_refused():
    x, _ = id_tokens(1, 4, torch.float64)
    assert x.dtype == torch.int64 and x.shape == (4, 3) and 0 <= x.min() <= x.max() < VOCABULARY
    spec = ShardedSpec(embedding=True, tokens=True)
    assert spec()(x).shape == (4, 3, VOCABULARY)
    with pytest.raises(InvalidArgument, match="divisor"):
        ShardedBlock("attention", 4, kv_heads=3)
    with pytest.raises(InvalidArgument, match="divisor"):
        ShardedBlock("mlp", 4, kv_heads=2)
    with pytest.raises(InvalidArgument, match="embedding=True"):
        ShardedSpec(tokens=True, tied=True)
