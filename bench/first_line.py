"""Progress from the first second: how long ``ddpcheck check`` on a terminal takes to print its
first line, and to count the battery's first example, from the moment its process starts.

Runs ``python -m ddpcheck check parallel --examples 2 --world-sizes 2`` with a pseudo-terminal as
its stdin, stdout and stderr (what a person sees), ``--runs`` times, and prints each run's
seconds to the first output, to the first ``battery k/N`` with k >= 1, and to its exit. The line
is drawn before torch loads, so the first figure stays under a second however loaded the
machine is (tests/front/test_progress.py holds it under 2 s). Quiet and loaded side by side:

    python bench/loaded.py --command "bench/first_line.py --runs 3"
"""

from __future__ import annotations

import argparse
import os
import re
import select
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = [
    sys.executable,
    "-m",
    "ddpcheck",
    "check",
    "parallel",
    "--examples",
    "2",
    "--world-sizes",
    "2",
]


def once() -> tuple[float, float, float, int]:
    """(first output, first battery count, exit) in seconds from the start, and the status."""
    master, slave = os.openpty()
    started = time.monotonic()
    proc = subprocess.Popen(
        COMMAND, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, start_new_session=True
    )
    os.close(slave)
    first = battery = float("nan")
    seen = b""
    while True:
        ready, _, _ = select.select([master], [], [], 1.0)
        if not ready:
            continue
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the command and its ranks closed the terminal
            break
        if not data:
            break
        now = time.monotonic() - started
        first = now if first != first else first
        seen += data
        if battery != battery and re.search(rb"battery [1-9]\d*/", seen):
            battery = now
    status = proc.wait()
    os.close(master)
    return first, battery, time.monotonic() - started, status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    runs = [once() for _ in range(args.runs)]
    print(f"{' '.join(COMMAND[1:])} under a pseudo-terminal, load {os.getloadavg()[0]:.1f}:")
    print(
        "; ".join(
            f"first line {f:.2f} s, battery 1/N {b:.1f} s, exit {e:.1f} s ({s})"
            for f, b, e, s in runs
        )
    )
    return 0 if all(s == 0 for *_, s in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
