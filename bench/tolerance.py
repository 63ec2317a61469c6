"""Calibration of the oracle's tolerance table (``ddpcheck._internal.oracle.tolerances.TOLERANCES``).

Runs correct targets on random scenarios (``ddpcheck.strategies``) in float64 and float32, and
prints, per dtype and world size, how much of the tolerance the worst rounding difference used:
``max |rank - reference| / allowed`` (the oracle's allowance) over every gradient, parameter and
optimizer-state tensor of every step. A healthy table keeps this well below 1 for correct code,
while real bugs exceed it by orders of magnitude (a wrong divisor is a relative error of >= 1/3).

    python bench/tolerance.py [--examples 150] [--seed 0]
"""

from __future__ import annotations

import argparse
import collections
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
from hypothesis import HealthCheck, assume, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ddpcheck import strategies as dst  # noqa: E402
from ddpcheck import targets  # noqa: E402
from ddpcheck.features import declines  # noqa: E402
from ddpcheck._internal.oracle.compare import reference_run, scaled_atol, tolerance  # noqa: E402
from ddpcheck._internal.rank.runner import run_example  # noqa: E402
from ddpcheck._internal.world.worlds import get_world, shutdown_worlds  # noqa: E402

TARGETS = (targets.PARALLEL, targets.TORCH_DDP)


def used_fraction(got: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> float:
    """max |got - ref| / allowed, with the oracle's own allowance (scaled_atol + rtol |ref|)."""
    if not ref.is_floating_point() or ref.numel() == 0:
        return 0.0
    diff = (got.double() - ref.double()).abs()
    return float((diff / (scaled_atol(ref, rtol, atol) + rtol * ref.double().abs())).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--where", action="store_true", help="print where each worst case was")
    args = parser.parse_args()
    worst: dict[tuple[str, int], float] = collections.defaultdict(float)
    where: dict[tuple[str, int], str] = {}
    count: dict[tuple[str, int], int] = collections.Counter()
    started = time.perf_counter()

    def note(key, fraction, what, scenario):
        if fraction > worst[key]:
            worst[key] = fraction
            where[key] = f"{what} of {scenario!r}"

    @seed(args.seed)
    @settings(max_examples=args.examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(scenario=dst.scenarios(models=dst.models(mixed_dtypes=True),
                                  dtypes=("float64", "float32")),
           world_size=dst.world_sizes(), target=st.sampled_from(TARGETS))
    def measure(scenario, world_size, target):
        assume(declines(target, scenario, world_size) is None)  # torch DDP: no per-rank orders
        reference = reference_run(scenario)
        records = get_world(world_size).run(run_example, target, scenario)
        dtype = reference.compute_dtype
        key = (str(dtype).replace("torch.", ""), world_size)
        count[key] += 1
        for step, ref in enumerate(reference.steps):
            rtol, atol = tolerance(dtype, world_size, step)
            for record in records:
                mine = record.steps[step]
                for field in ("grads", "params"):
                    for name, value in getattr(ref, field).items():
                        got = getattr(mine, field)[name]
                        if value is not None and got is not None:
                            note(key, used_fraction(got, value, rtol, atol),
                                 f"{field} {name} step {step}", scenario)
                for name, state in ref.state.items():
                    for k, value in state.items():
                        got = mine.state.get(name, {}).get(k)
                        if torch.is_tensor(value) and torch.is_tensor(got):
                            note(key, used_fraction(got, value, rtol, atol),
                                 f"state {name}[{k}] step {step}", scenario)

    measure()
    shutdown_worlds()
    print(f"tolerance calibration, {args.examples} random examples of {', '.join(type(t).__name__ for t in TARGETS)}, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, {time.perf_counter() - started:.0f} s")
    print(f"{'dtype':>8} {'W':>2} {'examples':>9} {'worst share of tolerance used':>30}")
    for (dtype, w), value in sorted(worst.items()):
        print(f"{dtype:>8} {w:>2} {count[(dtype, w)]:>9} {value:>30.3g}")
    if args.where:
        for key, text in sorted(where.items()):
            print(key, text)


if __name__ == "__main__":
    main()
