"""Ctrl-C ends a run within seconds wherever it lands, with exit 130 and nothing left.

The command line exits 130 with one line; a script calling the API gets the
``KeyboardInterrupt`` (Python's own exit: killed by SIGINT, 130 in a shell). The signal goes to
the run's whole process group, as a terminal sends it, at a moment chosen by what the run has
shown -- the fork server's directory, a world's directory, an example's seed, a line of output --
so each phase is hit whatever the machine's speed: start-up, ranks being forked, the battery,
random examples, shrinking. ``bench/ctrl_c.py`` does the same at random moments, 100 times.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from ddpcheck import cli
from ddpcheck.errors import ExitCode
from ddpcheck.targets import ParallelTarget
from tests.patience import patience

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: Seconds from the signal to the exit that the issue allows (``bench/ctrl_c.py`` measured a
#: median of ~0.2 s and at most ~2 s on a loaded 2-core machine).
WITHIN = 15.0
MARKER = "DDPCHECK_INTERRUPT_TEST"
SEEDS_LOG = "DDPCHECK_INTERRUPT_TEST_SEEDS"


#: The seeds from which SeededAfterBattery is faulty: above every battery scenario's (0-12), below
#: most random ones -- whichever examples Hypothesis's derandomized stream draws (it follows the
#: source of the drawing code: a reformatted fuzz.py drew no seed of 60,000 or more in 200).
FAULTY_FROM = 100


@dataclasses.dataclass(frozen=True)
class SeededAfterBattery(ParallelTarget):
    """parallel's target with the NoDivide mutant's bug in scenarios seeded :data:`FAULTY_FROM`
    or more (no battery scenario is): the battery passes, a random example fails and is shrunk.
    Notes each scenario's seed as the checking process takes it up, for the test to choose its
    moment."""

    def configure(self, scenario):
        log = os.environ.get(SEEDS_LOG)
        if log and multiprocessing.parent_process() is None:
            with open(log, "a") as f:
                f.write(f"{time.monotonic():.3f} {scenario.seed}\n")
        if scenario.seed >= FAULTY_FROM:
            from ddpcheck.mutation.catalogue import by_name

            return by_name("NoDivide").target.configure(scenario)
        return super().configure(scenario)


SEEDED = SeededAfterBattery()


@dataclasses.dataclass(frozen=True)
class FailsInTheBattery(SeededAfterBattery):
    """NoDivide's bug in the battery's SampleBranch scenarios alone (no random scenario builds a
    zoo model): the battery fails, then the search for a smaller counterexample runs its whole
    budget, finding none."""

    def configure(self, scenario):
        from ddpcheck import zoo

        super().configure(scenario)  # notes the seed
        if scenario.model is zoo.SampleBranch:
            from ddpcheck.mutation.catalogue import by_name

            return by_name("NoDivide").target.configure(scenario)
        return self


FAILS_IN_THE_BATTERY = FailsInTheBattery()

API_SCRIPT = """
import ddpcheck
from tests.front.test_interrupts import SEEDED

if __name__ == "__main__":
    print(ddpcheck.assert_equivalent(SEEDED, world_sizes=(2,)), flush=True)
    print("fuzzing", flush=True)
    ddpcheck.fuzz(SEEDED, examples=200, world_sizes=(2,))
"""


# ---------------------------------------------------------------------------------------------
# Where the signal lands outside any world: each raised from inside the command


def _command(source: str) -> subprocess.CompletedProcess:
    """Run ``source`` then ``cli.command()`` in a process of its own, SIGINT raising."""
    code = f"import signal, sys\nfrom ddpcheck import cli\n{source}\ncli.command()\n"
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=patience(60),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def test_a_ctrl_c_while_the_arguments_are_parsed_exits_130():
    out = _command(
        "real = cli.build_parser\n"
        "def build_parser():\n"
        "    signal.raise_signal(signal.SIGINT)\n"
        "    return real()\n"
        "cli.build_parser = build_parser\n"
        "sys.argv = ['ddpcheck', 'targets']"
    )
    assert out.returncode == ExitCode.INTERRUPTED == 130, out.stderr
    assert out.stderr.strip() == "ddpcheck: interrupted; every rank process was stopped"


def test_a_second_ctrl_c_while_the_worlds_stop_changes_nothing():
    """The first stops the command; a second, while its worlds are being stopped, neither cuts
    that short nor turns the exit into a traceback."""
    out = _command(
        "from ddpcheck._world import registry\n"
        "def interrupted(args):\n"
        "    raise KeyboardInterrupt\n"
        "cli._COMMANDS['targets'] = interrupted\n"
        "real = registry.shutdown_worlds\n"
        "def shutdown_worlds():\n"
        "    signal.raise_signal(signal.SIGINT)\n"
        "    real()\n"
        "    print('stopped', flush=True)\n"
        "registry.shutdown_worlds = shutdown_worlds\n"
        "sys.argv = ['ddpcheck', 'targets']"
    )
    assert out.returncode == 130, out.stderr
    assert out.stdout.split() == ["stopped"] * 2, out.stdout  # then again at exit: a no-op
    assert out.stderr.strip() == "ddpcheck: interrupted; every rank process was stopped"


LOSES_IT = (
    "def loses_it(args):\n"
    "    try:\n"
    "        signal.raise_signal(signal.SIGINT)\n"
    "    except BaseException:  # as code catching everything, or a gc callback, does\n"
    "        pass\n"
    "{then}\n"
    "cli._COMMANDS['targets'] = loses_it\n"
    "sys.argv = ['ddpcheck', 'targets']"
)


def test_a_ctrl_c_that_was_lost_is_raised_again():
    """Python loses a KeyboardInterrupt raised in a gc or weakref callback, and code catching
    everything swallows it: the command raises it again (``interrupts.AGAIN_AFTER``) rather
    than run on to its end."""
    from ddpcheck._world.interrupts import AGAIN_AFTER

    started = time.monotonic()
    out = _command(LOSES_IT.format(then="    import time\n    time.sleep(600)\n    return 0"))
    elapsed = time.monotonic() - started
    assert out.returncode == 130, out.stderr
    assert out.stderr.strip() == "ddpcheck: interrupted; every rank process was stopped"
    assert AGAIN_AFTER <= elapsed < AGAIN_AFTER + patience(10), elapsed


def test_what_a_lost_ctrl_c_left_behind_is_130_not_an_error():
    """An interrupted import came back as another error (RecursionError, "cannot load module
    more than once"): after a Ctrl-C, whatever the command came to is the interrupt's."""
    out = _command(LOSES_IT.format(then="    raise RecursionError('a module half imported')"))
    assert out.returncode == 130, out.stderr
    assert out.stderr.strip() == "ddpcheck: interrupted; every rank process was stopped"


def test_terminated_is_143_as_before(capsys):
    def terminated(args):
        raise cli.Terminated()

    real = cli._COMMANDS["targets"]
    cli._COMMANDS["targets"] = terminated
    try:
        assert cli.main(["targets"]) == ExitCode.TERMINATED == 143
    finally:
        cli._COMMANDS["targets"] = real
    assert "terminated; every rank process was stopped" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Runs interrupted at each phase


def _marked(token: str) -> list[int]:
    """Live processes whose environment carries the run's marker: everything the run started
    inherits it (the fork server, the resource tracker, ranks, janitors)."""
    needle = f"{MARKER}={token}".encode()
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            pass
    return found


@dataclasses.dataclass
class _Run:
    """What the run has shown so far."""

    tmp: str
    seeds_log: str
    lines: list = dataclasses.field(default_factory=list)  # (monotonic time, line)

    def files(self) -> list[str]:
        return os.listdir(self.tmp)

    def seeds(self) -> list[tuple[float, int]]:
        try:
            with open(self.seeds_log) as f:
                return [(float(t), int(s)) for t, s in (line.split() for line in f)]
        except (OSError, ValueError):
            return []

    def printed(self, word: str) -> float | None:
        return next((at for at, line in list(self.lines) if word in line), None)

    def after(self, word: str) -> bool:
        """An example taken up after ``word`` was printed."""
        at = self.printed(word)
        return at is not None and any(t > at for t, _ in self.seeds())


def _interrupt(cmd: list[str], moment, tmp_path) -> tuple[int, float, str]:
    """Run ``cmd`` in a process group of its own; once ``moment(run)`` holds, SIGINT the group.
    Return the exit status, the seconds from the signal to the exit, the output -- after checking
    that nothing the run started is left."""
    # TMPDIR short and its own: the fork server's socket lives in it, and a Unix socket's path
    # may not exceed 107 bytes (xdist's basetemp, pytest-N/popen-gwK/test_.../, came close)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="i"))
    run = _Run(str(tmp), str(tmp_path / "seeds.log"))
    token = f"{os.getpid()}-{tmp_path.name}"
    env = {
        **os.environ,
        "TMPDIR": str(tmp),
        SEEDS_LOG: run.seeds_log,
        MARKER: token,
        "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    reader = threading.Thread(
        target=lambda: run.lines.extend((time.monotonic(), line) for line in proc.stdout),
        daemon=True,
    )
    reader.start()
    try:
        end = time.monotonic() + patience(120)
        while not moment(run):
            assert proc.poll() is None, "the run ended before the moment:\n" + "".join(
                line for _, line in run.lines
            )
            assert time.monotonic() < end, "the moment never came"
            time.sleep(0.01)
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        status = proc.wait(timeout=patience(60))
        seconds = time.monotonic() - sent
        reader.join(patience(10))
        output = "".join(line for _, line in run.lines)
        end = time.monotonic() + patience(10)
        while _marked(token) and time.monotonic() < end:
            time.sleep(0.05)
        assert not _marked(token), f"left running: {_marked(token)}\n{output}"
        # torch's compile cache (torchinductor_USER) is meant to stay: not ddpcheck's
        left = [name for name in run.files() if not name.startswith("torchinductor_")]
        assert not left, f"left in TMPDIR: {left}\n{output}"
        return status, seconds, output
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in _marked(token):  # never leave anything, even when failing
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


CHECK = [
    sys.executable,
    "-m",
    "ddpcheck",
    "check",
    "tests.front.test_interrupts:SEEDED",
    "--world-sizes",
    "2",
    "--examples",
    "200",
]

MOMENTS = {
    # the fork server has just been started: this process goes on to import the target
    "fork-server": lambda run: any(n.startswith("pymp-") for n in run.files()),
    # the first world's directory exists: its janitor and ranks are being started
    "ranks-forking": lambda run: any(n.startswith("ddpcheck-w2-") for n in run.files()),
    "battery": lambda run: len(run.seeds()) >= 3,
    "random-examples": lambda run: run.after("fuzzing"),
    # the third failing example taken up: the first was found, the second Hypothesis run shrinks
    "shrinking": lambda run: sum(seed >= FAULTY_FROM for _, seed in run.seeds()) >= 3,
}
THOROUGH_MOMENTS = {"ranks-forking", "random-examples"}


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(
    "phase",
    # `make test` interrupts the fork server, the battery and the shrinking; the moments between
    # (a world forking, the random examples) are `thorough`
    [pytest.param(m, marks=pytest.mark.thorough if m in THOROUGH_MOMENTS else ()) for m in MOMENTS],
)
def test_ctrl_c_of_ddpcheck_check_exits_130_within_seconds(tmp_path, phase):
    status, seconds, out = _interrupt(CHECK, MOMENTS[phase], tmp_path)
    assert status == ExitCode.INTERRUPTED, out
    assert out.rstrip().endswith("ddpcheck: interrupted; every rank process was stopped"), out
    assert "Traceback" not in out, out
    assert seconds < patience(WITHIN), f"{seconds:.1f} s from the signal to the exit"


@pytest.mark.slow
@pytest.mark.thorough  # make test: Ctrl-C while Hypothesis shrinks (the "shrinking" moment above)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_while_check_searches_for_a_smaller_counterexample_exits_130(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "ddpcheck",
        "check",
        "tests.front.test_interrupts:FAILS_IN_THE_BATTERY",
        "--world-sizes",
        "2",
    ]
    status, seconds, out = _interrupt(
        cmd, lambda run: run.after("searching for a smaller"), tmp_path
    )
    assert status == ExitCode.INTERRUPTED, out
    assert out.rstrip().endswith("ddpcheck: interrupted; every rank process was stopped"), out
    assert "Traceback" not in out and "diverged" not in out, out
    assert seconds < patience(WITHIN), f"{seconds:.1f} s from the signal to the exit"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_of_a_script_calling_the_api_raises_keyboard_interrupt(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(API_SCRIPT)
    status, seconds, out = _interrupt(
        [sys.executable, str(script)], lambda run: run.after("fuzzing"), tmp_path
    )
    assert status == -signal.SIGINT, out  # Python's exit on a KeyboardInterrupt: 130 in a shell
    # the same exception, in one line instead of ddpcheck's frames
    assert "\nKeyboardInterrupt: ddpcheck.fuzz was interrupted (in " in out, out
    assert len(out[out.index("Traceback") :].splitlines()) <= 8, out
    assert seconds < patience(WITHIN), f"{seconds:.1f} s from the signal to the exit"
