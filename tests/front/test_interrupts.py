"""Ctrl-C ends a run within seconds wherever it lands, with exit 130 and nothing left.

The command line exits 130 with one line, whether the signal lands inside the command or outside
it (while the arguments are parsed, or a second one while the first stops the worlds).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from ddpcheck import cli
from ddpcheck.errors import ExitCode
from tests.patience import patience

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------------------------
# Where the signal lands outside any world: each raised from inside the command


def _command(source: str) -> subprocess.CompletedProcess:
    """Run ``source`` then ``cli.command()`` in a process of its own, SIGINT raising."""
    code = f"import signal, sys\nfrom ddpcheck import cli\n{source}\ncli.command()\n"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                           text=True, timeout=patience(60),
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_a_ctrl_c_while_the_arguments_are_parsed_exits_130():
    out = _command("real = cli.build_parser\n"
                   "def build_parser():\n"
                   "    signal.raise_signal(signal.SIGINT)\n"
                   "    return real()\n"
                   "cli.build_parser = build_parser\n"
                   "sys.argv = ['ddpcheck', 'targets']")
    assert out.returncode == ExitCode.INTERRUPTED == 130, out.stderr
    assert out.stderr.strip() == "ddpcheck: interrupted; every rank process was stopped"


def test_a_second_ctrl_c_while_the_worlds_stop_changes_nothing():
    """The first stops the command; a second, while its worlds are being stopped, neither cuts
    that short nor turns the exit into a traceback."""
    out = _command("from ddpcheck._internal.world import worlds\n"
                   "def interrupted(args):\n"
                   "    raise KeyboardInterrupt\n"
                   "cli._COMMANDS['targets'] = interrupted\n"
                   "real = worlds.shutdown_worlds\n"
                   "def shutdown_worlds():\n"
                   "    signal.raise_signal(signal.SIGINT)\n"
                   "    real()\n"
                   "    print('stopped', flush=True)\n"
                   "worlds.shutdown_worlds = shutdown_worlds\n"
                   "sys.argv = ['ddpcheck', 'targets']")
    assert out.returncode == 130, out.stderr
    assert out.stdout.split() == ["stopped"] * 2, out.stdout  # then again at exit: a no-op
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
