"""The marginal cost of one random example: data parallelism, tp=2 and dp=2 x tp=2, in one run.

Draws the same number of random examples from each target's own strategy (what ``ddpcheck
check`` draws), runs each through ``check_example`` in a persistent world that is already up (its
start-up and each example's reference excluded, as the wall of a long ``check`` amortises them),
and prints the median and upper quartile of seconds per example side by side, with the ratio to
the data-parallel figure -- a noisy machine moves all three columns alike.

    python bench/tensor_parallel_speed.py [--examples 40] [--seed 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from hypothesis import HealthCheck, given, seed, settings

import ddpcheck
from ddpcheck import strategies as dst
from ddpcheck._language.tensor_parallel import TensorParallel
from ddpcheck._runs.example import prepare_reference
from ddpcheck._world.registry import get_world, shutdown_worlds
from ddpcheck.targets.catalogue import PARALLEL, TORCH_2D, TORCH_TP


def _drawn(target, world_size: int, count: int, at_seed: int, tp: int | None) -> list:
    """``count`` scenarios of ``target``'s strategy at ``world_size`` (a tensor-parallel degree
    pinned to ``tp`` when given) that the target runs."""
    found: list = []

    @seed(at_seed)
    @settings(
        max_examples=count * 4,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(dst.examples(target, world_sizes=(world_size,)))
    def draw(example):
        scenario, w = example
        if len(found) >= count:
            return
        if tp is not None:
            scenario = dataclasses.replace(
                scenario,
                tensor_parallel=TensorParallel(
                    scenario.tensor_parallel.plan if scenario.tensor_parallel else (), tp
                ),
            )
        if ddpcheck.targets.support.declines(target, scenario, w) is None:
            found.append(scenario)

    draw()
    return found


def _seconds(target, scenarios: list, world_size: int) -> list[float]:
    get_world(world_size)  # up before the clock starts
    times = []
    for scenario in scenarios:
        prepare_reference(scenario)  # the reference is the checking process's, not the world's
        started = time.perf_counter()
        try:
            ddpcheck.check_example(target, scenario, world_size)
        except ddpcheck.DdpcheckError as exc:  # a decline at run time: not a cost
            print(f"  skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
            continue
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=40)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()
    rows = [
        ("data parallel (parallel)", PARALLEL, 2, None),
        ("tp=2 (torch_tp)", TORCH_TP, 2, None),
        ("dp=2 x tp=2 (torch_2d)", TORCH_2D, 4, 2),
    ]
    measured = []
    try:
        for label, target, w, tp in rows:
            scenarios = _drawn(target, w, args.examples, args.seed, tp)
            measured.append((label, w, _seconds(target, scenarios, w)))
    finally:
        shutdown_worlds()
    base = statistics.median(measured[0][2])
    print(f"\n{'':28} {'W':>2} {'examples':>8} {'median s':>9} {'p75 s':>7} {'/ DP':>6}")
    for label, w, times in measured:
        median = statistics.median(times)
        p75 = statistics.quantiles(times, n=4)[2] if len(times) > 1 else median
        print(f"{label:28} {w:>2} {len(times):>8} {median:>9.3f} {p75:>7.3f} {median / base:>6.1f}")


if __name__ == "__main__":
    main()
