"""Bad-input table: every argument of DDP, ShardedOptimizer, assert_equivalent and the command line,
given an invalid value, fails with a message that names the argument -- no deep torch traceback.

Rows already covered elsewhere are not repeated here: tests/parallel/test_ddp.py
(``test_bad_arguments_name_the_problem``: bucket_size_mb 0/-1/nan/'25', a module without trainable
parameters or not a module; no process group), tests/parallel/test_sharded_optimizer.py (``MISUSE``:
optimizer_cls, empty/set/duplicate params, optimizer kwargs, sharding rules, owner_of,
consolidate_state_dict(to=2), load_state_dict shapes) and tests/world/test_harness.py (world_sizes,
deadline=0, scenario, targets, Scenario fields).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpcheck
from ddpcheck import cli, targets
from ddpcheck._world.registry import get_world
from ddpcheck.errors import ExitCode
from parallel import DDP, InvalidArgument, ShardedOptimizer
from tests.patience import patience

# ---------------------------------------------------------------------------------------------
# parallel.DDP and parallel.ShardedOptimizer, inside a world of 2 (every rank must agree)


def _one_arg_rule(params):
    return [0] * len(params)


def _attempt(fn):
    try:
        fn()
    except Exception as e:  # the table asserts on the type and text
        if isinstance(e, InvalidArgument):
            return "parallel.InvalidArgument", str(e)
        return type(e).__name__, str(e)
    return "no error", ""


def rank_bad_parallel_arguments():
    only_rank_0 = dist.new_group([0])  # collective: every rank creates every group
    try:  # a group left behind would make the world unfit for the next task
        return _bad_parallel_arguments(only_rank_0)
    finally:
        dist.destroy_process_group(only_rank_0)


def _bad_parallel_arguments(only_rank_0):
    rank = dist.get_rank()
    SGD = torch.optim.SGD
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2, 2))]
    attempts = {
        "DDP module=None": lambda: DDP(None),
        "DDP bucket_size_mb=inf": lambda: DDP(nn.Linear(2, 2), bucket_size_mb=float("inf")),
        "DDP bucket_size_mb=True": lambda: DDP(nn.Linear(2, 2), bucket_size_mb=True),
        "DDP process_group='world'": lambda: DDP(nn.Linear(2, 2), process_group="world"),
        "SO params=None": lambda: ShardedOptimizer(None, SGD, lr=0.1),
        "SO params=[1.0]": lambda: ShardedOptimizer([1.0], SGD, lr=0.1),
        "SO unknown kwarg": lambda: ShardedOptimizer(params, SGD, lr=0.1, momentum_typo=0.9),
        "SO sharding_rule(params)": lambda: ShardedOptimizer(
            params, SGD, sharding_rule=_one_arg_rule, lr=0.1
        ),
        "SO process_group='world'": lambda: ShardedOptimizer(
            params, SGD, process_group="world", lr=0.1
        ),
    }
    if rank == 1:  # raised before any collective, so rank 0 is not left waiting
        attempts["DDP process_group without this rank"] = lambda: DDP(
            nn.Linear(2, 2), process_group=only_rank_0
        )
        attempts["SO process_group without this rank"] = lambda: ShardedOptimizer(
            params, SGD, process_group=only_rank_0, lr=0.1
        )
    out = {label: _attempt(fn) for label, fn in attempts.items()}
    opt = ShardedOptimizer(params, SGD, lr=0.1)
    out["SO consolidate to=-1"] = _attempt(lambda: opt.consolidate_state_dict(to=-1))
    out["SO consolidate to='0'"] = _attempt(lambda: opt.consolidate_state_dict(to="0"))
    out["SO load_state_dict(None)"] = _attempt(lambda: opt.load_state_dict(None))
    out["SO add_param_group(list)"] = _attempt(
        lambda: opt.add_param_group([nn.Parameter(torch.ones(1))])
    )
    out["SO add_param_group(no params key)"] = _attempt(lambda: opt.add_param_group({"lr": 0.1}))
    return out


# label -> fragments of the message, all raised as parallel.InvalidArgument; "*" rows run on
# rank 1 only
PARALLEL_ROWS = {
    "DDP module=None": ["module=None must be a torch.nn.Module"],
    "DDP bucket_size_mb=inf": ["bucket_size_mb=inf must be finite"],
    "DDP bucket_size_mb=True": ["bucket_size_mb=True must be a positive number"],
    "DDP process_group='world'": [
        "process_group='world' must be a torch.distributed ProcessGroup",
        "dist.new_group",
    ],
    "DDP process_group without this rank": ["does not contain this rank (global rank 1)"],
    "SO params=None": ["params=None must be an ordered iterable"],
    "SO params=[1.0]": ["param group 0, parameter 0 is 1.0", "parameters must be tensors"],
    "SO unknown kwarg": ["optimizer_cls=SGD rejected optimizer_kwargs=", "momentum_typo"],
    "SO sharding_rule(params)": [
        "sharding_rule=tests.front.test_bad_input._one_arg_rule",
        "rule(params, world_size)",
    ],
    "SO process_group='world'": [
        "process_group='world' must be a torch.distributed ProcessGroup",
        "dist.new_group",
    ],
    "SO process_group without this rank": ["does not contain this rank (global rank 1)"],
    "SO consolidate to=-1": ["to=-1 must be a rank", "[0, 2)"],
    "SO consolidate to='0'": ["to='0' must be a rank", "[0, 2)"],
    "SO load_state_dict(None)": ["state_dict=None", "state dict"],
    "SO add_param_group(list)": ["param_group=[", "must be a dict with a 'params' key"],
    "SO add_param_group(no params key)": [
        "param_group={'lr': 0.1}",
        "must be a dict with a 'params' key",
    ],
}


@pytest.fixture(scope="module")
def parallel_answers():
    return get_world(2).run(rank_bad_parallel_arguments, deadline=patience(120))


@pytest.mark.parametrize("label", list(PARALLEL_ROWS))
def test_parallel_argument_errors_name_the_argument(parallel_answers, label):
    fragments = PARALLEL_ROWS[label]
    ranks = [1] if "without this rank" in label else [0, 1]
    for rank in ranks:
        got_kind, message = parallel_answers[rank][label]
        assert got_kind == "parallel.InvalidArgument", (rank, label, got_kind, message)
        for fragment in fragments:
            assert fragment in message, (rank, fragment, message)
        assert "Traceback" not in message


# ---------------------------------------------------------------------------------------------
# ddpcheck.assert_equivalent (all raised before any rank process is spawned)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"deadline": -1}, ddpcheck.InvalidArgument, "deadline=-1 must be a positive number"),
        ({"deadline": "5"}, ddpcheck.InvalidArgument, "deadline='5' must be a positive number"),
        ({"deadline": float("nan")}, ddpcheck.InvalidArgument, "deadline=nan must be a positive"),
        ({"deadline": float("inf")}, ddpcheck.InvalidArgument, "deadline=inf must be finite"),
        ({"deadline": True}, ddpcheck.InvalidArgument, "deadline=True must be a positive number"),
        (
            {"world_sizes": None},
            ddpcheck.InvalidArgument,
            "world_sizes=None must be a sequence of positive integers",
        ),
        ({"world_sizes": [True]}, ddpcheck.InvalidArgument, "world_sizes=[True] contains True"),
        ({"scenario": ddpcheck.Scenario}, ddpcheck.InvalidArgument, "must be a ddpcheck.Scenario"),
        ({"world_size": 2}, TypeError, "unexpected keyword argument 'world_size'"),
    ],
)
def test_assert_equivalent_argument_errors(kwargs, error, message):
    with pytest.raises(error) as info:
        ddpcheck.assert_equivalent(targets.PARALLEL, **{"world_sizes": (1,), **kwargs})
    assert message in str(info.value)


@pytest.mark.parametrize(
    "target, message",
    [
        (None, "target=None lacks ['configure'"),
        ("parallel", "target='parallel' lacks ['configure'"),
    ],
)
def test_assert_equivalent_target_errors(target, message):
    with pytest.raises(ddpcheck.InvalidArgument) as info:
        ddpcheck.assert_equivalent(target, world_sizes=(1,))
    assert message in str(info.value)


# ---------------------------------------------------------------------------------------------
# The command line: exit status 2, the message on stderr, no traceback


class InitRaises(ddpcheck.Target):
    """A target whose constructor raises: the constructor's own exception is the message."""

    def __init__(self):
        raise ValueError("bucket_size_mb must be positive")


CLI_ROWS = [
    (
        ["check", "tests.front.test_bad_input:InitRaises()"],
        "InitRaises() raised ValueError: bucket_size_mb must be positive (test_bad_input.py, line ",
    ),
    (
        ["check", "nocolon"],
        "target 'nocolon' is not a built-in target (`ddpcheck targets` lists them: parallel, ",
    ),
    (
        ["check", "accelerat"],
        "target 'accelerat' is not a built-in target (did you mean 'accelerate'?)",
    ),
    (["check", "torch_fdsp"], "(did you mean 'torch_fsdp'?)"),
    (
        ["check", "ddpcheck.targets:PARALEL"],
        "'PARALEL' is not defined in ddpcheck.targets (did you mean 'PARALLEL'?)",
    ),
    (
        ["check", "--without", "acumulation"],
        "'acumulation' is not a feature (did you mean 'accumulation'?)",
    ),
    (["check", "no_such_module_xyz:T"], "cannot import 'no_such_module_xyz'"),
    (["check", "ddpcheck.targets:NOPE"], "'NOPE' is not defined in ddpcheck.targets"),
    (["check", "ddpcheck.targets:Target"], "target=Target is a class; pass an instance"),
    (["check", "ddpcheck.zoo:MLP()"], "lacks ['configure'"),
    (
        ["check", "--world-sizes", "0"],
        "--world-sizes='0' contains 0; every world size must be a positive integer",
    ),
    (["check", "--world-sizes", "two"], "--world-sizes='two' must be comma-separated integers"),
    (["check", "--world-sizes", ""], "--world-sizes='' is empty; give at least one world size"),
    (["check", "--deadline", "0"], "--deadline='0' must be a positive number"),
    (["check", "--deadline", "soon"], "--deadline='soon' must be a positive number"),
    (["check", "--deadline", "inf"], "--deadline='inf' must be finite"),
    (["check", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["chek"], "invalid choice: 'chek'"),
    (["chek"], "(did you mean 'check'?)"),
    (
        ["check", "--exampels", "3"],
        "unrecognized arguments: --exampels (did you mean '--examples'?)",
    ),
    (["survey", "--shrink-secs=2"], "(did you mean '--shrink-seconds'?)"),
    (
        ["check", "--dtypes", "float46"],
        "must name float64, float32 or both (did you mean 'float64'?)",
    ),
    (
        ["check", "--device", "cdua"],
        "invalid choice: 'cdua' (choose from 'cpu', 'cuda') (did you mean 'cuda'?)",
    ),
    (
        [
            "replay",
            "parallel",
            "--world-size",
            "2",
            "--scenario",
            "ddpcheck.Scenario(acumulation=2)",
        ],
        "Scenario has no field 'acumulation' (did you mean 'accumulation'?)",
    ),
    (
        [
            "replay",
            "parallel",
            "--world-size",
            "2",
            "--scenario",
            "ddpcheck.Scenario(model=ddpcheck.models.ModelSpec(widht=3))",
        ],
        "ModelSpec has no field 'widht' (did you mean 'width'?)",
    ),
    (
        ["replay", "parallel", "--scenario", "ddpcheck.Scenario()"],
        "the following arguments are required: --world-size",
    ),
    (
        ["replay", "parallel", "--world-size", "2"],
        "the following arguments are required: --scenario",
    ),
    (
        ["replay", "parallel", "--world-size", "0", "--scenario", "ddpcheck.Scenario()"],
        "argument --world-size: '0' must be positive",
    ),
    (
        ["replay", "parallel", "--world-size", "x", "--scenario", "ddpcheck.Scenario()"],
        "argument --world-size: 'x' is not a int",
    ),
    (
        ["replay", "parallel", "--world-size", "2", "--scenario", "ddpcheck.Scenario("],
        "--scenario could not be read: SyntaxError",
    ),
    (
        ["replay", "parallel", "--world-size", "2", "--scenario", "42"],
        "--scenario '42': '42' does not describe a ddpcheck.Scenario",
    ),
    (
        ["replay", "parallel", "--world-size", "2", "--scenario", "ddpcheck.Scenario(steps=0)"],
        "--scenario 'ddpcheck.Scenario(steps=0)': steps=0 must be an integer >= 1",
    ),
    (
        ["replay", "nocolon", "--world-size", "2", "--scenario", "ddpcheck.Scenario()"],
        "nor MODULE:NAME or path/to/FILE.py:NAME for your own",
    ),
    (["check", "no_such_file.py:T"], "target 'no_such_file.py:T': 'no_such_file.py' is not a file"),
    (
        ["fuzz-rule", "no/such_rules.py:greedy"],
        "rule 'no/such_rules.py:greedy': 'no/such_rules.py' is not a file",
    ),
]


@pytest.mark.parametrize("argv, message", CLI_ROWS, ids=[" ".join(a) for a, _ in CLI_ROWS])
def test_command_line_errors_exit_2_naming_the_argument(argv, message, capsys):
    try:
        status = cli.main(argv)
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    err = capsys.readouterr().err
    assert status == ExitCode.SETUP, err
    assert message in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "name, source, message",
    [
        ("my-checks.py", "T = 1\n", "'my-checks' is not a Python name; rename the file"),
        (
            "json.py",
            "T = 1\n",
            "cannot be imported as the module 'json': a module of that name is already imported",
        ),
        (
            "broken.py",
            "raise RuntimeError('boom')\n",
            "cannot import '{path}' for target '{path}:T': RuntimeError: boom",
        ),
    ],
)
def test_a_script_that_cannot_be_a_module_exits_2_naming_the_fix(
    tmp_path, capsys, monkeypatch, name, source, message
):
    monkeypatch.setattr(sys, "path", list(sys.path))
    path = tmp_path / name
    path.write_text(source)
    assert cli.main(["check", f"{path}:T"]) == ExitCode.SETUP
    err = capsys.readouterr().err
    assert message.format(path=path) in err, err
    assert "broken" not in sys.modules  # a module that failed to import is not left half-made


def test_the_installed_command_reports_usage_errors_without_a_traceback():
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
            "ddpcheck.Scenario(dtype='float16')",
        ],
        capture_output=True,
        text=True,
        timeout=patience(120),
    )
    assert out.returncode == 2, out.stderr
    assert "dtype='float16' must be one of ['float32', 'float64']" in out.stderr
    assert "Traceback" not in out.stderr
