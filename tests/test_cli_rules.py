"""``ddpcheck fuzz-rule``: each kind of bad rule is rejected with its own message; a good rule
passes. The rules travel to rank processes by reference (``tests.test_cli_rules.X``)."""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist

from ddpcheck.cli import main


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


@pytest.mark.parametrize("rule, message", [
    ("out_of_range", "out of range: tests.test_cli_rules.out_of_range on mlp (4 parameters) at "
                     "world_size=1 returned owner 1 for parameter 1; owners must be in "
                     "[0, world_size=1)"),
    ("wrong_length", "wrong length: tests.test_cli_rules.wrong_length on one parameter at "
                     "world_size=1 returned 2 owners for 1 parameters"),
    ("float_owners", "not an integer: tests.test_cli_rules.float_owners on one parameter at "
                     "world_size=1 returned owner 0.0 (type float) for parameter 0"),
    ("nondeterministic", "nondeterministic: tests.test_cli_rules.nondeterministic on one "
                         "parameter at world_size=2 answered [0] and then [1]"),
    ("rank_dependent", "rank-dependent: tests.test_cli_rules.rank_dependent on one parameter in "
                       "a world of 2 answered [0] on rank 0 but [1] on rank 1"),
    ("too_few_params", "raised: tests.test_cli_rules.too_few_params on one parameter at "
                       "world_size=2 raised ValueError: more ranks than parameters"),
])
def test_bad_rules_are_rejected_with_their_own_message(rule, message, capsys):
    status = main(["fuzz-rule", f"tests.test_cli_rules:{rule}", "--world-sizes", "2"])
    out = capsys.readouterr().out
    assert status == 1, out
    assert message in out, out


def test_a_good_rule_passes_and_reports_its_balance(capsys):
    status = main(["fuzz-rule", "parallel.sharding:greedy", "--world-sizes", "2"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "invariants hold" in out
    assert "ShardedOptimizer equivalent: " in out
    assert "max / ideal bytes, 1.000 is perfect): W=2 1.000, W=3 1.006" in out


def test_fuzz_rule_usage_errors(capsys):
    assert main(["fuzz-rule", "no_colon"]) == 2
    assert "rule 'no_colon' must look like MODULE:NAME" in capsys.readouterr().err
    assert main(["fuzz-rule", "parallel.sharding:__doc__"]) == 2
    assert ("rule 'parallel.sharding:__doc__' is a str, not a function rule(params, "
            "world_size) -> owners") in capsys.readouterr().err
