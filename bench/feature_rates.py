"""How often the random scenarios exercise each feature (the vocabulary table of docs/scenarios.md).

Draws N scenarios from ``ddpcheck.strategies.scenarios`` (both dtypes, mixed-dtype models, world
sizes 2-4 as the runs allow, checkpoints resumed at 1-3) and a world size from 2-4 each, then
counts ``ddpcheck.features.of(scenario, W)``: what the ranks would see, not what the generator
meant to draw.

    python bench/feature_rates.py --examples 1000
    python bench/feature_rates.py --examples 1000 --opt-in param-dtype   # a target that opts in
"""

from __future__ import annotations

import argparse
import collections
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ddpcheck import features  # noqa: E402
from ddpcheck import strategies as dst  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--opt-in", default="", help="opt-in features to draw too (param-dtype)")
    args = parser.parse_args(argv)
    opt_in = features.parse(args.opt_in, "--opt-in")
    counts: collections.Counter = collections.Counter()
    drawn = []

    @settings(
        max_examples=args.examples,
        database=None,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        scenario=dst.scenarios(
            models=dst.models(mixed_dtypes=True),
            dtypes=("float64", "float32"),
            resume_world_sizes=(1, 2, 3),
            opt_in=opt_in,
        ),
        world_size=st.integers(2, 4),
    )
    def draw(scenario, world_size):
        drawn.append(1)
        counts.update(features.of(scenario, world_size))

    draw()
    n = len(drawn)
    print(f"{n} scenarios drawn (W=2-4, both dtypes, opt-in: {', '.join(opt_in) or 'none'})")
    for name in features.FEATURES:
        print(f"{name:22s} {100 * counts[name] / n:5.1f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
