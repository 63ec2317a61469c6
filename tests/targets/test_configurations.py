"""The user's own framework configuration (``config=``, ``--config FILE``, ``--ddpcheck-config``):
read as given (a dict, a JSON file, a Python dict named ``MODULE:NAME``), reconciled by one rule
(``ddpcheck.targets.configuration``: the scenario's keys refused whatever their value, the
harness's accepted only with ddpcheck's value, naming every key, before any process starts), and
what it changes REACHES the framework -- seen inside the rank: the plugin the ``Accelerator``
holds, the options of the DDP model a Lightning or Fabric strategy built. A configured target is
replayable: its replay line rebuilds it. Frameworks cost seconds per example: few examples."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import ddpcheck
from ddpcheck import cli, targets, zoo
from ddpcheck._runs.replay import evaluate, target_spec
from ddpcheck.errors import ExitCode
from ddpcheck.scenario import Scenario
from ddpcheck.targets.configuration import load_config, reconcile
from tests.patience import patience

#: micro-batches, a schedule, clipping, Adam state: what each configured framework trains
ACCUMULATED = Scenario(
    zoo.MLP,
    optimizer=torch.optim.Adam,
    optimizer_kwargs={"lr": 0.01},
    lr_decay=0.5,
    global_batch=8,
    steps=2,
    accumulation=2,
    max_grad_norm=1.0,
)
#: the same without accumulation (a static graph declines it under no_sync)
ONE_PER_STEP = dataclasses.replace(ACCUMULATED, accumulation=1)


def _needs(*modules: str) -> None:
    for module in modules:
        if importlib.util.find_spec(module) is None:
            entry = next(e for e in targets.READY_MADE if e.module == module)
            pytest.skip(f"{module} is not installed ({entry.install})")


def _json(tmp_path, name, config):
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


# ---------------------------------------------------------------------------------------------
# The rule, without a world


def test_a_config_is_read_from_a_dict_or_a_json_file_and_a_bad_file_is_named(tmp_path):
    assert load_config(None, target="T") == {}
    given = {"a": 1}
    assert load_config(given, target="T") == given and load_config(given, target="T") is not given
    assert load_config(_json(tmp_path, "ok.json", {"a": [1]}), target="T") == {"a": [1]}
    broken = tmp_path / "broken.json"
    broken.write_text('{\n  "a": 1,\n  oops\n}')
    with pytest.raises(
        ddpcheck.InvalidArgument,
        match=r"T: the JSON file '.*broken\.json' is not "
        r"valid JSON \(line 3",
    ):
        load_config(str(broken), target="T")
    with pytest.raises(ddpcheck.InvalidArgument, match=r"must hold an object .*not list"):
        load_config(_json(tmp_path, "list.json", [1]), target="T")
    with pytest.raises(
        ddpcheck.InvalidArgument,
        match=r"T: the JSON file '.*missing\.json' "
        r"cannot be read",
    ):
        load_config(tmp_path / "missing.json", target="T")
    with pytest.raises(ddpcheck.InvalidArgument, match=r"must be a dict .* or the path"):
        load_config(3, target="T")


def test_reconcile_names_every_refused_key_dotted_with_what_owns_it():
    @dataclasses.dataclass
    class Plugin:
        num_steps: int | None = None
        sync_each_batch: bool = False

    scenario_keys = {
        "steps": "steps",
        "zero.stage": "the stage",
        "plugin.num_steps": "accumulation",
    }
    harness_keys = {"save": (("no",), "no checkpoints"), "world": ((), "ddpcheck's world")}
    ok = {"seed": 3, "save": "no", "zero": {"other": 1}, "plugin": Plugin(sync_each_batch=True)}
    reconcile(ok, target="T", scenario_keys=scenario_keys, harness_keys=harness_keys)
    with pytest.raises(ddpcheck.InvalidArgument) as info:
        reconcile(
            {
                "steps": 1,
                "zero": {"stage": 2},
                "plugin": Plugin(num_steps=2),
                "save": "steps",
                "world": 1,
                "sead": 3,
            },
            target="T",
            scenario_keys=scenario_keys,
            harness_keys=harness_keys,
            known={"seed", "steps", "zero", "plugin", "save", "world"},
        )
    text = str(info.value)
    for part in (
        "'steps' is the scenario's (set from Scenario.steps",
        "'zero.stage' is the scenario's",
        "'plugin.num_steps' is the scenario's",
        "'save'='steps' contradicts the run ddpcheck drives (no checkpoints); only "
        "'no' is accepted",
        "'world'=1 contradicts",
        "'sead' is no keyword argument (did you mean 'seed'?)",
        "docs/frameworks.md",
    ):
        assert part in text, text
    # True is no 1: an accepted value must be the value, not merely equal
    with pytest.raises(ddpcheck.InvalidArgument):
        reconcile({"save": True}, target="T", scenario_keys={}, harness_keys={"save": ((1,), "")})


def test_refused_keys_are_named_when_the_target_is_built(tmp_path):
    _needs("accelerate", "lightning")
    with pytest.raises(ddpcheck.InvalidArgument) as info:
        targets.AccelerateTarget(
            config={
                "gradient_accumulation_steps": 2,
                "cpu": True,
                "gradient_accumulation_plugin": {"num_steps": 2},
                "kwargs_handlers": [{"class": "InitProcessGroupKwargs"}],
                "rng_type": ["torch"],
            }
        )
    for part in (
        "'gradient_accumulation_steps' is the scenario's",
        "'cpu'=True contradicts",
        "'gradient_accumulation_plugin.num_steps' is the scenario's",
        "'kwargs_handlers.InitProcessGroupKwargs'",
        "(did you mean 'rng_types'?)",
    ):
        assert part in str(info.value), str(info.value)
    path = _json(
        tmp_path,
        "lightning.json",
        {
            "precision": "bf16-mixed",
            "logger": True,
            "strategy": {"name": "ddp", "start_method": "spawn"},
        },
    )
    with pytest.raises(ddpcheck.InvalidArgument) as info:
        targets.LightningTarget(config=path)
    for part in (
        f"LightningTarget(config={path!r}) cannot be used",
        "'precision' is the scenario's",
        "'logger'=True",
        "'strategy.start_method'='spawn'",
    ):
        assert part in str(info.value), str(info.value)
    for strategy, part in (
        ("fsdp", "is FSDPStrategy; this target checks torch DDP"),
        ({"static_grph": True}, "(did you mean 'static_graph'?)"),
    ):
        with pytest.raises(
            ddpcheck.InvalidArgument,
            match=part.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?"),
        ):
            targets.FabricTarget(config={"strategy": strategy})
    with pytest.raises(ddpcheck.InvalidArgument, match="static_graph=True and a 'strategy'"):
        targets.LightningTarget(static_graph=True, config={"strategy": "ddp"})
    with pytest.raises(ddpcheck.InvalidArgument, match="config= and training_args= are one"):
        targets.HfTrainerTarget(config={"seed": 1}, training_args={"seed": 1})


def test_the_users_ddp_options_decline_what_torch_ddp_cannot_train():
    _needs("accelerate", "lightning")
    unused = {"unused-everywhere", "unused-on-some-ranks"}
    assert not unused - targets.ACCELERATE.supported_features  # the target looks for them
    plain = targets.AccelerateTarget(
        config={"kwargs_handlers": [{"class": "DistributedDataParallelKwargs"}]}
    )  # torch's default: it does not look
    assert not unused & plain.supported_features
    assert not unused & targets.LightningTarget(config={"strategy": "ddp"}).supported_features
    static = targets.LightningTarget(config={"strategy": {"static_graph": True}})
    assert "static_graph (the config's strategy)" in static.supports(ACCUMULATED)
    assert static.supports(ONE_PER_STEP) is None
    # accelerate without no_sync (sync_each_batch) accumulates under a static graph
    synced = targets.AccelerateTarget(
        config={
            "gradient_accumulation_plugin": {"sync_each_batch": True},
            "kwargs_handlers": [{"class": "DistributedDataParallelKwargs", "static_graph": True}],
        }
    )
    assert synced.supports(ACCUMULATED) is None


# ---------------------------------------------------------------------------------------------
# The configuration reaches the framework, inside the rank; a run with it is green


def test_an_accelerate_config_reaches_the_accelerator(tmp_path):
    _needs("accelerate", "lightning")
    from tests.targets.configured import ACCELERATE, ObservingAccelerate

    for config in (ACCELERATE, _json(tmp_path, "accelerate.json", ACCELERATE)):
        ddpcheck.check_example(ObservingAccelerate(config=config), ACCUMULATED, 2)
    with pytest.raises(ddpcheck.SetupError) as info:  # the control: the target's own
        ddpcheck.check_example(ObservingAccelerate(), ACCUMULATED, 2)
    assert "fails without data parallelism" in str(info.value), str(info.value)
    assert "not the configuration given" in str(info.value)
    # plugin objects, as a Python user writes them: the same, and replayable
    from accelerate.utils import DistributedDataParallelKwargs, GradientAccumulationPlugin

    objects = ObservingAccelerate(
        config={
            "gradient_accumulation_plugin": GradientAccumulationPlugin(sync_each_batch=True),
            "kwargs_handlers": [
                DistributedDataParallelKwargs(
                    find_unused_parameters=True, gradient_as_bucket_view=True
                )
            ],
        }
    )
    ddpcheck.check_example(objects, ACCUMULATED, 2)
    assert evaluate(target_spec(objects)) == objects


def test_a_lightning_strategy_reaches_the_ddp_model():
    _needs("lightning")
    from tests.targets.configured import OBSERVED_LIGHTNING, UNCONFIGURED_LIGHTNING

    ddpcheck.check_example(OBSERVED_LIGHTNING, ONE_PER_STEP, 2)
    with pytest.raises(ddpcheck.SetupError) as info:
        ddpcheck.check_example(UNCONFIGURED_LIGHTNING, ONE_PER_STEP, 2)
    assert "not the strategy given" in str(info.value), str(info.value)
    # a value only the Trainer can judge: from the ranks, still the configuration's (exit 2)
    with pytest.raises(
        ddpcheck.InvalidArgument,
        match=r"Trainer\(\.\.\.\) with the "
        r"configuration.*raised Misconfiguration"
        r"Exception: .*reload_dataloaders_every_n_epochs",
    ):
        ddpcheck.check_example(
            targets.LightningTarget(config={"reload_dataloaders_every_n_epochs": -1}),
            ONE_PER_STEP,
            2,
        )
    # when validation runs is the scenario's: its evaluation set, after every epoch
    with pytest.raises(ddpcheck.InvalidArgument, match="val_check_interval"):
        targets.LightningTarget(config={"val_check_interval": 0.5})
    # manual optimization stays the target's field, beside the Trainer's configuration
    manual = targets.LightningTarget(
        manual=True,
        config={
            "strategy": {"name": "ddp_find_unused_parameters_true", "gradient_as_bucket_view": True}
        },
    )
    ddpcheck.check_example(manual, ACCUMULATED, 2)


def test_a_fabric_strategy_reaches_the_ddp_model():
    _needs("lightning")
    from tests.targets.configured import FABRIC, ObservingFabric

    ddpcheck.check_example(ObservingFabric(config=FABRIC), ACCUMULATED, 2)
    with pytest.raises(ddpcheck.SetupError) as info:
        ddpcheck.check_example(ObservingFabric(), ACCUMULATED, 2)
    assert "not the strategy given" in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------------
# Replay lines, and the command line


def test_a_configured_target_is_rebuilt_by_its_replay_line(tmp_path):
    _needs("accelerate", "lightning")
    from tests.targets.configured import ACCELERATE, FABRIC, LIGHTNING_STRATEGY

    path = _json(tmp_path, "accelerate.json", ACCELERATE)
    for target in (
        targets.AccelerateTarget(config=ACCELERATE),
        targets.AccelerateTarget(config=path),
        targets.LightningTarget(config={"strategy": LIGHTNING_STRATEGY}),
        targets.FabricTarget(config=FABRIC),
        targets.HfTrainerTarget(config={"seed": 3}),
    ):
        spec = target_spec(target)
        assert "config=" in spec, spec
        rebuilt = evaluate(spec)
        assert rebuilt == target and vars(rebuilt) == vars(target), spec
    # what --config builds: the ready-made target with config=, replayed without --config
    from ddpcheck._runs.admission import resolve_target

    built = resolve_target("accelerate", path)
    assert built == targets.AccelerateTarget(config=path)
    assert target_spec(built) == f"ddpcheck.targets.accelerate:AccelerateTarget(config={path!r})"


def test_the_command_line_refuses_a_config_before_any_process_starts(
    tmp_path, capsys, no_process_started
):
    _needs("accelerate")
    bad = _json(
        tmp_path, "bad.json", {"mixed_precision": "bf16", "step_scheduler_with_optimizer": False}
    )
    good = _json(tmp_path, "good.json", {"rng_types": ["torch"]})
    (tmp_path / "mine.py").write_text("NOT_A_DICT = [1]\n")
    cases = [
        (
            ["check", "accelerate", "--config", bad],
            [
                "'mixed_precision' is the scenario's",
                "'step_scheduler_with_optimizer'=False contradicts",
            ],
        ),
        (
            ["survey", "parallel", "--config", good],
            ["parallel takes no configuration", "accelerate, fabric, lightning"],
        ),
        (
            [
                "replay",
                "ddpcheck.targets:AccelerateTarget(config={})",
                "--config",
                good,
                "--world-size",
                "2",
                "--scenario",
                repr(ONE_PER_STEP),
            ],
            ["has a configuration already"],
        ),
        (
            ["trace", "accelerate", "--config", str(tmp_path / "nope.json")],
            ["the JSON file", "nope.json' cannot be read"],
        ),
        (
            ["check", "accelerate", "--config", f"{tmp_path / 'mine.py'}:NOT_A_DICT"],
            ["is a list, not a dict"],
        ),
    ]
    for argv, parts in cases:
        assert (
            cli.main([*argv, "--examples", "1"] if argv[0] in ("check", "survey") else argv)
            == ExitCode.SETUP
        ), argv
        err = capsys.readouterr().err
        for part in parts:
            assert part in err, (argv, err)


def test_the_command_line_runs_a_configured_framework_green(tmp_path, capsys):
    _needs("accelerate", "lightning")
    (tmp_path / "lightning_config.py").write_text(
        textwrap.dedent("""
        STRATEGY = {"name": "ddp", "static_graph": True}
        CONFIG = {"strategy": STRATEGY, "enable_model_summary": False}
    """)
    )
    path = _json(
        tmp_path, "accelerate.json", {"gradient_accumulation_plugin": {"sync_each_batch": True}}
    )
    assert (
        cli.main(
            [
                "replay",
                "accelerate",
                "--config",
                path,
                "--world-size",
                "2",
                "--scenario",
                repr(ACCUMULATED),
            ]
        )
        == ExitCode.OK
    )
    assert (
        cli.main(
            [
                "replay",
                "lightning",
                "--config",
                f"{tmp_path / 'lightning_config.py'}:CONFIG",
                "--world-size",
                "2",
                "--scenario",
                repr(ONE_PER_STEP),
            ]
        )
        == ExitCode.OK
    )
    assert (
        cli.main(
            [
                "check",
                "fabric",
                "--config",
                _json(tmp_path, "fabric.json", {"strategy": "ddp_find_unused_parameters_true"}),
                "--examples",
                "2",
                "--world-sizes",
                "2",
                "--only",
                "accumulation",
            ]
        )
        == ExitCode.OK
    ), capsys.readouterr().err
    out = capsys.readouterr().out
    assert "ddpcheck check fabric --config" in out and "nothing found" in out, out


@pytest.mark.slow  # a pytest of its own, and its worlds
def test_the_pytest_plugin_builds_the_framework_target_with_its_config(tmp_path):
    _needs("accelerate")
    (tmp_path / "accelerate.json").write_text(
        json.dumps({"gradient_accumulation_plugin": {"sync_each_batch": True}})
    )
    (tmp_path / "test_user.py").write_text(
        textwrap.dedent("""
        from ddpcheck import targets, zoo
        from ddpcheck.scenario import Scenario

        def test_accelerate(ddpcheck_run):
            ddpcheck_run(targets.ACCELERATE, Scenario(zoo.MLP, global_batch=8, steps=2,
                                                      accumulation=2))

        def test_parallel(ddpcheck_run):
            ddpcheck_run(targets.PARALLEL)
    """)
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "test_user.py",
            "--ddpcheck-world-sizes",
            "2",
            "--ddpcheck-config",
            "accelerate.json",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=patience(240),
    )
    out = done.stdout
    assert "1 failed, 1 passed" in out, out
    assert "--ddpcheck-config 'accelerate.json': ParallelTarget takes no configuration" in out, out
    wrong = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "test_user.py",
            "--ddpcheck-config",
            "missing.json",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=patience(120),
    )
    assert wrong.returncode == 4 and "missing.json' cannot be read" in wrong.stderr, wrong
