"""Calibration of the oracle's tolerance table
(``ddpcheck._oracle.tolerances.TOLERANCES``).

Runs correct targets on random scenarios (``ddpcheck.strategies``) in float64 and float32 (with
``--precision``: float32 scenarios under a precision policy -- autocast in bfloat16 or float16, a
bfloat16 ``param_dtype`` on FSDP2 -- over ``PARALLEL``, ``TORCH_DDP`` and ``TORCH_FSDP``), and
prints, per dtype (or policy) and world size, how much of the tolerance the worst rounding
difference used:
``max |rank - reference| / allowed`` (the oracle's allowance) over every gradient, parameter and
optimizer-state tensor of every step. A healthy table keeps this well below 1 for correct code,
while real bugs exceed it by orders of magnitude (a wrong divisor is a relative error of >= 1/3).

    python bench/tolerance.py [--examples 150] [--seed 0]
    python bench/tolerance.py --precision --examples 300 --seed 1
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
from ddpcheck._oracle.compare import reference_run, scaled_atol, tolerance  # noqa: E402
from ddpcheck._rank.runner import run_example  # noqa: E402
from ddpcheck._world.registry import get_world, shutdown_worlds  # noqa: E402
from ddpcheck.features import declines  # noqa: E402

TARGETS = (targets.PARALLEL, targets.TORCH_DDP)
PRECISION_TARGETS = (targets.PARALLEL, targets.TORCH_DDP, targets.TORCH_FSDP)


def policy(scenario) -> str:
    """The precision a scenario's numbers are judged at: its policy, else the oracle's dtype."""
    if scenario.param_dtype is not None:
        return f"{str(scenario.param_dtype).replace('torch.', '')} param_dtype"
    if scenario.autocast is not None:
        return f"{str(scenario.autocast).replace('torch.', '')} autocast"
    return ""


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
    parser.add_argument(
        "--precision",
        action="store_true",
        help="float32 scenarios under a precision policy (autocast, param_dtype)",
    )
    args = parser.parse_args()
    chosen = PRECISION_TARGETS if args.precision else TARGETS
    if args.precision:  # a policy in every scenario: autocast anywhere, param_dtype on FSDP2

        def scenarios(world_size):
            return st.one_of(
                dst.exercising("autocast", world_size=world_size),
                dst.exercising("param-dtype", world_size=world_size),
            )
    else:

        def scenarios(world_size):
            return dst.scenarios(
                models=dst.models(mixed_dtypes=True), dtypes=("float64", "float32")
            )

    worst: dict[tuple[str, int], float] = collections.defaultdict(float)
    where: dict[tuple[str, int], str] = {}
    count: dict[tuple[str, int], int] = collections.Counter()
    started = time.perf_counter()

    def note(key, fraction, what, scenario):
        if fraction > worst[key]:
            worst[key] = fraction
            where[key] = f"{what} of {scenario!r}"

    @seed(args.seed)
    @settings(
        max_examples=args.examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data(), world_size=dst.world_sizes(), target=st.sampled_from(chosen))
    def measure(data, world_size, target):
        scenario = data.draw(scenarios(world_size))
        assume(declines(target, scenario, world_size) is None)  # torch DDP: no per-rank orders
        reference = reference_run(scenario)
        records = get_world(world_size).run(run_example, target, scenario)
        dtype = reference.compute_dtype
        key = (policy(scenario) or str(dtype).replace("torch.", ""), world_size)
        count[key] += 1
        for step, ref in enumerate(reference.steps):
            rtol, atol = tolerance(dtype, world_size, step)
            for record in records:
                mine = record.steps[step]
                for field in ("grads", "params"):
                    for name, value in getattr(ref, field).items():
                        got = getattr(mine, field)[name]
                        if value is not None and got is not None:
                            note(
                                key,
                                used_fraction(got, value, rtol, atol),
                                f"{field} {name} step {step}",
                                scenario,
                            )
                for name, state in ref.state.items():
                    for k, value in state.items():
                        got = mine.state.get(name, {}).get(k)
                        if torch.is_tensor(value) and torch.is_tensor(got):
                            note(
                                key,
                                used_fraction(got, value, rtol, atol),
                                f"state {name}[{k}] step {step}",
                                scenario,
                            )

    measure()
    shutdown_worlds()
    names = ", ".join(type(t).__name__ for t in chosen)
    print(
        f"tolerance calibration, {args.examples} random examples of {names}, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
        f"{time.perf_counter() - started:.0f} s"
    )
    print(f"{'dtype':>18} {'W':>2} {'examples':>9} {'worst share of tolerance used':>30}")
    for (dtype, w), value in sorted(worst.items()):
        print(f"{dtype:>18} {w:>2} {count[(dtype, w)]:>9} {value:>30.3g}")
    if args.where:
        for key, text in sorted(where.items()):
            print(key, text)


if __name__ == "__main__":
    main()
