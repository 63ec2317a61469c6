"""Where the suite's CPU goes: a pytest plugin that writes each test's CPU -- its worker and every
process under it, live or reaped -- and a summary of what it wrote.

    PYTHONPATH=bench CPU_PER_TEST=/tmp/cpu /usr/bin/time -v .venv/bin/pytest -n auto -q \\
        -p cpu_per_test tests properties
    .venv/bin/python bench/cpu_per_test.py /tmp/cpu          # by file, then by test

Why per process tree: most of the suite's CPU is spent outside the worker (its ranks, and the
processes a test starts: a command, a script, a pytest), which pytest's --durations cannot tell
from waiting. Needs psutil (not a dependency of ddpcheck: the frameworks' extra brings it).
"""

from __future__ import annotations

import collections
import glob
import json
import os
import pathlib
import resource
import sys
import time

OUT = os.environ.get("CPU_PER_TEST", "/tmp/cpu-per-test")


def _tree_cpu() -> float:
    """This process's CPU, its reaped children's, and every live descendant's own and reaped
    children's (a descendant reaped by another descendant is in that one's children figures)."""
    import psutil

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


try:
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        cpu, wall = _tree_cpu(), time.time()
        yield
        row = {
            "id": item.nodeid,
            "cpu": round(_tree_cpu() - cpu, 3),
            "wall": round(time.time() - wall, 3),
        }
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, f"{worker}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
except ImportError:  # the summary below needs no pytest
    pass


def main(folder: str, files: int = 30, tests: int = 40) -> None:
    rows = [
        json.loads(line)
        for path in glob.glob(f"{folder}/*.jsonl")
        for line in pathlib.Path(path).read_text().splitlines()
    ]
    print(f"{len(rows)} tests, {sum(r['cpu'] for r in rows):.1f} CPU-s in all")
    by_file: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for r in rows:
        entry = by_file[r["id"].split("::")[0]]
        entry[0] += r["cpu"]
        entry[1] += 1
    print("--- by file: CPU-s, tests")
    for name, (cpu, n) in sorted(by_file.items(), key=lambda kv: -kv[1][0])[:files]:
        print(f"{cpu:8.1f} {int(n):5d}  {name}")
    print("--- by test: CPU-s")
    for r in sorted(rows, key=lambda r: -r["cpu"])[:tests]:
        print(f"{r['cpu']:8.1f}  {r['id']}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else OUT)
