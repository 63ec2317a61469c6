"""A correct target on a loaded machine: ``ddpcheck check`` with and without CPU-bound processes
beside it, side by side in one run.

Each load process spins in a session of its own, as another user's job does (the kernel shares
a CPU between sessions first, then between a session's processes). What it shows: the exit
status stays 0 (slowness is not a bug: docs/worlds.md, "A hang, or a slow machine"), and what the
load costs in wall time. ``--deadline`` below the examples' loaded cost forces deadlines to pass
while the ranks work, so the overtime rule is what keeps the verdict.

    python bench/loaded.py                    # 8 load processes, the issue's command
    python bench/loaded.py --deadline 0.5     # deadlines that pass under load
    python bench/loaded.py --command "bench/throughput.py --world-sizes 2 --repeats 1"
                                              # any command, quiet then loaded: its last lines

The README's figures are best cases; docs/figures.md puts each beside its loaded twin, printed by
``--command`` (``pytest -n auto properties/``, ``bench/throughput.py``, ``bench/first_line.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator


@contextlib.contextmanager
def load(processes: int) -> Iterator[None]:
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(processes)
    ]
    try:
        time.sleep(1.0)  # running, and counted in the load average
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def run(command: list[str], lines: int = 1) -> tuple[int, float, str]:
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    last = done.stdout.strip().splitlines() or done.stderr.strip().splitlines() or [""]
    return done.returncode, time.monotonic() - started, "\n     ".join(last[-lines:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=8, help="CPU-bound load processes")
    parser.add_argument("--runs", type=int, default=1, help="quiet/loaded pairs")
    parser.add_argument("--examples", type=int, default=30)
    parser.add_argument("--world-sizes", default="2,3")
    parser.add_argument("--deadline", type=float, default=None)
    parser.add_argument(
        "--command",
        default=None,
        help="run this instead (a leading FILE.py or -m runs with this Python); "
        "its last 3 lines are shown",
    )
    args = parser.parse_args()
    command = [
        sys.executable,
        "-m",
        "ddpcheck",
        "check",
        "--examples",
        str(args.examples),
        "--world-sizes",
        args.world_sizes,
    ]
    if args.deadline is not None:
        command += ["--deadline", str(args.deadline)]
    lines = 1
    if args.command is not None:
        command, lines = shlex.split(args.command), 3
        if command[0].endswith(".py") or command[0] == "-m":
            command.insert(0, sys.executable)
    print(
        f"{' '.join(command[1:])}  ({os.cpu_count()} cores; load: {args.processes} CPU-bound "
        "processes, a session each)"
    )
    print(f"{'run':>3}  {'load':>6}  {'exit':>4}  {'wall s':>7}  {'loadavg':>7}  last line")
    statuses = []
    for index in range(args.runs):
        for loaded in (False, True):
            with load(args.processes if loaded else 0):
                status, wall, last = run(command, lines)
                average = os.getloadavg()[0]
            statuses.append(status)
            print(
                f"{index:>3}  {'loaded' if loaded else 'quiet':>6}  {status:>4}  {wall:7.1f}  "
                f"{average:7.1f}  {last if lines > 1 else last[:90]}",
                flush=True,
            )
    print(f"exit statuses: {sorted(set(statuses))} (0 wanted everywhere)")
    sys.exit(0 if set(statuses) == {0} else 1)


if __name__ == "__main__":
    main()
