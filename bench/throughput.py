"""The product's own path: how fast `ddpcheck check` reaches a first verdict, and what each random
example costs after it, against a fresh world per example.

Prints, at each world size and in one run (commands interleaved, so a noisy machine slows all of
them alike), the medians of:
- spawn-per-example: a fresh world spawned, one example run in it, the world stopped -- what a
  harness without persistent worlds pays per example (in this process, torch already imported);
  the issue's baseline;
- fork-per-example: the same with the ranks forked from ddpcheck's fork server, which imported
  torch once (``_world.forking``; how ddpcheck starts its worlds now): a harness
  without persistent worlds could do that too, so the ratio against it is printed as well;
- first verdict: `ddpcheck check --world-sizes W --examples 1 --seed S` as a whole process
  (interpreter, imports, world start-up, the built-in battery, one random example);
- marginal cost per random example: (`--examples N` - `--examples 1`) / (N - 1), same seed;
- ranks alone: the same random examples (drawn once by ``fuzz`` in this process, same seed) run
  back to back on the persistent world with nothing drawn, referenced or judged in between --
  the target's own work, the recording and the round trip: the floor the marginal cost cannot
  go below however the checking process overlaps its work with the ranks';
and the ratios the issue holds them to: spawn / marginal (>= 100x) and first verdict / spawn
(<= 1.5x at W=2).

    python bench/throughput.py [--world-sizes 2,4] [--examples 201] [--repeats 3] [--seed 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import ddpcheck
from ddpcheck import targets
from ddpcheck._runs.example import check_example
from ddpcheck._world.registry import shutdown_worlds
from ddpcheck._world.worlds import World
from ddpcheck.battery import BATTERY


def _fresh_world_example(world_size: int, start_method: str) -> float:
    """Seconds for a fresh world, one example (the battery's first) in it, and its shutdown."""
    started = time.perf_counter()
    world = World(world_size, start_method=start_method).start()
    try:
        from ddpcheck._rank.runner import run_example_packed

        _, scenario = BATTERY[0]
        world.run(run_example_packed, targets.PARALLEL, scenario)
    finally:
        world.close()
    return time.perf_counter() - started


def _drawn(world_size: int, examples: int, seed: int) -> list:
    """The scenarios ``fuzz(PARALLEL)`` runs at ``world_size`` with ``seed``: captured while it
    runs them, so Hypothesis draws exactly what it draws for ``ddpcheck check``."""
    from ddpcheck._runs import engine, fuzz

    drawn, run = [], engine.one_behind_the_other

    def capture(items, settings, **kwargs):
        for item, outcome in run(items, settings, **kwargs):
            drawn.append(item[2])
            yield item, outcome

    engine.one_behind_the_other = capture
    try:
        fuzz.fuzz(targets.PARALLEL, examples=examples, world_sizes=(world_size,), seed=seed)
    finally:
        engine.one_behind_the_other = run
    return drawn


def _ranks_alone(world_size: int, scenarios: list) -> float:
    """Seconds per example for the ranks alone to run ``scenarios`` back to back, nothing judged
    in between -- but a resumed one (a few in a hundred), which runs as a whole example: its two
    halves in their two worlds, then judged."""
    from ddpcheck import check_example
    from ddpcheck._rank.runner import run_example_packed
    from ddpcheck._world.registry import get_world

    started = time.perf_counter()
    for scenario in scenarios:
        if scenario.checkpoint_after is None:
            get_world(world_size).run(run_example_packed, targets.PARALLEL, scenario)
        else:
            check_example(targets.PARALLEL, scenario, world_size)
    return (time.perf_counter() - started) / len(scenarios)


def _check(world_size: int, examples: int, seed: int) -> float:
    """Seconds of a whole `ddpcheck check` process."""
    started = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpcheck",
            "check",
            "--world-sizes",
            str(world_size),
            "--examples",
            str(examples),
            "--seed",
            str(seed),
        ],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"ddpcheck check exited {done.returncode}:\n{done.stdout}{done.stderr}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument(
        "--examples", type=int, default=201, help="random examples of the long run (default 201)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args(argv)
    sizes = [int(w) for w in args.world_sizes.split(",")]
    # one example in this process first: torch, dynamo and the reference machinery imported
    check_example(targets.PARALLEL, BATTERY[0][1], 1)
    shutdown_worlds()
    print(
        f"ddpcheck {ddpcheck.__version__}, {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.1f}; {args.repeats} repeats, interleaved"
    )
    rows = []
    for world_size in sizes:
        spawned, forked, first, long, alone = [], [], [], [], []
        scenarios = _drawn(world_size, args.examples, args.seed)
        for _ in range(args.repeats):
            alone.append(_ranks_alone(world_size, scenarios))
            spawned.append(_fresh_world_example(world_size, "spawn"))
            forked.append(_fresh_world_example(world_size, "auto"))
            first.append(_check(world_size, 1, args.seed))
            long.append(_check(world_size, args.examples, args.seed))
        s, f, k = statistics.median(spawned), statistics.median(first), statistics.median(forked)
        marginal = statistics.median((lg - fs) / (args.examples - 1) for lg, fs in zip(long, first))
        a = statistics.median(alone)
        rows.append((world_size, s, f, marginal))
        print(
            f"W={world_size}: spawn-per-example {s:.2f} s; first verdict {f:.2f} s "
            f"({f / s:.2f}x a spawned example); marginal {1e3 * marginal:.1f} ms per random "
            f"example ({s / marginal:.0f}x cheaper than a spawn); fork-per-example {k:.2f} s "
            f"({k / marginal:.0f}x the marginal); ranks alone {1e3 * a:.1f} ms per example "
            f"(at most {s / a:.0f}x cheaper than a spawn; the marginal is {marginal / a:.2f}x "
            f"it); "
            f"{args.examples} examples {statistics.median(long):.1f} s",
            flush=True,
        )
    verdict = all(s / m >= 100 for _, s, _, m in rows) and all(
        f / s <= 1.5 for w, s, f, _ in rows if w == 2
    )
    print(
        "targets (>= 100x cheaper at every W; first verdict <= 1.5x a spawn at W=2): "
        + ("met" if verdict else "NOT met")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
