"""Trustworthy verdicts, A: a failure's replay line rebuilds exactly the target that failed.

The replay line is the proof behind exit status 1, so it must never name another target: a
plain-class target is rebuilt from the arguments it was built with, a dataclass from its fields,
a module attribute by its name -- each verified by rebuilding it in this process -- and a target
that cannot be rebuilt is refused when the check starts, before any world runs. A target written
in the script being run is named by the script's path (``check_mine.py:MyTarget()``) and
verified in the script imported as a module, as the replay process will import it.
"""

from __future__ import annotations

import functools
import os
import pickle
import shlex
import subprocess
import sys
import textwrap
import types

import pytest

import ddpcheck
from ddpcheck import check_example, targets, zoo
from ddpcheck._runs.replay import evaluate, replay_command, shell_word, target_spec
from ddpcheck.cli import resolve_target
from ddpcheck.scenario import Scenario
from tests import verdict_helpers as h
from tests.patience import patience

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _table(text: str) -> list[str]:
    """The divergence table of an EquivalenceError's message (header to the first blank line)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("step  W  rank"))
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


@pytest.mark.slow
def test_a_plain_class_target_fails_and_its_replay_line_fails_the_same_way():
    scenario = Scenario(zoo.MLP)
    target = h.MyTarget(scale_bug=True)
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        check_example(target, scenario, 2)
    err = info.value
    assert "reference differs (gradient)" in err.kinds
    spec = "tests.verdict_helpers:MyTarget(scale_bug=True)"
    assert err.replay.startswith(f"python -m ddpcheck replay {shlex.quote(spec)} --world-size 2")
    assert f"replay: {err.replay}" in str(err)

    # the line as printed, run by a shell (this interpreter for its `python`), as a user pastes it
    assert err.replay.startswith("python ")
    command = shlex.quote(sys.executable) + err.replay.removeprefix("python")
    out = subprocess.run(
        command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=patience(300)
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert _table(out.stdout) == _table(str(err))
    assert f"replay: {err.replay}" in out.stdout  # the replay prints the same line again

    # The line the harness used to print, MyTarget(), is a target without the bug: it passes.
    check_example(h.MyTarget(), scenario, 2)


@pytest.mark.parametrize(
    "target, spec",
    [
        (h.SCALED, "tests.verdict_helpers:SCALED"),
        (targets.PARALLEL, "ddpcheck.targets:PARALLEL"),
        (h.MyTarget(), "tests.verdict_helpers:MyTarget()"),
        (h.MyTarget(True), "tests.verdict_helpers:MyTarget(True)"),
        (
            h.Positional(True, h.a_rule),
            "tests.verdict_helpers:Positional(True, tests.verdict_helpers.a_rule)",
        ),
        (h.NoInit(), "tests.verdict_helpers:NoInit()"),
        (
            h.ScaledDataclass(rule=h.a_rule, scale=2.0),
            "tests.verdict_helpers:ScaledDataclass(rule=tests.verdict_helpers.a_rule, scale=2.0)",
        ),
        (
            targets.ParallelTarget(bucket_size_mb=1.0),
            "ddpcheck.targets:ParallelTarget(bucket_size_mb=1.0)",
        ),
        # a function field: the dataclass's repr (<function greedy at 0x...>) is not code
        (
            targets.ParallelTarget(sharding_rule=__import__("parallel.sharding").sharding.greedy),
            "ddpcheck.targets:ParallelTarget(sharding_rule=parallel.sharding.greedy)",
        ),
    ],
)
def test_targets_round_trip_through_their_spec(target, spec):
    assert target_spec(target) == spec
    for rebuilt in (evaluate(spec), resolve_target(spec)):  # the command line's evaluation
        assert type(rebuilt) is type(target)
        assert _state(rebuilt) == _state(target)
    # A copy (what a rank unpickles) keeps the recorded call: it is replayable too, by its
    # call when it is no longer the module attribute itself.
    copy = pickle.loads(pickle.dumps(target))
    assert vars(copy).get("_ddpcheck_call") == vars(target).get("_ddpcheck_call")
    assert _state(evaluate(target_spec(copy))) == _state(target)


def _state(target):
    """A target's state: its attributes but the recorded call, pickled for comparison."""
    return pickle.dumps({k: v for k, v in vars(target).items() if k != "_ddpcheck_call"})


def test_a_class_without_init_still_takes_no_arguments():
    with pytest.raises(TypeError, match=r"NoInit\(\) takes no arguments"):
        h.NoInit(1)


def test_a_dataclass_target_configured_by_the_scenario_round_trips():
    configured = targets.PARALLEL.configure(Scenario(bucket_size_mb=2.0))
    assert target_spec(configured) == "ddpcheck.targets:ParallelTarget(bucket_size_mb=2.0)"


def test_a_subclass_names_the_defaults_it_changed():
    # left out, bucket_size_mb=1.0 would read as the ready-made target's own configuration
    assert target_spec(h.SmallBuckets()) == "tests.verdict_helpers:SmallBuckets(bucket_size_mb=1.0)"
    assert (
        target_spec(h.SmallBuckets(bucket_size_mb=None))
        == "tests.verdict_helpers:SmallBuckets(bucket_size_mb=None)"
    )


def test_replay_lines_are_one_readable_shell_word_each():
    scenario = Scenario(zoo.MLP, optimizer_kwargs={"lr": 0.01}, dtype="float32")
    line = replay_command(targets.TORCH_DDP, scenario, 2)
    assert line.endswith(f'--scenario "{scenario!r}"') and "'\"'\"'" not in line, line
    echoed = subprocess.run(
        ["bash", "-c", f"printf '%s\\n' {line.split(' ', 3)[3]}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert echoed.splitlines()[-1] == repr(scenario)  # what bash hands to ddpcheck
    for text in ["a\"b'c", "x$y'", "plain"]:
        assert shlex.split(shell_word(text)) == [text]


def _local_target():
    class Local(h.MyTarget):
        pass

    return Local(scale_bug=True)


def _mutated():
    target = h.MyTarget()
    target.scale_bug = True  # the call that built it no longer describes it
    return target


@pytest.mark.parametrize(
    "make, phrases",
    [
        (
            lambda: h.MyTarget(scale_bug=h.Opaque()),
            [
                "target tests.verdict_helpers.MyTarget cannot be replayed",
                "does not evaluate (SyntaxError",
                "assign it to a module-level name (MY_TARGET = MyTarget(...)) in "
                "tests.verdict_helpers, or "
                "make MyTarget a dataclass whose fields hold its whole state",
            ],
        ),
        (
            _mutated,
            [
                "tests.verdict_helpers:MyTarget() builds a different target (scale_bug=True on the "
                "target, False rebuilt)"
            ],
        ),
        (
            lambda: h.ScaledDataclass(rule=functools.partial(h.a_rule)),  # picklable, repr not code
            [
                "target tests.verdict_helpers.ScaledDataclass cannot be replayed",
                "does not evaluate",
            ],
        ),
        (_local_target, ["cannot be pickled", "define the class at module level"]),
    ],
)
def test_an_unreplayable_target_is_refused_before_any_world(no_process_started, make, phrases):
    target = make()
    for check in (
        lambda: check_example(target, Scenario(), 2),
        lambda: ddpcheck.assert_equivalent(target, world_sizes=(2,)),
    ):
        with pytest.raises(ddpcheck.InvalidArgument) as info:
            check()
        for phrase in phrases:
            assert phrase in str(info.value)


def test_a_target_changed_after_its_check_is_verified_again():
    target = h.MyTarget()
    assert target_spec(target) == "tests.verdict_helpers:MyTarget()"
    target.scale_bug = True
    with pytest.raises(ddpcheck.InvalidArgument, match="builds a different target"):
        target_spec(target)


# ---------------------------------------------------------------------------------------------
# Targets written in the script being run

SCRIPT = textwrap.dedent("""
    import ddpcheck
    from ddpcheck import zoo
    from tests.verdict_helpers import MyTarget


    def my_rule(params, world_size):
        return [0] * len(params)


    class Doubled(MyTarget):
        \"\"\"torch DDP; with bug=True every averaged gradient is doubled.\"\"\"

        def __init__(self, bug=False, rule=None):
            super().__init__(scale_bug=bug)
            self.rule = rule


    MINE = Doubled(bug=True)

    if __name__ == "__main__":
        GUARDED = Doubled(bug=True)  # a name importing the script does not define

        class Hidden(ddpcheck.Target):
            pass

        ddpcheck.check_example(Doubled(bug=True), ddpcheck.Scenario(zoo.MLP), 2)
""")


@pytest.fixture
def script_main(tmp_path, monkeypatch):
    """``check_mine.py`` in an empty folder, run as the main module (as ``python check_mine.py``
    would, up to its last line: no world), from that folder."""
    path = tmp_path / "check_mine.py"
    path.write_text(SCRIPT)
    main = types.ModuleType("__main__")
    main.__file__ = str(path)
    main.__spec__ = None
    source = SCRIPT.replace("ddpcheck.check_example(", "print(")  # everything but the check
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "check_mine", raising=False)
    monkeypatch.chdir(tmp_path)
    exec(compile(source, str(path), "exec"), vars(main))  # our own test script
    yield main
    sys.modules.pop("check_mine", None)


def test_a_target_in_the_script_being_run_is_named_by_the_scripts_path(script_main):
    parallel_sharding = __import__("parallel.sharding").sharding
    rows = [
        (script_main.Doubled(), "check_mine.py:Doubled()"),
        (script_main.GUARDED, "check_mine.py:Doubled(bug=True)"),  # not by the guarded name
        (script_main.MINE, "check_mine.py:MINE"),
        (
            script_main.Doubled(rule=script_main.my_rule),
            "check_mine.py:Doubled(rule=check_mine.my_rule)",
        ),
        (
            targets.ParallelTarget(sharding_rule=script_main.my_rule),
            "check_mine.py:ddpcheck.targets.ParallelTarget(sharding_rule=check_mine.my_rule)",
        ),
        (
            targets.ParallelTarget(sharding_rule=parallel_sharding.greedy),  # no script in it
            "ddpcheck.targets:ParallelTarget(sharding_rule=parallel.sharding.greedy)",
        ),
    ]
    for target, spec in rows:
        assert target_spec(target) == spec
        rebuilt = evaluate(spec)  # what the replay process does: the file, imported as a module
        if type(target).__module__ == "__main__":
            assert type(rebuilt).__module__ == "check_mine"
            assert type(rebuilt).__qualname__ == type(target).__qualname__
        else:
            assert type(rebuilt) is type(target)
    assert sys.modules["check_mine"].__file__ == script_main.__file__
    # the script imported as a module did not run its main block
    assert not hasattr(sys.modules["check_mine"], "GUARDED")
    # the scenario language names the script's functions by the same module
    assert repr(Scenario(data=script_main.my_rule)).endswith("data=check_mine.my_rule)")


def test_what_a_script_cannot_rebuild_is_refused_with_the_fix(script_main, no_process_started):
    changed = script_main.Doubled()
    changed.scale_bug = True
    rows = [
        (
            script_main.Hidden(),
            'its class Hidden is defined in check_mine.py under `if __name__ == "__main__":`',
            "define Hidden at module level",
        ),
        (
            changed,
            "check_mine.py:Doubled() builds a different target (scale_bug=True on the "
            "target, False rebuilt)",
            "assign it to a module-level name",
        ),
        (
            script_main.Doubled(rule=lambda params, world_size: [0] * len(params)),
            "cannot be pickled",
            "functions defined with def at module level (not a lambda",
        ),
    ]
    for target, why, fix in rows:
        with pytest.raises(ddpcheck.InvalidArgument) as info:
            check_example(target, Scenario(), 2)
        assert why in str(info.value) and fix in str(info.value), str(info.value)


def test_a_target_in_an_interactive_session_is_refused_with_the_fix():
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import ddpcheck\n"
            "class InMain(ddpcheck.Target): pass\n"
            "ddpcheck.check_example(InMain(), ddpcheck.Scenario(), 2)\n",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    assert (
        "ddpcheck.errors.InvalidArgument: target __main__.InMain cannot be replayed" in done.stderr
    ), done.stderr
    assert "save the code in a file and run it (python check_my_ddp.py)" in done.stderr


@pytest.mark.slow
def test_a_script_failure_replays_from_the_scripts_folder(tmp_path):
    """The whole path: ranks unpickle the script's class (spawn imports the script in each), the
    replay process imports the file by path, and its ranks import it by name."""
    (tmp_path / "check_mine.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": ROOT}  # the script imports tests.verdict_helpers
    run = subprocess.run(
        [sys.executable, "check_mine.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 1, run.stderr
    replay = next(line for line in run.stderr.splitlines() if line.startswith("replay: "))
    assert replay.startswith(
        "replay: python -m ddpcheck replay 'check_mine.py:Doubled(bug=True)' --world-size 2"
    ), replay
    argv = shlex.split(replay[len("replay: ") :])
    argv[0] = sys.executable
    again = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 1, again.stdout + again.stderr
    assert _table(again.stdout) == _table(run.stderr)
    assert replay in again.stdout  # the replay names the script by its path again


def test_a_file_spec_imports_the_script_as_a_module_and_replays_by_its_path(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "check_mine.py").write_text(SCRIPT)  # its main block would start a world
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "check_mine", raising=False)
    monkeypatch.chdir(tmp_path)
    try:
        target = resolve_target("sub/check_mine.py:Doubled(bug=True)")
        assert type(target).__module__ == "check_mine" and target.scale_bug
        assert not hasattr(sys.modules["check_mine"], "GUARDED")  # the main block did not run
        assert target_spec(target) == "sub/check_mine.py:Doubled(bug=True)"
        assert target_spec(sys.modules["check_mine"].MINE) == "sub/check_mine.py:MINE"
    finally:
        sys.modules.pop("check_mine", None)
