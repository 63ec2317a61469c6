"""Where a random example's CPU goes: the checking process and every rank, per example.

Runs ``fuzz(PARALLEL)`` at each world size in one persistent world and reads, from ``/proc``
(Linux), the CPU each rank spent and this process's own, per example -- first as ddpcheck runs
(one intra-op thread in this process while it checks an example), then with torch's default
threads here (the caller's setting, as before ddpcheck pinned it), interleaved. Prints the
floor this sets for ``bench/throughput.py``'s marginal cost: however well the processes overlap,
an example cannot take less wall time than their CPU divided by the cores.

    python bench/example_cpu.py [--world-sizes 2,4] [--examples 200] [--seed 3] [--repeats 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import statistics
import sys
import time

import torch

from ddpcheck import targets
from ddpcheck._runs import example
from ddpcheck._runs.fuzz import fuzz
from ddpcheck._world.registry import get_world


def _cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run(world_size: int, examples: int, seed: int) -> tuple[float, float, list[float]]:
    """Wall, this process's CPU and each rank's CPU, in seconds per example."""
    pids = get_world(world_size).pids
    ranks = [_cpu_seconds(p) for p in pids]
    here, started = time.process_time(), time.perf_counter()
    result = fuzz(targets.PARALLEL, examples=examples, world_sizes=(world_size,), seed=seed)
    wall, here = time.perf_counter() - started, time.process_time() - here
    if get_world(world_size).pids != pids:
        raise SystemExit("the world was replaced mid-run: its CPU cannot be read")
    n = result.examples
    return wall / n, here / n, [(_cpu_seconds(p) - r) / n for p, r in zip(pids, ranks)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    pinned = example._beside_the_ranks
    print(
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, torch threads here by "
        f"default {torch.get_num_threads()}; ms per example, medians of {args.repeats}"
    )
    for world_size in (int(w) for w in args.world_sizes.split(",")):
        fuzz(targets.PARALLEL, examples=3, world_sizes=(world_size,), seed=99)  # warm
        rows: dict[str, list] = {"one thread here": [], "default threads here": []}
        for _ in range(args.repeats):
            for arm in rows:
                example._beside_the_ranks = (
                    pinned if arm == "one thread here" else contextlib.nullcontext
                )
                try:
                    rows[arm].append(_run(world_size, args.examples, args.seed))
                finally:
                    example._beside_the_ranks = pinned
        for arm, runs in rows.items():
            wall = statistics.median(r[0] for r in runs)
            here = statistics.median(r[1] for r in runs)
            ranks = [statistics.median(r[2][i] for r in runs) for i in range(world_size)]
            total = here + sum(ranks)
            print(
                f"W={world_size} {arm}: wall {1e3 * wall:.1f}; CPU here {1e3 * here:.1f}, "
                f"ranks {' '.join(f'{1e3 * c:.1f}' for c in ranks)}; all {1e3 * total:.1f} "
                f"-> floor {1e3 * total / os.cpu_count():.1f} ms on {os.cpu_count()} cores",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
