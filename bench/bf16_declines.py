"""How many bfloat16 ``param_dtype`` examples the oracle declines as ``reference chaotic`` (not CI).

Issue 50, item 7: the family of models of the option-space map's one failing cell
(``tests/oracle/test_noise.py``'s ``ROUNDED``: an embedding, three linear layers and a width-2
LayerNorm, whose input gradient is zero in exact arithmetic, one sample, bfloat16 compute over
float32 masters), over seeds 0..N-1, at W=2, on two correct targets: FSDP2 as given
(``torch_fsdp``) and FSDP2 with its float32 masters started from their bfloat16 copies, as
DeepSpeed's bf16 mode starts them (``rounded``: no DeepSpeed needed). Prints, per target, how many
examples passed, were declined as chaotic, or failed (a false alarm: every target here is
correct), and each failure's first line.

``--mutants``: the seeded bugs that run under a ``param_dtype`` policy instead -- FSDP2's family I
(``ddpcheck.mutation.broken_fsdp``: a broadcast from the last rank, no division by W, a
neighbour's gradient shard, stale unsharded parameters) and J3 (gradients reduce-scattered in
bfloat16) -- over the same seeds, and the battery's ``tokens-param-dtype-bf16``: how many examples
each kills (exit 1), declines, or passes. A bug must be killed where the correct targets pass.

    python bench/bf16_declines.py --seeds 120
    python bench/bf16_declines.py --seeds 40 --mutants
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402

from ddpcheck import targets  # noqa: E402
from ddpcheck._runs.example import check_example  # noqa: E402
from ddpcheck._runs.settings import Settings  # noqa: E402
from ddpcheck._world.registry import shutdown_worlds  # noqa: E402
from ddpcheck.errors import EquivalenceError, ScenarioError  # noqa: E402
from ddpcheck.models import Layer, ModelSpec, SpecData  # noqa: E402
from ddpcheck.scenario import Scenario  # noqa: E402

FAMILY = Scenario(
    model=ModelSpec(
        layers=(Layer(kind="embedding"), Layer(), Layer(), Layer(), Layer(kind="layernorm")),
        width=2,
    ),
    data=SpecData(width=2),
    global_batch=1,
    dtype="float32",
    param_dtype=torch.bfloat16,
)


@dataclasses.dataclass(frozen=True)
class RoundedMastersFSDP(targets.TorchFSDPTarget):
    """FSDP2 under the param_dtype policy, its float32 masters started from their bfloat16
    copies, as DeepSpeed's bf16 mode starts them."""

    def wrap(self, module):
        model = super().wrap(module)
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                local.copy_(local.to(torch.bfloat16))
        return model


@dataclasses.dataclass(frozen=True)
class NudgedMastersFSDP(targets.TorchFSDPTarget):
    """FSDP2 under the param_dtype policy, its float32 masters each moved by a random fraction in
    [-1/2, 1/2] of its bfloat16 step before training (a seed per rank's shard, none of the
    reference's): about a quarter of its first bfloat16 copies land one step from the
    reference's -- a framework whose copies differ for another reason than DeepSpeed's."""

    def wrap(self, module):
        model = super().wrap(module)
        generator = torch.Generator().manual_seed(1234 + torch.distributed.get_rank())
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                magnitude = local.double().abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
                spacing = torch.finfo(torch.bfloat16).eps * torch.exp2(
                    torch.floor(torch.log2(magnitude))
                )
                u = torch.rand(local.shape, generator=generator, dtype=torch.float64) - 0.5
                local.add_((u * spacing).to(local.dtype))
        return model


TARGETS = {
    "rounded": RoundedMastersFSDP(),
    "nudged": NudgedMastersFSDP(),
    "torch_fsdp": targets.TORCH_FSDP,
}


#: ``--targets deepspeed`` (deepspeed installed): DeepSpeed's bf16 mode made to keep float32
#: gradients and reductions, so that the target applies the ``param_dtype`` policy -- the
#: option-space map's failing cell (docs/frameworks.md).
DEEPSPEED_BF16 = {"communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"}}


def _mutants() -> dict:
    from ddpcheck.mutation import broken_fsdp as F

    return {
        name: getattr(F, name)()
        for name in (
            "BroadcastsFromLastRankFSDP",
            "NoGradientDivideFSDP",
            "NeighbourGradientShardFSDP",
            "StaleUnshardedParamsFSDP",
            "ReducesInParamDtypeFSDP",
        )
    }


def _scenarios(first: int, seeds: int, steps: int | None, battery: bool) -> list[Scenario]:
    out = [dataclasses.replace(FAMILY, seed=seed) for seed in range(first, first + seeds)]
    if steps is not None:
        out = [dataclasses.replace(sc, steps=steps) for sc in out]
    if battery:
        from ddpcheck._language.battery import BATTERY

        out.append(dict(BATTERY)["tokens-param-dtype-bf16"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=120)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--targets", default="rounded,nudged,torch_fsdp")
    parser.add_argument("--steps", type=int, default=None, help="steps (default: the family's)")
    parser.add_argument("--verbose", action="store_true", help="print every decline's detail")
    parser.add_argument(
        "--without-rounded-variant",
        action="store_true",
        help="the reference's noise without the masters started rounded (as before it existed)",
    )
    parser.add_argument(
        "--mutants", action="store_true", help="FSDP2's seeded bugs (families I and J3) instead"
    )
    args = parser.parse_args(argv)
    if "deepspeed" in args.targets.split(","):  # DeepSpeed's bf16 mode with float32 gradients
        TARGETS["deepspeed"] = targets.DeepSpeedTarget(config=DEEPSPEED_BF16)
    chosen = _mutants() if args.mutants else {n: TARGETS[n] for n in args.targets.split(",")}
    if args.without_rounded_variant:
        from ddpcheck._oracle import reference

        reference.PARAM_DTYPE_VARIANTS = ()
    started = time.perf_counter()
    counts: dict[str, collections.Counter] = {}
    try:
        for name, target in chosen.items():
            tally = collections.Counter()
            counts[name] = tally
            for sc in _scenarios(args.first_seed, args.seeds, args.steps, args.mutants):
                seed = sc.seed
                try:
                    check_example(target, sc, args.world_size, Settings(deadline=120.0))
                    tally["passed"] += 1
                except ScenarioError as declined:
                    tally["declined"] += 1
                    if args.verbose:
                        print(f"  {name} seed {seed} declined: {declined}"[:1500], flush=True)
                except EquivalenceError as failed:
                    tally["FAILED"] += 1
                    if not args.mutants or args.verbose:
                        print(f"  {name} seed {seed} FAILED: {str(failed)[:1500]}", flush=True)
            print(f"{name}: {dict(tally)}", flush=True)
    finally:
        shutdown_worlds()
    print(
        f"bf16 declines, W={args.world_size}, seeds {args.first_seed}.."
        f"{args.first_seed + args.seeds - 1}: "
        + "; ".join(
            f"{name} {c['declined']} declined, {c['passed']} passed, {c['FAILED']} failed"
            for name, c in counts.items()
        )
        + f"; {time.perf_counter() - started:.0f} s"
    )
    if args.mutants:  # every bug must be killed somewhere
        return 0 if all(c["FAILED"] for c in counts.values()) else 1
    return 1 if any(c["FAILED"] for c in counts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
