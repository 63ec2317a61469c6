"""The stacks surveyed and left without a target: ``ddpcheck targets`` says which releases were
tried and why, and ``ddpcheck check NAME`` refuses with that reason as a set-up error (exit 2),
never "no such target" and never a crash -- whether the framework is installed or not (nothing
of it is imported)."""

from __future__ import annotations

import pathlib

from ddpcheck import cli
from ddpcheck.errors import ExitCode
from ddpcheck.targets.surveyed import SURVEYED

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_check_of_a_surveyed_stack_exits_2_with_the_releases_tried_and_why(capsys):
    assert cli.main(["check", "deepspeed_autotp"]) == ExitCode.SETUP
    err = capsys.readouterr().err
    assert "deepspeed 0.19.8 tried" in err and "autotp_size" in err, err


def test_targets_lists_each_surveyed_stack_after_the_ready_made_ones(capsys):
    assert cli.main(["targets"]) == ExitCode.OK
    out = capsys.readouterr().out
    for stack in SURVEYED:
        assert f"\n{stack.name}  (no target: {stack.framework} " in out, out
        assert (ROOT / stack.bench.split()[0]).is_file(), stack.bench  # the script behind it
