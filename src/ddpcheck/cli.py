"""The ``ddpcheck`` command line.

Exit status, one meaning each (:data:`EXIT_CODES`): 0 checked and nothing found; 1 a counterexample
in the target (printed, with its replay line); 2 a usage or set-up error -- anything that is not
the target's fault (an unimportable module, a world that cannot start or fit the machine, an
unwritable output, a scenario the oracle cannot judge); 3 nothing was checked (every example
skipped or declined); 130 interrupted (Ctrl-C), 143 terminated (SIGTERM: every rank process is
stopped and every world directory removed before exiting). ``MODULE:TARGET`` names a module-level
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

from ddpcheck._internal.cli_parser import build_parser
from ddpcheck._internal.devices import check_fits
from ddpcheck._internal.options import DEFAULT_WORLD_SIZES, check_fits_machine

EXIT_OK, EXIT_FOUND, EXIT_USAGE, EXIT_NOTHING_CHECKED = 0, 1, 2, 3


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
    except Exception as exc:  # ImportError, and whatever the module raises while importing
        where = ""
        if isinstance(exc, SyntaxError) and exc.filename:
            where = f" ({exc.filename}, line {exc.lineno})"
        raise UsageError(f"cannot import {module_name!r} for {what} {spec!r}: "
                         f"{type(exc).__name__}: {exc}{where}") from None
    from ddpcheck.replay import evaluate_in  # the evaluation replay lines are verified against

    try:
        return evaluate_in(module, expr)
    except Exception as exc:
        raise UsageError(f"{what} {spec!r}: {expr!r} is not defined in {module_name} "
                         f"({type(exc).__name__}: {exc})") from exc


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
        if args.command == "survey":
            return _survey(args)
        if args.command == "replay":
            return _replay(args)
        if args.command == "mutants":
            return _mutants(args)
        if args.command == "fuzz-rule":
            return _fuzz_rule(args)
        if args.command == "trace":
            return _trace(args)
    except ddpcheck.NothingChecked as exc:
        print(f"ddpcheck {args.command}: nothing was checked: {exc}", file=sys.stderr)
        return EXIT_NOTHING_CHECKED
    except (UsageError, ddpcheck.InvalidArgument, ddpcheck.SetupError) as exc:
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

    from ddpcheck.torchrun import check_in_world, local_world_size, under_torchrun

    # first: a machine without the GPUs asked for is told so in seconds, before the target loads
    check_fits(args.device, (local_world_size(),) if under_torchrun() else
               args.world_sizes or DEFAULT_WORLD_SIZES, args.backend, flag="--device")
    target = resolve_target(args.target)
    if under_torchrun():  # use the world torchrun built instead of spawning one
        if os.environ.get("RANK") == "0":
            # Random examples would need every rank to draw the same ones; the battery is
            # deterministic. Say so rather than ignore --examples/--seed silently.
            print("ddpcheck check under torchrun: the built-in battery only; --examples and "
                  "--seed apply to spawned worlds", file=sys.stderr, flush=True)
        status = check_in_world(target, deadline=args.deadline, out=sys.stdout,
                                world_sizes=args.world_sizes, device=args.device,
                                backend=args.backend)
        sys.stdout.flush()
        sys.stderr.flush()
        # Every rank has the same status. os._exit skips gloo's teardown, which races with its
        # worker threads right after the last collective (docs/platform.md).
        os._exit(status)
    from ddpcheck.fuzz import fuzz, terminal_progress

    from ddpcheck import features

    args.world_sizes = args.world_sizes or DEFAULT_WORLD_SIZES
    without = features.parse(args.without, "--without")
    dtypes = tuple(sorted(features.parse(args.dtypes, "--dtypes")))
    if not dtypes or any(d not in ("float64", "float32") for d in dtypes):
        raise UsageError(f"--dtypes={args.dtypes!r} must name float64, float32 or both")
    started = time.perf_counter()
    sizes = ",".join(map(str, args.world_sizes)) + ("" if args.device == "cpu" else
                                                     f" on {args.device}")
    check_fits_machine(args.world_sizes)
    # 1. the built-in battery: representative scenarios, every world size
    try:
        report = ddpcheck.assert_equivalent(target, world_sizes=args.world_sizes,
                                            deadline=args.deadline, without=without,
                                            device=args.device, backend=args.backend)
    except ddpcheck.EquivalenceError as exc:
        print(str(exc))
        return EXIT_FOUND
    except ddpcheck.NothingChecked as exc:  # the random examples may still find something
        battery, declined, exercised = 0, str(exc), set()
        print(f"battery: nothing checked: {exc}")
    else:
        battery, declined, exercised = report.count, "", report.features
        print(f"battery: {report}")
    # 2. random examples, shrunk to a minimal counterexample on failure
    print(f"fuzzing {args.target} with {args.examples} random examples at world sizes {sizes}"
          f"{'' if args.seed is None else f' (seed {args.seed})'}", flush=True)
    result = fuzz(target, examples=args.examples, world_sizes=args.world_sizes, seed=args.seed,
                  deadline=args.deadline, progress=terminal_progress(args.examples),
                  dtypes=dtypes, without=without, device=args.device, backend=args.backend)
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    if result.found:
        print(f"counterexample found after {result.first_failure} examples and shrunk "
              f"({result.examples} examples, {result.seconds:.1f} s):\n")
        print(str(result.error))
        return EXIT_FOUND
    if battery + result.examples == 0:
        reasons = "; ".join(f"{why} ({n}x)" for why, n in result.declined.items())
        raise ddpcheck.NothingChecked(
            f"{args.target} declined every battery scenario ({declined}) and every one of "
            f"{args.examples} random examples ({reasons or 'no reason given'})")
    print(f"ddpcheck check {args.target}: nothing found in {battery} battery and "
          f"{result.examples} random examples, {features.exercised(exercised | result.features)} "
          f"(wall {time.perf_counter() - started:.1f} s, world start-up included)")
    return EXIT_OK


def _survey(args: argparse.Namespace) -> int:
    from ddpcheck import features, surveys

    sizes = args.world_sizes or DEFAULT_WORLD_SIZES
    check_fits(args.device, sizes, args.backend, flag="--device")
    target = resolve_target(args.target)
    check_fits_machine(sizes)
    if args.json:
        _check_writable(args.json, "--json")
    return surveys.command(target, args.target, world_sizes=sizes, examples=args.examples,
                           without=features.parse(args.without, "--without"), seed=args.seed,
                           deadline=args.deadline, shrink_seconds=args.shrink_seconds,
                           json_path=args.json, device=args.device, backend=args.backend)


def _replay(args: argparse.Namespace) -> int:
    import ddpcheck
    from ddpcheck.api import check_example
    from ddpcheck.replay import from_repr

    check_fits(args.device, (args.world_size,), args.backend, flag="--device")
    target = resolve_target(args.target)
    try:
        scenario = from_repr(args.scenario)
    except ddpcheck.InvalidArgument as exc:  # e.g. Scenario(steps=0): say which flag held it
        raise UsageError(f"--scenario {args.scenario!r}: {exc}") from exc
    except Exception as exc:
        raise UsageError(f"--scenario could not be read: {type(exc).__name__}: {exc}") from exc
    check_fits_machine((args.world_size,), flag="--world-size")
    try:  # a declined scenario raises NothingChecked (exit 3)
        check_example(target, scenario, args.world_size, deadline=args.deadline,
                      device=args.device, backend=args.backend)
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
    check_fits_machine((args.world_size,), flag="--world-size")
    _check_writable(args.output, "-o")
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


def _check_writable(path: str, flag: str) -> None:
    """Fail before any world runs, not after: the folder exists and the file can be written."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path!r}: the folder {folder!r} does not exist; create it or "
                         "write elsewhere")
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise UsageError(f"{flag} {path!r} cannot be written ({exc.strerror}); write "
                         "elsewhere") from None
    if not existed:
        os.remove(path)


def _mutants(args: argparse.Namespace) -> int:
    from ddpcheck.mutation.command import run_mutants

    return run_mutants(args.only, budget_seconds=args.budget_seconds, search_name=args.search,
                       world_sizes=args.world_sizes, deadline=args.deadline)


def _fuzz_rule(args: argparse.Namespace) -> int:
    from ddpcheck import rules

    rule = _resolve(args.rule, "rule")
    if not callable(rule):
        raise UsageError(f"rule {args.rule!r} is a {type(rule).__name__}, not a function "
                         "rule(params, world_size) -> owners")
    return rules.command(rule, args.rule, examples=args.examples, seed=args.seed,
                         deadline=args.deadline, world_sizes=args.world_sizes)


if __name__ == "__main__":
    sys.exit(main())
