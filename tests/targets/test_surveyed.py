"""The stacks surveyed and left without a target: ``ddpcheck targets`` says which releases were
tried and why, and ``ddpcheck check NAME`` refuses with that reason as a set-up error (exit 2),
never "no such target" and never a crash -- whether the framework is installed or not (nothing
of it is imported)."""

from __future__ import annotations

import pathlib

import pytest

from ddpcheck import cli
from ddpcheck.errors import ExitCode
from ddpcheck.targets import surveyed
from ddpcheck.targets.surveyed import Surveyed

#: torchtitan and DeepSpeed AutoTP were surveyed and have targets now: a stack as one was
STACK = Surveyed(
    "somestack",
    "somestack",
    ("1.0.0",),
    "its training refuses the CPU: 'no accelerator found'",
    "bench/torchtitan_cpu.py",
)

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def one_surveyed(monkeypatch):
    monkeypatch.setattr(surveyed, "SURVEYED", (STACK,))


def test_check_of_a_surveyed_stack_exits_2_with_the_releases_tried_and_why(capsys, one_surveyed):
    assert cli.main(["check", "somestack"]) == ExitCode.SETUP
    err = capsys.readouterr().err
    assert "somestack 1.0.0 tried" in err and "no accelerator found" in err, err


def test_targets_lists_each_surveyed_stack_after_the_ready_made_ones(capsys, one_surveyed):
    assert cli.main(["targets"]) == ExitCode.OK
    out = capsys.readouterr().out
    for stack in surveyed.SURVEYED:
        assert f"\n{stack.name}  (no target: {stack.framework} " in out, out
        assert (ROOT / stack.bench.split()[0]).is_file(), stack.bench  # the script behind it
