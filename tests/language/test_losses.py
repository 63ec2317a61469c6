"""The language-model losses beside token cross-entropy (``objective.TOKEN_LOSSES``): one term
per non-padding token each, what every party computes, what the strategies draw, and which
combinations with ``loss_parallel()`` are never drawn and declined (in one process: no world).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings

import ddpcheck
from ddpcheck import zoo
from ddpcheck._language import objective
from ddpcheck._language.plans import tensor_parallel_scenarios
from ddpcheck._language.sharded_models import (
    LOSS_STYLES,
    ShardedBlock,
    ShardedSpec,
    plan_choices,
    sequence_tokens,
)
from ddpcheck.targets.tensor_parallel import no_loss_parallel


def _logits_and_tokens():
    g = torch.Generator().manual_seed(3)
    out = torch.randn(3, 4, 7, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 7, (3, 4), generator=g)
    y[0, 2:] = objective.IGNORE_INDEX  # padding: no term
    y[2, 1:] = objective.IGNORE_INDEX
    return out, y


def _by_hand(name, out, y):
    """Each loss written out plainly, per token, padding dropped."""
    real = y != objective.IGNORE_INDEX
    logits, tokens = out[real], y[real]
    logp = logits.log_softmax(-1)
    nll = -logp.gather(-1, tokens[:, None]).squeeze(-1)
    p = logp.exp()
    positions = torch.arange(y.shape[1]).expand_as(y)[real]
    if name == "token_cross_entropy":
        return nll
    if name == "label_smoothing":
        eps = objective.LABEL_SMOOTHING
        return (1 - eps) * nll - eps * logp.mean(-1)
    if name == "entropy_bonus":
        return nll - objective.ENTROPY_WEIGHT * -(p * logp).sum(-1)
    if name == "token_kl":
        g = torch.Generator().manual_seed(48_005 + 7)
        table = torch.randn(7, 7, generator=g, dtype=torch.float64).log_softmax(-1)
        reference = table[(tokens + positions) % 7]
        return nll + objective.KL_WEIGHT * (p * (logp - reference)).sum(-1)
    advantage = 0.5 + torch.cos(1.3 * tokens.double() + 0.7 * positions.double())
    return advantage * nll


@pytest.mark.parametrize("name", objective.TOKEN_LOSSES)
def test_each_token_loss_is_one_term_per_non_padding_token_and_its_gradient_is_right(name):
    out, y = _logits_and_tokens()
    scenario = ddpcheck.Scenario(zoo.TinyGPT, data=zoo.token_data, loss=name)
    assert objective.is_token_loss(scenario)
    assert objective.count(scenario, y) == int((y != objective.IGNORE_INDEX).sum()) == 7
    summed = objective.summed(scenario, out, y)
    expected = _by_hand(name, out, y)
    assert torch.allclose(summed, expected.sum(), rtol=1e-12, atol=1e-12)
    per_sample = objective.sample_terms(scenario, out, y)
    assert per_sample[:, 1].tolist() == [2.0, 4.0, 1.0]
    assert torch.allclose(per_sample[:, 0].sum(), summed, rtol=1e-12)
    (grad,) = torch.autograd.grad(summed, out)
    (want,) = torch.autograd.grad(expected.sum(), out)
    assert torch.allclose(grad, want, rtol=1e-10, atol=1e-12)
    assert grad[0, 2:].abs().max() == 0  # padding moves nothing
    assert f"loss={name!r}" in repr(scenario)  # the replay line names it


def test_the_reference_distribution_and_advantages_depend_on_the_data_alone():
    tokens, positions = torch.tensor([0, 3, 4]), torch.tensor([0, 1, 2])
    first = objective.reference_log_probs(tokens, positions, 5, torch.float64)
    again = objective.reference_log_probs(tokens.clone(), positions.clone(), 5, torch.float64)
    assert torch.equal(first, again)
    assert torch.allclose(first.exp().sum(-1), torch.ones(3, dtype=torch.float64))
    assert not torch.equal(first[0], first[1])
    a = objective.advantages(tokens, positions, torch.float64)
    assert torch.equal(a, objective.advantages(tokens, positions, torch.float64))
    assert a.min() >= -0.5 and a.max() <= 1.5


def test_label_smoothing_is_torchs():
    out, y = _logits_and_tokens()
    scenario = ddpcheck.Scenario(zoo.TinyGPT, data=zoo.token_data, loss="label_smoothing")
    torchs = F.cross_entropy(
        out.reshape(-1, 7),
        y.reshape(-1),
        ignore_index=objective.IGNORE_INDEX,
        label_smoothing=objective.LABEL_SMOOTHING,
        reduction="sum",
    )
    assert torch.allclose(objective.summed(scenario, out, y), torchs, rtol=1e-12)


_TOKENS_HEAD = ShardedSpec(blocks=(ShardedBlock("mlp", 4),), width=4, tokens=True)


def test_loss_heads_only_for_the_losses_loss_parallel_computes():
    def heads(groups):
        return {s for group in groups for fragment in group for _, s in fragment} & LOSS_STYLES

    assert heads(plan_choices(_TOKENS_HEAD, 2)) == {"colwise-loss"}
    assert heads(plan_choices(_TOKENS_HEAD, 2, loss_head=False)) == set()
    assert objective.LOSS_PARALLEL == ("token_cross_entropy", "policy_gradient")


@pytest.mark.parametrize("name", objective.TOKEN_LOSSES)
def test_torch_tp_declines_a_loss_parallel_head_with_a_loss_torch_cannot_compute_there(name):
    plan = (("blocks.0.up", "colwise"), ("blocks.0.down", "rowwise"), ("head", "colwise-loss"))
    scenario = ddpcheck.Scenario(
        _TOKENS_HEAD,
        data=sequence_tokens,
        loss=name,
        tensor_parallel=ddpcheck.TensorParallel(plan),
    )
    why = no_loss_parallel(scenario)
    if name in objective.LOSS_PARALLEL:
        assert why is None
    elif name == "label_smoothing":
        assert why is not None and '"Currently not supported"' in why
    else:
        assert why is not None and "bench/loss_parallel_entropy.py" in why
    gathered = ddpcheck.Scenario(
        _TOKENS_HEAD,
        data=sequence_tokens,
        loss=name,
        tensor_parallel=ddpcheck.TensorParallel((("head", "colwise-replicate"),)),
    )
    assert no_loss_parallel(gathered) is None  # gathered logits: any loss


@settings(max_examples=25, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(tensor_parallel_scenarios(world_size=2, dtypes=("float32",)))
def test_mesh_scenarios_draw_every_loss_and_no_head_loss_parallel_cannot_compute(scenario):
    plan = scenario.tensor_parallel.plan
    if scenario.loss not in objective.LOSS_PARALLEL:
        assert not any(style in LOSS_STYLES for _, style in plan), scenario
    assert no_loss_parallel(scenario) is None
