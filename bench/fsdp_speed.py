"""Examples per second of ``torch_fsdp`` against ``torch_ddp``, in persistent worlds.

Median seconds per ``check_example`` (reference prepared once per scenario, outside the timing)
at W = 2, 3, 4, the two targets interleaved example by example so that machine load hits both
alike; prints examples/s and the FSDP / DDP ratio.

    python bench/fsdp_speed.py [--examples 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402

from ddpcheck import check_example, targets, zoo  # noqa: E402
from ddpcheck._runs.example import prepare_reference  # noqa: E402
from ddpcheck._world.registry import shutdown_worlds  # noqa: E402
from ddpcheck.scenario import Scenario  # noqa: E402

SCENARIOS = [Scenario(zoo.MLP, global_batch=8, steps=1, seed=s) for s in range(3)] + [
    Scenario(zoo.Tied, global_batch=7, steps=1, seed=3)
]
TARGETS = {"torch_ddp": targets.TORCH_DDP, "torch_fsdp": targets.TORCH_FSDP}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=30, help="timed examples per W and target")
    args = parser.parse_args()
    references = [prepare_reference(s) for s in SCENARIOS]
    print(
        f"torch_fsdp vs torch_ddp, torch {torch.__version__}, {args.examples} examples per W "
        "and target (persistent worlds, medians)"
    )
    try:
        for world_size in (2, 3, 4):
            times: dict[str, list[float]] = {name: [] for name in TARGETS}
            for i in range(args.examples + len(SCENARIOS)):  # the first round warms up
                for name, target in TARGETS.items():
                    k = i % len(SCENARIOS)
                    t0 = time.perf_counter()
                    check_example(target, SCENARIOS[k], world_size, reference=references[k])
                    if i >= len(SCENARIOS):
                        times[name].append(time.perf_counter() - t0)
            med = {name: statistics.median(t) for name, t in times.items()}
            print(
                f"W={world_size}: "
                + ", ".join(
                    f"{name} {1 / s:.1f} examples/s ({1e3 * s:.1f} ms)" for name, s in med.items()
                )
                + f"; fsdp/ddp {med['torch_fsdp'] / med['torch_ddp']:.2f}x",
                flush=True,
            )
    finally:
        shutdown_worlds()


if __name__ == "__main__":
    main()
