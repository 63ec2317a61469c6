"""The ready-made targets of production stacks (accelerate, Lightning Fabric, Lightning's Trainer,
transformers' Trainer -- more in test_hf_trainer.py --, torch's ZeRO and FSDP2 options): each
checked on one busy scenario in a shared world of 2 -- frameworks are slow to import (3-5 s per
rank), so these tests are few -- plus what ``ddpcheck targets`` lists. A framework that is not
installed skips its test, saying so."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib

import pytest
import torch

import ddpcheck
from ddpcheck import cli, targets, zoo
from ddpcheck.errors import ExitCode
from ddpcheck.features import FEATURES, supported_by
from ddpcheck.scenario import Scenario

#: micro-batches, a schedule, clipping, Adam state, a parameter some ranks do not use
BUSY = Scenario(
    zoo.SampleBranch,
    optimizer=torch.optim.Adam,
    optimizer_kwargs={"lr": 0.01},
    lr_decay=0.5,
    global_batch=7,
    steps=2,
    accumulation=3,
    max_grad_norm=1.0,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


def _needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        entry = next(e for e in targets.READY_MADE if e.module == module)
        pytest.skip(f"{module} is not installed ({entry.install})")


def test_ddpcheck_targets_lists_every_ready_made_target_with_its_declines(capsys):
    assert cli.main(["targets"]) == ExitCode.OK
    out = capsys.readouterr().out
    for name in (
        "torch_zero",
        "torch_zero_bucket_view",
        "torch_fsdp",
        "accelerate",
        "fabric",
        "lightning",
        "hf_trainer",
    ):
        assert f"\n{name}  (" in f"\n{out}", out
    assert "declines mixed-dtypes: ZeroRedundancyOptimizer rejects" in out
    for entry in targets.READY_MADE:  # every declined feature has its reason, and only those
        assert set(entry.declines) == set(FEATURES) - supported_by(entry.target), entry.name


@pytest.mark.parametrize("framework", sorted(targets.TESTED))
def test_the_releases_listed_as_tested_run_from_the_floor_to_the_pin(framework, capsys):
    """``ddpcheck targets`` says which releases were tried: the oldest is the floor every
    ready-made target of that framework states, the newest the pin every install uses."""
    tested = targets.TESTED[framework]
    pins = dict(
        line.split("==")
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert tested[-1] == pins[framework], (framework, tested, pins.get(framework))
    entries = [e for e in targets.READY_MADE if e.framework == framework]
    # a floor names the oldest release tried, or its series (torch 2.1: 2.1.2); a floor that
    # depends on the device (FSDP2's torch) is measured apart (docs/torch-releases.md)
    # (a target tried on fewer releases than its framework's list, ReadyMade.tried: its own)
    assert entries and all(
        e.minimum is None
        or e.tested[0] in (e.minimum, *(e.minimum + f".{n}" for n in range(10)))
        or callable(getattr(e.target, "requirements", None))
        for e in entries
    ), framework
    assert cli.main(["targets"]) == ExitCode.OK
    assert f"tried with {', '.join(tested)}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "name, hint",
    [
        ("fabric", "drives lightning, which is not installed here: pip install 'lightning>=2.0.9'"),
        # once hinted `pip install 'ddpcheck[frameworks]'`, which installs no DeepSpeed
        (
            "deepspeed_zero1",
            "drives deepspeed, which is not installed here: pip install 'deepspeed>=0.19.0'",
        ),
    ],
    ids=["fabric", "deepspeed_zero1"],
)
def test_a_framework_that_is_not_installed_is_named_with_how_to_install_it(
    monkeypatch, capsys, name, hint
):
    monkeypatch.delitem(targets.BUILTIN, name, raising=False)
    status = cli.main(["check", name, "--examples", "1"])
    assert status == ExitCode.SETUP
    assert hint in capsys.readouterr().err


@dataclasses.dataclass(frozen=True)
class SplitBatchesFalseRunsSchedules(targets.AccelerateTarget):
    """``split_batches=False`` without its decline: what the decline spares a correct run."""

    def supports(self, scenario):
        return None


def test_accelerate_as_its_docs_drive_it():
    _needs("accelerate")
    ddpcheck.check_example(targets.ACCELERATE, BUSY, 2)
    # its documented default: the prepared scheduler steps num_processes times per step -- so
    # split_batches=False (an option --fuzz-config draws) declines scenarios with a schedule
    unsplit = targets.AccelerateTarget(split_batches=False)
    with pytest.raises(ddpcheck.NothingChecked, match="num_processes times per optimizer step"):
        ddpcheck.check_example(unsplit, BUSY, 2)
    ddpcheck.check_example(unsplit, dataclasses.replace(BUSY, lr_decay=None), 2)
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        ddpcheck.check_example(SplitBatchesFalseRunsSchedules(split_batches=False), BUSY, 2)
    assert info.value.kinds[0] == "LR schedule differs", str(info.value)


@dataclasses.dataclass(frozen=True)
class ReducesLossWithSum(targets.AccelerateTarget):
    """A loop that logs ``accelerator.reduce(loss)`` -- its default reduction is "sum": the
    logged loss W times the objective, every gradient right."""

    def reported_loss(self, model, optimizer, losses):
        from ddpcheck.targets.accelerate import _accelerator

        step = targets.MicroBatchLoss.total(losses)
        return _accelerator(model).reduce(step)  # reduction="sum", accelerate's default


def test_the_loss_accelerate_reduces_for_the_log_is_checked():
    # ACCELERATE reports accelerator.reduce(loss, "mean") (right: the test above); "sum" is not
    _needs("accelerate")
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        ddpcheck.check_example(ReducesLossWithSum(), BUSY, 2)
    assert set(info.value.kinds) == {"loss differs"}, str(info.value)


@dataclasses.dataclass(frozen=True)
class LogsLossSummed(targets.LightningTarget):
    """``self.log(..., sync_dist=True, reduce_fx="sum")``: the logged loss W times the
    objective, every gradient right."""

    log_reduce_fx = "sum"


def test_the_loss_lightning_logs_with_sync_dist_is_checked():
    _needs("lightning")
    ddpcheck.check_example(LogsLossSummed(), BUSY, 1)  # one rank: a sum of one
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        ddpcheck.check_example(LogsLossSummed(), BUSY, 2)
    assert set(info.value.kinds) == {"loss differs"}, str(info.value)
    assert "loss rank 1 reports" in str(info.value)  # every rank reads what Lightning logs


@dataclasses.dataclass(frozen=True)
class CountsReportedLosses(targets.LightningTarget):
    """Lightning with a check, in each rank, that its logged loss reached ``run.reported`` once
    after every recorded step -- the last one included (read at ``on_train_end``)."""

    def fit(self, module, run):
        steps, reports = [], []

        def record(*args):
            steps.append(len(reports))
            run.record(*args)

        def reported(*args, **kwargs):
            reports.append(len(steps))
            run.reported(*args, **kwargs)

        super().fit(module, dataclasses.replace(run, record=record, reported=reported))
        # the reading after step k comes after its record and before step k + 1's
        if reports != list(range(1, run.steps + 1)) or steps != list(range(run.steps)):
            raise AssertionError(f"records at {steps}, readings at {reports}")


@pytest.mark.parametrize("manual", [False, True])
def test_lightnings_logged_loss_is_read_after_every_step_on_every_rank(manual):
    _needs("lightning")
    scenario = dataclasses.replace(BUSY, steps=3, global_batch=6, accumulation=2)
    assert ddpcheck.check_example(CountsReportedLosses(manual=manual), scenario, 2) == ()


def test_lightning_fabric():
    _needs("lightning")
    ddpcheck.check_example(targets.FABRIC, BUSY, 2)


def test_lightnings_trainer_owns_the_loop_automatic_and_manual():
    _needs("lightning")
    ddpcheck.check_example(targets.LIGHTNING, BUSY, 2)
    ddpcheck.check_example(
        targets.LightningTarget(manual=True),
        Scenario(
            zoo.Tied,
            global_batch=5,
            steps=2,
            accumulation=2,
            max_grad_norm=1.0,
            grad_norm_type=float("inf"),
        ),
        2,
    )


#: a language model on padded tokens, accumulated, under bfloat16 autocast
TOKENS = Scenario(
    zoo.TinyGPT,
    data=zoo.token_data,
    loss="token_cross_entropy",
    dtype="float32",
    autocast=torch.bfloat16,
    optimizer=torch.optim.AdamW,
    global_batch=7,
    steps=2,
    accumulation=2,
)


@pytest.mark.parametrize(
    "name,module",
    [
        ("accelerate", "accelerate"),
        ("fabric", "lightning"),
        ("lightning", "lightning"),
        ("hf_trainer", "transformers"),
    ],
)
def test_the_frameworks_train_language_models_under_autocast(name, module):
    _needs(module)
    ddpcheck.check_example(targets.BUILTIN[name], TOKENS, 2)


def test_a_token_scenario_is_judged_or_declined_by_every_configuration_never_a_crash():
    # (LightningTarget(static_graph=True) read a GPTConfig's layer count as a list of layers:
    # exit 4 as soon as a token scenario was drawn)
    configured = [entry.target for entry in targets.READY_MADE] + [
        targets.LightningTarget(manual=True, static_graph=True),
        targets.LightningTarget(static_graph=True),
    ]
    plain = Scenario(zoo.GPTConfig(layers=1), data=zoo.token_data, loss="token_cross_entropy")
    for target in configured:
        for scenario in (TOKENS, plain):
            for world_size in (1, 2, 3):
                why = ddpcheck.features.declines(target, scenario, world_size)
                assert why is None or isinstance(why, str), (target, why)


def test_zero_with_parameters_as_bucket_view_gets_a_channels_last_conv_wrong():
    scenario = Scenario(zoo.ChannelsLastConv, global_batch=6, steps=1)
    ddpcheck.check_example(targets.TORCH_ZERO, scenario, 2)
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        ddpcheck.check_example(targets.TORCH_ZERO_BUCKET_VIEW, scenario, 2)
    assert info.value.kinds[0] == "reference differs (gradient)", str(info.value)
    assert "conv.weight" in str(info.value)


def test_fsdp2_options_resharding_and_cpu_offload():
    scenario = Scenario(zoo.Tied, global_batch=5, steps=2, accumulation=2, lr_decay=0.5)
    ddpcheck.check_example(targets.TorchFSDPTarget(reshard_after_forward=False), scenario, 2)
    ddpcheck.check_example(targets.TorchFSDPTarget(reshard_after_forward=2), scenario, 2)
    # CPU offload copies to an accelerator for compute: in a CPU world it declines, not fails
    with pytest.raises(ddpcheck.NothingChecked, match=r"cpu_offload.*--device cuda"):
        ddpcheck.check_example(targets.TorchFSDPTarget(cpu_offload=True), scenario, 2)
    ddpcheck.check_example(targets.TORCH_FSDP, scenario, 2)  # the world serves the next one


def test_deepspeed_zero_1_and_2_on_its_cpu_accelerator_over_gloo():
    _needs("deepspeed")
    scenario = Scenario(
        zoo.Tied,
        dtype="float32",
        optimizer=torch.optim.Adam,
        optimizer_kwargs={"lr": 0.01, "eps": 1e-3},
        lr_decay=0.5,
        global_batch=7,
        steps=2,
        accumulation=2,
    )
    ddpcheck.check_example(targets.DEEPSPEED_ZERO1, scenario, 2)
    # ZeRO-2 reduces every micro-batch by design (declared): within its budget
    ddpcheck.check_example(targets.DEEPSPEED_ZERO2, scenario, 2)
