"""False-alarm soak (not CI): many correct examples, zero divergences expected.

Runs N examples (default 10,000) of the built-in correct targets PARALLEL, TORCH_DDP and TORCH_ZERO
over deterministic, varied scenarios -- every zoo model x optimizer x batch size x steps x
accumulation x dtype x seed, drawn from a seeded RNG -- at world sizes 2, 3 and 4, and prints the
count, every divergence (with its replay line) and the time. Any divergence is a false alarm of
the oracle or a real bug in a target; either way it must be looked at.

    python bench/soak.py                     # 10,000 examples
    python bench/soak.py --examples 900 --max-seconds 600
    python bench/soak.py --targets torch_fsdp --examples 1000   # FSDP2 (not in the default set)
    python bench/soak.py --whole-step --examples 2000            # clipping, orders, checkpoints
    python bench/soak.py --strategies --examples 20000            # check's own random examples
    python bench/soak.py --tokens --examples 2000                # language models, bf16 policies
    python bench/soak.py --losses --examples 300                 # the other token losses
    python bench/soak.py --epochs --examples 2000                # epochs: the data paths
    python bench/soak.py --tensor-parallel --examples 2000       # torch_tp, torch_2d, float32
    python bench/soak.py --pipeline --examples 1000              # torch_pp, torch_nd, float32
    python bench/soak.py --precision --examples 1000             # bf16/fp16 policies only

``--strategies`` draws exactly what ``ddpcheck check`` draws after its battery -- ``ddpcheck.fuzz``
with ``ddpcheck.strategies``: every layer kind (attention, embeddings, tied heads...), SGD/Adam/
AdamW, accumulation, float64 and float32 (a third of it under bfloat16 or float16 autocast, or
FSDP2's bfloat16 ``param_dtype``), clipping, orders, checkpoints -- in chunks of 500 with a new
seed each, over ``local`` at W=1 and ``parallel``, ``torch_ddp``, ``torch_zero`` and
``torch_fsdp`` at W=1-4 (W=3, and W above a small global batch, included), until ``--examples``
ran. A false alarm stops that target's chunk and is printed shrunk, with its replay line. It
counts, where ``fuzz`` runs each example, the dtypes, precision policies and world sizes; the
examples declined because the reference is chaotic (its own rounding spread as large as a bug,
``_oracle.tolerances.noise_verdict``); and the examples whose judgement computed the reference's
noise variants at all (a comparison beyond the fixed tolerance), printing each.

``--precision`` draws only float32 examples under a precision policy, in chunks of 100: FSDP2's
bfloat16 ``param_dtype`` (``--only param-dtype``) on ``torch_fsdp`` and on the two FSDP2s of
``bench/bf16_declines.py`` whose bfloat16 copies land a step from the reference's (masters started
from their bfloat16 copies as DeepSpeed's bf16 mode starts them, or moved by a fraction of a step),
and bfloat16 or float16 autocast (``--only autocast``) on ``parallel`` and ``torch_ddp``, at W=1-4.

``--whole-step`` makes every scenario use at least one feature of the whole training step --
gradient clipping (2- or inf-norm), per-rank registration orders, a checkpoint resumed at this
or another world size -- and adds ``parallel_strided``, ``parallel`` owning its batch
(``ddpcheck.batches.strided``: non-contiguous shards, every sample weighted as in the full batch).

``--tokens`` makes every scenario a language model (``ddpcheck.zoo.GPTConfig`` variants of
``TinyGPT``, tied or not, 0-2 blocks) trained on padded token sequences with
``loss="token_cross_entropy"``, in float64, float32, or float32 under a precision policy (autocast
in bfloat16 or float16, a bfloat16 ``param_dtype`` -- which only FSDP2 applies), over
``parallel``, ``torch_ddp``, ``torch_zero`` and ``torch_fsdp``: every other scenario from this
file's generator (half of them with the whole step's features too), the others drawn from the
random strategies ``ddpcheck check`` draws from (``strategies.exercising("tokens")`` in float64
and float32, ``param-dtype`` opted in), in Hypothesis's derandomized order.

``--losses`` is ``--tokens`` with the language-model losses beside token cross-entropy
(``objective.TOKEN_LOSSES``: label smoothing, a KL term to a fixed reference, an entropy bonus, a
policy gradient): this file's half draws one of those four, the strategies' half draws all five;
it counts the examples of each loss.

``--epochs`` makes every scenario a run over a dataset in epochs (``Scenario.epochs``: short last
batches and windows), drawn from ``strategies.exercising("epochs")`` in float64 and float32, over
``parallel`` and ``torch_fsdp`` (the harness's split) and ``torch_ddp``, ``torch_zero`` and
``accelerate`` (their own ``DistributedSampler`` or ``DataLoader``); an example a data path
declines in its ranks (a sampler's padding) counts as skipped. Half of them evaluate an
evaluation set after every epoch: "evaluation metric judged" counts the examples whose target
reported the metric the oracle judged (``torch_ddp``, ``torch_zero``, ``accelerate``,
``lightning``). ``--targets deepspeed_zero1,deepspeed_zero2`` runs DeepSpeed's own data path
(``engine.deepspeed_io``; float32 only: the float64 draws are declined).

Each scenario is checked by every target at every world size (9 examples), sharing one reference.
"""

from __future__ import annotations

import argparse
import collections
import math
import random
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402

import ddpcheck  # noqa: E402
from ddpcheck import batches, targets, zoo  # noqa: E402
from ddpcheck import strategies as dst  # noqa: E402
from ddpcheck._language import objective  # noqa: E402
from ddpcheck._oracle.compare import CHAOTIC  # noqa: E402
from ddpcheck._oracle.reference import noise_computed  # noqa: E402
from ddpcheck._runs.example import check_example, prepare_reference  # noqa: E402
from ddpcheck._runs.settings import Settings  # noqa: E402
from ddpcheck._world.registry import shutdown_worlds  # noqa: E402
from ddpcheck.features import FEATURES, declines, of  # noqa: E402
from ddpcheck.scenario import Scenario  # noqa: E402
from parallel import DDP, ShardedOptimizer  # noqa: E402

MODELS = [
    zoo.MLP,
    zoo.Tied,
    zoo.SampleBranch,
    zoo.UnusedAndFrozen,
    zoo.WithBuffers,
    zoo.NonContiguous,
    zoo.MixedPrecision,
]
OPTIMIZERS = [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
]
#: ``parallel`` owning its batch. Not rank-orders: torch's clip_grad_norm_ sums the norm in each
#: rank's own parameter order, so replicas would differ in the last bit (ParallelTarget clips in
#: name order for that reason).
PARALLEL_STRIDED = ddpcheck.Target.from_wrappers(
    ddp=DDP,
    finish="finish_gradient_sync",
    optimizer=ShardedOptimizer,
    supports=frozenset(FEATURES) - {"rank-orders"},
    shard_batch=batches.strided,
)
TARGETS = {
    "parallel": targets.PARALLEL,
    "torch_ddp": targets.TORCH_DDP,
    "torch_zero": targets.TORCH_ZERO,
    "torch_fsdp": targets.TORCH_FSDP,
    "parallel_strided": PARALLEL_STRIDED,
    "accelerate": targets.ACCELERATE,
    # the frameworks whose reported loss the oracle reads (--targets): installed on request
    "hf_trainer": targets.HF_TRAINER,
    "lightning": targets.LIGHTNING,
    # Fabric's own data path over epochs (--epochs --targets fabric): setup_dataloaders
    "fabric": targets.FABRIC,
    # DeepSpeed's own data path over epochs (--epochs --targets deepspeed_zero1,...): float32
    "deepspeed_zero1": targets.DEEPSPEED_ZERO1,
    "deepspeed_zero2": targets.DEEPSPEED_ZERO2,
}
#: The features of the whole step the --whole-step soak counts examples of.
WHOLE_STEP = ("clipping", "rank-orders", "checkpoint")
#: ... and the precision features the --tokens soak counts.
PRECISION = ("float32", "autocast", "param-dtype", "accumulation", "uneven-batches", "epochs")
DEFAULT_TARGETS = "parallel,torch_ddp,torch_zero"  # torch_fsdp on request: --targets torch_fsdp
TOKEN_TARGETS = "parallel,torch_ddp,torch_zero,torch_fsdp"
EPOCH_TARGETS = "parallel,torch_ddp,torch_zero,torch_fsdp,accelerate"
#: --tokens: (dtype, precision policy) of a scenario, float64 and the policies most often.
PRECISIONS = [
    ("float64", {}),
    ("float64", {}),
    ("float32", {}),
    ("float32", {"autocast": torch.bfloat16}),
    ("float32", {"autocast": torch.bfloat16}),
    ("float32", {"autocast": torch.float16}),
    ("float32", {"param_dtype": torch.bfloat16}),
    ("float32", {"param_dtype": torch.bfloat16}),
]


def _evaluates(sc: Scenario) -> bool:
    """Whether ``sc`` has an evaluation set (a data path that reports a metric is judged on it
    after every epoch)."""
    return sc.epochs is not None and sc.epochs.evaluation is not None


def drawn_token_scenarios(
    n: int, world_size: int, feature: str = "tokens", chunk: int = 0
) -> list[Scenario]:
    """``n`` scenarios from ``strategies.exercising(feature)`` (float64 and float32, the
    ``param-dtype`` policy opted in), in Hypothesis's derandomized order; ``chunk`` > 0: ``n``
    more, from Hypothesis seeded with it (a target that declines most scenarios would otherwise
    see the same few again and again)."""
    from hypothesis import HealthCheck, given, seed, settings

    found: list[Scenario] = []

    @seed(chunk)
    @settings(
        max_examples=n,
        database=None,
        deadline=None,
        derandomize=chunk == 0,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        dst.exercising(
            feature, world_size=world_size, dtypes=("float64", "float32"), opt_in=("param-dtype",)
        )
    )
    def draw(scenario):
        found.append(scenario)

    draw()
    return found


def scenario(index: int, seed: int, whole_step: tuple[int, ...] = ()) -> Scenario:
    """The index-th soak scenario: a pure function of (index, seed, whole_step). ``whole_step``:
    the world sizes a checkpoint may resume at; when given, every scenario clips, registers per
    rank, or checkpoints (at least one of them)."""
    rng = random.Random(seed * 1_000_003 + index)
    optimizer, kwargs = rng.choice(OPTIMIZERS)
    extra = _whole_step(rng, whole_step) if whole_step else {}
    return Scenario(**{**_plain(rng, optimizer, kwargs), **extra})


def token_scenario(
    index: int, seed: int, sizes: tuple[int, ...], losses: tuple[str, ...] = ()
) -> Scenario:
    """The index-th ``--tokens`` scenario: a pure function of (index, seed, sizes); ``losses``:
    its loss drawn among them (none: token cross-entropy)."""
    rng = random.Random(seed * 1_000_003 + index + 7)
    optimizer, kwargs = rng.choice(OPTIMIZERS)
    dtype, precision = rng.choice(PRECISIONS)
    plain = _plain(rng, optimizer, kwargs)
    plain.update(
        model=zoo.GPTConfig(
            width=rng.choice([8, 12]),
            heads=rng.choice([1, 2, 4]),
            layers=rng.randint(0, 2),
            tied=rng.random() < 0.7,
        ),
        data=zoo.token_data,
        loss=rng.choice(losses) if losses else "token_cross_entropy",
        dtype=dtype,
        **precision,
    )
    if dtype == "float32":  # the mean objective: a summed one moves fast and amplifies rounding
        plain["reduction"] = "mean"
    if precision and optimizer is not torch.optim.SGD:  # as ddpcheck.strategies draws them
        plain["optimizer_kwargs"]["eps"] = dst.LOW_PRECISION_EPS
    extra = _whole_step(rng, sizes) if rng.random() < 0.5 else {}
    return Scenario(**{**plain, **extra})


def _whole_step(rng: random.Random, sizes: tuple[int, ...]) -> dict:
    steps = rng.randint(1, 3)
    extra: dict = {"steps": steps}
    if rng.random() < 0.5:
        extra["max_grad_norm"] = rng.choice([0.05, 0.5, 2.0])
        extra["grad_norm_type"] = rng.choice([2.0, 2.0, math.inf])
    if rng.random() < 0.4:
        extra["rank_orders"] = True
    if steps > 1 and rng.random() < 0.6:
        extra["checkpoint_after"] = rng.randint(0, steps - 2)
        extra["resume_world_size"] = rng.choice((None, *sizes))
    if len(extra) == 1:  # none drawn: every scenario uses one
        extra["rank_orders"] = True
    return extra


def _plain(rng: random.Random, optimizer: type, kwargs: dict) -> dict:
    return dict(
        model=rng.choice(MODELS),
        optimizer=optimizer,
        optimizer_kwargs=dict(kwargs),
        param_groups=rng.choice([None, None, zoo.BiasGroups(lr=0.02, weight_decay=0.0)]),
        lr_decay=rng.choice([None, None, 0.5]),
        global_batch=rng.randint(1, 12),
        steps=rng.randint(1, 3),
        accumulation=rng.randint(1, 3),
        dtype=rng.choice(["float64", "float64", "float32"]),
        reduction=rng.choice(["mean", "mean", "sum"]),
        seed=rng.randint(0, 10_000),
        bucket_size_mb=rng.choice([None, 1e-6, 1000.0]),
        set_to_none=rng.choice([True, False]),
    )


#: (name, target, world sizes) of the --strategies soak: no synchronisation is correct at W=1.
STRATEGY_TARGETS = [
    ("local", targets.LOCAL, (1,)),
    ("parallel", targets.PARALLEL, (1, 2, 3, 4)),
    ("torch_ddp", targets.TORCH_DDP, (1, 2, 3, 4)),
    ("torch_zero", targets.TORCH_ZERO, (1, 2, 3, 4)),
    ("torch_fsdp", targets.TORCH_FSDP, (1, 2, 3, 4)),
]
#: ``--tensor-parallel``: meshes of <= 4 ranks, every divisor of W drawn as the degree
TENSOR_PARALLEL_TARGETS = [
    ("torch_tp", targets.TORCH_TP, (1, 2, 3, 4)),
    ("torch_2d", targets.TORCH_2D, (2, 4)),
    ("parallel_tp", targets.PARALLEL_TP, (1, 2, 3, 4)),
    ("hf_tp", targets.HF_TP, (1, 2, 3, 4)),  # transformers' own styles; its FSDP2 over dp
    # accelerate's ParallelismConfig, on request only (--targets accelerate_nd): it declines
    # every example on the CPU, where accelerate 1.15 refuses it (MULTI_CPU)
    ("accelerate_nd", targets.ACCELERATE_ND, (2, 3, 4)),
]
ON_REQUEST = {"accelerate_nd"}
#: ``--pipeline``: (dp, pp) meshes of <= 4 ranks, every schedule, stages and pieces drawn; and
#: torch_nd's (dp, pp, tp): at W=4 half its examples pp=2 x tp=2 (W=2: its tp=1 path)
PIPELINE_TARGETS = [
    ("torch_pp", targets.TORCH_PP, (1, 2, 3, 4)),
    ("torch_nd", targets.TORCH_ND, (2, 4)),
]


def _precision_targets() -> list:
    """``--precision``: (name, target, world sizes, the feature every example exercises)."""
    from bf16_declines import NudgedMastersFSDP, RoundedMastersFSDP

    sizes = (1, 2, 3, 4)
    return [
        ("torch_fsdp", targets.TORCH_FSDP, sizes, ("param-dtype",)),
        ("rounded", RoundedMastersFSDP(), sizes, ("param-dtype",)),
        ("nudged", NudgedMastersFSDP(), sizes, ("param-dtype",)),
        ("parallel", targets.PARALLEL, sizes, ("autocast",)),
        ("torch_ddp", targets.TORCH_DDP, sizes, ("autocast",)),
    ]


class _Tally:
    """What the --strategies soak counts of every example ``fuzz`` runs, seen where ``fuzz``
    runs them (``_runs.engine.one_behind_the_other``, wrapped by :meth:`watching`): dtypes and
    precision policies, world sizes above the global batch, the examples declined as chaotic, and
    those whose judgement computed the reference's noise variants (printed)."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.noise = noise_computed()

    def watching(self, run, name: str):
        def wrapped(items, settings, **kwargs):
            for item, outcome in run(items, settings, **kwargs):
                self.see(name, item, outcome)
                yield item, outcome

        return wrapped

    def see(self, name: str, item: tuple, outcome) -> None:
        _, world_size, sc = item
        if outcome.skipped is not None:
            chaotic = outcome.unjudgeable and CHAOTIC in outcome.skipped
            self.counts["chaotic" if chaotic else "skipped"] += 1
            if chaotic:
                print(f"  declined, chaotic ({name}): {outcome.skipped[:600]}", flush=True)
        else:
            self.counts["ran"] += 1
            self.counts[sc.dtype] += 1
            policy = sc.autocast or sc.param_dtype
            if policy is not None:
                kind = "autocast" if sc.autocast is not None else "param_dtype"
                self.counts[f"{kind} {str(policy).replace('torch.', '')}"] += 1
            self.counts[f"W={world_size}"] += 1
            self.counts[f"loss {sc.loss}"] += 1
            plan = sc.tensor_parallel.plan if sc.tensor_parallel is not None else ()
            if any(style.endswith("-loss") for _, style in plan):  # under loss_parallel()
                self.counts[f"loss {sc.loss} (loss_parallel)"] += 1
            if world_size > sc.global_batch:
                self.counts["W > batch"] += 1
        if noise_computed() > self.noise:
            self.noise = noise_computed()
            self.counts["noise"] += 1
            verdict = (
                "a false alarm"
                if outcome.error is not None
                else "skipped"
                if outcome.skipped is not None
                else "passed"
            )
            print(
                f"  noise variants computed ({name}, W={world_size}, {verdict}): {sc!r}", flush=True
            )


#: What the --strategies soak's summary lists, in this order.
COUNTED = (
    "float64",
    "float32",
    "autocast bfloat16",
    "autocast float16",
    "param_dtype bfloat16",
    "W=1",
    "W=2",
    "W=3",
    "W=4",
    "W > batch",
)


def strategies_soak(
    examples: int,
    seed: int,
    chunk: int = 500,
    max_seconds: float | None = None,
    chosen: list | None = None,
    dtypes: tuple[str, ...] = ("float64", "float32"),
) -> int:
    """``ddpcheck.fuzz`` -- check's random examples -- over ``chosen`` (default
    STRATEGY_TARGETS) in turn, in ``dtypes``."""
    chosen = STRATEGY_TARGETS if chosen is None else chosen
    from ddpcheck._runs import engine

    # --precision: (name, target, sizes, the features every example exercises)
    only = {entry[0]: tuple(entry[3]) for entry in chosen if len(entry) > 3}
    chosen = [tuple(entry[:3]) for entry in chosen]

    started = time.perf_counter()
    ran: collections.Counter = collections.Counter()
    tally = _Tally()
    found, declined, rounds = [], 0, 0
    pipeline = engine.one_behind_the_other
    try:
        while sum(ran.values()) < examples:
            if max_seconds and time.perf_counter() - started > max_seconds:
                print(f"stopping early: --max-seconds {max_seconds} reached")
                break
            name, target, sizes = chosen[rounds % len(chosen)]
            chunk_seed = seed * 1_000_003 + rounds
            rounds += 1
            engine.one_behind_the_other = tally.watching(pipeline, name)
            result = ddpcheck.fuzz(
                target,
                examples=chunk,
                world_sizes=sizes,
                seed=chunk_seed,
                dtypes=dtypes,
                deadline=120.0,
                only=only.get(name, ()),
            )
            ran[name] += result.examples
            declined += sum(
                n for why, n in result.declined.items() if not why.startswith("unjudgeable: ")
            )
            if result.found:
                found.append(result.error)
                print(
                    f"FALSE ALARM {name} (seed {chunk_seed}), after {result.first_failure} "
                    f"examples:\n{result.error}\n",
                    flush=True,
                )
            print(
                f"  {sum(ran.values())} examples, {len(found)} false alarms, "
                f"{tally.counts['chaotic']} declined as chaotic, noise computed for "
                f"{tally.counts['noise']}, {time.perf_counter() - started:.0f} s",
                flush=True,
            )
    finally:
        engine.one_behind_the_other = pipeline
        shutdown_worlds()
    seconds = time.perf_counter() - started
    total, counts = sum(ran.values()), tally.counts
    chaotic = counts["chaotic"]
    print(
        f"strategies soak: {total} examples "
        f"({', '.join(f'{n} {c}' for n, c in ran.items())}) in {rounds} chunks of {chunk}; "
        f"{', '.join(f'{f} {counts[f]}' for f in COUNTED)}; "
        f"{', '.join(f'{f} {n}' for f, n in sorted(counts.items()) if f.startswith('loss '))}; "
        f"{declined} drawn and declined by the target; {counts['skipped']} unjudgeable or "
        f"declined in the ranks, {chaotic} of them as chaotic "
        f"({100 * chaotic / max(total + counts['skipped'], 1):.2f} % of the examples run); "
        f"the reference's noise variants computed for {counts['noise']} examples; "
        f"{len(found)} false alarms; {seconds:.1f} s"
    )
    return 1 if found else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=10_000, help="examples to run")
    parser.add_argument("--world-sizes", default="2,3,4", help="comma-separated (default 2,3,4)")
    parser.add_argument(
        "--targets",
        default=DEFAULT_TARGETS,
        help=f"comma-separated names among {', '.join(TARGETS)} (default {DEFAULT_TARGETS})",
    )
    parser.add_argument("--seed", type=int, default=0, help="scenario stream seed")
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds per example")
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="stop early after this long and report what ran",
    )
    parser.add_argument(
        "--whole-step",
        action="store_true",
        help="every scenario clips, registers per rank or checkpoints; adds "
        "the parallel_strided target unless --targets is given",
    )
    parser.add_argument(
        "--strategies",
        action="store_true",
        help="check's own random examples (ddpcheck.fuzz) over local at W=1 and "
        "the correct targets (torch_fsdp included) at W=1-4, in chunks of "
        "500; counts the examples declined as chaotic",
    )
    parser.add_argument(
        "--tokens",
        action="store_true",
        help="every scenario a language model on tokens (bf16 policies "
        "included); adds torch_fsdp unless --targets is given",
    )
    parser.add_argument(
        "--epochs",
        action="store_true",
        help="every scenario a run over a dataset in epochs (the data paths); adds "
        "torch_fsdp and accelerate unless --targets is given",
    )
    parser.add_argument(
        "--tensor-parallel",
        action="store_true",
        help="check's own random examples over torch_tp (W=1-4), torch_2d (W=2, 4) and "
        "parallel_tp (W=1-4): "
        "meshes, models and plans drawn, float32 only, in chunks of 250",
    )
    parser.add_argument(
        "--losses",
        action="store_true",
        help="--tokens with the other language-model losses (label smoothing, KL, entropy "
        "bonus, policy gradient)",
    )
    parser.add_argument(
        "--precision",
        action="store_true",
        help="check's own random examples under a precision policy only (bf16 param_dtype on "
        "FSDP2 and two FSDP2s whose bf16 copies differ; autocast on parallel and torch_ddp), "
        "float32, W=1-4, in chunks of 100",
    )
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="check's own random examples over torch_pp (W=1-4) and torch_nd (W=2, 4): (dp, pp) "
        "and (dp, pp, tp) meshes, schedules, stages, pieces and plans drawn, float32 only, in "
        "chunks of 250",
    )
    args = parser.parse_args(argv)
    args.tokens = args.tokens or args.losses
    losses = tuple(objective.TOKEN_LOSSES[1:]) if args.losses else ()
    on_a_mesh = (
        PIPELINE_TARGETS
        if args.pipeline
        else TENSOR_PARALLEL_TARGETS
        if args.tensor_parallel
        else None
    )
    if on_a_mesh is not None and args.targets != DEFAULT_TARGETS:  # --targets picks among them
        on_a_mesh = [entry for entry in on_a_mesh if entry[0] in args.targets.split(",")]
    elif on_a_mesh is not None:
        on_a_mesh = [entry for entry in on_a_mesh if entry[0] not in ON_REQUEST]
    if on_a_mesh is not None:  # float32 only, in chunks of 250
        return strategies_soak(
            args.examples,
            args.seed,
            chunk=250,
            max_seconds=args.max_seconds,
            chosen=on_a_mesh,
            dtypes=("float32",),
        )
    if args.strategies:
        return strategies_soak(args.examples, args.seed, max_seconds=args.max_seconds)
    if args.precision:
        return strategies_soak(
            args.examples,
            args.seed,
            chunk=100,
            max_seconds=args.max_seconds,
            chosen=_precision_targets(),
            dtypes=("float32",),
        )
    sizes = [int(w) for w in args.world_sizes.split(",")]
    names = args.targets
    if args.whole_step and names == DEFAULT_TARGETS:
        names += ",parallel_strided"
    if args.tokens and names == DEFAULT_TARGETS:
        names = TOKEN_TARGETS
    if args.epochs and names == DEFAULT_TARGETS:
        names = EPOCH_TARGETS
    chosen = {name: TARGETS[name] for name in names.split(",")}
    whole_step = tuple(sizes) if args.whole_step else ()
    used: collections.Counter = collections.Counter()
    drawn: list[Scenario] = []  # --tokens: scenarios from the random strategies

    started = time.perf_counter()
    ran, skipped, divergences, errors = 0, 0, [], []
    unjudged: list[Exception] = []  # examples the oracle declined as chaotic
    per_target: dict[str, int] = collections.Counter()
    distinct: set[str] = set()  # the scenarios examples ran, by their replay form
    index = 0
    try:
        while ran < args.examples:
            if args.max_seconds and time.perf_counter() - started > args.max_seconds:
                print(f"stopping early: --max-seconds {args.max_seconds} reached")
                break
            if args.epochs:
                if index >= len(drawn):  # fresh draws, never the same scenarios again
                    chunk = len(drawn) // args.examples
                    drawn += drawn_token_scenarios(args.examples, max(sizes), "epochs", chunk)
                sc = drawn[index]
            elif args.tokens and index % 2:
                if index // 2 >= len(drawn):
                    chunk = len(drawn) // args.examples
                    drawn += drawn_token_scenarios(args.examples, max(sizes), chunk=chunk)
                sc = drawn[index // 2]
            elif args.tokens:
                sc = token_scenario(index, args.seed, tuple(sizes), losses)
            else:
                sc = scenario(index, args.seed, whole_step)
            try:
                reference = prepare_reference(sc)
            except Exception as exc:  # the scenario itself cannot train: say so, never hide it
                errors.append(exc)
                print(
                    f"SCENARIO ERROR soak-{index}: {type(exc).__name__}: {exc}\n  {sc!r}",
                    flush=True,
                )
                index += 1
                continue
            for name, target in chosen.items():
                for w in sizes:
                    if declines(target, sc, w) is not None:
                        skipped += 1
                        continue
                    if ran >= args.examples:
                        break
                    try:
                        check_example(
                            target,
                            sc,
                            w,
                            Settings(deadline=args.deadline),
                            reference=reference,
                            name=f"soak-{index}",
                        )
                    except ddpcheck.NothingChecked:  # a data path declined it in its ranks
                        skipped += 1
                        continue
                    except ddpcheck.ScenarioError as exc:  # unjudgeable (chaotic): nobody's bug
                        unjudged.append(exc)
                        continue
                    except ddpcheck.EquivalenceError as exc:
                        divergences.append(exc)
                        print(
                            f"DIVERGENCE {name} W={w} soak-{index}: {exc.kinds}\n"
                            + "\n".join(str(exc).splitlines()[:12])
                            + f"\n{exc.replay}\n",
                            flush=True,
                        )
                    ran += 1
                    per_target[name] += 1
                    distinct.add(repr(sc))
                    exercised = of(sc, w)
                    used.update(f for f in WHOLE_STEP + PRECISION if f in exercised)
                    if sc.autocast is not None or sc.param_dtype is not None:
                        used[f"policy {sc.autocast or sc.param_dtype}"] += 1
                    if target is PARALLEL_STRIDED:
                        used["owns its batch"] += 1
                    if getattr(target, "reports_metric", False) and _evaluates(sc):
                        used["evaluation metric judged"] += 1
                    if sc.epochs is not None and sc.epochs.samples % sc.global_batch:
                        used["short last step"] += 1
                    if args.losses:
                        used[f"loss {sc.loss}"] += 1
                    if sc.epochs is not None and sc.loss == "token_cross_entropy":
                        used["tokens over epochs"] += 1
                    if ran % 500 == 0:
                        print(
                            f"  {ran} examples, {len(divergences)} divergences, "
                            f"{time.perf_counter() - started:.0f} s",
                            flush=True,
                        )
            index += 1
    finally:
        shutdown_worlds()
    seconds = time.perf_counter() - started
    print(
        f"soak: {ran} examples ({', '.join(f'{n} {c}' for n, c in per_target.items())}) over "
        f"{index} scenarios ({len(distinct)} distinct among those run) at world sizes "
        f"{sizes}; {skipped} skipped (unsupported); "
        f"{len(divergences)} divergences; {len(unjudged)} unjudgeable (reference chaotic); "
        f"{len(errors)} scenarios the reference could not train; {seconds:.1f} s "
        f"({1e3 * seconds / max(ran, 1):.1f} ms per example, world start-up included)"
    )
    if whole_step or args.tokens or args.epochs:
        print("examples using: " + ", ".join(f"{f} {n}" for f, n in sorted(used.items())))
    return 1 if divergences or errors else 0


if __name__ == "__main__":
    sys.exit(main())
