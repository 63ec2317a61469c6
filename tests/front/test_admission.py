"""One admission step for every front door (``ddpcheck._runs.admission``).

Each door -- the API's four functions, the command line's six commands, the pytest plugin and a
``ddpcheck check`` under torchrun -- refuses a bad input before any process starts (observed in
the process table, ``tests.processes``), by the same rule with the same message: only the name of
the argument and the value as written differ (``world_sizes=(0,)`` / ``--world-sizes='0'``).
"""

from __future__ import annotations

import types

import pytest

import ddpcheck
from ddpcheck import cli, targets
from ddpcheck._runs import admission
from ddpcheck.scenario import Scenario
from tests.processes import none_started

#: (the API's keyword and value, the command line's flag and text, the rule's words)
BAD = {
    "world size 0": (
        ("world_sizes", (0,)),
        ("--world-sizes", "0"),
        "contains 0; every world size must be a positive integer",
    ),
    "no world size": (
        ("world_sizes", ()),
        ("--world-sizes", ""),
        "is empty; give at least one world size",
    ),
    "an endless deadline": (
        ("deadline", float("inf")),
        ("--deadline", "inf"),
        "must be finite: every wait has a deadline",
    ),
    "a negative deadline": (("deadline", -1), ("--deadline", "-1"), "must be a positive number"),
    "a mistyped feature": (
        ("without", ("acumulation",)),
        ("--without", "acumulation"),
        "'acumulation' is not a feature (did you mean 'accumulation'?)",
    ),
    "a dtype ddpcheck does not draw": (
        ("dtypes", ("float16",)),
        ("--dtypes", "float16"),
        "must name float64, float32 or both (did you mean 'float64'?)",
    ),
    "a mistyped focus": (
        ("only", ("acumulation",)),
        ("--only", "acumulation"),
        "'acumulation' is not a feature (did you mean 'accumulation'?)",
    ),
    "a malformed mesh shape": (
        ("meshes", "tp2"),
        ("--mesh", "tp2"),
        "'tp2' is not a mesh shape; write AXIS=N joined by x, such as tp=2, dp=2xtp=2 or pp=2xtp=2",
    ),
    "an unknown mesh axis": (
        ("meshes", "tp=2,cp=2"),
        ("--mesh", "tp=2,cp=2"),
        "unknown axis 'cp'; the axes are dp, pp and tp",
    ),
    "a mesh degree below 1": (
        ("meshes", "dp=2xtp=0"),
        ("--mesh", "dp=2xtp=0"),
        "tp=0 must be at least 1",
    ),
    "no mesh shape": (("meshes", ""), ("--mesh", ""), "is empty; give at least one shape"),
}

#: The API's doors, each with what it takes besides the bad argument (a survey maps every
#: feature, both dtypes included: it takes no ``dtypes``).
API_DOORS = {
    "assert_equivalent": lambda **kw: ddpcheck.assert_equivalent(targets.PARALLEL, **kw),
    "fuzz": lambda **kw: ddpcheck.fuzz(targets.PARALLEL, examples=1, **kw),
    "survey": lambda **kw: ddpcheck.survey(targets.PARALLEL, examples=1, **kw),
}
NOT_TAKEN = {("survey", "dtypes")}

#: The command line's doors and the flags each has.
CLI_DOORS = {
    "check": (
        ["check", "parallel"],
        {"--world-sizes", "--deadline", "--without", "--dtypes", "--only", "--mesh"},
    ),
    "survey": (
        ["survey", "parallel"],
        {"--world-sizes", "--deadline", "--without", "--only", "--mesh"},
    ),
    "replay": (
        ["replay", "parallel", "--world-size", "2", "--scenario", "ddpcheck.Scenario(steps=1)"],
        {"--deadline"},
    ),
    "trace": (["trace", "parallel"], {"--deadline"}),
    "mutants": (["mutants"], {"--world-sizes", "--deadline"}),
    "fuzz-rule": (["fuzz-rule", "parallel.sharding:greedy"], {"--world-sizes", "--deadline"}),
}


def _tail(message: str) -> str:
    """The message without the argument's name and value: the rule, as every door words it."""
    return message.split(" ", 1)[1]


def _cli_message(argv: list[str], capsys) -> str:
    capsys.readouterr()
    with none_started():
        assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    return err.split(": error: ", 1)[1]


@pytest.mark.parametrize("bad", BAD, ids=str)
@pytest.mark.parametrize("door", API_DOORS)
def test_every_api_door_refuses_before_any_process(door, bad):
    (keyword, value), _, rule = BAD[bad]
    if (door, keyword) in NOT_TAKEN:
        pytest.skip(f"{door} takes no {keyword}")
    with none_started(), pytest.raises(ddpcheck.InvalidArgument) as info:
        API_DOORS[door](**{keyword: value})
    assert rule in str(info.value)
    assert str(info.value).startswith(keyword), str(info.value)


@pytest.mark.parametrize(
    "bad", [b for b in BAD if BAD[b][0][0] in ("world_sizes", "deadline")], ids=str
)
def test_check_example_refuses_before_any_process(bad):
    (keyword, value), _, rule = BAD[bad]
    if keyword == "world_sizes":  # check_example takes one world size
        with none_started(), pytest.raises(ddpcheck.InvalidArgument, match="world_size=0"):
            ddpcheck.check_example(targets.PARALLEL, Scenario(), 0)
        return
    with none_started(), pytest.raises(ddpcheck.InvalidArgument) as info:
        ddpcheck.check_example(targets.PARALLEL, Scenario(), 2, **{keyword: value})
    assert rule in str(info.value)


@pytest.mark.parametrize("bad", BAD, ids=str)
@pytest.mark.parametrize("door", CLI_DOORS)
def test_every_command_refuses_before_any_process_with_the_api_message(door, bad, capsys):
    (keyword, value), (flag, text), _ = BAD[bad]
    argv, flags = CLI_DOORS[door]
    if flag not in flags:
        pytest.skip(f"ddpcheck {door} has no {flag}")
    message = _cli_message([*argv, f"{flag}={text}"], capsys)
    assert message.startswith(f"{flag}"), message
    with pytest.raises(ddpcheck.InvalidArgument) as info:
        admission.admit(**{keyword: value})
    assert _tail(message) == _tail(str(info.value))


def test_a_scenario_and_a_target_are_admitted_before_any_process(capsys):
    """replay reads and judges its scenario, and every door resolves its target, at the door."""
    message = _cli_message(
        ["replay", "parallel", "--world-size", "2", "--scenario", "ddpcheck.Scenario(steps=0)"],
        capsys,
    )
    assert message.startswith("--scenario 'ddpcheck.Scenario(steps=0)'"), message
    for door in ("check", "survey", "trace"):
        assert "did you mean 'accelerate'?" in _cli_message([door, "accelerat"], capsys)
    with none_started(), pytest.raises(ddpcheck.InvalidArgument, match="is a class"):
        ddpcheck.assert_equivalent(targets.ParallelTarget)


class _Config:
    """What ``pytest_plugin.resolve_options`` reads of pytest's config."""

    def __init__(self, **given):
        self.given = {f"ddpcheck_{k}": v for k, v in given.items()}
        self.option = types.SimpleNamespace(numprocesses=None)

    def getoption(self, name):
        return self.given.get(name)


@pytest.mark.parametrize("bad", BAD, ids=str)
def test_the_pytest_plugin_admits_its_options_as_the_other_doors(bad):
    from ddpcheck import pytest_plugin

    _, (flag, text), rule = BAD[bad]
    option = flag.lstrip("-").replace("-", "_")
    with none_started(), pytest.raises(pytest.UsageError) as info:
        pytest_plugin.resolve_options(_Config(**{option: text}))
    assert str(info.value).startswith(f"--ddpcheck-{flag.lstrip('-')}"), str(info.value)
    assert rule in str(info.value)


def test_under_torchrun_check_admits_before_joining_the_world(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    message = _cli_message(["check", "parallel", "--without", "acumulation"], capsys)
    assert "did you mean 'accumulation'?" in message


def test_one_set_of_defaults():
    """The API and the command line default alike: what each door would run."""
    api = admission.admit(targets.PARALLEL)
    parsed = cli.build_parser().parse_args(["check"])
    command = admission.admit(
        parsed.target,
        world_sizes=parsed.world_sizes or ddpcheck.DEFAULT_WORLD_SIZES,
        deadline=parsed.deadline,
        without=parsed.without,
        dtypes=parsed.dtypes,
        device=parsed.device,
        backend=parsed.backend,
        spelling=admission.COMMAND_LINE,
    )
    assert api == command
    assert api.battery_without == frozenset()  # the whole battery, float32 scenario too
    assert api.random_dtypes == ("float64",)


class _Float32Only(targets.ParallelDDPTarget):
    """A target that declines float64, as torchtitan (its RoPE rotates in float32) does."""

    supported_features = frozenset(ddpcheck.features.FEATURES) - {"float64"}


def test_a_target_that_declines_float64_draws_the_dtypes_it_checks():
    assert admission.admit(_Float32Only()).random_dtypes == ("float32",)
    assert admission.admit(targets.ParallelDDPTarget()).random_dtypes == ("float64",)
    named = admission.admit(_Float32Only(), dtypes=("float64",))
    assert named.random_dtypes == ("float64",)  # what is named is drawn (and said undrawable)
    # what the user excluded stays excluded: nothing to draw, said so (test_options)
    excluded = admission.admit(_Float32Only(), without=("float32",))
    assert excluded.random_dtypes == ("float64",)
