"""Exit codes with one meaning each: 0 nothing found, 1 a counterexample in the target, 2 usage or
set-up (not the target's fault), 3 nothing was checked. Every case here is caught before a world
runs, so each must answer in seconds and without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import ddpcheck
from ddpcheck import cli, targets
from ddpcheck._front.environment import keep_hypothesis_out_of_the_current_folder
from ddpcheck.errors import ExitCode
from tests.patience import patience

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class DeclinesEverything(targets.ParallelTarget):
    def supports(self, scenario):
        return "this target only runs on Tuesdays"


DECLINES_EVERYTHING = DeclinesEverything()


def _ddpcheck(*args: str, cwd: str = ROOT, env: dict | None = None):
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "ddpcheck", *args],
        capture_output=True,
        text=True,
        timeout=patience(120),
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )
    return out, time.perf_counter() - started


@pytest.mark.parametrize(
    "source, message",
    [
        ("raise RuntimeError('no GPU here')\n", "RuntimeError: no GPU here"),
        ("def broken(:\n", "SyntaxError"),
    ],
)
def test_a_module_that_cannot_be_imported_is_a_setup_error(tmp_path, source, message):
    (tmp_path / "badmod.py").write_text(source)
    out, seconds = _ddpcheck("check", "badmod:T", cwd=str(tmp_path))
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr
    assert seconds < patience(10)  # interpreter + torch import, then one line


def test_worlds_that_cannot_fit_the_machine_are_refused_before_spawning():
    out, _ = _ddpcheck("check", "--world-sizes", "2,4096", "--examples", "1")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "would start 4096 rank processes" in out.stderr
    assert "Traceback" not in out.stderr


def test_an_unwritable_trace_output_is_refused_before_any_world_runs(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    (folder / "trace.json").mkdir()  # a directory where the file should go: never writable
    out, _ = _ddpcheck("trace", "-o", str(folder / "trace.json"))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "cannot be written" in out.stderr and "Traceback" not in out.stderr


def test_a_target_that_declines_everything_does_not_exit_0(capsys):
    # In this process: the claim is the command's status and message, which cli.main returns
    # and prints as the console script does (the process around it: the tests of set-up errors).
    status = cli.main(["check", "tests.front.test_exits:DECLINES_EVERYTHING", "--examples", "5"])
    err = capsys.readouterr().err
    assert status == 3, err
    assert "nothing was checked" in err
    assert "only runs on Tuesdays" in err


def test_replaying_a_declined_scenario_checks_nothing(capsys):
    status = cli.main(
        [
            "replay",
            "tests.front.test_exits:DECLINES_EVERYTHING",
            "--world-size",
            "2",
            "--scenario",
            "ddpcheck.Scenario(model=ddpcheck.zoo.MLP)",
        ]
    )
    assert status == 3, capsys.readouterr()


def test_assert_equivalent_raises_nothing_checked_not_success():
    with pytest.raises(ddpcheck.NothingChecked, match="only runs on Tuesdays"):
        ddpcheck.assert_equivalent(DECLINES_EVERYTHING, world_sizes=(2,))
    assert issubclass(ddpcheck.NothingChecked, ddpcheck.SetupError)
    assert not issubclass(ddpcheck.SetupError, AssertionError)  # never a failed assertion


def test_help_states_the_exit_codes():
    out, _ = _ddpcheck("check", "--help")
    assert "3 nothing was checked" in out.stdout.replace("\n", " ").replace("  ", " ")


WIDE_MODEL = """
from torch import nn


class Wide(nn.Module):  # expects 10 features; the default data has 5
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(10, 3)

    def forward(self, x):
        return self.fc(x)
"""


@pytest.mark.slow
def test_a_model_that_does_not_fit_its_data_is_a_setup_error_in_one_line(tmp_path):
    (tmp_path / "wide.py").write_text(WIDE_MODEL)
    out, _ = _ddpcheck(
        "replay",
        "local",
        "--world-size",
        "2",
        "--scenario",
        "ddpcheck.Scenario(model=wide.Wide)",
        cwd=str(tmp_path),
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "wide.Wide" in out.stderr and "(8x5 and 10x3)" in out.stderr, out.stderr


def test_the_model_failing_while_its_features_are_read_is_a_scenario_error(tmp_path, monkeypatch):
    (tmp_path / "wide.py").write_text(WIDE_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    import wide

    scenario = ddpcheck.Scenario(model=wide.Wide)
    with pytest.raises(ddpcheck.ScenarioError) as info:
        ddpcheck.features.of(scenario, 3)
    text = str(info.value)
    assert "model=wide.Wide" in text and "RuntimeError" in text and "\n" not in text, text


def test_an_internal_error_is_never_reported_as_a_found_bug(monkeypatch, capsys):

    def broken(args):
        raise RuntimeError("a bug in ddpcheck")

    monkeypatch.setitem(cli._COMMANDS, "trace", broken)
    assert cli.main(["trace"]) == ddpcheck.ExitCode.INTERNAL == 4
    err = capsys.readouterr().err
    assert "internal error (a bug in ddpcheck, not a verdict on the target" in err, err
    assert "RuntimeError: a bug in ddpcheck" in err, err


def _holders(pipe) -> list[str]:
    """The command lines of every other process that holds ``pipe`` open (Linux ``/proc``)."""
    name = f"pipe:[{os.fstat(pipe.fileno()).st_ino}]"
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(pid) != os.getpid() and any(
                os.readlink(f"/proc/{pid}/fd/{fd}") == name for fd in os.listdir(f"/proc/{pid}/fd")
            ):
                with open(f"/proc/{pid}/cmdline") as f:
                    found.append(f.read().replace("\0", " ").strip())
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(
    "args",
    [
        # a verdict after worlds ran: test_check_leaves_no_hypothesis_folder_in_the_current_folder
        # runs that command and asks this question of it too (one command, one world: not two)
        ("check", "nosuch_module:T"),  # a set-up error while the fork server still imports torch
    ],
    ids=["setup-error"],
)
def test_the_command_leaves_nothing_holding_its_output(args):
    """When the command has exited, its output has ended too: nothing it started (the fork
    server, multiprocessing's resource tracker, ranks, janitors) still holds the pipe, so
    `ddpcheck ... | tee` and a captured run end with the verdict, not seconds later (the fork
    server used to finish its imports, then tear down torch, ~1-3 s, holding stdout; the
    resource tracker a moment more)."""
    returncode, _, _, holders = _run_and_find_holders(args, cwd=ROOT)
    assert holders == [], f"still holding the command's output after it exited: {holders}"
    assert returncode == 2


def _run_and_find_holders(args, cwd, env=None, timeout=120.0):
    """Runs ``ddpcheck *args`` and, once it has exited, the processes still holding its output
    pipes: (exit status, stdout, stderr, holders)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpcheck", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # the output is a few lines: it fits the pipe's buffer, so waiting first cannot block
        proc.wait(timeout=patience(timeout))
        linux = sys.platform.startswith("linux")
        holders = _holders(proc.stdout) + _holders(proc.stderr) if linux else []
    finally:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err, holders


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ("targets",),  # make test: the same stop; check's (worlds running) a thorough variant
        pytest.param(
            ("check", "--world-sizes", "1", "--examples", "1"), marks=pytest.mark.thorough
        ),
    ],
    ids=["targets", "check"],
)
def test_a_closed_output_is_a_clean_stop_not_an_internal_error(args):
    """`ddpcheck targets | head` closes the pipe while the command still writes: that is the
    reader's choice, not a bug in ddpcheck (it was INTERNAL, 4, with a traceback) and no verdict
    (the table never reached anyone): the command stops as a SIGPIPE'd one would, 141, and
    leaves no world behind. The reading end is closed before the command starts, so the first
    line it writes finds no reader."""
    read, write = os.pipe()
    os.close(read)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "ddpcheck", *args],
            cwd=ROOT,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=patience(120),
        )
    finally:
        os.close(write)
    assert out.returncode == ExitCode.OUTPUT_CLOSED == 141, out.stderr
    assert "internal error" not in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_broken_pipe_that_is_not_the_output_is_an_internal_error(capsys, monkeypatch):
    """A pipe to a rank process breaking is ddpcheck's failure: only a closed *output* is the
    reader's choice (its status is 141); anything else keeps INTERNAL and its traceback."""

    def breaks():
        raise BrokenPipeError(32, "Broken pipe (a rank's)")

    assert cli._outcome("check", breaks) == ExitCode.INTERNAL
    assert "internal error" in capsys.readouterr().err
    read, write = os.pipe()
    with open(write, "w") as output:
        monkeypatch.setattr(sys, "stdout", output)
        assert not cli._output_closed()  # someone reads it
        os.close(read)
        assert cli._output_closed()  # nobody does any more


@pytest.mark.slow  # a process of its own: the command's environment is the subject
def test_check_leaves_no_hypothesis_folder_in_the_current_folder(tmp_path):
    # and, a verdict after worlds ran, nothing it started still holds its output once it exited
    # (test_the_command_leaves_nothing_holding_its_output's other case, asked of this command;
    # on Linux, where /proc tells)
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_STORAGE_DIRECTORY"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    work = tmp_path / "work"
    work.mkdir()
    returncode, out, err, holders = _run_and_find_holders(
        ("check", "local", "--world-sizes=1", "--examples=2"), cwd=str(work), env=env, timeout=300
    )
    assert holders == [], f"still holding the command's output after it exited: {holders}"
    assert returncode == 0, out + err
    assert list(work.iterdir()) == [], list(work.iterdir())
    assert (tmp_path / "cache" / "ddpcheck" / "hypothesis").is_dir()


def test_hypothesis_storage_the_user_asked_for_is_kept(monkeypatch):
    monkeypatch.setenv("HYPOTHESIS_STORAGE_DIRECTORY", ".hypothesis")
    keep_hypothesis_out_of_the_current_folder()
    assert os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] == ".hypothesis"
    monkeypatch.delenv("HYPOTHESIS_STORAGE_DIRECTORY")
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere")
    keep_hypothesis_out_of_the_current_folder()
    assert os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] == "/somewhere/ddpcheck/hypothesis"


def test_a_users_own_parallel_package_first_on_the_path_is_a_setup_error_naming_it(tmp_path):
    """The wheel's top-level ``parallel`` (docs/parallel.md#the-name-parallel): a folder with its
    own ``parallel`` package, first on ``sys.path`` under ``python -m``, is named, exit 2."""
    (tmp_path / "parallel").mkdir()
    (tmp_path / "parallel" / "__init__.py").write_text("MINE = True\n")
    out, _ = _ddpcheck("targets", cwd=str(tmp_path))
    assert out.returncode == ExitCode.SETUP, out.stdout + out.stderr
    assert "found " + str(tmp_path / "parallel" / "__init__.py") in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
