"""What the collector costs a rank: its start-up objects frozen (``gc.freeze()`` at the end of
``_rank.serve``'s start-up, as ranks run now) against the same rank with them unfrozen.

A task that leaves a process group behind (frameworks create their own groups; hand-written ZeRO
does) makes the fitness check run a full ``gc.collect()`` (``_rank.fitness``), which, unfrozen,
walks the ~285k objects torch and dynamo imported. Prints, side by side in one persistent W=2
world, interleaved: one full collection in a rank, and the wall and CPU per example of a target
that creates one process group per example (machine CPU, every process).

    python bench/rank_gc.py [--examples 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch.distributed as dist

from ddpcheck import Scenario, targets


class MakesAGroup(targets.ParallelTarget):
    """parallel's target, and one process group created per example and left behind."""

    def wrap(self, module):
        dist.new_group(list(range(dist.get_world_size())))
        return super().wrap(module)


def _collection_seconds() -> tuple[float, int]:
    started = time.perf_counter()
    gc.collect()
    return time.perf_counter() - started, gc.get_freeze_count()


def _unfreeze() -> None:
    gc.unfreeze()


def _freeze() -> None:
    gc.freeze()


def _machine_cpu() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _per_example(world, n: int) -> tuple[float, float]:
    from ddpcheck._rank.runner import run_example_packed

    scenario = Scenario()
    cpu, wall = _machine_cpu(), time.perf_counter()
    for _ in range(n):
        world.run(run_example_packed, MakesAGroup(), scenario)
    return (time.perf_counter() - wall) / n, (_machine_cpu() - cpu) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from ddpcheck._rank.runner import run_example_packed
    from ddpcheck._world.registry import get_world, shutdown_worlds

    world = get_world(2)
    world.run(run_example_packed, MakesAGroup(), Scenario())  # warm: the target imported
    figures = {"frozen": [], "unfrozen": []}
    try:
        for _ in range(args.repeats):
            for state in ("frozen", "unfrozen"):
                if state == "unfrozen":
                    world.run(_unfreeze)
                collection, frozen = world.run(_collection_seconds)[0]
                wall, cpu = _per_example(world, args.examples)
                figures[state].append((collection, wall, cpu, frozen))
                if state == "unfrozen":
                    world.run(_freeze)
    finally:
        shutdown_worlds()
    print(
        f"W=2, a target creating one process group per example, {args.examples} examples x "
        f"{args.repeats} (medians)"
    )
    medians = {
        state: [statistics.median(r[i] for r in rows) for i in range(3)]
        for state, rows in figures.items()
    }
    for state, (collection, wall, cpu) in medians.items():
        print(
            f"  {state:<9} objects frozen {figures[state][0][3]:>7}: gc.collect() in a rank "
            f"{collection * 1e3:7.2f} ms; per example wall {wall * 1e3:6.1f} ms, "
            f"CPU {cpu * 1e3:6.1f} ms"
        )
    (c0, w0, u0), (c1, w1, u1) = medians["frozen"], medians["unfrozen"]
    print(
        f"  unfrozen / frozen: collection {c1 / c0:.0f}x, example wall {w1 / w0:.1f}x, "
        f"CPU {u1 / u0:.1f}x"
    )


if __name__ == "__main__":
    main()
