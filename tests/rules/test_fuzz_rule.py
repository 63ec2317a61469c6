"""``ddpcheck fuzz-rule``: each kind of bad rule is rejected with its own message, on the smallest
parameter list Hypothesis finds; a rule that hangs or kills its process is the rule's fault (exit
1), a check that cannot run is a set-up error (exit 2); good rules pass. The rules travel to rank
processes by reference (``tests.rules.test_fuzz_rule.X``).

Tests that kill a world (a crash kills the world of 2, a hang the world of 1) come last, so the
others share the persistent worlds.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import time
import types

import pytest
import torch.distributed as dist

from ddpcheck._world.registry import get_world
from ddpcheck.cli import main
from tests.patience import patience

RULE = "ddpcheck fuzz-rule tests.rules.test_fuzz_rule"


def out_of_range(params, world_size):
    return [i % (world_size + 1) for i in range(len(params))]


def wrong_length(params, world_size):
    return [0] * (len(params) + 1)


def float_owners(params, world_size):
    return [0.0] * len(params)


_calls = itertools.count()


def nondeterministic(params, world_size):
    shift = next(_calls)
    return [(i + shift) % world_size for i in range(len(params))]


def rank_dependent(params, world_size):
    rank = dist.get_rank() if dist.is_initialized() else 0
    return [(i + rank) % world_size for i in range(len(params))]


def too_few_params(params, world_size):
    if world_size > len(params):
        raise ValueError("more ranks than parameters")
    return [i % world_size for i in range(len(params))]


def wrong_for_two(params, world_size):
    """Right for every length but exactly two (five fixed lists would never notice)."""
    if len(params) == 2:
        return [0, world_size]
    return [i % world_size for i in range(len(params))]


_answers = itertools.count()


def garbage_second(params, world_size):
    """A valid answer, then garbage for the same input."""
    return [0] * len(params) if next(_answers) % 2 == 0 else "garbage"


def hangs(params, world_size):
    while True:
        pass


def crashes_in_a_real_world(params, world_size):
    if dist.get_world_size() > 1:
        os._exit(3)
    return [0] * len(params)


@pytest.mark.parametrize(
    "rule, message",
    [
        (
            "out_of_range",
            "out of range: tests.rules.test_fuzz_rule.out_of_range at world size 1 on 2 "
            "parameters [float32 (1,), float32 (1,)]: returned owner 1 for parameter 1; "
            "owners must be in [0, world_size=1)",
        ),
        (
            "wrong_length",
            "wrong length: tests.rules.test_fuzz_rule.wrong_length at world size 1 on 1 "
            "parameter [float32 (1,)]: returned 2 owners for 1 parameter",
        ),
        (
            "float_owners",
            "not an integer: tests.rules.test_fuzz_rule.float_owners at world size 1 on 1 "
            "parameter [float32 (1,)]: returned owner 0.0 (type float) for parameter 0",
        ),
        (
            "nondeterministic",
            re.compile(
                r"nondeterministic: tests\.rules\.test_fuzz_rule\.nondeterministic at world size 2 "
                r"on 1 "
                r"parameter \[float32 \(1,\)\]: answered \[(0\] and then \[1|1\] and then \[0)\]"
            ),
        ),
        (
            "rank_dependent",
            "rank-dependent: tests.rules.test_fuzz_rule.rank_dependent in a world of 2 "
            "processes on tiny (1 parameter) [float32 (4,)]: answered [0] on "
            "rank 0 but [1] on rank 1",
        ),
        (
            "too_few_params",
            "raised: tests.rules.test_fuzz_rule.too_few_params at world size 2 on 1 "
            "parameter [float32 (1,)]: raised ValueError: more ranks than parameters",
        ),
        (
            "wrong_for_two",
            "out of range: tests.rules.test_fuzz_rule.wrong_for_two at world size 1 on 2 "
            "parameters [float32 (1,), float32 (1,)]: returned owner 1 for parameter 1",
        ),
        (
            "garbage_second",
            "wrong length: tests.rules.test_fuzz_rule.garbage_second at world size 1 "
            "on 1 parameter [float32 (1,)]: on the second call (the first answered "
            "[0]), returned 'garbage', not a sequence",
        ),
    ],
)
def test_bad_rules_are_rejected_with_their_own_message(rule, message, capsys):
    status = main(["fuzz-rule", f"tests.rules.test_fuzz_rule:{rule}", "--world-sizes", "2"])
    out, err = capsys.readouterr()
    assert status == 1, out + err
    if isinstance(message, str):
        assert message in out, out
    else:
        assert message.search(out), out
    assert len(out.strip().splitlines()) == 1, out  # one violation, nothing else
    assert "Traceback" not in out + err


@pytest.mark.parametrize("rule", ["modulo", "contiguous", "greedy"])
def test_the_built_in_rules_pass(rule, capsys):
    status = main(["fuzz-rule", f"parallel.sharding:{rule}", "--world-sizes", "2"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "invariants hold" in out and "200 drawn parameter lists" in out, out
    assert "ShardedOptimizer equivalent: " in out
    if rule == "greedy":
        assert (
            "max / ideal bytes, 1.000 is perfect): W=2 1.000, W=3 1.006, W=4 1.241, W=8 2.481"
            in out
        ), out


def test_fuzz_rule_usage_errors(capsys):
    assert main(["fuzz-rule", "no_colon"]) == 2
    assert "rule 'no_colon' must look like MODULE:NAME" in capsys.readouterr().err
    assert main(["fuzz-rule", "parallel.sharding:__doc__"]) == 2
    assert (
        "rule 'parallel.sharding:__doc__' is a str, not a function rule(params, "
        "world_size) -> owners"
    ) in capsys.readouterr().err


def test_a_rule_module_that_fails_to_import_is_a_usage_error(tmp_path, monkeypatch, capsys):
    assert main(["fuzz-rule", "no_such_module_here:rule"]) == 2
    assert "cannot import 'no_such_module_here'" in capsys.readouterr().err
    (tmp_path / "fuzz_rule_broken_module.py").write_text("1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["fuzz-rule", "fuzz_rule_broken_module:rule"]) == 2
    out, err = capsys.readouterr()
    assert (
        "cannot import 'fuzz_rule_broken_module' for rule 'fuzz_rule_broken_module:rule': "
        "ZeroDivisionError: division by zero"
    ) in err, out + err
    assert "Traceback" not in out + err


def test_a_directory_added_to_the_path_after_the_world_started_travels_to_its_ranks(
    tmp_path, monkeypatch
):
    world = get_world(1)  # started before the module's directory is on the path
    (tmp_path / "fuzz_rule_parent_only.py").write_text(
        "def rule(params, world_size):\n    return [0] * len(params)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from fuzz_rule_parent_only import rule

    assert world.run(rule, ["a", "b"], 1) == [[0, 0]]


def test_a_rule_the_ranks_cannot_import_is_a_set_up_error(monkeypatch, capsys):
    get_world(1)
    module = types.ModuleType("fuzz_rule_in_memory")  # imported here, on no disk the ranks see
    exec("def rule(params, world_size):\n    return [0] * len(params)\n", module.__dict__)
    monkeypatch.setitem(sys.modules, "fuzz_rule_in_memory", module)
    assert main(["fuzz-rule", "fuzz_rule_in_memory:rule"]) == 2
    out, err = capsys.readouterr()
    assert "no call of the rule was running when it failed, so nothing was decided" in err, err
    assert "No module named 'fuzz_rule_in_memory'" in err, err
    assert out == ""


def test_a_rule_that_kills_its_rank_is_reported_not_raised(capsys):
    status = main(["fuzz-rule", "tests.rules.test_fuzz_rule:crashes_in_a_real_world"])
    out, err = capsys.readouterr()
    assert status == 1, out + err
    assert (
        "crashed: tests.rules.test_fuzz_rule.crashes_in_a_real_world in a world of 2 "
        "processes on rank 0, on tiny (1 parameter) [float32 (4,)]: the call ended its "
        "process (exit code 3)"
    ) in out, out
    assert "Traceback" not in out + err


def test_a_hanging_rule_is_killed_at_the_deadline_and_named(capsys):
    get_world(1)  # start-up is not the rule's time
    started = time.monotonic()
    status = main(["fuzz-rule", "tests.rules.test_fuzz_rule:hangs", "--deadline", "3"])
    seconds = time.monotonic() - started
    out, err = capsys.readouterr()
    assert status == 1, out + err
    assert (
        "hangs: tests.rules.test_fuzz_rule.hangs at world size 1 on 1 parameter "
        "[float32 (1,)]: did not return within the 3 s deadline (--deadline); it was "
        "at "
    ) in out, out
    assert "test_fuzz_rule.py" in out and "in hangs" in out, out
    assert seconds < 3 + patience(6), seconds
