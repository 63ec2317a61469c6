"""What scenario validity (``ddpcheck._oracle.judgeable.check_scenario``) adds to each
random example.

Draws the random scenarios ``ddpcheck check`` fuzzes with (``strategies.scenarios`` over
mixed-dtype models), then prints, per scenario, the parent's CPU time of ``check_scenario`` and
of ``reference_run`` (the single-process reference every example computes anyway), and -- unless
``--examples 0`` -- the wall time of whole examples (``check_example`` of the built-in parallel
target at W=2 in a running world) with and without the check, interleaved.

    python bench/validity_cost.py [--scenarios 200] [--examples 60]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from hypothesis import HealthCheck, given, settings  # noqa: E402

from ddpcheck import check_example, targets  # noqa: E402
from ddpcheck import strategies as dst  # noqa: E402
from ddpcheck._oracle import judgeable as validity  # noqa: E402
from ddpcheck._oracle.compare import reference_run  # noqa: E402
from ddpcheck._world.registry import get_world, shutdown_worlds  # noqa: E402


def _scenarios(n: int) -> list:
    drawn = []

    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(dst.scenarios(models=dst.models(mixed_dtypes=True)))
    def draw(scenario):
        drawn.append(scenario)

    draw()
    return drawn


def _cpu(function, scenario) -> float:
    started = time.process_time()
    function(scenario)
    return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenarios", type=int, default=200)
    parser.add_argument("--examples", type=int, default=60)
    args = parser.parse_args()
    scenarios = _scenarios(args.scenarios)
    validity.check_scenario(scenarios[0])  # first-use imports (torch._dynamo via optimizer.step)
    reference_run(scenarios[0])
    checks, references = [], []
    for scenario in scenarios:
        validity._PASSED.clear()  # every fuzzed scenario is a new object: no cache hits
        checks.append(_cpu(validity.check_scenario, scenario))
        references.append(_cpu(reference_run, scenario))

    def ms(values: list[float]) -> str:
        return (
            f"median {statistics.median(values) * 1e3:.2f} ms, "
            f"mean {statistics.fmean(values) * 1e3:.2f} ms"
        )

    print(f"{len(scenarios)} random scenarios, parent CPU time per scenario:")
    print(f"  check_scenario  {ms(checks)}")
    print(f"  reference_run   {ms(references)}")
    if args.examples <= 0:
        return
    get_world(2)
    real = validity.check_scenario
    with_check, without = [], []
    try:
        for i in range(args.examples):
            scenario = scenarios[i % len(scenarios)]
            order = ((True, with_check), (False, without))
            for enabled, times in order if i % 2 else order[::-1]:  # no order bias
                validity._PASSED.clear()
                validity.check_scenario = real if enabled else (lambda s: None)
                started = time.perf_counter()
                check_example(targets.PARALLEL, scenario, 2)
                times.append(time.perf_counter() - started)
    finally:
        validity.check_scenario = real
        shutdown_worlds()
    added = statistics.median(with_check) - statistics.median(without)
    print(f"{args.examples} examples at W=2 (parallel target, wall time):")
    print(f"  with check_scenario     {ms(with_check)}")
    print(f"  without check_scenario  {ms(without)}")
    print(
        f"  added: {added * 1e3:.2f} ms per example (median difference), "
        f"{added / statistics.median(without) * 100:.0f} %"
    )


if __name__ == "__main__":
    main()
