"""Language-model scenarios: the token objective, its data and model, token-weighted batch plans,
the precision policies, and the vocabulary and strategies that draw them (no worlds: everything
here runs in this process)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ddpcheck
from ddpcheck import features, targets, zoo
from ddpcheck import strategies as dst
from ddpcheck._language import objective
from ddpcheck._oracle.reference import reference_run
from ddpcheck._oracle.sample_weights import check_sample_weights
from ddpcheck._runs.replay import from_repr
from ddpcheck.batches import GlobalBatch, TokenMean, contiguous, global_indices
from ddpcheck.errors import InvalidArgument
from ddpcheck.scenario import Scenario, global_batch

TOKENS = Scenario(
    zoo.TinyGPT,
    data=zoo.token_data,
    loss="token_cross_entropy",
    global_batch=7,
    accumulation=2,
    steps=2,
)


# ---------------------------------------------------------------------------------------------
# The data and the model


def test_token_data_pads_sequences_of_different_lengths_with_the_ignore_index():
    x, y = zoo.token_data(3, 9, torch.float64)
    assert x.shape == y.shape == (9, zoo.BLOCK) and x.dtype == y.dtype == torch.int64
    real = y != zoo.IGNORE_INDEX
    lengths = real.sum(dim=1)
    assert bool((lengths >= 1).all()) and len(set(lengths.tolist())) > 1
    # right padding: every real token comes before the first padded position
    assert torch.equal(real, torch.arange(zoo.BLOCK)[None, :] < lengths[:, None])
    assert torch.equal(x[:, 1:][real[:, 1:]], y[:, :-1][real[:, 1:]])  # y is x shifted by one
    assert torch.equal(zoo.token_data(3, 9, torch.float32)[1], y)  # deterministic, any dtype


def test_tiny_gpt_is_causal_per_sample_and_ties_its_head():
    torch.manual_seed(0)
    model = zoo.TinyGPT().double()
    x, _ = zoo.token_data(0, 6, torch.float64)
    out = model(x)
    assert out.shape == (6, zoo.BLOCK, zoo.VOCAB)
    parts = torch.cat([model(part) for part in torch.tensor_split(x, 3)])
    torch.testing.assert_close(parts, out, rtol=1e-12, atol=1e-12)  # per sample
    changed = x.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % zoo.VOCAB  # later tokens never reach earlier logits
    torch.testing.assert_close(model(changed)[:, :5], out[:, :5], rtol=1e-12, atol=1e-12)
    assert model.head.weight is model.tok.weight
    assert zoo.GPTConfig(tied=False)().head.weight is not zoo.GPTConfig(tied=False)().tok.weight
    assert len(zoo.GPTConfig(layers=2)().blocks) == 2
    with pytest.raises(ValueError, match="multiple of heads"):
        zoo.GPTConfig(width=6, heads=4)


# ---------------------------------------------------------------------------------------------
# The objective: one place, every party


def test_the_token_objective_is_the_sum_over_non_padding_tokens():
    _, y = global_batch(TOKENS, 0)
    logits = torch.randn(*y.shape, zoo.VOCAB, dtype=torch.float64)
    real = y != zoo.IGNORE_INDEX
    expected = torch.nn.functional.cross_entropy(logits[real], y[real], reduction="sum")
    torch.testing.assert_close(objective.summed(TOKENS, logits, y), expected)
    assert objective.count(TOKENS, y) == int(real.sum())
    assert objective.tokens(TOKENS, y) == tuple(real.sum(dim=1).tolist())
    # an empty shard (B < W) back-propagates nothing, not NaN
    assert float(objective.summed(TOKENS, logits[:0], y[:0])) == 0.0
    # the squared error keeps its bits: the same expression as ever
    plain = Scenario(zoo.MLP)
    out, target = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    assert torch.equal(objective.summed(plain, out, target), ((out - target) ** 2).sum(1).sum())
    assert objective.terms(plain, target) is None and objective.count(plain, target) == 4


class PerTokenScore(torch.nn.Module):
    """One number per token, not logits: the token loss cannot take it."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x.to(self.w.dtype) * self.w  # (B, L)


def test_the_probe_names_a_model_or_data_that_does_not_fit_the_token_loss():
    from ddpcheck._runs.example import prepare_reference

    with pytest.raises(ddpcheck.ScenarioError, match=r"needs logits of shape \(8, 8\) \+"):
        prepare_reference(Scenario(PerTokenScore, data=zoo.token_data, loss="token_cross_entropy"))
    with pytest.raises(ddpcheck.ScenarioError, match="needs integer target tokens"):
        prepare_reference(Scenario(zoo.MLP, loss="token_cross_entropy"))
    with pytest.raises(ddpcheck.ScenarioError, match="squared error of each sample"):
        prepare_reference(Scenario(zoo.TinyGPT, data=zoo.token_data))  # the loss forgotten


def test_scenarios_refuse_unknown_losses_and_policies_outside_float32():
    with pytest.raises(InvalidArgument, match="loss='tokens' must be one of"):
        Scenario(loss="tokens")
    with pytest.raises(InvalidArgument, match="needs dtype='float32'"):
        Scenario(autocast=torch.bfloat16)  # autocast leaves float64 alone
    with pytest.raises(InvalidArgument, match=r"must be None, torch\.bfloat16 or torch\.float16"):
        Scenario(dtype="float32", param_dtype=torch.float32)
    scenario = Scenario(dtype="float32", autocast=torch.bfloat16)
    assert "autocast=torch.bfloat16" in repr(scenario) and from_repr(repr(scenario)) == scenario


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda: Scenario(acumulation=2),
            "Scenario has no field 'acumulation' (did you mean 'accumulation'?)",
        ),
        (
            lambda: ddpcheck.models.Layer(knd="conv1d"),
            "Layer has no field 'knd' (did you mean 'kind'?)",
        ),
        (lambda: zoo.GPTConfig(head=2), "GPTConfig has no field 'head' (did you mean 'heads'?)"),
        (lambda: TokenMean(nothing=1), "TokenMean has no field 'nothing'; its fields: "),
    ],
)
def test_a_mistyped_field_names_the_closest_one(build, message):
    with pytest.raises(InvalidArgument) as info:  # the scenario language's error, exit 2 ...
        build()
    assert isinstance(info.value, TypeError)  # ... and still Python's for a wrong keyword
    assert message in str(info.value)


def test_the_reference_weighs_tokens_and_runs_the_precision_policy():
    ref = reference_run(TOKENS)
    assert ref.steps[0].tokens == objective.tokens(TOKENS, global_batch(TOKENS, 0)[1])
    assert ref.compute_dtype == torch.float64 and ref.gradient_dtype == torch.float64
    for field in ("autocast", "param_dtype"):
        policy = Scenario(
            zoo.TinyGPT,
            data=zoo.token_data,
            loss="token_cross_entropy",
            dtype="float32",
            steps=1,
            **{field: torch.bfloat16},
        )
        ref = reference_run(policy)
        assert ref.compute_dtype == torch.bfloat16 and ref.gradient_dtype == torch.float32
        assert all(g.dtype == torch.float32 for g in ref.steps[0].grads.values())  # masters


def test_the_param_dtype_emulation_computes_in_it_and_keeps_float32_masters():
    torch.manual_seed(0)
    scenario = Scenario(
        zoo.TinyGPT,
        data=zoo.token_data,
        loss="token_cross_entropy",
        dtype="float32",
        param_dtype=torch.bfloat16,
    )
    model = zoo.TinyGPT()
    x, y = global_batch(scenario, 0)
    out = objective.forward(scenario, model, x, emulate=True)
    assert out.dtype == torch.bfloat16
    assert objective.forward(scenario, model, x).dtype == torch.float32  # a rank: the target's
    objective.micro_batch_loss(scenario, model, x, y, emulate=True).backward()
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# Token-weighted batch plans


def _plans(hook, scenario, world_size, step=0):
    batch = global_indices(scenario, step, 0, world_size)
    return batch, [hook(GlobalBatch(**{**batch.__dict__, "rank": r})) for r in range(world_size)]


def test_the_default_plan_and_the_global_token_mean_weigh_every_token_alike():
    for world_size in (1, 2, 3, 4):
        for hook in (contiguous, TokenMean("global")):
            batch, plans = _plans(hook, TOKENS, world_size)
            assert batch.tokens is not None and batch.total == sum(batch.tokens)
            assert plans[0].scales[0] == world_size / batch.total
            assert check_sample_weights(0, world_size, plans, 7, "mean", batch.tokens) == []


def test_token_means_per_micro_batch_or_per_rank_misweigh_tokens_and_say_where():
    batch, plans = _plans(TokenMean("micro-batch"), TOKENS, 2)
    rows = check_sample_weights(0, 2, plans, 7, "mean", batch.tokens)
    assert rows and {r.kind for r in rows} == {"token misweighted"}
    first = rows[0]
    assert first.rank is not None and first.name.startswith("sample ")
    n = batch.tokens[int(first.name.split()[1])]
    assert first.name.endswith(f"({n} token{'s' if n > 1 else ''})")
    assert f"rank {first.rank} scales micro-batch" in first.detail
    assert f"1/T = 1/{batch.total}" in first.detail
    batch, plans = _plans(TokenMean("rank"), TOKENS, 2)
    assert {r.kind for r in check_sample_weights(0, 2, plans, 7, "mean", batch.tokens)} == {
        "token misweighted"
    }
    # per-sample losses: the same hooks are the per-sample means (one term per sample)
    even = Scenario(zoo.MLP, global_batch=8, accumulation=2)
    for over in ("micro-batch", "rank", "global"):
        batch, plans = _plans(TokenMean(over), even, 2)
        assert check_sample_weights(0, 2, plans, 8, "mean") == []
    # a dropped sample's tokens are named as tokens
    batch, plans = _plans(contiguous, TOKENS, 2)
    plans[1] = plans[1].__class__(plans[1].micro_batches[:1], plans[1].scales[:1])
    kinds = {r.kind for r in check_sample_weights(0, 2, plans, 7, "mean", batch.tokens)}
    assert kinds == {"token dropped"}
    with pytest.raises(InvalidArgument, match="over='token'"):
        TokenMean("token")


def test_a_sum_of_tokens_needs_no_count():
    summed = Scenario(
        zoo.TinyGPT,
        data=zoo.token_data,
        loss="token_cross_entropy",
        global_batch=5,
        reduction="sum",
        accumulation=2,
    )
    for over in ("micro-batch", "rank", "global"):
        batch, plans = _plans(TokenMean(over), summed, 3)
        assert check_sample_weights(0, 3, plans, 5, "sum", batch.tokens) == []


# ---------------------------------------------------------------------------------------------
# The vocabulary and the strategies


def test_features_name_tokens_and_the_precision_policies():
    assert {"tokens", "broadcast"} <= features.of(TOKENS, 2)
    policy = Scenario(dtype="float32", autocast=torch.float16)
    assert "autocast" in features.of(policy) and "param-dtype" not in features.of(policy)
    bf16 = Scenario(dtype="float32", param_dtype=torch.bfloat16)
    assert "param-dtype" in features.of(bf16)
    # param-dtype is opt-in: the target applies the policy; autocast is the loop's, for everyone
    assert features.declines(targets.TORCH_FSDP, bf16, 2) is None
    for target in (targets.PARALLEL, targets.TORCH_DDP, ddpcheck.Target()):
        assert "applies_param_dtype is not set" in features.declines(target, bf16, 2)
        assert features.declines(target, policy, 2) is None
        assert "param-dtype" not in features.supported_by(target)
    assert "param-dtype" in features.supported_by(targets.TORCH_FSDP)


@settings(
    max_examples=12,
    database=None,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
@given(data=st.data(), world_size=st.integers(1, 4))
def test_exercising_draws_token_and_precision_scenarios(data, world_size):
    for feature in ("tokens", "autocast", "param-dtype"):
        scenario = data.draw(dst.exercising(feature, world_size=world_size))
        assert feature in features.of(scenario, world_size)
        assert from_repr(repr(scenario)) == scenario
    policy = data.draw(dst.exercising("autocast", world_size=world_size))
    if policy.optimizer is not torch.optim.SGD:
        assert policy.optimizer_kwargs["eps"] == dst.LOW_PRECISION_EPS


def test_the_random_scenarios_draw_tokens_and_opt_in_policies_only_when_asked():
    found = []

    @settings(
        max_examples=150,
        database=None,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(dst.scenarios(dtypes=("float32",)))
    def draw(scenario):
        found.append(features.of(scenario))

    draw()
    share = sum("tokens" in f for f in found) / len(found)
    assert 0.05 < share < 0.5, share
    assert any("autocast" in f for f in found)
    assert not any("param-dtype" in f for f in found)  # opt-in
    opted: list = []
    settings(
        max_examples=150,
        database=None,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )(
        given(dst.scenarios(dtypes=("float32",), opt_in=("param-dtype",)))(
            lambda scenario: opted.append(features.of(scenario))
        )
    )()
    assert sum("param-dtype" in f for f in opted) / len(opted) >= 0.03  # a target that opts in
    with pytest.raises(InvalidArgument, match="only the opt-in features"):
        dst.scenarios(opt_in=("tokens",))
    with pytest.raises(InvalidArgument, match="needs dtypes=\\('float32',\\)"):
        dst.exercising("autocast", world_size=2, dtypes=("float64",))
    assert not math.isnan(share)


# ---------------------------------------------------------------------------------------------
# The built-in targets on token examples (worlds)


@pytest.mark.parametrize(
    "target, world_size, precision",
    [
        (targets.PARALLEL, 3, {}),
        (targets.TORCH_DDP, 2, {"autocast": torch.bfloat16}),
        (targets.TORCH_ZERO, 2, {}),
        (targets.PARALLEL_DDP, 2, {"autocast": torch.float16}),
        (targets.LOCAL, 1, {}),
    ],
    ids=["parallel", "torch_ddp-bf16", "torch_zero", "parallel_ddp-fp16", "local"],
)
def test_correct_targets_pass_token_examples(target, world_size, precision):
    scenario = (
        TOKENS
        if not precision
        else Scenario(
            zoo.TinyGPT,
            data=zoo.token_data,
            loss="token_cross_entropy",
            global_batch=7,
            accumulation=2,
            steps=2,
            dtype="float32",
            **precision,
        )
    )
    ddpcheck.check_example(target, scenario, world_size)  # raises EquivalenceError on a bug


def test_a_language_model_counterexample_has_its_one_line_summary():
    """The mutants' table names a shrunk token scenario by its blocks and policy (a GPTConfig's
    ``layers`` is a count, not a ModelSpec's tuple of layers)."""
    from ddpcheck._language.messages import scenario_line

    scenario = Scenario(
        zoo.GPTConfig(layers=2),
        data=zoo.token_data,
        loss="token_cross_entropy",
        dtype="float32",
        autocast=torch.bfloat16,
        global_batch=3,
        steps=1,
    )
    assert scenario_line(scenario) == (
        "gpt(2 blocks, tied) SGD B=3 steps=1 float32 autocast=bfloat16"
    )
    untied = Scenario(
        zoo.GPTConfig(layers=1, tied=False),
        data=zoo.token_data,
        loss="token_cross_entropy",
        global_batch=3,
        steps=1,
    )
    assert scenario_line(untied) == "gpt(1 block) SGD B=3 steps=1"


@settings(
    max_examples=20,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
@given(dst.exercising("tokens", world_size=4), st.integers(1, 4))
def test_a_language_models_usage_is_read_without_a_backward_and_agrees(scenario, world_size):
    """``features`` says a TinyGPT on its token data leaves no parameter without a gradient on
    any rank, with no backward; the backward per rank shard says the same."""
    from ddpcheck._language.features import _usage
    from ddpcheck.scenario import build_model

    assert not features.of(scenario, world_size) & {"unused-on-some-ranks", "unused-everywhere"}
    assert _usage(scenario, build_model(scenario, scenario.seed), world_size) == set()
