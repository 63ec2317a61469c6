"""The drawn plans' sequence-parallel regions and loss heads are valid by construction: followed
through the model, the stream between modules is replicated or cut along the sequence exactly
where each style expects it (no world runs: pure plan data)."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from ddpcheck._language.plans import plans, sharded_models
from ddpcheck._language.sharded_models import (
    LOSS_STYLES,
    NORM_KINDS,
    SEQUENCE,
    SEQUENCE_STYLES,
    ShardedBlock,
    ShardedSpec,
    every_rank_holds,
    plan_choices,
)


def _follow(spec: ShardedSpec, plan: tuple[tuple[str, str], ...]) -> None:
    """Asserts that every module gets the layout its style expects: "R" (whole on every rank)
    or "S" (each rank its share of the sequence)."""
    styles = dict(plan)
    state = "S" if styles.get("inp") in ("rowwise-sequence", "vocab-sequence") else "R"
    for i, block in enumerate(spec.blocks):
        ends = styles.get(f"blocks.{i}", "")
        if ends in ("sequence-in", "sequence-in-out"):
            assert state == "R", (plan, i)
            state = "S"
        sequence = styles.get(f"blocks.{i}.norm") == "sequence"
        assert sequence <= (block.kind in NORM_KINDS), (plan, i)
        assert state == ("S" if sequence else "R"), (plan, i)
        if ends in ("sequence-out", "sequence-in-out"):
            state = "R"
    head = styles.get("head", "")
    assert state == ("S" if head.startswith("colwise-sequence") else "R"), plan
    assert spec.tokens or head not in LOSS_STYLES, plan


@settings(max_examples=60, deadline=None, database=None)
@given(data=st.data(), tp=st.sampled_from((2, 3, 4)), tokens=st.booleans())
def test_drawn_regions_are_closed_and_loss_heads_need_tokens(data, tp, tokens):
    spec = dataclasses.replace(data.draw(sharded_models()), tokens=tokens)
    plan = data.draw(plans(spec, tp))
    _follow(spec, plan)
    if any(style in SEQUENCE_STYLES for _, style in plan):
        assert every_rank_holds(SEQUENCE, tp)  # a token on every rank


def test_every_region_fragment_of_a_norm_only_model_is_closed():
    # all three norms, the input projection and the head in one group: every combination
    spec = ShardedSpec(tuple(ShardedBlock(k) for k in ("norm", "rmsnorm", "norm")), tokens=True)
    (group,) = plan_choices(spec, 2)
    assert group[0] == () and len(group) > 100
    for fragment in group:
        _follow(spec, fragment)
    styles = {style for fragment in group for _, style in fragment}
    assert styles >= (SEQUENCE_STYLES - {"vocab-sequence"}) | LOSS_STYLES  # no embedding
    # 3 tokens over 4 ranks leave one none: no region drawn there
    drawn = {style for g in plan_choices(spec, 4) for f in g for _, style in f}
    assert not drawn & SEQUENCE_STYLES
