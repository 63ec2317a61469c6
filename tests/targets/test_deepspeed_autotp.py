"""``deepspeed_autotp``: what the target takes and declines (no DeepSpeed needed), the scenarios
it draws for itself (transformers causal LMs, their own plan, tp > 1), and -- where DeepSpeed is
installed -- AutoTP trained as the one-process reference, a seeded bug caught."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ddpcheck
from ddpcheck import EquivalenceError
from ddpcheck._base.errors import InvalidArgument
from ddpcheck._language.tensor_parallel import TensorParallel
from ddpcheck._language.zoo import token_data

pytest.importorskip("transformers")

from ddpcheck.targets.deepspeed_autotp import BATTERY, DeepSpeedAutoTPTarget
from ddpcheck.targets.hf_models import HfCausalLM

LLAMA = BATTERY[0][1]


def test_a_config_it_cannot_take_is_refused_naming_the_key():
    with pytest.raises(InvalidArgument, match="autotp_size"):
        DeepSpeedAutoTPTarget(config={"tensor_parallel": {"autotp_size": 1}})
    with pytest.raises(InvalidArgument, match="handed"):
        DeepSpeedAutoTPTarget(handed="model")


def test_what_autotp_cannot_serve_is_declined_with_the_reason():
    target = DeepSpeedAutoTPTarget()
    assert target.supports(LLAMA) is None and target.supports_at(LLAMA, 4) is None
    plain = dataclasses.replace(LLAMA, model=ddpcheck.zoo.TinyGPT)
    assert "HfCausalLM" in (target.supports(plain) or "")
    phi3 = dataclasses.replace(LLAMA, model=HfCausalLM("phi3", heads=4, kv_heads=2))
    assert "rowwise_split_input" in (target.supports(phi3) or "")
    sized = DeepSpeedAutoTPTarget(config={"tensor_parallel": {"autotp_size": 4}})
    assert "autotp_size=4" in (sized.supports_at(LLAMA, 4) or "")
    alone = dataclasses.replace(LLAMA, tensor_parallel=TensorParallel((), 1))
    assert "tp=1" in (target.supports_at(alone, 2) or "")


@settings(max_examples=25, deadline=None, database=None)
@given(st.data())
def test_its_own_draws_are_causal_lms_on_meshes_it_takes(data):
    target = DeepSpeedAutoTPTarget()
    world_size = data.draw(st.sampled_from((2, 4)))
    scenario = data.draw(target.drawn_scenarios(world_size, ("float32",), frozenset(), None))
    assert isinstance(scenario.model, HfCausalLM) and scenario.data is token_data
    assert scenario.tensor_parallel is not None and scenario.tensor_parallel.plan == ()
    assert target.supports(scenario) is None


@dataclasses.dataclass(frozen=True)
class _Unbroadcast(DeepSpeedAutoTPTarget):
    """The seeded bug: each rank's own initial weights, never broadcast from rank 0."""

    def parallelize(self, module, mesh):
        import torch.distributed as dist

        object.__setattr__(self, "_tp_ranks", dist.get_process_group_ranks(mesh["tp"].get_group()))
        object.__setattr__(self, "_module", module)
        return module  # BUG: no broadcast_from(module, 0)


@pytest.mark.slow  # a W=2 world importing DeepSpeed (skipped where it is not installed)
def test_autotp_trains_as_one_process_and_a_seeded_bug_is_caught():
    pytest.importorskip("deepspeed")
    ddpcheck.check_example(DeepSpeedAutoTPTarget(), LLAMA, 2)  # raises where they differ
    with pytest.raises(EquivalenceError):
        ddpcheck.check_example(_Unbroadcast(), LLAMA, 2)


def test_autotps_parser_leaving_qk_norms_unreduced_is_named_where_it_can_explain_a_verdict():
    from ddpcheck.targets.known_bugs import known_bug_line

    pytest.importorskip("deepspeed")
    qwen3 = dataclasses.replace(LLAMA, model=HfCausalLM("qwen3", heads=4, kv_heads=2))
    wrapper = DeepSpeedAutoTPTarget(handed="wrapper")
    line = known_bug_line(wrapper, {"tensor-parallel"}, qwen3)
    assert line is not None and "--architecture qwen3 --wrapped" in line
    assert known_bug_line(DeepSpeedAutoTPTarget(), {"tensor-parallel"}, qwen3) is None
    assert known_bug_line(wrapper, {"tensor-parallel"}, LLAMA) is None
