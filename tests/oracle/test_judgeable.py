"""Trustworthy verdicts, B: scenario validity before blame.

A scenario the oracle cannot judge -- a model factory, data function or optimizer that fails on
its own, a model that is not a per-sample function -- is refused in the parent, before any world
runs, with a ScenarioError naming the cause and the fix (exit status 2 on the command line), not
blamed on the target. And no valid scenario is refused: the built-in ones and every scenario the
strategies generate pass.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import ddpcheck
from ddpcheck import cli, zoo
from ddpcheck import strategies as dst
from ddpcheck._oracle.judgeable import check_scenario
from ddpcheck._runs.example import prepare_reference
from ddpcheck._runs.replay import from_repr
from ddpcheck.battery import BATTERY
from ddpcheck.errors import ExitCode
from ddpcheck.scenario import Scenario
from tests import verdict_helpers as h
from tests.patience import patience
from tests.runs.test_replay import ROOT

H = "tests.verdict_helpers"

#: (id, the scenario as the replay command line takes it, phrases of the message)
BAD = [
    (
        "model class needing arguments",
        "ddpcheck.Scenario(model=torch.nn.Linear)",
        [
            "model=torch.nn.Linear cannot be called without arguments",
            "missing 2 required positional arguments",
            "def make_model(): return Linear(...)",
        ],
    ),
    (
        "model instance",
        "ddpcheck.Scenario(model=torch.nn.Linear(5, 3))",
        [
            "model=Linear(in_features=5, out_features=3, bias=True) is a module instance, not a "
            "factory",
            "pass a class whose constructor takes no arguments",
        ],
    ),
    (
        "model returns no module",
        "ddpcheck.Scenario(model=tests.world.test_harness.not_a_module)",
        ["model=tests.world.test_harness.not_a_module returned int, not a torch.nn.Module"],
    ),
    (
        "data with the wrong arguments",
        f"ddpcheck.Scenario(model=ddpcheck.zoo.MLP, data={H}.two_arg_data)",
        [
            f"data={H}.two_arg_data cannot be called as data(seed, batch, dtype)",
            "takes 2 positional arguments but 3 were given",
        ],
    ),
    (
        "data returns one tensor",
        f"ddpcheck.Scenario(model=ddpcheck.zoo.MLP, data={H}.one_tensor_data)",
        [f"data={H}.one_tensor_data returned tensor(8, 5); it must return (inputs, targets)"],
    ),
    (
        "data with too few targets",
        f"ddpcheck.Scenario(model=ddpcheck.zoo.MLP, data={H}.short_data)",
        ["returned inputs of shape (8, 5) and targets of shape (7, 3) for batch=8"],
    ),
    (
        "tuple output",
        f"ddpcheck.Scenario(model={H}.TupleOutput)",
        [
            "the model's forward returned a tuple of 2 (tensor(8, 3), tensor()), not one tensor",
            "make forward return only the prediction",
        ],
    ),
    (
        "dict output",
        f"ddpcheck.Scenario(model={H}.DictOutput)",
        ["the model's forward returned a dict with keys 'logits', not one tensor"],
    ),
    (
        "output shape",
        f"ddpcheck.Scenario(model={H}.WrongShape)",
        ["the model's forward returned shape (8, 1) for targets of shape (8, 3)"],
    ),
    (
        "LBFGS",
        "ddpcheck.Scenario(model=ddpcheck.zoo.MLP, optimizer=torch.optim.LBFGS)",
        [
            "optimizer=torch.optim.LBFGS requires a closure",
            "use a first-order optimizer such as torch.optim.SGD, Adam or AdamW",
        ],
    ),
    (
        "lr of the wrong type",
        "ddpcheck.Scenario(model=ddpcheck.zoo.MLP, optimizer_kwargs={'lr': 'x'})",
        ["optimizer_kwargs={'lr': 'x'} were rejected by torch.optim.SGD: TypeError"],
    ),
    (
        "unknown optimizer kwarg",
        "ddpcheck.Scenario(model=ddpcheck.zoo.MLP, "
        "optimizer_kwargs={'lr': 0.1, 'momentum_typo': 0.9})",
        [
            "optimizer_kwargs={'lr': 0.1, 'momentum_typo': 0.9} were rejected by torch.optim.SGD",
            "unexpected keyword argument 'momentum_typo'",
        ],
    ),
    (
        "optimizer that fails to step",
        "ddpcheck.Scenario(model=ddpcheck.zoo.MLP, optimizer=torch.optim.SparseAdam)",
        [
            "torch.optim.SparseAdam.step() with optimizer_kwargs={'lr': 0.1} raised RuntimeError",
            "does not support dense gradients",
        ],
    ),
    (
        "dropout",
        f"ddpcheck.Scenario(model={H}.WithDropout)",
        [
            "the model is random per call (dropout?)",
            "drop (Dropout)",
            "each rank would draw different masks",
            "put dropout in eval mode or set p=0",
        ],
    ),
    (
        "dropout, one sample",
        f"ddpcheck.Scenario(model={H}.WithDropout, global_batch=1)",
        ["the model is random per call (dropout?)"],
    ),
    (
        "batchnorm in train mode",
        f"ddpcheck.Scenario(model={H}.WithBatchNorm)",
        [
            "the output of a sample depends on the other samples of its batch (batch statistics, "
            "e.g. BatchNorm in train mode)",
            "bn (BatchNorm1d)",
            "data-parallel shards see different batches, so no full-batch reference exists; "
            "use eval "
            "mode, GroupNorm/LayerNorm, or SyncBatchNorm in your own test",
        ],
    ),
    (
        "batchnorm, one sample",
        f"ddpcheck.Scenario(model={H}.WithBatchNorm, global_batch=1)",
        [
            "Expected more than 1 value per channel when training",
            "bn (BatchNorm1d)",
            "GroupNorm/LayerNorm, or SyncBatchNorm",
        ],
    ),
    (
        "batch mean",
        f"ddpcheck.Scenario(model={H}.BatchMean)",
        [
            "the output of a sample depends on the other samples of its batch",
            "forwards on the whole batch of 8 and on the two shards of world size 2 "
            "(4 + 4 samples) "
            "differ by up to",
        ],
    ),
    (
        "buffer written by forward",
        f"ddpcheck.Scenario(model={H}.CountsForwards)",
        [
            "the model's forward changes its buffers ['calls'] (running statistics?)",
            "keep forward from writing buffers",
        ],
    ),
    (
        "nothing trainable",
        f"ddpcheck.Scenario(model={H}.AllFrozen)",
        ["does not depend on any trainable parameter"],
    ),
]

#: Scenarios that look suspicious and are fine: they must pass.
GOOD = [
    Scenario(zoo.MLP),
    Scenario(h.batchnorm_eval),  # BatchNorm in eval mode: per sample
    Scenario(h.linear, global_batch=1),
    Scenario(zoo.SampleBranch, global_batch=2, dtype="float32"),
    Scenario(
        zoo.MLP,
        optimizer=torch.optim.Adam,
        optimizer_kwargs={"lr": 0.01},
        param_groups=zoo.BiasGroups(lr=0.05),
        lr_decay=0.5,
    ),
]


@pytest.mark.parametrize("text, phrases", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_scenario_is_a_scenario_error_naming_the_cause(text, phrases):
    with pytest.raises(ddpcheck.ScenarioError) as info:
        prepare_reference(from_repr(text))  # what every check computes first
    message = str(info.value)
    for phrase in phrases:
        assert phrase in message
    assert "\n" not in message
    assert isinstance(info.value, ddpcheck.SetupError)
    assert isinstance(info.value, ddpcheck.InvalidArgument)


@pytest.mark.parametrize("text, phrases", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_the_command_line_exits_2_with_one_line(no_process_started, capsys, text, phrases):
    status = cli.main(["replay", "parallel", "--world-size", "2", "--scenario", text])
    captured = capsys.readouterr()
    assert status == ExitCode.SETUP, captured
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("ddpcheck replay: error: ")
    assert phrases[0] in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["model instance", "batchnorm in train mode"])
def test_the_installed_command_exits_2_without_a_traceback(name):
    text, phrases = next(b[1:] for b in BAD if b[0] == name)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpcheck",
            "replay",
            "parallel",
            "--world-size",
            "2",
            "--scenario",
            text,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=patience(120),
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout == ""
    assert out.stderr.count("\n") == 1 and phrases[0] in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("scenario", GOOD + [s for _, s in BATTERY], ids=repr)
def test_valid_scenarios_pass(scenario):
    check_scenario(scenario)


@settings(
    max_examples=100,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
@given(scenario=dst.scenarios(models=dst.models(mixed_dtypes=True), dtypes=("float64", "float32")))
def test_every_generated_scenario_passes(scenario):
    check_scenario(scenario)  # a false refusal is as bad as a false alarm


def test_the_probe_leaves_the_random_state_alone_and_runs_once_per_scenario(monkeypatch):
    from ddpcheck._oracle import judgeable as validity

    scenario = Scenario(zoo.MLP, seed=3)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    check_scenario(scenario)
    assert torch.equal(torch.random.get_rng_state(), before)
    calls = []
    monkeypatch.setattr(validity, "_probe", calls.append)
    check_scenario(scenario)
    assert calls == []
    check_scenario(Scenario(zoo.MLP, seed=3))  # an equal scenario, another object: probed
    assert len(calls) == 1
