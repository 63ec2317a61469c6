"""The ``ddpcheck`` command line.

Exit status: 0 nothing found, 1 a counterexample (printed with its replay line), 2 a usage or
set-up error, 130 interrupted (Ctrl-C), 143 terminated (SIGTERM: every rank process is stopped
and every world directory removed before exiting). ``MODULE:TARGET`` names a module-level
attribute importable on ``PYTHONPATH`` (or an expression evaluated in that module, such as
``mypkg.targets:MyTarget(bucket_size_mb=1)``); the built-in short names are ``parallel``,
``parallel_ddp``, ``torch_ddp``, ``torch_zero``, ``local``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from typing import Any

from ddpcheck._internal.options import DEFAULT_DEADLINE, DEFAULT_WORLD_SIZES, parse_world_sizes

EXIT_OK, EXIT_FOUND, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A command-line mistake: printed without a traceback, exit status 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (``timeout``, a CI cancel): unwinds like Ctrl-C, so a running world is killed on
    the way out, then :func:`main` stops the others and exits 143."""


def _terminate(signum: int, frame: Any) -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends us at once
    raise Terminated()


def resolve_target(spec: str) -> Any:
    """``parallel`` / ``MODULE:ATTR`` / ``MODULE:EXPR`` -> a target instance."""
    from ddpcheck.targets import BUILTIN

    if spec in BUILTIN:
        return BUILTIN[spec]
    return _resolve(spec, "target")


def _resolve(spec: str, what: str) -> Any:
    if ":" not in spec:
        raise UsageError(f"{what} {spec!r} must look like MODULE:NAME (for example "
                         f"mypkg.checks:MY_{what.upper()})")
    module_name, expr = spec.split(":", 1)
    sys.path.insert(0, os.getcwd())  # like `python -m`, modules in the current directory count
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"cannot import {module_name!r} for {what} {spec!r}: {exc}") from exc
    try:
        return eval(expr, vars(module))  # noqa: S307 -- the user's own module and expression
    except Exception as exc:
        raise UsageError(f"{what} {spec!r}: {expr!r} is not defined in {module_name} "
                         f"({type(exc).__name__}: {exc})") from exc


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpcheck",
        description="Find bugs in data-parallel training code: run it in real multi-process "
                    "worlds against a single-process full-batch reference.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    check = sub.add_parser("check", help="check a target (default: the built-in parallel target)",
                           description="Run the built-in battery of scenarios against a target "
                                       "at every world size. Exit 0 if nothing diverges, 1 with "
                                       "a counterexample, 2 on a usage error.")
    check.add_argument("target", nargs="?", default="parallel", metavar="MODULE:TARGET")
    check.add_argument("--world-sizes", type=_world_sizes, default=None,
                       help="comma-separated world sizes (default 1,2,3,4; under torchrun, "
                            "torchrun's world size)")
    check.add_argument("--deadline", type=_positive(float), default=DEFAULT_DEADLINE,
                       help="seconds one example may take before it counts as hung (default 60)")
    check.add_argument("--examples", type=_positive(int), default=100,
                       help="random examples to run after the built-in battery (default 100)")
    check.add_argument("--seed", type=int, default=None,
                       help="seed of the random examples (default: the same examples every run)")

    replay = sub.add_parser("replay", help="run one example again (the line a failure prints)")
    replay.add_argument("target", metavar="MODULE:TARGET")
    replay.add_argument("--world-size", type=_positive(int), required=True)
    replay.add_argument("--scenario", required=True, help="the scenario's repr, as printed")
    replay.add_argument("--deadline", type=_positive(float), default=DEFAULT_DEADLINE)

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
        description="Call the rule on tiny, mixed-dtype and GPT-shaped parameter lists at world "
                    "sizes 1-8 (right length, integer owners in range, same answer twice), then on "
                    "every rank of real worlds of 2-4 processes (same answer everywhere), then "
                    "check ShardedOptimizer under the rule against the battery, and print the "
                    "optimizer-state balance (max / ideal bytes) on GPT-like parameters. Exit 0 if "
                    "the rule holds, 1 with the violations, 2 on a usage error.")
    rule.add_argument("rule", metavar="MODULE:RULE",
                      help="a function rule(params, world_size) -> owners, such as "
                           "parallel.sharding:greedy")
    rule.add_argument("--world-sizes", type=_world_sizes, default=DEFAULT_WORLD_SIZES,
                      help="world sizes of the equivalence check (default 1,2,3,4)")
    rule.add_argument("--deadline", type=_positive(float), default=DEFAULT_DEADLINE,
                      help="seconds one example may take before it counts as hung (default 60)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    import signal
    import threading

    # SIGTERM unwinds like Ctrl-C while a command runs; a caller of main() gets its handler back.
    previous = (signal.signal(signal.SIGTERM, _terminate)
                if threading.current_thread() is threading.main_thread() else None)
    try:
        return _dispatch(args)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _dispatch(args: argparse.Namespace) -> int:
    import warnings

    # torch warns at import when numpy is missing; ddpcheck does not need numpy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import ddpcheck

    try:
        if args.command == "check":
            return _check(args)
        if args.command == "replay":
            return _replay(args)
        if args.command == "mutants":
            return _mutants(args)
        if args.command == "fuzz-rule":
            return _fuzz_rule(args)
        if args.command == "trace":
            return _trace(args)
    except (UsageError, ddpcheck.InvalidArgument) as exc:
        print(f"ddpcheck {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as exc:
        from ddpcheck._internal.world import shutdown_worlds

        shutdown_worlds()
        if isinstance(exc, Terminated):
            print("ddpcheck: terminated; every rank process was stopped", file=sys.stderr)
            return 143
        print("ddpcheck: interrupted; every rank process was stopped", file=sys.stderr)
        return 130
    raise AssertionError(f"unhandled command {args.command!r}")


def _check(args: argparse.Namespace) -> int:
    import ddpcheck

    target = resolve_target(args.target)
    from ddpcheck.torchrun import check_in_world, under_torchrun

    if under_torchrun():  # use the world torchrun built instead of spawning one
        if os.environ.get("RANK") == "0":
            # Random examples would need every rank to draw the same ones; the battery is
            # deterministic. Say so rather than ignore --examples/--seed silently.
            print("ddpcheck check under torchrun: the built-in battery only; --examples and "
                  "--seed apply to spawned worlds", file=sys.stderr, flush=True)
        status = check_in_world(target, deadline=args.deadline, out=sys.stdout,
                                world_sizes=args.world_sizes)
        sys.stdout.flush()
        sys.stderr.flush()
        # Every rank has the same status. os._exit skips gloo's teardown, which races with its
        # worker threads right after the last collective (platform-notes.md).
        os._exit(status)
    from ddpcheck.fuzz import fuzz, terminal_progress

    args.world_sizes = args.world_sizes or DEFAULT_WORLD_SIZES
    started = time.perf_counter()
    sizes = ",".join(map(str, args.world_sizes))
    # 1. the built-in battery: representative scenarios, every world size
    try:
        report = ddpcheck.assert_equivalent(target, world_sizes=args.world_sizes,
                                            deadline=args.deadline)
    except ddpcheck.EquivalenceError as exc:
        print(str(exc))
        return EXIT_FOUND
    print(f"battery: {report}")
    # 2. random examples, shrunk to a minimal counterexample on failure
    print(f"fuzzing {args.target} with {args.examples} random examples at world sizes {sizes}"
          f"{'' if args.seed is None else f' (seed {args.seed})'}", flush=True)
    result = fuzz(target, examples=args.examples, world_sizes=args.world_sizes, seed=args.seed,
                  deadline=args.deadline, progress=terminal_progress(args.examples))
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    if result.found:
        print(f"counterexample found after {result.first_failure} examples and shrunk "
              f"({result.examples} examples, {result.seconds:.1f} s):\n")
        print(str(result.error))
        return EXIT_FOUND
    print(f"ddpcheck check {args.target}: nothing found in {report.count} battery and "
          f"{result.examples} random examples (wall {time.perf_counter() - started:.1f} s, "
          "world start-up included)")
    return EXIT_OK


def _replay(args: argparse.Namespace) -> int:
    import ddpcheck
    from ddpcheck.api import check_example
    from ddpcheck.scenario import from_repr

    target = resolve_target(args.target)
    try:
        scenario = from_repr(args.scenario)
    except ddpcheck.InvalidArgument as exc:  # e.g. Scenario(steps=0): say which flag held it
        raise UsageError(f"--scenario {args.scenario!r}: {exc}") from exc
    except Exception as exc:
        raise UsageError(f"--scenario could not be read: {type(exc).__name__}: {exc}") from exc
    try:
        check_example(target, scenario, args.world_size, deadline=args.deadline)
    except ddpcheck.EquivalenceError as exc:
        print(str(exc))
        return EXIT_FOUND
    print(f"ddpcheck replay: equivalent at world size {args.world_size}")
    return EXIT_OK


def _trace(args: argparse.Namespace) -> int:
    import json

    from ddpcheck.trace import TRACE_SCENARIO, chrome_trace, overlap, record_step
    from ddpcheck._internal.world import WorldFailure, get_world

    target = resolve_target(args.target)
    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(folder):
        raise UsageError(f"-o {args.output!r}: the folder {folder!r} does not exist; create it "
                         "or write elsewhere")
    try:
        traces = get_world(args.world_size).run(record_step, target, TRACE_SCENARIO,
                                                deadline=args.deadline, what="ddpcheck trace")
    except WorldFailure as exc:
        raise UsageError(f"the traced step did not complete on every rank:\n{exc}") from exc
    with open(args.output, "w") as f:
        json.dump(chrome_trace(traces, title=f"ddpcheck trace {args.target} "
                                             f"--world-size {args.world_size}"), f)
    print(f"ddpcheck trace {args.target}: one step at world size {args.world_size} written to "
          f"{args.output} (open it in https://ui.perfetto.dev)")
    for t in traces:
        reduced = sum(c.nbytes for c in t.collectives if c.op == "all_reduce")
        line = f"  rank {t.rank}: {len(t.collectives)} collectives, {reduced} bytes all-reduced"
        seen = overlap(t)
        if seen is not None:
            line += (f"; first async all-reduce launched {seen[0] * 1e3:.2f} ms into a "
                     f"{seen[1] * 1e3:.2f} ms backward")
        print(line)
    return EXIT_OK


def _mutants(args: argparse.Namespace) -> int:
    from ddpcheck.mutation import catalogue as mutants, search
    from ddpcheck.targets import PARALLEL

    catalogue = mutants.CATALOGUE
    if args.only is not None:
        catalogue = [mutants.by_name(n.strip()) for n in args.only.split(",") if n.strip()]
        if not catalogue:
            raise UsageError(f"--only={args.only!r} names no mutant")
    widths = [max(len("(unmutated)"), *(len(m.name) for m in catalogue)), 5,
              len("SURVIVED (budget)"), len("examples"), len("seconds"), len("counterexample")]
    print(f"ddpcheck mutants: {len(catalogue)} mutants, {args.budget_seconds:g} s each, "
          f"{args.search} search, world sizes {','.join(map(str, args.world_sizes))} "
          "(starting worlds...)", flush=True)
    header = search.table_lines([], widths)
    print("\n".join(header), flush=True)
    started = time.perf_counter()
    chosen = search.default_search() if args.search == "shrinking" else search.battery_search
    rows = search.score(catalogue, args.budget_seconds, control=PARALLEL, search=chosen,
                        world_sizes=args.world_sizes, deadline=args.deadline,
                        on_row=lambda r: print(search.table_lines([r.row()], widths)[2],
                                               flush=True))
    killed = sum(r.killed for r in rows if not r.control)
    control_ok = all(r.as_expected for r in rows if r.control)
    seconds = sorted(r.outcome.seconds for r in rows if not r.control and r.killed)
    median = seconds[len(seconds) // 2] if seconds else float("nan")
    print(f"\nkilled {killed}/{len(catalogue)} "
          f"({100 * killed / max(len(catalogue), 1):.0f} %); median {median:.2f} s to the first "
          f"counterexample; unmutated target {'passes' if control_ok else 'FAILS'}; "
          f"wall {time.perf_counter() - started:.1f} s")
    for r in rows:
        if r.control and r.killed:
            print(f"\nthe unmutated target failed, so the scores above mean nothing:\n"
                  f"{r.outcome.counterexample.error}")
    return EXIT_OK if killed == len(catalogue) and control_ok else EXIT_FOUND


def _fuzz_rule(args: argparse.Namespace) -> int:
    import ddpcheck
    from ddpcheck import rules
    from ddpcheck.targets import ParallelTarget

    rule = _resolve(args.rule, "rule")
    if not callable(rule):
        raise UsageError(f"rule {args.rule!r} is a {type(rule).__name__}, not a function "
                         "rule(params, world_size) -> owners")
    violations = rules.rule_violations(rule, deadline=args.deadline)
    for v in violations:
        print(f"ddpcheck fuzz-rule {args.rule}: {v.message}")
    if violations:
        return EXIT_FOUND
    print(f"ddpcheck fuzz-rule {args.rule}: invariants hold (length, integer owners in range, "
          "deterministic, same on every rank; world sizes 1-8 on 5 parameter lists)")
    try:
        report = ddpcheck.assert_equivalent(ParallelTarget(sharding_rule=rule),
                                            world_sizes=args.world_sizes, deadline=args.deadline)
    except ddpcheck.EquivalenceError as exc:
        print(f"ddpcheck fuzz-rule {args.rule}: ShardedOptimizer under the rule is not "
              f"equivalent:\n{exc}")
        return EXIT_FOUND
    print(f"ddpcheck fuzz-rule {args.rule}: ShardedOptimizer equivalent: {report}")
    params = rules.gpt_like()
    ratios = ", ".join(f"W={w} {rules.balance(rule, params, w):.3f}" for w in (2, 3, 4, 8))
    print(f"ddpcheck fuzz-rule {args.rule}: optimizer-state balance on GPT-2-small parameters "
          f"(max / ideal bytes, 1.000 is perfect): {ratios}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
