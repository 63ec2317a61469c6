"""The grammar of the ``ddpcheck`` command line: every subcommand, flag, default and help text.

Apart from ``ddpcheck.cli`` (what each command does) so either reads on its own. Imports no torch:
``ddpcheck --help`` must answer at once.
"""

from __future__ import annotations

import argparse

from ddpcheck._internal.devices import BACKENDS, DEVICES
from ddpcheck._internal.options import DEFAULT_DEADLINE, DEFAULT_WORLD_SIZES, parse_world_sizes

__all__ = ["EXIT_CODES", "SURVEY_EXIT_CODES", "build_parser"]

#: The exit codes, as ``--help`` and the README state them.
EXIT_CODES = ("exit status: 0 checked, nothing found; 1 a counterexample in the target (printed "
              "with its replay line); 2 usage or set-up error, not the target's fault; 3 nothing "
              "was checked (every example skipped or declined)")
SURVEY_EXIT_CODES = ("exit status: 0 every cell that ran passed; 1 some cell failed (each a "
                     "proven counterexample, with its replay line); 2 usage or set-up error, not "
                     "the target's fault (a scenario the oracle cannot judge, too); 3 no cell ran")


def _world_sizes(text: str) -> tuple[int, ...]:
    from ddpcheck._internal.validation import InvalidArgument

    try:
        return parse_world_sizes(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(kind: type):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be positive")
        return value
    return parse


def _target_options(parser: argparse.ArgumentParser, *, examples: int, what: str,
                    world_sizes: str) -> None:
    """The options ``check`` and ``survey`` share."""
    parser.add_argument("target", nargs="?", default="parallel", metavar="MODULE:TARGET")
    parser.add_argument("--world-sizes", type=_world_sizes, default=None,
                        help=f"comma-separated world sizes ({world_sizes})")
    parser.add_argument("--deadline", type=_positive(float), default=DEFAULT_DEADLINE,
                        help="seconds one example may take before it counts as hung (default 60)")
    parser.add_argument("--examples", type=_positive(int), default=examples,
                        help=f"{what} (default {examples})")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the random examples (default: the same examples every run)")
    parser.add_argument("--without", default="", metavar="FEATURE[,FEATURE...]",
                        help="features never to exercise, on top of the target's "
                             "supported_features (e.g. accumulation,buffers; see "
                             "ddpcheck.features)")
    _device_options(parser)


def _device_options(parser: argparse.ArgumentParser) -> None:
    """Where the ranks compute; the reference always runs on the CPU (``_internal.devices``)."""
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="cpu (default), or cuda: rank r on GPU r, NCCL, TF32 off; refused "
                             "without a GPU, or with more ranks than GPUs unless --backend gloo")
    parser.add_argument("--backend", choices=BACKENDS, default=None,
                        help="the process-group backend (default: gloo on cpu, nccl on cuda); "
                             "gloo with --device cuda lets ranks share GPUs")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpcheck",
        description="Find bugs in data-parallel training code: run it in real multi-process "
                    "worlds against a single-process full-batch reference.",
        epilog=EXIT_CODES)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    check = sub.add_parser("check", help="check a target (default: the built-in parallel target)",
                           description="Run the built-in battery of scenarios against a target "
                                       "at every world size, then random examples shrunk by "
                                       "Hypothesis.", epilog=EXIT_CODES)
    _target_options(check, examples=100, what="random examples to run after the built-in battery",
                    world_sizes="default 1,2,3,4; under torchrun, torchrun's world size")
    check.add_argument("--dtypes", default="float64", metavar="DTYPE[,DTYPE...]",
                       help="dtypes of the random examples: float64 (default), float32 or both")

    survey = sub.add_parser(
        "survey", help="run everything, stopping nowhere, and print the capability matrix",
        description="The battery at every world size, then random examples exercising each "
                    "feature of ddpcheck.features at each world size (a cell stops at its first "
                    "failure, shrunk by Hypothesis): the feature x world-size matrix, every "
                    "failure with its replay line, the battery table.", epilog=SURVEY_EXIT_CODES)
    _target_options(survey, examples=8, what="random examples per feature and world size",
                    world_sizes="default 1,2,3,4")
    survey.add_argument("--shrink-seconds", type=_positive(float), default=3.0,
                        help="seconds to shrink each failing cell's counterexample (default 3)")
    survey.add_argument("--json", default=None, metavar="PATH",
                        help="also write the survey (every cell) as JSON to PATH")

    replay = sub.add_parser("replay", help="run one example again (the line a failure prints)",
                            epilog=EXIT_CODES)
    replay.add_argument("target", metavar="MODULE:TARGET")
    replay.add_argument("--world-size", type=_positive(int), required=True)
    replay.add_argument("--scenario", required=True, help="the scenario's repr, as printed")
    replay.add_argument("--deadline", type=_positive(float), default=DEFAULT_DEADLINE)
    _device_options(replay)

    trace = sub.add_parser("trace", help="record every collective of one step as a Chrome/"
                                         "Perfetto trace",
                           description="Run one steady-state training step of a model with "
                                       "several gradient buckets on every rank and write its "
                                       "collectives and phases in Chrome trace format (open in "
                                       "https://ui.perfetto.dev or chrome://tracing). Exit 0, "
                                       "or 2 on a usage or set-up error.")
    trace.add_argument("target", nargs="?", default="parallel", metavar="MODULE:TARGET")
    trace.add_argument("--world-size", type=_positive(int), default=2,
                       help="ranks to trace (default 2)")
    trace.add_argument("-o", "--output", default="trace.json",
                       help="where to write the JSON (default trace.json)")
    trace.add_argument("--deadline", type=_positive(float), default=DEFAULT_DEADLINE)

    mutants = sub.add_parser(
        "mutants", help="run the built-in mutant catalogue and print which bugs were caught",
        description="Search each mutant of ddpcheck.mutation.catalogue (the parallel target with one seeded "
                    "bug from the bug catalogue) for a counterexample, after checking that the "
                    "unmutated parallel target passes the same search. Exit 0 if every mutant is "
                    "killed and the unmutated target passes, 1 otherwise, 2 on a usage error.")
    mutants.add_argument("--budget-seconds", type=_positive(float), default=10.0,
                         help="search time per mutant, world start-up excluded (default 10)")
    mutants.add_argument("--world-sizes", type=_world_sizes, default=DEFAULT_WORLD_SIZES,
                         help="comma-separated world sizes (default 1,2,3,4)")
    mutants.add_argument("--only", default=None, metavar="NAME[,NAME...]",
                         help="run only these mutants (names as in the table)")
    mutants.add_argument("--search", choices=("shrinking", "battery"), default="shrinking",
                         help="shrinking: random examples shrunk by Hypothesis, then the battery "
                              "(default); battery: the built-in battery only (fastest)")
    mutants.add_argument("--deadline", type=_positive(float), default=DEFAULT_DEADLINE,
                         help="seconds one example may take before it counts as hung (default 60)")

    rule = sub.add_parser(
        "fuzz-rule", help="check a sharding rule's invariants and equivalence, report its balance",
        description="Call the rule on parameter lists drawn by Hypothesis (1-300 parameters shaped "
                    "like real models', mixed dtypes, world sizes 1-8, often more ranks than "
                    "parameters) and on fixed GPT-like lists, each call with a deadline, in a "
                    "separate process (right length, integer owners in range, same answer twice, "
                    "returns in time), then on every rank of real worlds of 2-4 processes (same "
                    "answer everywhere); a violation is shrunk to the smallest parameter list "
                    "that shows it. Then check ShardedOptimizer under the rule against the "
                    "battery, and print the optimizer-state balance (max / ideal bytes) on "
                    "GPT-like parameters. Exit 0 if the rule holds, 1 with the violations (the "
                    "rule raised, hung, crashed its process, answered wrongly, or ShardedOptimizer "
                    "under it is not equivalent), 2 on a usage or set-up error.")
    rule.add_argument("rule", metavar="MODULE:RULE",
                      help="a function rule(params, world_size) -> owners, such as "
                           "parallel.sharding:greedy")
    rule.add_argument("--world-sizes", type=_world_sizes, default=DEFAULT_WORLD_SIZES,
                      help="world sizes of the equivalence check (default 1,2,3,4)")
    rule.add_argument("--deadline", type=_positive(float), default=DEFAULT_DEADLINE,
                      help="seconds one call of the rule, or one equivalence example, may take "
                           "before it counts as hung (default 60)")
    rule.add_argument("--examples", type=_positive(int), default=200,
                      help="parameter lists Hypothesis draws (default 200)")
    rule.add_argument("--seed", type=int, default=None,
                      help="seed of the drawn lists (default: the same lists every run)")
    return parser
