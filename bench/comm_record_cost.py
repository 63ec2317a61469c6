"""What recording DTensor's collectives costs: the marginal seconds of one random example with
torch's functional collectives recorded (the default) and unrecorded, side by side, in one run.

Draws random examples as ``bench/tensor_parallel_speed.py`` does (data parallelism at W=2,
``torch_tp`` at tp=2, ``torch_2d`` at dp=2 x tp=2), and runs each twice in the same persistent
world, alternately with and without the recorder's wrappers of
``torch.distributed._functional_collectives`` (``recorder.record_functional``, switched in every
rank between examples) -- the order alternating from one example to the next, so a machine that
gets busier moves both columns alike. Prints the medians, and the median of the examples' own
ratios (recorded / unrecorded, example by example: what a loaded machine moves least); the data
parallel row runs no DTensor, so its ratio is the bench's own noise.

    python bench/comm_record_cost.py [--examples 20] [--seed 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tensor_parallel_speed import _drawn

import ddpcheck
from ddpcheck._rank import recorder
from ddpcheck._runs.example import prepare_reference
from ddpcheck._world.registry import get_world, shutdown_worlds
from ddpcheck.targets.catalogue import PARALLEL, TORCH_2D, TORCH_TP


def _once(target, scenario, world_size: int) -> float | None:
    started = time.perf_counter()
    try:
        ddpcheck.check_example(target, scenario, world_size)
    except ddpcheck.DdpcheckError as exc:  # a decline at run time: not a cost
        print(f"  skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
        return None
    return time.perf_counter() - started


def _pairs(target, scenarios: list, world_size: int) -> tuple[list[float], list[float]]:
    world = get_world(world_size)  # up before the clock starts
    on: list[float] = []
    off: list[float] = []
    for i, scenario in enumerate(scenarios):
        prepare_reference(scenario)  # the reference is the checking process's, not the world's
        order = (True, False) if i % 2 == 0 else (False, True)
        got = {}
        for enabled in order:
            world.run(recorder.record_functional, enabled)
            got[enabled] = _once(target, scenario, world_size)
        world.run(recorder.record_functional, True)
        if got[True] is not None and got[False] is not None:
            on.append(got[True])
            off.append(got[False])
    return on, off


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=20)
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
            measured.append((label, w, *_pairs(target, scenarios, w)))
    finally:
        shutdown_worlds()
    print(
        f"\n{'':28} {'W':>2} {'pairs':>5} {'recorded s':>10} {'unrecorded s':>12} "
        f"{'ratio of medians':>16} {'median ratio':>12}"
    )
    for label, w, on, off in measured:
        a, b = statistics.median(on), statistics.median(off)
        paired = statistics.median(x / y for x, y in zip(on, off))
        print(
            f"{label:28} {w:>2} {len(on):>5} {a:>10.3f} {b:>12.3f} {a / b:>16.2f} {paired:>12.2f}"
        )


if __name__ == "__main__":
    main()
