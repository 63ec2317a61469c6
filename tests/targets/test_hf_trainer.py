"""The ``hf_trainer`` target: transformers' ``Trainer.train`` owns the loop, each rank fed its own
micro-batches, the scenario's model a causal LM whose loss takes ``num_items_in_batch``.

What it must do: train drawn scenarios (token ones among them, bfloat16 too) as the reference
does; pass the user's ``TrainingArguments`` to the Trainer (seen inside the rank); refuse, before
any world runs, a key the scenario or the harness sets, naming it (exit 2); and catch a Trainer
whose loss is normalised per micro-batch rather than per token -- the seeded bug, the older
convention, and ``average_tokens_across_devices=False`` at W > 1, each right only where the
micro-batches or the ranks hold as many tokens. Without transformers the tests that run a
Trainer skip, naming ddpcheck's install hint."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ddpcheck
from ddpcheck import cli, features, targets, zoo
from ddpcheck import strategies as dst
from ddpcheck.errors import ExitCode
from ddpcheck.scenario import Scenario
from ddpcheck.targets.hf_trainer import HARNESS_KEYS, SCENARIO_KEYS, HfTrainerTarget

#: a language model on padded tokens, accumulated: micro-batches and ranks hold different
#: numbers of tokens, which is where the normalisation goes wrong
TOKENS = Scenario(
    zoo.TinyGPT,
    data=zoo.token_data,
    loss="token_cross_entropy",
    optimizer=torch.optim.AdamW,
    global_batch=7,
    steps=2,
    accumulation=2,
)
#: per-sample losses in micro-batches of equal size on every rank: any normalisation is right
EVEN = Scenario(zoo.MLP, global_batch=8, steps=2, accumulation=2)


def _needs_transformers() -> None:
    if importlib.util.find_spec("transformers") is None:
        entry = next(e for e in targets.READY_MADE if e.name == "hf_trainer")
        pytest.skip(f"transformers is not installed ({entry.install})")


@settings(
    max_examples=4,
    database=None,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
@given(data=st.data())
def test_the_trainer_trains_drawn_scenarios_as_the_reference_does(data):
    _needs_transformers()
    scenario, world_size = data.draw(
        dst.examples(targets.HF_TRAINER, world_sizes=(2,), dtypes=("float64", "float32"))
    )
    ddpcheck.check_example(targets.HF_TRAINER, scenario, world_size)
    tokens = data.draw(
        dst.exercising(
            "tokens", world_size=2, without=features.unsupported(targets.HF_TRAINER)
        ).filter(lambda s: features.declines(targets.HF_TRAINER, s, 2) is None)
    )
    ddpcheck.check_example(targets.HF_TRAINER, tokens, 2)


def test_the_trainer_trains_a_language_model_under_bf16_and_the_loop_features():
    _needs_transformers()
    ddpcheck.check_example(targets.HF_TRAINER, TOKENS, 2)
    busy = Scenario(
        zoo.SampleBranch,
        optimizer=torch.optim.Adam,
        optimizer_kwargs={"lr": 0.01},
        lr_decay=0.5,
        global_batch=7,
        steps=2,
        accumulation=3,
        max_grad_norm=1.0,
    )
    ddpcheck.check_example(targets.HF_TRAINER, busy, 3)


def test_the_users_training_arguments_reach_the_trainer_inside_the_rank():
    _needs_transformers()
    from tests.targets.hf_trainers import BUCKET_MB, ObservingTrainer

    given = HfTrainerTarget(
        training_args={"ddp_bucket_cap_mb": BUCKET_MB}, trainer_class=ObservingTrainer
    )
    ddpcheck.check_example(given, EVEN, 2)
    # the control: without the argument, the DDP model the Trainer built has torch's 25 MB
    # its assertion fails at W=1 too (no DDP model there): the target's set-up error (issue 50)
    with pytest.raises(ddpcheck.SetupError) as info:
        ddpcheck.check_example(HfTrainerTarget(trainer_class=ObservingTrainer), EVEN, 2)
    assert "fails without data parallelism" in str(info.value), str(info.value)
    assert f"not the ddp_bucket_cap_mb={BUCKET_MB} given" in str(info.value)


def test_a_key_the_scenario_or_the_harness_sets_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(
        ddpcheck.InvalidArgument,
        match=r"'gradient_accumulation_steps' is the "
        r"scenario's \(set from "
        r"Scenario\.accumulation",
    ):
        HfTrainerTarget(training_args={"gradient_accumulation_steps": 2})
    # a user's JSON file: every key named at once; what changes nothing is accepted
    path = tmp_path / "args.json"
    path.write_text(
        json.dumps(
            {
                "output_dir": str(tmp_path),
                "learning_rate": 2e-5,
                "save_strategy": "steps",
                "report_to": "none",
                "seed": 3,
            }
        )
    )
    with pytest.raises(ddpcheck.InvalidArgument) as info:
        HfTrainerTarget(training_args=str(path))
    assert "'learning_rate' is the scenario's" in str(info.value)
    assert "'save_strategy'='steps' contradicts the run ddpcheck drives" in str(info.value)
    assert "'report_to'" not in str(info.value) and "'seed'" not in str(info.value)
    HfTrainerTarget(training_args={"save_strategy": "no", "report_to": "none", "seed": 3})
    assert not set(SCENARIO_KEYS) & set(HARNESS_KEYS)
    # from the command line: exit 2, the key named, before any example runs
    spec = "ddpcheck.targets:HfTrainerTarget(training_args={'max_grad_norm': 0.5})"
    assert cli.main(["check", spec, "--examples", "1"]) == ExitCode.SETUP
    assert "'max_grad_norm' is the scenario's" in capsys.readouterr().err


def test_a_precision_the_environment_imposes_is_refused(monkeypatch):
    # TrainingArguments takes ACCELERATE_MIXED_PRECISION as its precision unless bf16/fp16 say
    # otherwise (checked in the ranks, which inherit the environment: here, without a world)
    from ddpcheck.targets.hf_trainer import _check_environment

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    with pytest.raises(ddpcheck.InvalidArgument, match="ACCELERATE_MIXED_PRECISION='bf16'"):
        _check_environment(EVEN)
    _check_environment(Scenario(zoo.MLP, dtype="float32", autocast=torch.bfloat16))
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    _check_environment(EVEN)


def test_the_glue_speaks_to_the_older_releases_too(tmp_path):
    # transformers 4.46 passes num_items_in_batch only to a forward whose ** is named
    # loss_kwargs (later releases: any **), and 4.x defaults average_tokens_across_devices to
    # False (each rank's own token count): the target sets True unless the user gives it
    _needs_transformers()
    import inspect

    from ddpcheck.targets.hf_trainer import ScenarioCausalLM, arguments

    kind = inspect.signature(ScenarioCausalLM.forward).parameters["loss_kwargs"].kind
    assert kind is inspect.Parameter.VAR_KEYWORD
    cpu = torch.device("cpu")
    assert arguments({}, EVEN, 2, 2, cpu, str(tmp_path))["average_tokens_across_devices"]
    given = {"average_tokens_across_devices": False}
    assert not arguments(given, EVEN, 2, 2, cpu, str(tmp_path))["average_tokens_across_devices"]


def test_an_examples_precision_does_not_leak_into_the_next_through_the_environment():
    # transformers 4.45-4.57's TrainingArguments(bf16=True) writes ACCELERATE_MIXED_PRECISION=bf16
    # into os.environ; the target restores it after the example, so the next example of the
    # persistent rank (no autocast) neither trains under bfloat16 nor is refused for it
    _needs_transformers()
    from tests.targets.hf_trainers import WritesPrecisionToEnvironment

    writes = HfTrainerTarget(trainer_class=WritesPrecisionToEnvironment)
    bf16 = Scenario(
        zoo.MLP, dtype="float32", autocast=torch.bfloat16, global_batch=8, steps=2, accumulation=2
    )
    ddpcheck.check_example(writes, bf16, 2)
    ddpcheck.check_example(writes, EVEN, 2)


def test_a_name_or_value_trainingarguments_rejects_is_a_usage_error():
    _needs_transformers()
    with pytest.raises(
        ddpcheck.InvalidArgument, match="'gradient_acumulation_steps' is no TrainingArguments field"
    ):
        HfTrainerTarget(training_args={"gradient_acumulation_steps": 2})
    # a value only TrainingArguments itself can judge: from the ranks, still exit 2
    with pytest.raises(ddpcheck.InvalidArgument, match=r"hub_strategy='sometimes'.*raised"):
        ddpcheck.check_example(
            HfTrainerTarget(training_args={"hub_strategy": "sometimes"}), EVEN, 2
        )


def test_a_loss_normalised_per_micro_batch_is_caught_where_token_counts_differ():
    _needs_transformers()
    from tests.targets.hf_trainers import PerMicroBatchLoss

    seeded = HfTrainerTarget(trainer_class=PerMicroBatchLoss)
    ddpcheck.check_example(seeded, EVEN, 2)  # equal micro-batches: right
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        ddpcheck.check_example(seeded, TOKENS, 2)
    assert info.value.kinds[0] == "reference differs (gradient)", str(info.value)
    # the older convention (no **kwargs in the model's forward): the same, documented
    with pytest.raises(ddpcheck.EquivalenceError):
        ddpcheck.check_example(HfTrainerTarget(loss_kwargs=False), TOKENS, 2)


def test_tokens_averaged_per_rank_differ_only_across_ranks():
    _needs_transformers()
    per_rank = HfTrainerTarget(training_args={"average_tokens_across_devices": False})
    ddpcheck.check_example(per_rank, TOKENS, 1)  # one rank: its count is the global one
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        ddpcheck.check_example(per_rank, TOKENS, 2)
    assert info.value.kinds[0] == "reference differs (gradient)", str(info.value)


def test_the_loss_the_trainer_logs_is_checked_against_the_reference():
    # log_history's "loss" of every step (on_log): right on the Trainer as it is (the tests
    # above pass through it), W times too small on a Trainer that only mislogs it
    _needs_transformers()
    from tests.targets.hf_trainers import LogsLossOverW

    seeded = HfTrainerTarget(trainer_class=LogsLossOverW)
    ddpcheck.check_example(seeded, TOKENS, 1)  # one rank: nothing divided
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        ddpcheck.check_example(seeded, TOKENS, 2)
    assert set(info.value.kinds) == {"loss differs"}, str(info.value)
    assert "the loss rank 0 reports" in str(info.value)
