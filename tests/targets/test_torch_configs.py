"""``TorchFSDPTarget(config=...)`` and ``TorchZeroTarget(config=...)``: the user's ``fully_shard``
and ``ZeroRedundancyOptimizer`` keyword arguments reach torch.

What it must do: pass the keys the rule leaves to the user (read back inside the rank from
FSDP2's state and ZeRO's flag), a check with them passing; refuse the scenario's and the harness's
keys, a typo (with the closest name) and a key both the field and the config set, when the target
is built -- before any process starts (exit 2 from the command line); read the config from a JSON
file; and print a replay line that rebuilds it."""

from __future__ import annotations

import json

import pytest
import torch

import ddpcheck
from ddpcheck import cli, zoo
from ddpcheck._runs.replay import evaluate, target_spec
from ddpcheck.errors import ExitCode
from ddpcheck.scenario import Scenario
from ddpcheck.targets import TorchFSDPTarget, TorchZeroTarget
from tests.targets.config_readers import ReadingFSDP, ReadingZero, read_back

#: an odd seed: without a config, the target reshards after forward (True for odd seeds)
POLICY = Scenario(
    zoo.MLP,
    dtype="float32",
    optimizer=torch.optim.AdamW,
    global_batch=8,
    steps=2,
    accumulation=2,
    param_dtype=torch.bfloat16,
    seed=1,
)
PLAIN = Scenario(zoo.MLP, optimizer=torch.optim.Adam, global_batch=7, steps=2, accumulation=2)
FSDP = {"reshard_after_forward": False, "mp_policy": {"cast_forward_inputs": True}}


def test_fully_shard_options_reach_fsdp2_inside_the_rank(tmp_path):
    ddpcheck.check_example(ReadingFSDP(config=FSDP, report=str(tmp_path)), POLICY, 2)
    for seen in read_back(str(tmp_path)):
        # the config's policy fields beside those the target sets from the scenario
        assert seen["output_dtype"] == "None"
        assert (seen["param_dtype"], seen["reduce_dtype"]) == ("torch.bfloat16", "torch.float32")
        assert seen["keeps_gathered"] and all(seen["keeps_gathered"])
    # the control: without the config, the same scenario reshards after forward
    folder = tmp_path / "control"
    folder.mkdir()
    ddpcheck.check_example(ReadingFSDP(report=str(folder)), POLICY, 2)
    assert not any(any(s["keeps_gathered"]) for s in read_back(str(folder)))


def test_zero_options_reach_the_optimizer_inside_the_rank(tmp_path):
    ddpcheck.check_example(
        ReadingZero(config={"parameters_as_bucket_view": True}, report=str(tmp_path)), PLAIN, 2
    )
    assert [s["parameters_as_bucket_view"] for s in read_back(str(tmp_path))] == [True, True]


def test_a_check_with_the_configs_passes_on_random_examples(tmp_path, capsys):
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps(FSDP))
    for spec in (
        f"ddpcheck.targets:TorchFSDPTarget(config={str(path)!r})",
        "ddpcheck.targets:TorchZeroTarget(config={'parameters_as_bucket_view': False})",
    ):
        code = cli.main(["check", spec, "--examples", "6", "--world-sizes", "2", "--seed", "5"])
        assert code == ExitCode.OK, capsys.readouterr().err


def test_refused_keys_are_named_when_the_target_is_built(capsys):
    with pytest.raises(ddpcheck.InvalidArgument) as info:
        TorchFSDPTarget(
            config={
                "mesh": None,
                "ignored_params": {1},
                "mp_policy": {
                    "param_dtype": "bfloat16",
                    "output_dtype": "float32",
                    "cast_forward_inputs": False,
                },
                "reshard_after_froward": 1,
            }
        )
    message = str(info.value)
    for part in (
        "'mp_policy.param_dtype' is the scenario's",
        "'mp_policy.output_dtype' is the scenario's",
        "'ignored_params'={1} contradicts",
        "'mp_policy.cast_forward_inputs'=False contradicts",
        "'reshard_after_froward' is no keyword argument (did you mean 'reshard_after_forward'?)",
    ):
        assert part in message, message
    assert "'mesh'" not in message  # None: what the target sets
    with pytest.raises(ddpcheck.InvalidArgument, match="both set it"):
        TorchFSDPTarget(reshard_after_forward=2, config={"reshard_after_forward": False})
    with pytest.raises(ddpcheck.InvalidArgument, match="both set it"):
        TorchFSDPTarget(cpu_offload=True, config={"offload_policy": {"pin_memory": False}})
    with pytest.raises(ddpcheck.InvalidArgument) as info:
        TorchZeroTarget(
            config={
                "lr": 0.1,
                "optimizer_class": "SGD",
                "overlap_with_ddp": True,
                "parameters_as_bucket_veiw": True,
            }
        )
    message = str(info.value)
    for part in (
        "'lr' is the scenario's (set from Scenario.optimizer_kwargs",
        "'optimizer_class' is the scenario's",
        "'overlap_with_ddp'=True contradicts",
        "did you mean 'parameters_as_bucket_view'?",
    ):
        assert part in message, message
    spec = "ddpcheck.targets:TorchZeroTarget(config={'process_group': 'gloo'})"
    assert cli.main(["check", spec, "--examples", "1"]) == ExitCode.SETUP
    assert "'process_group'='gloo' contradicts" in capsys.readouterr().err


def test_offload_from_the_config_declines_in_a_cpu_world():
    target = TorchFSDPTarget(config={"offload_policy": {"pin_memory": False}})
    with pytest.raises(ddpcheck.NothingChecked, match="CPUOffloadPolicy"):
        ddpcheck.check_example(target, PLAIN, 2)


def test_the_configs_are_read_from_json_and_replayed(tmp_path):
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps(FSDP))
    from_file = TorchFSDPTarget(config=str(path))
    assert vars(from_file)["_given"] == FSDP
    for target in (
        from_file,
        TorchFSDPTarget(config=FSDP),
        TorchZeroTarget(config={"parameters_as_bucket_view": True}),
    ):
        spec = target_spec(target)
        rebuilt = evaluate(spec)
        assert rebuilt == target and vars(rebuilt) == vars(target), spec
    (tmp_path / "bad.json").write_text('{\n  "reshard_after_forward": tru\n}')
    with pytest.raises(ddpcheck.InvalidArgument, match=r"TorchFSDPTarget.*line 2"):
        TorchFSDPTarget(config=str(tmp_path / "bad.json"))
