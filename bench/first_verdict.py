"""The first verdict of ``ddpcheck check`` on the mutant catalogue: the battery, then the search
for a smaller counterexample (``_runs.smaller``) -- what it finds, in how many examples and seconds.

Per mutant (the catalogue's, or ``--only``): ``assert_equivalent`` at ``--world-sizes`` (check's
battery, world sizes in order) until it fails, then ``smaller.first_verdict`` as check runs it.
One row each: the battery scenario and W, its size, the verdict shown (shrunk or the battery's)
and its size, examples and seconds of the search; then how many got a smaller verdict and the
search's median and largest seconds. Budgets as ``ddpcheck check`` uses them
(``smaller.EXAMPLES``, ``smaller.SECONDS``).

    python bench/first_verdict.py --world-sizes 1,2,3,4
    python bench/first_verdict.py --world-sizes 2 --only SumsEachMicroBatch,NoFinalFlush
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import ddpcheck  # noqa: E402
from ddpcheck._base.options import parse_world_sizes  # noqa: E402
from ddpcheck._language.messages import scenario_line  # noqa: E402
from ddpcheck._runs import smaller  # noqa: E402
from ddpcheck.errors import EquivalenceError  # noqa: E402
from ddpcheck.mutation.catalogue import CATALOGUE  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=parse_world_sizes, default=(1, 2, 3, 4))
    parser.add_argument("--only", default=None, help="mutant names, comma-separated")
    args = parser.parse_args(argv)
    wanted = None if args.only is None else {n.lower() for n in args.only.split(",")}
    searched: list[float] = []
    shrunk = 0
    print("| mutant | battery W | size | verdict shown | size | examples | search s |")
    print("|---|---|---|---|---|---|---|")
    for mutant in CATALOGUE:
        if wanted is not None and mutant.name.lower() not in wanted:
            continue
        try:
            ddpcheck.assert_equivalent(mutant.target, world_sizes=args.world_sizes)
        except EquivalenceError as found:
            battery = found
        else:
            print(f"| {mutant.name} | passes the battery | | | | | |", flush=True)
            continue
        lines: list[str] = []
        started = time.perf_counter()
        error, _ = smaller.first_verdict(
            mutant.target,
            battery,
            world_sizes=args.world_sizes,
            without=frozenset(),
            seed=None,
            say=lines.append,
        )
        seconds = time.perf_counter() - started
        searched.append(seconds)
        ran = next((line.split("(")[1].split(" example")[0] for line in lines[1:]), "-")
        w = battery.world_size
        shown = (
            f"{scenario_line(error.scenario)} W={error.world_size}: {error.kinds[0]}"
            if error is not battery
            else "battery stands: "
            + lines[-1].split(": ", 1)[-1].strip().removesuffix("; the battery scenario stands")
        )
        shrunk += error is not battery
        print(
            f"| {mutant.name} | {battery.name} W={w}: {battery.kinds[0]} | "
            f"{smaller.size(battery.scenario, w)} | {shown} | "
            f"{smaller.size(error.scenario, w)} | {ran} | {seconds:.1f} |",
            flush=True,
        )
    if searched:
        print(
            f"\n{shrunk}/{len(searched)} battery verdicts replaced by a smaller counterexample; "
            f"search median {statistics.median(searched):.1f} s, max {max(searched):.1f} s "
            f"(budget {smaller.EXAMPLES} examples, {smaller.SECONDS:g} s)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
