"""The ``ddpcheck`` command line: one path from options to an exit status (the grammar:
``_front.grammar``).

Every command goes the same way (:func:`main`): parse; validate what the commands share before
anything heavy loads (:func:`_prepare`: the device and GPUs asked for, the world sizes against the
machine, output paths, then the target or rule named); run the command, which prints its report
and returns an :class:`~ddpcheck.errors.ExitCode` or raises an outcome; and map every outcome
to its exit status in one place (:func:`_outcome`), with one line and no traceback for anything
that is not the target's fault. The exit statuses, one meaning each, are ``ExitCode``'s: 0 checked
and nothing found; 1 a counterexample in the target (printed with its replay line); 2 a usage or
set-up error; 3 nothing was checked; 4 an internal error of ddpcheck (its traceback); 130
interrupted (Ctrl-C), 143 terminated (SIGTERM: every rank process is stopped and every world
directory removed before exiting).

``MODULE:TARGET`` names a module-level attribute importable on ``PYTHONPATH`` (or an expression
evaluated in that module, such as ``mypkg.targets:MyTarget(bucket_size_mb=1)``), and
``path/to/FILE.py:TARGET`` the same in a script, imported as the module ``FILE`` (so its
``if __name__ == "__main__":`` block does not run); the built-in short names are those of
``ddpcheck.targets.BUILTIN``.

Lazy imports, measured: this module imports neither torch nor Hypothesis, so ``ddpcheck --help``
and a usage error answer in ~0.1 s instead of ~1.5 s (importing torch); each command imports what
it runs.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import gc
import os
import select
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from ddpcheck._base.devices import local_world_size, under_torchrun
from ddpcheck._base.errors import (
    DdpcheckError,
    EquivalenceError,
    ExitCode,
    Inconclusive,
    InvalidArgument,
    NothingChecked,
)
from ddpcheck._base.options import DEFAULT_WORLD_SIZES
from ddpcheck._front import lines
from ddpcheck._front.environment import keep_hypothesis_out_of_the_current_folder
from ddpcheck._front.grammar import (
    EXIT_CODES,
    SURVEY_EXIT_CODES,
    build_parser,
    parse_command_line,
)
from ddpcheck._front.terminal import ProgressLine

if TYPE_CHECKING:
    from ddpcheck._runs.admission import Request
    from ddpcheck.targets.protocol import Target

__all__ = [
    "EXIT_CODES",
    "SURVEY_EXIT_CODES",
    "UsageError",
    "build_parser",
    "command",
    "main",
    "resolve_target",
]


class UsageError(InvalidArgument):
    """A command-line mistake: printed without a traceback, exit status 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (``timeout``, a CI cancel): unwinds like Ctrl-C, so a running world is killed on
    the way out, then :func:`main` stops the others and exits 143."""


# ---------------------------------------------------------------------------------------------
# The one path: parse, prepare, run, map the outcome


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_command_line(parser, argv)
    if args.command is None:
        parser.print_help()
        return ExitCode.SETUP
    # SIGTERM unwinds like Ctrl-C while a command runs; a caller of main() gets its handler back.
    previous = (
        signal.signal(signal.SIGTERM, _terminate)
        if threading.current_thread() is threading.main_thread()
        else None
    )
    # The live line, from the first second on a terminal: before torch loads (_prepare)
    progress = ProgressLine()
    if args.command in ("check", "survey") and not _under_torchrun(args):
        progress.show("starting worlds ...")
    try:
        return int(_outcome(args.command, lambda: _run(args, progress)))
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace, progress: ProgressLine) -> ExitCode:
    """The command; its live line is gone before anything reports how it ended."""
    try:
        return _COMMANDS[args.command](_prepare(args, progress))
    finally:
        progress.close()


def command() -> NoReturn:
    """The ``ddpcheck`` command (and ``python -m ddpcheck``): :func:`main`, then the exit
    handlers (every world shut down, every directory removed), the output flushed, and the
    process ends without the interpreter's teardown. With torch and dynamo imported, that
    teardown -- freeing every module, of no use to a process that ends -- took 1.0-1.7 s after
    the verdict was printed on the 2-core machine (``bench/throughput.py``'s first verdict
    waits for it). A caller of :func:`main` (tests, scripts) keeps its interpreter.

    Ctrl-C ends it with 130 wherever it lands once this function runs (``bench/ctrl_c.py``):
    :func:`_outcome` stops the worlds; one that lands outside it (while the arguments are
    parsed, or a second one while the first stops them) is 130 here, the exit handlers stop
    them; one that Python lost is raised again (``interrupts.Insistent``). Once the status is
    decided, SIGINT and SIGTERM are ignored: every wait from there on has a deadline, and a
    signal could only turn the status into a traceback."""
    global _CTRL_C
    keep_hypothesis_out_of_the_current_folder()
    # The process is the command's: it imports torch, dynamo and Hypothesis as it runs (~300,000
    # objects, kept to the end), and at the interpreter's default threshold (a collection every
    # 700 allocations) the collector ran ~800 times while they loaded, freeing nothing: 0.3-0.5 s
    # of CPU per command (measured 2026-12-07; a run's later collections cost the same either
    # way). A caller of main() keeps its own threshold.
    threshold = gc.get_threshold()
    gc.set_threshold(max(threshold[0], 10_000), *threshold[1:])
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ):  # not if ignored
        from ddpcheck._world.interrupts import Insistent

        _CTRL_C = Insistent()
        signal.signal(signal.SIGINT, _CTRL_C)
    try:
        try:
            status = main()
        except BrokenPipeError:  # our output's reader went away (`ddpcheck targets | head`): a
            # print failed (`_outcome` makes any other broken pipe an internal error)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing to say
            status = ExitCode.OUTPUT_CLOSED
        except SystemExit as exc:  # argparse: --help, a usage error
            status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
        interrupted = None
    except KeyboardInterrupt as exc:
        interrupted = exc
        status = ExitCode.TERMINATED if isinstance(exc, Terminated) else ExitCode.INTERRUPTED
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    if _CTRL_C is not None:
        _CTRL_C.taken()
    atexit._run_exitfuncs()
    _stop_resource_tracker()
    if interrupted is not None:
        _say_stopped(interrupted)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`ddpcheck ... | head`): nothing to say
            pass
    os._exit(status)


#: Seconds between the survey's progress lines off a terminal (on one, its live line says it).
SURVEY_HEARTBEAT = 60.0

#: Seconds multiprocessing's resource tracker gets to exit once told to (it takes milliseconds;
#: a process still holding its pipe would keep it, and us, waiting for as long as it lives).
TRACKER_DEADLINE = 2.0


def _stop_resource_tracker() -> None:
    """Stop multiprocessing's resource tracker, which the worlds started and which inherited
    our stdout: left to notice our exit by itself, it held the output open a moment longer
    (a loaded machine made that visible to a caller reading to the end). The process is ours
    alone here, so nothing else needs it; ``_stop`` is the stdlib's own way (3.8+), and it waits
    for the tracker without a deadline: a rank half-started by a Ctrl-C (ddpcheck holds those
    back now, ``_world.interrupts``) kept it waiting for over 10 minutes. Past
    :data:`TRACKER_DEADLINE` the tracker is killed: it has nothing of ours to clean up."""
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker, "_resource_tracker", None)
    stop, pid = getattr(tracker, "_stop", None), getattr(tracker, "_pid", None)
    if stop is None or pid is None:
        return
    stopping = threading.Thread(target=_quietly, args=(stop,), daemon=True)
    stopping.start()
    stopping.join(TRACKER_DEADLINE)
    if stopping.is_alive():
        try:
            os.kill(pid, signal.SIGKILL)  # its waitpid in the thread then returns
        except OSError:
            pass
        stopping.join(TRACKER_DEADLINE)


def _quietly(stop: Callable[[], Any]) -> None:
    try:
        stop()
    except Exception:  # it exits by itself at EOF all the same
        pass


def _output_closed() -> bool:
    """Whether this process's stdout is a pipe nobody reads any more (poll reports an error on
    it): a broken pipe to a rank process is ddpcheck's own failure, not the reader's choice."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), no file descriptor
        return False


#: The command's SIGINT handler, while :func:`command` runs (a caller of :func:`main` keeps its
#: own): it says whether a Ctrl-C came, whatever became of its ``KeyboardInterrupt``.
_CTRL_C: Any = None


def _outcome(command: str, run: Callable[[], ExitCode]) -> ExitCode:
    """Run a command and turn whatever it raises into its exit status, one line each. After a
    Ctrl-C, whatever the command came to is its consequence: 130."""
    # torch warns at import when numpy is missing; ddpcheck does not need numpy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        try:
            status = run()
        except BaseException as exc:
            if _ctrl_c_came() and not isinstance(exc, KeyboardInterrupt):  # what a lost one
                raise KeyboardInterrupt from exc  # left behind (an import it broke: RecursionError)
            raise
        if _ctrl_c_came():
            raise KeyboardInterrupt  # lost on the way, and the command ended meanwhile
        return status
    except EquivalenceError as exc:  # the target's bug: the table and the replay line
        print(str(exc))
        return exc.exit_code
    except NothingChecked as exc:
        print(f"ddpcheck {command}: nothing was checked: {exc}", file=sys.stderr)
        return exc.exit_code
    except DdpcheckError as exc:
        print(f"ddpcheck {command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:  # ddpcheck's own bug: say so, and never with FOUND's status
        if isinstance(exc, BrokenPipeError) and _output_closed():
            raise  # not a bug: the reader closed our output (``command``)
        print(
            f"ddpcheck {command}: internal error (a bug in ddpcheck, not a verdict on the "
            f"target; please report it):\n{traceback.format_exc()}",
            file=sys.stderr,
        )
        return ExitCode.INTERNAL
    except KeyboardInterrupt as exc:
        if _CTRL_C is not None:
            _CTRL_C.taken()
        from ddpcheck._world.interrupts import held
        from ddpcheck._world.registry import shutdown_worlds

        with held(deliver=False):  # a second Ctrl-C does not cut the stop short (it is bounded)
            shutdown_worlds()
        _say_stopped(exc)
        return ExitCode.TERMINATED if isinstance(exc, Terminated) else ExitCode.INTERRUPTED


def _ctrl_c_came() -> bool:
    return _CTRL_C is not None and _CTRL_C.came is not None


def _say_stopped(exc: KeyboardInterrupt) -> None:
    what = "terminated" if isinstance(exc, Terminated) else "interrupted"
    try:
        print(f"ddpcheck: {what}; every rank process was stopped", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # nobody reads our errors any more
        pass


def _terminate(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends us at once
    raise Terminated()


@dataclasses.dataclass(frozen=True)
class Invocation:
    """A command as admitted (:func:`_prepare`): the arguments as parsed (read, never written),
    the request its options became (``_runs.admission.Request``: what every layer below takes),
    the target and rule as the command line named them, and the live line."""

    args: argparse.Namespace
    progress: ProgressLine
    request: Request
    #: the target as named (``--config FILE`` included), for the closing lines
    target_spec: str = ""
    #: the target's argument alone (the survey command a verdict ends with)
    target_word: str = ""
    rule: Callable[..., object] | None = None
    rule_spec: str = ""
    #: under torchrun: whether --world-sizes was given (its world must be among them)
    sizes_asked: bool = False

    @property
    def world_sizes(self) -> tuple[int, ...]:
        return self.request.world_sizes

    @property
    def target(self) -> Target:
        return self.request.target


def _prepare(args: argparse.Namespace, progress: ProgressLine) -> Invocation:
    """The command's request, admitted (``_runs.admission``, as at every door, cheapest check
    first: the device, the world sizes against the machine, the deadline, features, dtypes, the
    scenario, then the target or rule, whose import may be slow), and the output paths -- all
    before any process starts. The first world ``check`` and ``survey`` need then boots (import
    torch, join the group: ~2 s) while this process computes the battery's references."""
    from ddpcheck._runs import admission

    if args.command == "targets":
        return Invocation(args, progress, admission.admit())
    torchrun = _under_torchrun(args)
    spelling = admission.COMMAND_LINE
    sizes_asked = getattr(args, "world_sizes", None) is not None
    mesh = getattr(args, "mesh", None)
    if torchrun and mesh is not None:
        raise UsageError(
            "--mesh under torchrun: torchrun's world is the one checked (the battery only); "
            "run ddpcheck check --mesh without torchrun"
        )
    if torchrun:  # torchrun's world is the one; --world-sizes must contain it (check_in_world)
        sizes: str | tuple[int, ...] = args.world_sizes if sizes_asked else (local_world_size(),)
    elif getattr(args, "world_size", None) is not None:
        sizes = (args.world_size,)
        spelling = dataclasses.replace(spelling, world_sizes="--world-size")
    else:  # `--world-sizes=` is refused as empty, not read as the default
        sizes = args.world_sizes if sizes_asked else DEFAULT_WORLD_SIZES
    target = getattr(args, "target", admission.NO_TARGET)
    config = getattr(args, "config", None)
    request = admission.admit(
        target,
        scenario=getattr(args, "scenario", None),
        world_sizes=sizes,
        deadline=args.deadline,
        without=getattr(args, "without", ""),
        dtypes=getattr(args, "dtypes", None),
        device=getattr(args, "device", "cpu"),
        backend=getattr(args, "backend", None),
        only=args.only if args.command in ("check", "survey") else "",  # mutants': names
        spelling=spelling,
        fits_machine=not torchrun,
        fuzz_config=getattr(args, "fuzz_config", False),
        config=config,
        meshes=mesh,
    )
    named = target if isinstance(target, str) else ""
    rule_spec = getattr(args, "rule", None)
    rule = None if rule_spec is None else admission.resolve_rule(rule_spec)
    for flag in ("json", "output"):
        if getattr(args, flag, None):
            _check_writable(getattr(args, flag), "-o" if flag == "output" else f"--{flag}")
    if args.command == "survey":
        from ddpcheck._runs.survey import check_survey_meshes

        check_survey_meshes(request)
    if args.command in ("check", "survey") and not torchrun:
        from ddpcheck._world.registry import launch_worlds

        launch_worlds(request.world_sizes[:1], device=request.device, backend=request.backend)
    return Invocation(
        args,
        progress,
        request,
        target_spec=named if config is None else f"{named} --config {config}",
        target_word=named,
        rule=rule,
        rule_spec=rule_spec or "",
        sizes_asked=sizes_asked,
    )


def _under_torchrun(args: argparse.Namespace) -> bool:
    return args.command == "check" and under_torchrun()


def resolve_target(spec: str) -> Any:
    """``parallel`` / ``MODULE:ATTR`` / ``MODULE:EXPR`` -> a target instance
    (``_runs.admission.resolve_target``)."""
    from ddpcheck._runs.admission import resolve_target as resolve

    return resolve(spec)


def _check_writable(path: str, flag: str) -> None:
    """Fail before any world runs, not after: the folder exists and the file can be written."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(
            f"{flag} {path!r}: the folder {folder!r} does not exist; create it or write elsewhere"
        )
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise UsageError(
            f"{flag} {path!r} cannot be written ({exc.strerror}); write elsewhere"
        ) from None
    if not existed:
        os.remove(path)


# ---------------------------------------------------------------------------------------------
# The commands: each prints its report and returns its exit status (or raises an outcome)


def _say_notes(call: Invocation, say: Callable[[str], None]) -> None:
    """Before the run, what a default hook means for what is checked (``targets.support``),
    and each mesh asked for that the target runs nothing on."""
    from ddpcheck.targets.support import checked_through_defaults

    for note in checked_through_defaults(call.target, call.request.without):
        say(f"note: {note}")
    for note in lines.mesh_notes(call.request, call.target_spec):
        say(f"note: {note}")


def _survey_command(call: Invocation) -> str:
    return lines.survey_command(call.target_word, call.request, call.args)


def _check(call: Invocation) -> ExitCode:
    from ddpcheck._language import features
    from ddpcheck._runs import smaller
    from ddpcheck._runs.equivalence import run_battery
    from ddpcheck._runs.fuzz import fuzz_admitted, undrawable
    from ddpcheck.targets.support import battery_for

    if _under_torchrun(call.args):  # use the world torchrun built instead of spawning one
        _check_under_torchrun(call)
    request = call.request
    without, dtypes = request.without, request.random_dtypes
    started = time.perf_counter()
    sizes = lines.where(request) + ("" if call.args.device == "cpu" else f" on {call.args.device}")
    line = call.progress
    battery_size = len(battery_for(request.target))

    def battery_done(done: int, total: int) -> None:
        if done == 0:  # off a terminal, the one line of start-up and the battery
            line.phase(
                f"battery 0/{total}",
                f"ddpcheck check {call.target_spec}: starting worlds "
                f"({sizes}), then the battery: {battery_size} scenarios at each",
            )
        else:
            line.show(f"battery {done}/{total}")

    def say(text: str) -> None:
        with line.paused():
            print(text, flush=True)

    _say_notes(call, say)
    # 1. the built-in battery: representative scenarios, every world size; a failure is
    # followed by the search for a smaller counterexample (_runs.smaller)
    try:
        report = run_battery(request, progress=battery_done)
    except NothingChecked as exc:  # the random examples may still find something
        battery, declined, exercised = 0, str(exc), set()
        say(f"battery: nothing checked: {exc}")
    except EquivalenceError as found:
        line.show("searching for a smaller counterexample")
        error, what = smaller.first_verdict(
            call.target,
            found,
            world_sizes=call.world_sizes,
            without=without,
            seed=call.args.seed,
            say=say,
            run=request.run,
            degrees=request.degrees,
        )
        raise smaller.with_features(error, what, _survey_command(call)) from None
    else:
        battery, declined, exercised = report.count, "", report.features
        say(f"battery: {report}")
    # 2. random examples, shrunk to a minimal counterexample on failure -- if any can be drawn
    cannot = undrawable(call.target, dtypes, without)
    if cannot is not None:  # no dtype left (a battery in other dtypes may have run: torchtitan's)
        say(f"random examples: none can be drawn: {cannot}")
        ran = (
            f"the battery checked {battery} example(s), but"
            if battery
            else "every battery scenario was declined (the reasons above) and"
        )
        raise NothingChecked(f"{ran} no random example can be drawn: {cannot}")
    options = (
        ", each with a configuration of its options drawn (--fuzz-config)"
        if request.fuzz_config
        else ""
    )
    say(
        f"fuzzing {call.target_spec} with {call.args.examples} random examples at "
        f"{sizes}{'' if call.args.seed is None else f' (seed {call.args.seed})'}{options}"
    )
    line.show(f"random examples 0/{call.args.examples}")
    result = fuzz_admitted(
        request,
        examples=call.args.examples,
        seed=call.args.seed,
        progress=lambda done, _: line.show(f"random examples {done}/{call.args.examples}"),
    )
    line.close()
    if result.error is not None:
        print(
            f"counterexample found after {result.first_failure} examples and shrunk "
            f"({result.examples} examples, {result.seconds:.1f} s):\n"
        )
        raise smaller.with_features(
            result.error, "the shrunk counterexample", _survey_command(call)
        )
    if battery + result.examples == 0:
        reasons = "; ".join(f"{why} ({n}x)" for why, n in result.declined.items())
        drawn = sum(result.declined.values())
        raise NothingChecked(
            f"{call.target_spec} declined every battery scenario ({declined}) and every one of "
            f"the {drawn} random scenario(s) drawn ({reasons or 'no reason given'})"
        )
    for note in result.notes:
        print(f"note: {note}")
    print(
        f"ddpcheck check {call.target_spec}: nothing found in {battery} battery and "
        f"{result.examples} random examples ({lines.declined(result.declined)}), "
        f"{features.exercised(exercised | result.features)}; {lines.losses(call.target)} "
        f"(wall {time.perf_counter() - started:.1f} s, world start-up included)"
    )
    return ExitCode.OK


def _check_under_torchrun(call: Invocation) -> None:
    """Every rank of torchrun's world runs the battery; every rank exits with the verdict."""
    from ddpcheck._runs.torchrun import check_in_world

    if os.environ.get("RANK") == "0":
        # Random examples would need every rank to draw the same ones; the battery is
        # deterministic. Say so rather than ignore --examples/--seed silently.
        print(
            "ddpcheck check under torchrun: the built-in battery only; --examples, "
            "--seed and --fuzz-config apply to spawned worlds",
            file=sys.stderr,
            flush=True,
        )
    request = call.request
    status = check_in_world(
        request.target,
        deadline=request.deadline,
        out=sys.stdout,
        world_sizes=request.world_sizes if call.sizes_asked else None,
        without=request.battery_without,
        only=request.only,
        device=request.device,
        backend=request.backend,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    # Every rank has the same status. os._exit skips gloo's teardown, which races with its
    # worker threads right after the last collective (docs/platform.md).
    os._exit(status)


def _survey(call: Invocation) -> ExitCode:
    from ddpcheck._runs import survey

    sizes = lines.where(call.request)
    seed = "" if call.args.seed is None else f" (seed {call.args.seed})"
    line = call.progress
    with line.paused():
        what = (
            "each option its config_space() draws x each feature: "
            if call.args.fuzz_config
            else "the battery and "
        )
        print(
            f"ddpcheck survey {call.target_spec}: {what}{call.args.examples} random "
            f"examples per feature at {sizes}{seed}\n",
            flush=True,
        )

    said = time.monotonic()

    def cell(done: int, total: int, what: str, seconds: float) -> None:
        # Off a terminal (a log, CI) a line now and then: a survey of a slow framework runs for
        # an hour, and until its matrix prints nothing else says how far it got.
        nonlocal said
        text = f"cell {done + 1}/{total}: {what}"
        if line.live or time.monotonic() - said < SURVEY_HEARTBEAT:
            line.show(text)
            return
        said = time.monotonic()
        line.phase(text, f"ddpcheck survey: {text} ({seconds:.0f} s)")

    result = survey.survey_admitted(
        call.request,
        examples=call.args.examples,
        seed=call.args.seed,
        shrink_seconds=call.args.shrink_seconds,
        progress=cell,
    )
    line.close()
    print(result, flush=True)
    if call.args.json:
        import json

        with open(call.args.json, "w") as f:
            json.dump(result.as_dict(), f, indent=2)
    if result.exit_code == ExitCode.NOTHING_CHECKED:
        print(
            "ddpcheck survey: nothing was checked: every cell was declined or not applicable",
            file=sys.stderr,
        )
    return ExitCode(result.exit_code)


def _replay(call: Invocation) -> ExitCode:
    from ddpcheck._runs.example import check_example, prepare_reference

    # Everything about the example is settled before any process starts: the scenario was read
    # and judged with the request (_prepare), its reference is computed now (which is what tells
    # an optimizer that cannot step, or nothing to train) -- one example, so computing it while
    # the ranks run would save little. A declined scenario raises NothingChecked (exit 3).
    request, scenario = call.request, call.request.scenario
    assert scenario is not None  # replay's --scenario is required (_front.grammar)
    reference = prepare_reference(scenario)
    repeat = call.args.repeat  # a possibly racy verdict's line repeats: one pass proves nothing
    for _ in range(repeat):  # the first failure raises: its verdict, exit 1
        check_example(
            request.target, scenario, call.args.world_size, request.run, reference=reference
        )
    if repeat > 1:
        raise Inconclusive(
            f"not reproduced in {repeat} runs: a race -- the example passed every time here, "
            "where the verdict that printed this line failed once, then passed when run again; "
            "no verdict either way (a larger --repeat, or a busier machine, may reproduce it)"
        )
    print(f"ddpcheck replay: equivalent at world size {call.args.world_size}")
    return ExitCode.OK


def _trace(call: Invocation) -> ExitCode:
    import json

    from ddpcheck._runs.trace import TRACE_SCENARIO, chrome_trace, overlap, record_step
    from ddpcheck._world.failures import WorldFailure
    from ddpcheck._world.registry import get_world

    if callable(getattr(call.target, "fit", None)):
        raise UsageError(
            f"{call.target_spec} owns its training loop (Target.fit); ddpcheck "
            "trace times the steps of its own loop, so it cannot trace this target"
        )

    try:
        traces = get_world(call.args.world_size).run(
            record_step,
            call.target,
            TRACE_SCENARIO,
            deadline=call.request.deadline,
            what="ddpcheck trace",
        )
    except WorldFailure as exc:
        raise UsageError(f"the traced step did not complete on every rank:\n{exc}") from exc
    with open(call.args.output, "w") as f:
        json.dump(
            chrome_trace(
                traces,
                title=f"ddpcheck trace {call.target_spec} --world-size {call.args.world_size}",
            ),
            f,
        )
    print(
        f"ddpcheck trace {call.target_spec}: one step at world size {call.args.world_size} written "
        f"to {call.args.output} (open it in https://ui.perfetto.dev)"
    )
    for t in traces:
        reduced = sum(c.nbytes for c in t.collectives if c.op == "all_reduce")
        line = f"  rank {t.rank}: {len(t.collectives)} collectives, {reduced} bytes all-reduced"
        seen = overlap(t)
        if seen is not None:
            line += (
                f"; first async all-reduce launched {seen[0] * 1e3:.2f} ms into a "
                f"{seen[1] * 1e3:.2f} ms backward"
            )
        print(line)
    return ExitCode.OK


def _targets(call: Invocation) -> ExitCode:
    from ddpcheck.targets import READY_MADE

    for entry in READY_MADE:
        version = entry.version
        floor = "" if entry.minimum is None else f", supported from {entry.minimum}"
        floor += f" ({entry.minimum_on_cuda} on cuda)" if entry.minimum_on_cuda else ""
        floor += f", tried with {', '.join(entry.tested)}" if entry.tested else ""
        where = (
            f"{entry.framework} {version}{floor}"
            if version is not None
            else f"{entry.framework} not installed{floor}: {entry.install}"
        )
        print(f"{entry.name}  ({where})\n    {entry.summary}")
        for feature, why in entry.declines.items():
            print(f"    declines {feature}: {why}")
        if entry.per_scenario:
            print(f"    declines, scenario by scenario: {entry.per_scenario}")
    from ddpcheck.targets.surveyed import SURVEYED

    for stack in SURVEYED:  # surveyed, left without a target: the releases tried and why
        print(f"{stack.name}  (no target: {stack.framework} {', '.join(stack.tried)} tried)")
        print(f"    {stack.why} ({stack.bench})")
    print("\ncheck one with: ddpcheck check NAME; or your own with ddpcheck check MODULE:EXPR")
    return ExitCode.OK


def _mutants(call: Invocation) -> ExitCode:
    from ddpcheck.mutation.score import run_mutants

    return run_mutants(
        call.args.only,
        budget_seconds=call.args.budget_seconds,
        search_name=call.args.search,
        world_sizes=call.world_sizes,
        deadline=call.request.deadline,
    )


def _fuzz_rule(call: Invocation) -> ExitCode:
    import ddpcheck
    from ddpcheck._rules import check as rules
    from ddpcheck.targets import ParallelTarget

    assert call.rule is not None  # fuzz-rule's RULE is required (_front.grammar)
    prefix = f"ddpcheck fuzz-rule {call.rule_spec}"
    deadline = call.request.deadline
    # a world that cannot start, or fails while no call of the rule runs, is a SetupError: exit 2
    report = rules.check_rule(
        call.rule, examples=call.args.examples, seed=call.args.seed, deadline=deadline
    )
    for v in report.violations:
        print(f"{prefix}: {v.message}")
    if report.violations:
        return ExitCode.FOUND
    print(f"{prefix}: {report.summary(deadline, call.args.seed)}")
    try:
        result = ddpcheck.assert_equivalent(
            ParallelTarget(sharding_rule=call.rule), world_sizes=call.world_sizes, deadline=deadline
        )
    except EquivalenceError as exc:
        print(f"{prefix}: ShardedOptimizer under the rule is not equivalent:\n{exc}")
        return ExitCode.FOUND
    print(f"{prefix}: ShardedOptimizer equivalent: {result}")
    print(
        f"{prefix}: optimizer-state balance on GPT-2-small parameters (max / ideal bytes, "
        f"1.000 is perfect): {report.balance()}"
    )
    return ExitCode.OK


_COMMANDS: dict[str, Callable[[Invocation], ExitCode]] = {
    "check": _check,
    "survey": _survey,
    "replay": _replay,
    "trace": _trace,
    "mutants": _mutants,
    "fuzz-rule": _fuzz_rule,
    "targets": _targets,
}


if __name__ == "__main__":
    sys.exit(main())
