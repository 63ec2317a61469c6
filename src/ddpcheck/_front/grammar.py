"""The ``ddpcheck`` command line's grammar: every subcommand, flag, default and help text, and
the exit statuses ``--help`` states.

Apart from :mod:`ddpcheck.cli`, which runs the commands, so that the grammar reads as one page
and the path from options to an exit status as another. Imports no torch: ``ddpcheck --help``
and a usage error answer before torch would load.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import NoReturn, TypeVar

from ddpcheck._base.devices import BACKENDS, DEVICES
from ddpcheck._base.errors import ExitCode
from ddpcheck._base.options import DEFAULT_DEADLINE, DEFAULT_WORLD_SIZES, did_you_mean

__all__ = [
    "EXIT_CODES",
    "SURVEY_EXIT_CODES",
    "TARGET_HELP",
    "SuggestingParser",
    "build_parser",
    "parse_command_line",
]

#: The exit statuses, as ``--help`` states them (``ddpcheck.errors.ExitCode``).
EXIT_CODES = (
    f"exit status: {ExitCode.OK:d} checked, nothing found; {ExitCode.FOUND:d} a "
    "counterexample in the target (printed with its replay line); "
    f"{ExitCode.SETUP:d} usage or set-up error, not the target's fault; "
    f"{ExitCode.NOTHING_CHECKED:d} nothing was checked (every example skipped or "
    f"declined); {ExitCode.INTERNAL:d} an internal error of ddpcheck; "
    f"{ExitCode.INCONCLUSIVE:d} inconclusive (the machine too slow to tell, or a race "
    "a replay's --repeat did not reproduce); "
    f"{ExitCode.OUTPUT_CLOSED:d} its output was closed before it ended"
)
SURVEY_EXIT_CODES = (
    f"exit status: {ExitCode.OK:d} every cell that ran passed; "
    f"{ExitCode.FOUND:d} some cell failed (each a proven counterexample, with its "
    f"replay line); {ExitCode.SETUP:d} usage or set-up error, not the target's "
    "fault (a scenario the oracle cannot judge, too); "
    f"{ExitCode.NOTHING_CHECKED:d} no cell ran; {ExitCode.INTERNAL:d} an "
    f"internal error of ddpcheck; {ExitCode.INCONCLUSIVE:d} inconclusive (the "
    f"machine too slow to tell); {ExitCode.OUTPUT_CLOSED:d} its output was "
    "closed before it ended"
)


#: What a target argument may be (``resolve_target``).
TARGET_HELP = (
    "a built-in name (parallel, torch_ddp, ...), MODULE:EXPR (mypkg.checks:MY_TARGET), "
    "or path/to/FILE.py:EXPR, a script imported as a module "
    "(check_my_ddp.py:MyTarget())"
)
#: What ``--config`` takes (``runs.admission.configured``).
CONFIG_HELP = (
    "the framework's own configuration for a ready-made framework target (accelerate, "
    "lightning, fabric, hf_trainer, ...): a JSON file of its keyword arguments, or "
    "MODULE:NAME / path/to/FILE.py:NAME naming a dict; keys the scenario or ddpcheck "
    'sets are refused (docs/frameworks.md, "Your own configuration")'
)


def _config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="FILE", help=CONFIG_HELP)


def parse_command_line(
    parser: argparse.ArgumentParser, argv: list[str] | None
) -> argparse.Namespace:
    """``parse_args``, with a mistyped option answered by the command's closest one (argparse
    only learns ``suggest_on_error`` in Python 3.14)."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        commands = [a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        where = commands[0].get(args.command, parser) if commands and args.command else parser
        options = [o for action in where._actions for o in action.option_strings]
        flags = [u for u in unknown if u.startswith("-")]
        hint = did_you_mean(flags[0].split("=", 1)[0], options) if flags else ""
        where.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    return args


class SuggestingParser(argparse.ArgumentParser):
    """Argparse's parser, whose "invalid choice" names the closest choice too."""

    def error(self, message: str) -> NoReturn:
        wrong = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if wrong:
            message += did_you_mean(wrong.group(1), re.findall(r"'([^']*)'", wrong.group(2)))
        super().error(message)


N = TypeVar("N", int, float)


def _positive(kind: type[N]) -> Callable[[str], N]:
    def parse(text: str) -> N:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be positive")
        return value

    return parse


def _target_options(
    parser: argparse.ArgumentParser, *, examples: int, what: str, world_sizes: str
) -> None:
    """The options ``check`` and ``survey`` share."""
    parser.add_argument(
        "target",
        nargs="?",
        default="parallel",
        metavar="MODULE:TARGET",
        help=f"{TARGET_HELP}; default parallel",
    )
    parser.add_argument(
        "--world-sizes", default=None, help=f"comma-separated world sizes ({world_sizes})"
    )
    parser.add_argument(
        "--mesh",
        default=None,
        metavar="SHAPE[,SHAPE...]",
        help="mesh shapes, AXIS=N joined by x (axes dp, pp and tp, 1 where not named): "
        "tp=2,tp=3,dp=2xtp=2 runs every example on one of them, at world size dp*pp*tp; for a "
        "target that applies plans (torch_tp, torch_2d, parallel_tp, hf_tp) or runs pipelines "
        "(torch_pp: pp=2,dp=2xpp=2; torch_nd: pp=2xtp=2 too); instead of --world-sizes",
    )
    parser.add_argument(
        "--deadline",
        default=DEFAULT_DEADLINE,
        help="seconds one example may take before it counts as hung (default 60)",
    )
    parser.add_argument(
        "--examples", type=_positive(int), default=examples, help=f"{what} (default {examples})"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the random examples (default: the same examples every run)",
    )
    parser.add_argument(
        "--without",
        default="",
        metavar="FEATURE[,FEATURE...]",
        help="features never to exercise, on top of the target's "
        "supported_features (e.g. accumulation,buffers; see "
        "ddpcheck.features)",
    )
    _config_option(parser)
    parser.add_argument(
        "--only",
        default="",
        metavar="FEATURE[,FEATURE...]",
        help="check only examples that exercise one of these features (e.g. "
        "autocast; see ddpcheck.features): the battery scenarios that do, "
        "random examples drawn to",
    )
    parser.add_argument(
        "--fuzz-config",
        action="store_true",
        help="draw the target's options with every random example (its "
        "config_space(): e.g. lightning's manual and static_graph), "
        "shrunk to the fewest that fail; survey: the option x feature "
        "matrix",
    )
    _device_options(parser)


def _device_options(parser: argparse.ArgumentParser) -> None:
    """Where the ranks compute; the reference always runs on the CPU (``_base.devices``)."""
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="cpu (default), or cuda: rank r on GPU r, NCCL, TF32 off; refused "
        "without a GPU, or with more ranks than GPUs unless --backend gloo",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="the process-group backend (default: gloo on cpu, nccl on cuda); "
        "gloo with --device cuda lets ranks share GPUs",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(
        prog="ddpcheck",
        description="Find bugs in data-parallel training code: run it in real multi-process "
        "worlds against a single-process full-batch reference.",
        epilog=EXIT_CODES,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    check = sub.add_parser(
        "check",
        help="check a target (default: the built-in parallel target)",
        description="Run the built-in battery of scenarios against a target "
        "at every world size, then random examples shrunk by "
        "Hypothesis.",
        epilog=EXIT_CODES,
    )
    _target_options(
        check,
        examples=100,
        what="random examples to run after the built-in battery",
        world_sizes="default 1,2,3,4; under torchrun, torchrun's world size",
    )
    check.add_argument(
        "--dtypes",
        default=None,
        metavar="DTYPE[,DTYPE...]",
        help="float64, float32 or both: the dtypes of the battery scenarios and "
        "random examples (default: the whole battery, float64 random "
        "examples -- float32 for a target that declines float64)",
    )

    survey = sub.add_parser(
        "survey",
        help="run everything, stopping nowhere, and print the capability matrix",
        description="The battery at every world size, then random examples exercising each "
        "feature of ddpcheck.features at each world size (a cell stops at its first "
        "failure, shrunk by Hypothesis): the feature x world-size matrix, every "
        "failure with its replay line, the battery table.",
        epilog=SURVEY_EXIT_CODES,
    )
    _target_options(
        survey,
        examples=8,
        what="random examples per feature and world size",
        world_sizes="default 1,2,3,4",
    )
    survey.add_argument(
        "--shrink-seconds",
        type=_positive(float),
        default=3.0,
        help="seconds to shrink each failing cell's counterexample (default 3)",
    )
    survey.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write the survey (every cell) as JSON to PATH",
    )

    replay = sub.add_parser(
        "replay", help="run one example again (the line a failure prints)", epilog=EXIT_CODES
    )
    replay.add_argument("target", metavar="MODULE:TARGET", help=TARGET_HELP)
    replay.add_argument("--world-size", type=_positive(int), required=True)
    replay.add_argument("--scenario", required=True, help="the scenario's repr, as printed")
    replay.add_argument(
        "--repeat",
        type=_positive(int),
        default=1,
        metavar="N",
        help="run the example up to N times, stopping at the first failure; N > 1 runs that "
        f"all pass exit {ExitCode.INCONCLUSIVE:d}, not reproduced (a race), never 0",
    )
    replay.add_argument("--deadline", default=DEFAULT_DEADLINE)
    _config_option(replay)
    _device_options(replay)

    trace = sub.add_parser(
        "trace",
        help="record every collective of one step as a Chrome/Perfetto trace",
        description="Run one steady-state training step of a model with "
        "several gradient buckets on every rank and write its "
        "collectives and phases in Chrome trace format (open in "
        "https://ui.perfetto.dev or chrome://tracing). Exit 0, "
        "or 2 on a usage or set-up error.",
    )
    trace.add_argument(
        "target",
        nargs="?",
        default="parallel",
        metavar="MODULE:TARGET",
        help=f"{TARGET_HELP}; default parallel",
    )
    trace.add_argument(
        "--world-size", type=_positive(int), default=2, help="ranks to trace (default 2)"
    )
    trace.add_argument(
        "-o", "--output", default="trace.json", help="where to write the JSON (default trace.json)"
    )
    trace.add_argument("--deadline", default=DEFAULT_DEADLINE)
    _config_option(trace)

    sub.add_parser(
        "targets",
        help="list the ready-made targets: framework, installed version, "
        "what each declines and why",
        description="List every ready-made target ddpcheck check accepts by name: "
        "what it drives, its framework and installed version (a "
        "framework's target is usable only where it is installed), and "
        "each feature it declines with the reason. Exit 0.",
    )

    mutants = sub.add_parser(
        "mutants",
        help="run the built-in mutant catalogue and print which bugs were caught",
        description="Search each mutant of ddpcheck.mutation.catalogue (the parallel target with "
        "one seeded bug from the bug catalogue) for a counterexample, after checking "
        "that the unmutated parallel target passes the same search. Exit 0 if every "
        "mutant is killed and the unmutated target passes, 1 otherwise, 2 on a usage "
        "error.",
    )
    mutants.add_argument(
        "--budget-seconds",
        type=_positive(float),
        default=10.0,
        help="search time per mutant, world start-up excluded (default 10)",
    )
    mutants.add_argument(
        "--world-sizes",
        default=DEFAULT_WORLD_SIZES,
        help="comma-separated world sizes (default 1,2,3,4)",
    )
    mutants.add_argument(
        "--only",
        default=None,
        metavar="NAME[,NAME...]",
        help="run only these mutants (names as in the table)",
    )
    mutants.add_argument(
        "--search",
        choices=("shrinking", "battery"),
        default="shrinking",
        help="shrinking: random examples shrunk by Hypothesis, then the battery "
        "(default); battery: the built-in battery only (fastest)",
    )
    mutants.add_argument(
        "--deadline",
        default=DEFAULT_DEADLINE,
        help="seconds one example may take before it counts as hung (default 60)",
    )

    rule = sub.add_parser(
        "fuzz-rule",
        help="check a sharding rule's invariants and equivalence, report its balance",
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
        "under it is not equivalent), 2 on a usage or set-up error.",
    )
    rule.add_argument(
        "rule",
        metavar="MODULE:RULE",
        help="a function rule(params, world_size) -> owners, such as "
        "parallel.sharding:greedy or my_rules.py:balanced",
    )
    rule.add_argument(
        "--world-sizes",
        default=DEFAULT_WORLD_SIZES,
        help="world sizes of the equivalence check (default 1,2,3,4)",
    )
    rule.add_argument(
        "--deadline",
        default=DEFAULT_DEADLINE,
        help="seconds one call of the rule, or one equivalence example, may take "
        "before it counts as hung (default 60)",
    )
    rule.add_argument(
        "--examples",
        type=_positive(int),
        default=200,
        help="parameter lists Hypothesis draws (default 200)",
    )
    rule.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the drawn lists (default: the same lists every run)",
    )
    return parser
