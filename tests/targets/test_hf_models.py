"""The transformers architectures as model factories: each builds from its own config class,
ships a tensor-parallel plan, is a deterministic function of the seed, and computes each sample
on its own (the battery's invariant, which a padded batch would break were padding attended)."""

import pickle

import pytest
import torch

from ddpcheck._base.errors import InvalidArgument
from ddpcheck._language.scenario import Scenario, build_model
from ddpcheck._language.zoo import VOCAB, token_data

pytest.importorskip("transformers")

from ddpcheck.targets.hf_models import ARCHITECTURES, HfCausalLM


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_each_architecture_builds_with_its_plan_deterministically_per_sample(architecture):
    factory = HfCausalLM(architecture, kv_heads=1)
    scenario = Scenario(model=factory, data=token_data, loss="token_cross_entropy")
    model, again = build_model(scenario, 3), build_model(scenario, 3)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    assert model.lm._tp_plan, f"{architecture} ships no tensor-parallel plan"
    x, _ = token_data(0, 3, torch.float64)
    logits = model(x)
    assert logits.shape == (3, x.shape[1], VOCAB)
    assert torch.equal(logits[1:2], model(x[1:2]))  # each sample on its own
    assert pickle.loads(pickle.dumps(factory)) == factory


def test_a_factory_that_cannot_be_built_names_the_field():
    with pytest.raises(InvalidArgument, match="architecture must be one of"):
        HfCausalLM("gpt2")
    with pytest.raises(InvalidArgument, match="heads a multiple of kv_heads"):
        HfCausalLM(heads=3, kv_heads=2)
