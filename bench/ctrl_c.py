"""Ctrl-C at a random moment: does ddpcheck end within seconds, exit 130 and leave nothing?

Starts ``ddpcheck check`` (or, with ``--api``, a script calling ``ddpcheck.assert_equivalent`` then
``ddpcheck.fuzz``) on :data:`SEEDED` -- the built-in parallel target with a seeded bug in scenarios
the battery does not have, so a run goes through every phase: the interpreter and its imports, the
fork server importing torch, ranks forked, the battery, random examples, shrinking the
counterexample -- and sends SIGINT to its process group, as a terminal's Ctrl-C does, at a moment
drawn uniformly from ``[0, window]``. The window is 0.9 times one uninterrupted run's length,
measured first (``--window`` to give it, ``--start`` to begin it later than 0). For each run it
records the exit status, the seconds from the signal to the exit, and whether anything is left: a
process carrying the run's marker in its environment (every process the run starts inherits it: the
fork server, multiprocessing's resource tracker, ranks, janitors, what targets start) still alive,
or a directory left in the run's own ``TMPDIR`` (worlds' directories, the fork server's socket). It
prints one line per run and a tally: exits, median and max seconds to exit, leftovers, and where the
signals landed.

    python bench/ctrl_c.py [--runs 100] [--seed 0] [--api] [--window SECONDS] [--start SECONDS]

Runs that end before their signal is sent are reported and not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from ddpcheck.targets import ParallelTarget

#: Seconds from the signal to the exit that count as "ends within seconds".
WITHIN = 15.0
#: Seconds after which a run that has not exited is killed (and counted as hung).
GIVE_UP = 120.0
#: Seconds the processes a run started get to disappear once it has exited.
SETTLE = 10.0
#: The environment variable that marks every process of one run.
MARKER = "DDPCHECK_CTRL_C_BENCH"
#: The environment variable naming the file where :data:`SEEDED` notes each example's seed.
SEEDS_LOG = "DDPCHECK_CTRL_C_SEEDS"


@dataclasses.dataclass(frozen=True)
class SeededAfterBattery(ParallelTarget):
    """The built-in parallel target, with the ``NoDivide`` mutant's bug (gradients summed over
    ranks, not averaged) in every scenario seeded 60,000 or more: the battery's scenarios (seeds
    0-12) pass, about one random example in twelve fails, and shrinking ends at seed 60,000.
    Notes each scenario's seed (the checking process's, not the ranks') for the tally."""

    def configure(self, scenario):
        log = os.environ.get(SEEDS_LOG)
        if log and multiprocessing.parent_process() is None:  # the checking process
            with open(log, "a") as f:
                f.write(f"{time.monotonic():.3f} {scenario.seed}\n")
        if scenario.seed >= 60_000:
            from ddpcheck.mutation.catalogue import by_name

            return by_name("NoDivide").target.configure(scenario)
        return super().configure(scenario)


SEEDED = SeededAfterBattery()


def api_script() -> None:
    """What ``--api`` runs: a user's script, with no handler of its own."""
    import ddpcheck

    print(ddpcheck.assert_equivalent(SEEDED, world_sizes=(2,)), flush=True)
    print("fuzzing", flush=True)
    result = ddpcheck.fuzz(SEEDED, examples=200, world_sizes=(2,))
    print(result.error if result.found else "nothing found", flush=True)


# ---------------------------------------------------------------------------------------------
# One run


@dataclasses.dataclass
class Run:
    status: int | None  # None: hung (killed after GIVE_UP)
    seconds: float  # from the signal to the exit (or the whole run, uninterrupted)
    phase: str  # where the signal landed
    left: list[str]  # processes (and directories) still there SETTLE s after the exit
    settled: float  # seconds from the exit until the last of the run's processes was gone
    output: str

    expected: int  # the status a Ctrl-C must end it with

    @property
    def good(self) -> bool:
        return self.status == self.expected and self.seconds <= WITHIN and not self.left


def _command(api: bool) -> list[str]:
    if api:
        return [sys.executable, os.path.abspath(__file__), "--api-script"]
    here = os.path.dirname(sys.executable)
    ddpcheck = os.path.join(here, "ddpcheck")
    front = [ddpcheck] if os.path.exists(ddpcheck) else [sys.executable, "-m", "ddpcheck"]
    return [
        *front,
        "check",
        f"{os.path.abspath(__file__)}:SEEDED",
        "--world-sizes",
        "2",
        "--examples",
        "200",
    ]


def _marked(token: str) -> list[int]:
    """Live processes whose environment carries ``token`` (zombies are not alive)."""
    needle = f"{MARKER}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            pass
    return found


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        with open(f"/proc/{pid}/stat") as f:
            ppid = f.read().rsplit(")", 1)[1].split()[1]
        return f"{pid} (ppid {ppid}): {cmd[:120]}"
    except OSError:
        return f"{pid} (gone)"


class _Output:
    """The run's output, read in a thread, each line with the moment it arrived."""

    def __init__(self, stream):
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), line))

    def text(self) -> str:
        self._thread.join(5)
        return "".join(line for _, line in self.lines)

    def seen(self, word: str, before: float) -> bool:
        return any(word in line for at, line in list(self.lines) if at <= before)


def _phase(tmp: str, out: _Output, seeds_log: str, at: float) -> str:
    """Where a signal sent at ``at`` landed, from what the run had shown by then."""
    try:
        with open(seeds_log) as f:
            seeds = [(float(t), int(s)) for t, s in (line.split() for line in f)]
    except (OSError, ValueError):
        seeds = []
    seeds = [s for t, s in seeds if t <= at]
    if any(s >= 60_000 for s in seeds):
        return "shrinking"
    if out.seen("fuzzing", at):
        return "random examples"
    if seeds:
        return "battery"
    names = os.listdir(tmp)
    if any(n.startswith("ddpcheck-w") for n in names):
        return "ranks forking"
    if any(n.startswith("pymp-") for n in names):
        return "start-up (fork server booting)"
    return "start-up (interpreter, imports)"


def one_run(api: bool, delay: float | None, number: int) -> Run:
    """Run the command; SIGINT its process group ``delay`` seconds in (None: let it finish)."""
    tmp = tempfile.mkdtemp(prefix="ctrl-c-")
    seeds_log = os.path.join(tmp, "seeds.log")
    run_tmp = os.path.join(tmp, "tmp")
    os.mkdir(run_tmp)
    token = f"{os.getpid()}-{number}"
    env = {
        **os.environ,
        "TMPDIR": run_tmp,
        SEEDS_LOG: seeds_log,
        MARKER: token,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")])
        ),
    }
    started = time.monotonic()
    # Ctrl-C as a terminal gives it: its own process group, SIGINT not ignored (a bench started
    # in the background ignores it, and a child would inherit that)
    proc = subprocess.Popen(
        _command(api),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    out = _Output(proc.stdout)
    try:
        phase, sent = "uninterrupted", started
        if delay is not None:
            while time.monotonic() < started + delay and proc.poll() is None:
                time.sleep(min(0.01, max(started + delay - time.monotonic(), 0)))
            if proc.poll() is not None:
                phase = "ended before the signal"
            else:
                sent = time.monotonic()
                phase = _phase(run_tmp, out, seeds_log, sent)
                os.killpg(proc.pid, signal.SIGINT)
        try:
            status: int | None = proc.wait(timeout=GIVE_UP)
        except subprocess.TimeoutExpired:
            status = None
        ended = time.monotonic()
        seconds = ended - sent
        while _marked(token) and time.monotonic() < ended + SETTLE:
            time.sleep(0.05)
        settled = time.monotonic() - ended
        left = [_describe(pid) for pid in _marked(token)]
        # torch's compile cache (``torchinductor_USER``) is meant to stay: not ddpcheck's
        left += [
            f"directory {name}"
            for name in os.listdir(run_tmp)
            if not name.startswith("torchinductor_")
        ]
        # the command exits 130; a script gets the KeyboardInterrupt, and Python's exit then is
        # to kill itself with SIGINT (130 in a shell)
        expected = -signal.SIGINT if api else 130
        return Run(status, seconds, phase, left, settled, out.text(), expected)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in _marked(token):  # never leave anything, whatever happened
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The tally


def _status(status: int | None) -> str:
    if status is None:
        return "hung"
    if status < 0:
        return f"killed by {signal.Signals(-status).name}"
    return f"exit {status}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="interrupted runs (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the moments (default 0)")
    parser.add_argument(
        "--api",
        action="store_true",
        help="interrupt a script calling the API, not `ddpcheck check`",
    )
    parser.add_argument(
        "--window",
        type=float,
        default=None,
        help="seconds the moments are drawn from (default: 0.9 times one "
        "uninterrupted run's length, measured first)",
    )
    parser.add_argument(
        "--start", type=float, default=0.0, help="draw the moments from [START, window] (default 0)"
    )
    parser.add_argument("--verbose", action="store_true", help="print every bad run's output")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        sys.exit("bench/ctrl_c.py reads /proc: Linux only")
    what = "a script calling the API" if args.api else "ddpcheck check"
    window = args.window
    if window is None:
        full = one_run(args.api, None, 0)
        window = 0.9 * full.seconds  # a run's length varies: most moments fall before its end
        print(
            f"{what}, uninterrupted: {_status(full.status)} in {full.seconds:.1f} s"
            + (f"; LEFT {full.left}" if full.left else ""),
            flush=True,
        )
    print(
        f"{args.runs} Ctrl-Cs of {what} at moments drawn from [{args.start:g}, {window:.1f}] s "
        f"(seed {args.seed})",
        flush=True,
    )
    rng = random.Random(args.seed)
    runs: list[Run] = []
    early = 0
    number = 0
    while len(runs) < args.runs:
        number += 1
        delay = rng.uniform(args.start, window)
        run = one_run(args.api, delay, number)
        if run.phase == "ended before the signal":
            early += 1
            print(
                f"  ({delay:5.2f} s: the run had ended, {_status(run.status)}; not counted)",
                flush=True,
            )
            continue
        runs.append(run)
        mark = "ok " if run.good else "BAD"
        print(
            f"{len(runs):4d} {mark} at {delay:5.2f} s ({run.phase}): {_status(run.status)} "
            f"{run.seconds:.2f} s after the signal, all gone {run.settled:.2f} s after the exit"
            + (f"; LEFT {run.left}" if run.left else ""),
            flush=True,
        )
        if not run.good and args.verbose:
            print("     | " + run.output.rstrip().replace("\n", "\n     | "), flush=True)
    seconds = sorted(r.seconds for r in runs if r.status is not None)
    statuses: dict[str, int] = {}
    for r in runs:
        statuses[_status(r.status)] = statuses.get(_status(r.status), 0) + 1
    phases: dict[str, list[int]] = {}
    for r in runs:
        phases.setdefault(r.phase, [0, 0])[0 if r.good else 1] += 1
    good = sum(r.good for r in runs)
    ended = "killed by SIGINT (Python's exit on a KeyboardInterrupt)" if args.api else "exit 130"
    print(f"\n{what}: {good}/{len(runs)} {ended} within {WITHIN:.0f} s with nothing left")
    print("  exits: " + ", ".join(f"{k} x{v}" for k, v in sorted(statuses.items())))
    if seconds:
        print(
            f"  seconds from the signal to the exit: median {statistics.median(seconds):.2f}, "
            f"max {max(seconds):.2f}"
        )
    print(
        f"  runs with something left {SETTLE:.0f} s after the exit: "
        f"{sum(bool(r.left) for r in runs)}; all gone after the exit: median "
        f"{statistics.median(r.settled for r in runs):.2f} s, max "
        f"{max(r.settled for r in runs):.2f} s"
    )
    print(
        "  where the signals landed (good / bad): "
        + ", ".join(f"{p} {g}/{b}" for p, (g, b) in phases.items())
    )
    if early:
        print(f"  ({early} runs ended before their signal, not counted)")


if __name__ == "__main__":
    if sys.argv[1:] == ["--api-script"]:
        api_script()
    else:
        main()
