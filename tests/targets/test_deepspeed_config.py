"""``DeepSpeedTarget(config=...)``: the user's ds_config, verbatim, reaches DeepSpeed's engine.

What it must do: pass every key the rule leaves to the user to ``deepspeed.initialize`` (read back
inside the rank from the engine: its stage, dtypes, bucket size, the optimizer it chose); run
DeepSpeed's bf16 mode as the scenario's ``param_dtype`` policy where the config keeps reductions
and accumulation in float32, and decline it, naming the keys, where it does not; refuse a key the
scenario or the harness sets, or a stage contradicting the target's, when the target is built --
before any process starts -- naming it (exit 2); read the config from a JSON file; and print a
replay line that rebuilds it. The module skips without DeepSpeed."""

from __future__ import annotations

import json

import pytest
import torch

import ddpcheck
from ddpcheck import cli, targets, zoo
from ddpcheck._runs.replay import evaluate, target_spec
from ddpcheck.errors import ExitCode
from ddpcheck.scenario import Scenario
from ddpcheck.targets.deepspeed import HARNESS_KEYS, SCENARIO_KEYS, DeepSpeedTarget
from tests.targets.config_readers import ReadingDeepSpeed, read_back

pytest.importorskip(
    "deepspeed", reason="DeepSpeed is not installed (pip install 'deepspeed>=0.19.0')"
)

#: bf16 with float32 reductions and accumulation: DeepSpeed's mode that is the param_dtype policy
BF16 = {
    "zero_optimization": {
        "stage": 2,
        "reduce_bucket_size": 4096,
        "allgather_bucket_size": 4096,
        "contiguous_gradients": False,
    },
    "communication_data_type": "fp32",
    "data_types": {"grad_accum_dtype": "fp32"},
}
POLICY = Scenario(
    zoo.MLP,
    dtype="float32",
    optimizer=torch.optim.AdamW,
    global_batch=8,
    steps=2,
    accumulation=2,
    param_dtype=torch.bfloat16,
)
PLAIN = Scenario(
    zoo.MLP,
    dtype="float32",
    optimizer=torch.optim.Adam,
    global_batch=7,
    steps=2,
    accumulation=3,
    lr_decay=0.5,
)


def test_the_config_reaches_the_engine_inside_the_rank(tmp_path):
    ddpcheck.check_example(ReadingDeepSpeed(config=BF16, report=str(tmp_path)), POLICY, 2)
    for seen in read_back(str(tmp_path)):
        assert seen == {
            "stage": 2,
            "bf16": True,
            "param_dtype": "torch.bfloat16",
            "model_dtype": "torch.bfloat16",
            "grad_accum_dtype": "torch.float32",
            "communication_data_type": "torch.float32",
            "reduce_bucket_size": 4096,
            "gradient_clipping": 0.0,
            "optimizer": "DeepSpeedZeroOptimizer",
        }
    # ZeRO-1 through the 'deepspeed' target, its stage from the config: DeepSpeed then wraps
    # bf16 with float32 accumulation in its BF16_Optimizer
    stage1 = {**BF16, "zero_optimization": {"stage": 1}}
    folder = tmp_path / "stage1"
    folder.mkdir()
    ddpcheck.check_example(ReadingDeepSpeed(config=stage1, report=str(folder)), POLICY, 2)
    assert {(s["stage"], s["optimizer"]) for s in read_back(str(folder))} == {(1, "BF16_Optimizer")}
    # a float32 scenario under the same config: bf16 stays off, the float32 keys change nothing
    folder = tmp_path / "plain"
    folder.mkdir()
    ddpcheck.check_example(ReadingDeepSpeed(config=BF16, report=str(folder)), PLAIN, 2)
    assert {(s["bf16"], s["model_dtype"]) for s in read_back(str(folder))} == {
        (False, "torch.float32")
    }


def test_a_frozen_parameter_under_bf16_is_its_bfloat16_copy_widened():
    # no optimizer holds it, so it has no float32 master: found by a random example (the harness
    # read None for its parameter); the shrunk counterexample, now equivalent
    frozen = Scenario(
        ddpcheck.models.ModelSpec(layers=(ddpcheck.models.Layer(frozen=True),), width=2),
        data=ddpcheck.models.SpecData(width=2),
        global_batch=1,
        steps=1,
        dtype="float32",
        param_dtype=torch.bfloat16,
    )
    ddpcheck.check_example(DeepSpeedTarget(config=BF16), frozen, 2)


def test_a_check_with_the_config_passes_on_random_examples(tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(BF16))
    spec = f"ddpcheck.targets.deepspeed:DeepSpeedTarget(config={str(path)!r})"
    code = cli.main(
        [
            "check",
            spec,
            "--examples",
            "6",
            "--world-sizes",
            "2",
            "--dtypes",
            "float32",
            "--seed",
            "3",
        ]
    )
    assert code == ExitCode.OK, capsys.readouterr().err


def test_round_robin_gradients_is_read_by_the_partitions_real_layout():
    # DeepSpeed's safe_get_full_grad / _fp32_param / _optimizer_state read the wrong pieces under
    # the option (bench/deepspeed_round_robin_gradients.py): the target reads the partitions
    # itself there -- gradients, Adam's state, and (bf16) the float32 masters
    rr = {"round_robin_gradients": True}
    ddpcheck.check_example(DeepSpeedTarget(stage=1, config={"zero_optimization": rr}), PLAIN, 2)
    ddpcheck.check_example(DeepSpeedTarget(stage=2, config={"zero_optimization": rr}), PLAIN, 3)
    bf16 = {**BF16, "zero_optimization": {**BF16["zero_optimization"], **rr}}
    ddpcheck.check_example(DeepSpeedTarget(config=bf16), POLICY, 2)


def test_bf16_without_float32_reductions_is_declined_naming_the_keys():
    half = {"data_types": {"grad_accum_dtype": "fp32"}}
    for config in (None, half):
        target = DeepSpeedTarget(config=config)
        assert not target.applies_param_dtype
        reason = target.supports(POLICY)
        assert reason is not None and "'communication_data_type'" in reason
    assert "'data_types.grad_accum_dtype'" in (DeepSpeedTarget().supports(POLICY) or "")
    assert "'data_types.grad_accum_dtype'" not in (
        DeepSpeedTarget(config=half).supports(POLICY) or ""
    )
    with pytest.raises(ddpcheck.NothingChecked, match="param-dtype"):
        ddpcheck.check_example(DeepSpeedTarget(config=half), POLICY, 2)
    fp16 = Scenario(zoo.MLP, dtype="float32", param_dtype=torch.float16)
    assert "loss" in (DeepSpeedTarget(config=BF16).supports(fp16) or "")


def test_a_key_the_scenario_or_the_harness_sets_is_refused_when_built(tmp_path, capsys):
    given = {
        "train_batch_size": 16,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW"},
        "bf16": {"enabled": True},
        "communication_data_type": "bf16",
        "zero_optimization": {"stage": 2, "overlap_comm": True},
    }
    with pytest.raises(ddpcheck.InvalidArgument) as info:
        DeepSpeedTarget(config=given)
    message = str(info.value)
    for key in (
        "'train_batch_size' is the scenario's",
        "'gradient_accumulation_steps'",
        "'gradient_clipping'",
        "'optimizer'",
        "'bf16.enabled' is the scenario's",
        "'communication_data_type'='bf16' contradicts",
    ):
        assert key in message, message
    assert "overlap_comm" not in message  # the user's, passed as given
    assert not set(SCENARIO_KEYS) & set(HARNESS_KEYS)
    # the stage: fixed by deepspeed_zero1/2, the config's for 'deepspeed'
    with pytest.raises(
        ddpcheck.InvalidArgument,
        match=r"stage=1\).*'zero_optimization.stage'"
        r"=2 contradicts",
    ):
        DeepSpeedTarget(stage=1, config={"zero_optimization": {"stage": 2}})
    with pytest.raises(ddpcheck.InvalidArgument, match=r"'zero_optimization\.stage'=3"):
        DeepSpeedTarget(config={"zero_optimization": {"stage": 3}})
    assert DeepSpeedTarget(config={"zero_optimization": {"stage": 1}}).zero_stage == 1
    assert DeepSpeedTarget().zero_stage == 2
    assert not targets.DEEPSPEED_ZERO1.reduces_every_micro_batch
    # from the command line: exit 2, the key named, the spec refused before any world starts
    spec = "ddpcheck.targets:DeepSpeedTarget(config={'train_micro_batch_size_per_gpu': 4})"
    assert cli.main(["check", spec, "--examples", "1"]) == ExitCode.SETUP
    assert "'train_micro_batch_size_per_gpu' is the scenario's" in capsys.readouterr().err
    # DeepSpeed's own parser judges the rest: a mistyped ZeRO key is exit 2 too, from the ranks
    with pytest.raises(
        ddpcheck.InvalidArgument,
        match=r"DeepSpeed rejects the config.*"
        r"reduce_bucket_sise; Extra inputs",
    ):
        ddpcheck.check_example(
            DeepSpeedTarget(config={"zero_optimization": {"reduce_bucket_sise": 10}}), PLAIN, 2
        )


def test_the_config_is_read_from_a_json_file_and_replayed(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(BF16))
    from_file = DeepSpeedTarget(config=str(path))
    assert vars(from_file)["_given"] == vars(DeepSpeedTarget(config=BF16))["_given"]
    assert from_file.applies_param_dtype
    for target in (
        from_file,
        DeepSpeedTarget(
            stage=1,
            config={
                "zero_optimization": {"contiguous_gradients": False},
                "communication_data_type": "fp32",
            },
        ),
    ):
        spec = target_spec(target)
        rebuilt = evaluate(spec)
        assert rebuilt == target and vars(rebuilt) == vars(target), spec
    (tmp_path / "broken.json").write_text('{"zero_optimization": {"stage": 2,}}')
    with pytest.raises(ddpcheck.InvalidArgument, match=r"broken.json.*not valid JSON \(line 1"):
        DeepSpeedTarget(config=str(tmp_path / "broken.json"))
    with pytest.raises(ddpcheck.InvalidArgument, match=r"missing\.json.*cannot be read"):
        DeepSpeedTarget(config=str(tmp_path / "missing.json"))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ddpcheck.InvalidArgument, match="must hold an object"):
        DeepSpeedTarget(config=str(tmp_path / "list.json"))
