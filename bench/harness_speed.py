"""Examples per second of the harness: persistent worlds vs a fresh world per example.

Prints, at W = 2, 3, 4 and on the same small scenarios in the same run:
- persistent: median seconds per ``check_example`` in a world that stays up;
- spawn-per-example: median seconds when every example spawns (and tears down) its own world,
  as PyTorch's own test harness does;
- raw collectives: median seconds to replay, in the running world, exactly the collectives one
  example issued (same ops, shapes, dtypes, roots) with no model, no oracle, no pickling;
and the ratios: spawn / persistent (target >= 100x) and persistent / raw (target <= 1.5x).

    python bench/harness_speed.py [--examples 30] [--spawned 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from ddpcheck import check_example, targets, zoo
from ddpcheck._rank.runner import run_example
from ddpcheck._runs.example import prepare_reference
from ddpcheck._world.registry import get_world, shutdown_worlds
from ddpcheck._world.worlds import World
from ddpcheck.scenario import Scenario

SCENARIOS = [Scenario(zoo.MLP, global_batch=8, steps=1, seed=s) for s in range(3)] + [
    Scenario(zoo.Tied, global_batch=7, steps=1, seed=3)
]
TARGET = targets.PARALLEL
#: docs/platform.md: one equivalence example in an already-running world, W = 2, 3, 4.
NOTES_MS = {2: 6.5, 3: 14.6, 4: 22.5}


def _replay_collectives(calls: list[tuple], repeats: int) -> list[float]:
    """In a rank: issue `calls` (op, shapes, dtypes, root) `repeats` times; seconds each."""
    tensors = [
        [torch.zeros(s, dtype=getattr(torch, d)) for s, d in zip(shapes, dtypes)]
        for _, shapes, dtypes, _, _ in calls
    ]
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        handles = []
        for (op, _, _, root, is_async), ts in zip(calls, tensors):
            if op == "all_reduce":
                handles.append(dist.all_reduce(ts[0], async_op=is_async))
            elif op == "broadcast":
                handles.append(dist.broadcast(ts[0], src=root, async_op=is_async))
            elif op == "all_gather":
                handles.append(
                    dist.all_gather(
                        [torch.empty_like(ts[0]) for _ in range(dist.get_world_size())], ts[0]
                    )
                )
        for h in handles:
            if h is not None:
                h.wait()  # sync point: the replay is done when every collective is
        times.append(time.perf_counter() - start)
    return times


def _collectives_of_one_example(world_size: int, scenario: Scenario) -> list[tuple]:
    records = get_world(world_size).run(_run_and_log, TARGET, scenario)
    return records[0]


def _run_and_log(target, scenario):
    from ddpcheck._rank import recorder as comm

    comm.reset()
    run_example(target, scenario)
    return [(c.op, c.shapes, c.dtypes, c.root, c.async_op) for c in comm.records()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=30)
    parser.add_argument("--spawned", type=int, default=3, help="fresh-world examples per W")
    args = parser.parse_args()
    references = [prepare_reference(s) for s in SCENARIOS]
    print(
        f"harness speed, {TARGET.__class__.__name__}, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    print(
        f"{'W':>2} {'persistent':>12} {'spawn/example':>14} {'raw comm':>10} "
        f"{'spawn/persist':>14} {'persist/raw':>12} {'persist/notes':>14}"
    )
    for world_size in (2, 3, 4):
        get_world(world_size)  # start-up is not part of the per-example figure
        persistent, raw = [], []
        calls = _collectives_of_one_example(world_size, SCENARIOS[0])
        for i in range(args.examples):  # interleave the two measurements
            scenario = SCENARIOS[i % len(SCENARIOS)]
            start = time.perf_counter()
            check_example(TARGET, scenario, world_size, reference=references[i % len(SCENARIOS)])
            persistent.append(time.perf_counter() - start)
            if scenario is SCENARIOS[0]:
                raw.append(min(get_world(world_size).run(_replay_collectives, calls, 1)[0]))
        spawned = []
        for i in range(args.spawned):
            start = time.perf_counter()
            world = World(world_size).start()
            world.run(run_example, TARGET, SCENARIOS[i % len(SCENARIOS)])
            world.close()
            spawned.append(time.perf_counter() - start)
        p, s, r = (statistics.median(x) for x in (persistent, spawned, raw))
        print(
            f"{world_size:>2} {p * 1e3:>10.1f}ms {s:>13.2f}s {r * 1e3:>8.2f}ms "
            f"{s / p:>13.0f}x {p / r:>11.1f}x {p * 1e3 / NOTES_MS[world_size]:>13.2f}x"
        )
    shutdown_worlds()


if __name__ == "__main__":
    main()
