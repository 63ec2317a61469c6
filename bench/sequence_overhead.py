"""What the collective-sequence files cost per example (issue 7: must stay under ~5 %).

Runs the same example (PARALLEL, default scenario) in one warm world, alternating blocks with the
sequence files on (rank: one os.write per collective; parent: read W files, compare as text) and
off, and prints the median time per example of each. Blocks alternate so machine load drifts
affect both sides alike.

    python bench/sequence_overhead.py [--world-size 2] [--examples 200] [--blocks 6]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch.distributed as dist  # noqa: E402

from ddpcheck import check_example, targets  # noqa: E402
from ddpcheck._rank import recorder as comm  # noqa: E402
from ddpcheck._runs import example as api  # noqa: E402
from ddpcheck._runs.example import prepare_reference  # noqa: E402
from ddpcheck._world.registry import get_world, shutdown_worlds  # noqa: E402
from ddpcheck._world.worlds import World  # noqa: E402
from ddpcheck.scenario import Scenario  # noqa: E402


def _record_to(paths):
    comm.record_to(None if paths is None else paths[dist.get_rank()])


def _switch(world: World, on: bool, saved: dict) -> None:
    world.run(_record_to, world._sequences if on else None)
    if on:
        api._mismatched_collectives = saved["check"]
        World.collective_sequences = saved["read"]
    else:
        api._mismatched_collectives = lambda texts, world_size: []
        World.collective_sequences = lambda self: []


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--examples", type=int, default=200, help="per block")
    parser.add_argument("--blocks", type=int, default=6, help="per side")
    args = parser.parse_args()
    scenario = Scenario()
    reference = prepare_reference(scenario)
    world = get_world(args.world_size)
    saved = {"check": api._mismatched_collectives, "read": World.collective_sequences}
    for _ in range(20):  # warm up: lazy imports, allocator
        check_example(targets.PARALLEL, scenario, args.world_size, reference=reference)
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for block in range(2 * args.blocks):
            on = block % 4 in (0, 3)  # ABBA: a load drift hits both sides alike
            _switch(world, on, saved)
            started = time.perf_counter()
            for _ in range(args.examples):
                check_example(targets.PARALLEL, scenario, args.world_size, reference=reference)
            times[on].append((time.perf_counter() - started) / args.examples)
        _switch(world, True, saved)
        check_example(targets.PARALLEL, scenario, args.world_size, reference=reference)
        texts = world.collective_sequences()
        per_rank = [len(t.splitlines()) for t in texts]
        started = time.perf_counter()
        for _ in range(1000):
            api._mismatched_collectives(world.collective_sequences(), args.world_size)
        parent_us = (time.perf_counter() - started) * 1e3
    finally:
        shutdown_worlds()
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(
        f"W={args.world_size}: {per_rank[0]} collectives per example per rank; "
        f"sequence files on {on * 1e3:.2f} ms, off {off * 1e3:.2f} ms per example "
        f"(median of {args.blocks} blocks x {args.examples}): overhead "
        f"{100 * (on - off) / off:+.1f} %; parent-side read+compare {parent_us:.0f} us"
    )
    print("  blocks on (ms): " + " ".join(f"{t * 1e3:.1f}" for t in times[True]))
    print("  blocks off (ms): " + " ".join(f"{t * 1e3:.1f}" for t in times[False]))


if __name__ == "__main__":
    main()
