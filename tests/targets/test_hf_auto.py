"""``hf_tp`` on transformers' own architectures (``tp_plan="auto"``): a model of its own plan
trains as the one-process reference; hf_tp draws every architecture, only shapes the plans
accept, and declines the others with transformers' reason; the known bugs it finds on Qwen3
(q/k norms under accumulation) and on a tied head under transformers' FSDP2 are named."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ddpcheck
from ddpcheck import EquivalenceError, Scenario
from ddpcheck._language.tensor_parallel import TensorParallel
from ddpcheck._language.zoo import token_data

pytest.importorskip("transformers")

from ddpcheck.targets.catalogue import HF_TP
from ddpcheck.targets.hf_auto import (
    FSDP_UNTRIAGED,
    architectures,
    heads_problem,
    own_styles,
    shard_problem,
)
from ddpcheck.targets.hf_models import ARCHITECTURES, HfCausalLM
from ddpcheck.targets.hf_tp import HfTPTarget
from ddpcheck.targets.known_bugs import known_bug_line

#: a Llama of 2 heads (1 kv head each per rank at tp=2), its own plan over tp = W = 2
LLAMA = Scenario(
    model=HfCausalLM(heads=2, kv_heads=2, head_dim=2, intermediate=3),
    data=token_data,
    loss="token_cross_entropy",
    global_batch=4,
    steps=2,
    seed=3,
    tensor_parallel=TensorParallel(),
)


@pytest.mark.slow  # a W=2 world importing transformers in each rank
def test_an_architecture_sharded_by_its_own_plan_matches_the_reference():
    assert ddpcheck.check_example(HF_TP, LLAMA, 2) == ()


@pytest.mark.slow  # a W=2 world importing transformers in each rank (0.5 s once warm)
def test_qwen3s_own_plan_is_wrong_under_accumulation_and_named():
    qwen3 = dataclasses.replace(LLAMA, model=dataclasses.replace(LLAMA.model, architecture="qwen3"))
    accumulated = dataclasses.replace(qwen3, accumulation=2, steps=1)
    with pytest.raises(EquivalenceError) as caught:
        ddpcheck.check_example(HF_TP, accumulated, 2)
    wrong = {name for _, name in ((d.kind, d.name) for d in caught.value.divergences)}
    assert any("q_norm" in name or "k_norm" in name for name in wrong), wrong
    line = known_bug_line(HF_TP, {"accumulation", "tensor-parallel"}, accumulated)
    assert "replicated_with_grad_allreduce" in (line or "")


class _OverDataParallel(HfTPTarget):
    """hf_tp without its decline of architectures over dp > 1 (:data:`FSDP_UNTRIAGED`)."""

    def supports_at(self, scenario: Scenario, world_size: int) -> str | None:
        why = super().supports_at(scenario, world_size)
        return None if why == FSDP_UNTRIAGED else why


def test_architectures_over_data_parallelism_are_declined_until_the_crash_is_triaged():
    over_dp = dataclasses.replace(LLAMA, tensor_parallel=TensorParallel(tp=2))
    assert HF_TP.supports_at(over_dp, 4) == FSDP_UNTRIAGED
    assert HF_TP.supports_at(LLAMA, 2) is None


@pytest.mark.slow  # a W=4 world importing transformers in each rank
@pytest.mark.thorough  # varies test_an_architecture_sharded_by_its_own_plan_matches_the_...
def test_a_tied_head_under_transformers_fsdp2_leaves_the_reference_and_is_named():
    tied = dataclasses.replace(
        LLAMA,
        model=dataclasses.replace(LLAMA.model, tied=True),
        tensor_parallel=TensorParallel(tp=2),
    )
    untied = dataclasses.replace(tied, model=LLAMA.model)
    target = _OverDataParallel()
    assert ddpcheck.check_example(target, untied, 4) == ()
    with pytest.raises(EquivalenceError):
        ddpcheck.check_example(target, tied, 4)
    assert "bench/hf_fsdp_tied.py" in (known_bug_line(HF_TP, {"tensor-parallel"}, tied) or "")


@settings(max_examples=30, deadline=None, database=None)
@given(st.sampled_from((2, 3, 4)).flatmap(lambda tp: st.tuples(st.just(tp), architectures(tp))))
def test_the_draws_are_shapes_each_architectures_plan_accepts(drawn):
    tp, spec = drawn
    assert shard_problem(spec, tp) is None
    assert spec.head_dim % 2 == 0  # rotary embeddings


def test_the_draws_cover_every_architecture_and_shrink_towards_llama():
    assert set(ARCHITECTURES) >= {"llama", "qwen3", "gemma3_text", "phi3", "olmo2", "granite"}
    assert next(iter(ARCHITECTURES)) == "llama"  # sampled_from shrinks towards the first


def test_a_degree_the_plan_cannot_split_the_heads_over_is_declined_with_the_reason():
    uneven = dataclasses.replace(LLAMA, model=HfCausalLM(heads=3, kv_heads=3, head_dim=2))
    reason = heads_problem(uneven, 2)
    assert reason is not None and "get_kv_heads_per_rank" in reason
    assert HF_TP.supports_at(uneven, 2) == reason
    gathered = dataclasses.replace(
        uneven, model=dataclasses.replace(uneven.model, architecture="phi3")
    )
    assert heads_problem(gathered, 2) is None  # Phi-3's plan gathers q/k/v: any heads
    assert heads_problem(LLAMA, 2) is None


def test_the_qk_norm_style_is_read_from_the_architectures_own_plan():
    assert "replicated_with_grad_allreduce" in own_styles(
        dataclasses.replace(LLAMA, model=HfCausalLM("gemma3_text"))
    )
    assert "replicated_with_grad_allreduce" not in own_styles(LLAMA)
    assert known_bug_line(HF_TP, {"accumulation", "tensor-parallel"}, LLAMA) is None
