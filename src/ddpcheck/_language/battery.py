"""The built-in battery: representative scenarios ``assert_equivalent`` runs when given none.

Each one aims at bug classes of the catalogue (docs/bug-catalogue.md): tied weights (B4),
unused and frozen parameters (B1, B3, B11), buffers and rank-0 initialisation (D1, D2), several
param groups with a schedule (E4, E5), accumulation (B2, C1-C3), tiny and large buckets (B1, B6),
non-contiguous gradients (B9), mixed dtypes (B10), uneven and tiny batches (A3, E2), gradient
clipping (A4), per-rank registration orders (G1), SGD for scale bugs (A1, A2), Adam/AdamW for
state bugs (E3, E7), a checkpoint resumed at W=2 -- the same world at W=2, another elsewhere
(E7, E8) -- and a language model on padded tokens, in float64 and under the two bfloat16
precision policies (J1-J4: token means per micro-batch or per rank, reductions in a narrower
dtype, accumulators).
"""

from __future__ import annotations

import torch

from ddpcheck._language import zoo
from ddpcheck._language.models import Layer, ModelSpec, SpecData
from ddpcheck._language.pipeline_parallel import PipelineParallel
from ddpcheck._language.scenario import Epochs, Scenario
from ddpcheck._language.sharded_models import (
    ShardedBlock,
    ShardedSpec,
    id_tokens,
    sequence_data,
    sequence_tokens,
)
from ddpcheck._language.tensor_parallel import TensorParallel

__all__ = ["BATTERY", "PIPELINE_BATTERY", "TENSOR_PARALLEL_BATTERY"]

_SGD_MOMENTUM = {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}

#: (name, scenario) pairs, cheapest first.
BATTERY: list[tuple[str, Scenario]] = [
    ("mlp-sgd", Scenario(zoo.MLP, global_batch=8, steps=2)),
    # bfloat16 parameters with float32 master weights and reductions: only targets that apply
    # param_dtype (FSDP2) run it -- the others decline it at no cost, hence so early: it is where
    # a bfloat16 reduction shows, as "communication in a narrower dtype" (J3)
    (
        "tokens-param-dtype-bf16",
        Scenario(
            zoo.TinyGPT,
            data=zoo.token_data,
            loss="token_cross_entropy",
            optimizer=torch.optim.AdamW,
            optimizer_kwargs={"lr": 0.01, "eps": 0.1},
            global_batch=7,
            steps=2,
            accumulation=2,
            dtype="float32",
            seed=12,
            param_dtype=torch.bfloat16,
        ),
    ),
    (
        "tied-sgd-momentum",
        Scenario(zoo.Tied, optimizer_kwargs=_SGD_MOMENTUM, global_batch=7, steps=3, seed=1),
    ),
    (
        "unused-frozen-adamw",
        Scenario(
            zoo.UnusedAndFrozen,
            optimizer=torch.optim.AdamW,
            optimizer_kwargs={"lr": 0.01, "weight_decay": 0.1},
            global_batch=9,
            steps=3,
            seed=2,
        ),
    ),
    (
        "sample-branch-accumulate",
        Scenario(
            zoo.SampleBranch,
            optimizer_kwargs=_SGD_MOMENTUM,
            global_batch=11,
            steps=2,
            accumulation=3,
            seed=3,
            bucket_size_mb=1e-6,
        ),
    ),
    # an epoch of two steps: a framework's own DataLoader (a batch meant to be split across the
    # ranks that is not brings the next step's samples); a micro-batch of 12 samples, which
    # every W of 1-4 divides (random examples run several epochs)
    (
        "epochs-accumulate",
        Scenario(
            zoo.MLP,
            optimizer_kwargs={"lr": 0.05},
            global_batch=24,
            accumulation=2,
            seed=13,
            epochs=Epochs(samples=48),
        ),
    ),
    # a schedule and micro-batches together: a framework that gates optimizer.step() and the
    # scheduler after every micro-batch must let neither act inside the window (C2)
    (
        "schedule-accumulate",
        Scenario(
            zoo.MLP,
            optimizer_kwargs={"lr": 0.1},
            lr_decay=0.5,
            global_batch=8,
            steps=2,
            accumulation=2,
            seed=10,
        ),
    ),
    # 26 samples in steps of 24: the epoch ends with 2 samples in a window of one micro-batch,
    # and W=3 and W=4 do not divide the dataset (a sampler pads, or drops, to even out the ranks);
    # an evaluation set of 13 after the epoch, in batches of 12 across the ranks: at W=2 shares
    # of 7 and 6, one padded sample, a last batch on one rank only
    (
        "epochs-short-last",
        Scenario(
            zoo.MLP,
            optimizer_kwargs={"lr": 0.05},
            global_batch=24,
            accumulation=2,
            seed=14,
            epochs=Epochs(samples=26, evaluation=13),
        ),
    ),
    (
        "buffers-groups-schedule",
        Scenario(
            zoo.WithBuffers,
            optimizer=torch.optim.Adam,
            optimizer_kwargs={"lr": 0.02},
            param_groups=zoo.BiasGroups(lr=0.05, weight_decay=0.0),
            lr_decay=0.5,
            global_batch=6,
            steps=3,
            seed=4,
        ),
    ),
    (
        "non-contiguous-one-bucket",
        Scenario(
            zoo.NonContiguous,
            optimizer_kwargs={"lr": 0.1},
            global_batch=5,
            steps=2,
            seed=5,
            bucket_size_mb=1000.0,
            set_to_none=False,
        ),
    ),
    # 157-byte buckets: [b.bias, b.weight] (float32), [a.bias], [a.weight] (float64) -- several
    # buckets (B1), and one that would mix both dtypes if buckets ignored dtype (B10)
    (
        "mixed-dtypes-sum",
        Scenario(
            zoo.MixedPrecision,
            optimizer_kwargs={"lr": 0.05},
            global_batch=8,
            steps=2,
            reduction="sum",
            seed=6,
            bucket_size_mb=1.5e-4,
        ),
    ),
    (
        "tiny-batch",
        Scenario(
            zoo.SampleBranch,
            optimizer=torch.optim.Adam,
            optimizer_kwargs={"lr": 0.01},
            global_batch=3,
            steps=2,
            seed=7,
        ),
    ),
    # gradient 2-norms 1.6, 3.9, 2.9: step 0 is not clipped, the later steps are
    (
        "clip-sgd-momentum",
        Scenario(
            zoo.MLP,
            optimizer_kwargs=_SGD_MOMENTUM,
            global_batch=10,
            steps=3,
            seed=8,
            max_grad_norm=2.0,
        ),
    ),
    # same-shaped tensors (4x4 weights, 4-vectors) that every rank registers in its own order,
    # one bucket per dtype: pairing them by this rank's position mixes them up silently (G1)
    (
        "rank-orders-adam",
        Scenario(
            ModelSpec(layers=(Layer(), Layer(kind="buffer"), Layer())),
            data=SpecData(4),
            optimizer=torch.optim.Adam,
            optimizer_kwargs={"lr": 0.01},
            global_batch=6,
            steps=2,
            seed=9,
            rank_orders=True,
        ),
    ),
    # saved after step 0, resumed at W=2: Adam moments and step counts on every rank, a
    # scheduler's count, two param groups; resharded onto another world at W != 2
    (
        "checkpoint-resume",
        Scenario(
            zoo.MLP,
            optimizer=torch.optim.Adam,
            optimizer_kwargs={"lr": 0.02},
            param_groups=zoo.BiasGroups(lr=0.05, weight_decay=0.0),
            lr_decay=0.5,
            global_batch=6,
            steps=3,
            seed=9,
            checkpoint_after=0,
            resume_world_size=2,
        ),
    ),
    # 7 sequences of 1-8 tokens in 2 micro-batches: micro-batches and ranks hold different token
    # counts at every W, so a token mean per micro-batch or per rank misweighs tokens (J1, J2),
    # and so does an entropy bonus normalised per rank (J5); the other token scenarios below
    # train the plain cross-entropy
    (
        "tokens-accumulate",
        Scenario(
            zoo.TinyGPT,
            data=zoo.token_data,
            loss="entropy_bonus",
            optimizer=torch.optim.AdamW,
            optimizer_kwargs={"lr": 0.01},
            global_batch=7,
            steps=2,
            accumulation=2,
            seed=10,
        ),
    ),
    # bfloat16 autocast, every target's (the loop's precision policy, not the wrapper's)
    (
        "tokens-autocast-bf16",
        Scenario(
            zoo.TinyGPT,
            data=zoo.token_data,
            loss="token_cross_entropy",
            optimizer_kwargs={"lr": 0.1},
            global_batch=7,
            steps=2,
            accumulation=2,
            dtype="float32",
            seed=11,
            autocast=torch.bfloat16,
        ),
    ),
]


def _attention_mlp_plan(at: str) -> tuple[tuple[str, str], ...]:
    """Megatron's split of one attention block and one MLP block (heads and hidden features)."""
    return (
        *((f"{at}0.{n}", "colwise") for n in "qkv"),
        (f"{at}0.out", "rowwise"),
        (f"{at}1.up", "colwise"),
        (f"{at}1.down", "rowwise"),
    )


#: The battery of a target that applies tensor-parallel plans (``Target.parallelizes``): sizes
#: every degree of 1-4 divides where the plan needs whole heads, and ones it does not divide
#: where torch shards unevenly -- never leaving a rank an empty shard, which no plan anybody
#: writes does (and which torch 2.13's FSDP2 hangs on: bench/fsdp2_empty_tp_shard.py).
TENSOR_PARALLEL_BATTERY: list[tuple[str, Scenario]] = [
    # first, though not the cheapest: what alone reaches the embedding and tie mutants (K15,
    # K16), which every other entry's plan leaves untouched. A vocabulary-parallel embedding
    # (5 words: 3+2) tied to the head, both Shard(0) on that matrix, grouped-query attention
    # split along its 2 kv heads with q/k norms over the heads (K18), a sequence region closed
    # by the loss-parallel head
    (
        "tp-vocab-tied-gqa",
        Scenario(
            ShardedSpec(
                blocks=(
                    ShardedBlock("attention", 4, kv_heads=2, qk_norm=True),
                    ShardedBlock("norm"),
                ),
                width=4,
                head_dim=2,  # q/k norms over two features (one: its sign, chaotic)
                tokens=True,
                embedding=True,
                tied=True,
            ),
            data=id_tokens,
            loss="token_cross_entropy",
            global_batch=4,
            steps=2,
            seed=48,
            tensor_parallel=TensorParallel(
                (
                    ("inp", "vocab"),
                    *((f"blocks.0.{n}", "colwise") for n in "qkv"),
                    *((f"blocks.0.{n}_norm", "heads-norm") for n in "qk"),
                    ("blocks.0.out", "rowwise"),
                    ("blocks.1.norm", "sequence"),
                    ("blocks.1", "sequence-in"),
                    ("head", "colwise-sequence-loss"),
                ),
                tp=2,
            ),
        ),
    ),
    (
        "tp-attention-mlp",
        Scenario(
            ShardedSpec(
                blocks=(ShardedBlock("attention", 12), ShardedBlock("mlp", 12)),
                width=7,  # over tp=2, 3, 4: 4+3, 3+3+1, 2+2+2+1 (every rank holds some)
                head_dim=1,
            ),
            data=sequence_data,
            global_batch=6,
            steps=2,
            seed=21,
            tensor_parallel=TensorParallel(
                (
                    ("inp", "colwise-replicate"),
                    *_attention_mlp_plan("blocks."),
                    ("head", "rowwise-replicate"),
                )
            ),
        ),
    ),
    # a hidden width of 7 and a norm: uneven shards (4+3, 3+3+1, 2+2+2+1), replicated
    # parameters, Adam's state on DTensor shards, an uneven batch and clipping of a norm over
    # shards and replicas
    (
        "tp-uneven-adam-clip",
        Scenario(
            ShardedSpec(blocks=(ShardedBlock("mlp", 7), ShardedBlock("norm")), width=3, head_dim=1),
            data=sequence_data,
            optimizer=torch.optim.Adam,
            optimizer_kwargs={"lr": 0.01},
            global_batch=7,
            steps=2,
            accumulation=2,
            seed=22,
            max_grad_norm=0.5,
            tensor_parallel=TensorParallel(
                (("blocks.0.up", "colwise-dtensor"), ("blocks.0.down", "rowwise"))
            ),
        ),
    ),
    # a (dp, tp) mesh with tp=2: at W=4 two data-parallel groups of two (torch_2d), at W=2 one
    (
        "tp2-mesh-accumulate",
        Scenario(
            ShardedSpec(
                blocks=(ShardedBlock("attention", 2), ShardedBlock("mlp", 6), ShardedBlock("norm")),
                width=4,
                head_dim=2,
            ),
            data=sequence_data,
            optimizer_kwargs=_SGD_MOMENTUM,
            lr_decay=0.5,
            global_batch=9,
            steps=2,
            accumulation=2,
            seed=23,
            tensor_parallel=TensorParallel(_attention_mlp_plan("blocks."), tp=2),
        ),
    ),
    # sequence parallelism: a LayerNorm entered by the input projection's reduce-scatter and
    # left by a gather, an MLP, an RMSNorm entered by a cut and left by the head's gather; the
    # sequence (3) and the head (3) uneven over tp=2, the input (5) over tp=3
    (
        "tp-sequence-norms",
        Scenario(
            ShardedSpec(
                blocks=(ShardedBlock("norm"), ShardedBlock("mlp", 6), ShardedBlock("rmsnorm")),
                width=4,
            ),
            data=sequence_data,
            optimizer=torch.optim.Adam,
            optimizer_kwargs={"lr": 0.01},
            global_batch=6,
            steps=2,
            seed=24,
            tensor_parallel=TensorParallel(
                (
                    ("inp", "rowwise-sequence"),
                    ("blocks.0.norm", "sequence"),
                    ("blocks.0", "sequence-out"),
                    ("blocks.1.up", "colwise"),
                    ("blocks.1.down", "rowwise"),
                    ("blocks.2.norm", "sequence"),
                    ("blocks.2", "sequence-in"),
                    ("head", "colwise-sequence"),
                )
            ),
        ),
    ),
    # loss parallelism: token cross-entropy of logits sharded over a vocabulary of 5 (3+2)
    # under loss_parallel(), padded sequences, after a sequence-parallel norm
    (
        "tp-loss-parallel",
        Scenario(
            ShardedSpec(
                blocks=(ShardedBlock("mlp", 6), ShardedBlock("norm")), width=4, tokens=True
            ),
            data=sequence_tokens,
            loss="token_cross_entropy",
            global_batch=6,
            steps=2,
            seed=25,
            tensor_parallel=TensorParallel(
                (
                    ("blocks.0.up", "colwise"),
                    ("blocks.0.down", "rowwise"),
                    ("blocks.1.norm", "sequence"),
                    ("blocks.1", "sequence-in"),
                    ("head", "colwise-sequence-loss"),
                ),
                tp=2,  # at W=4, dp=2 x tp=2: loss_parallel() under FSDP2 (torch_2d)
            ),
        ),
    ),
    # a policy gradient under loss_parallel(): log_softmax and nll_loss(reduction="none") of
    # logits sharded over the vocabulary, each token's term times a fixed advantage
    (
        "tp-policy-gradient",
        Scenario(
            ShardedSpec(blocks=(ShardedBlock("mlp", 4),), width=4, tokens=True),
            data=sequence_tokens,
            loss="policy_gradient",
            global_batch=5,
            steps=2,
            seed=48,
            tensor_parallel=TensorParallel(
                (
                    ("blocks.0.up", "colwise"),
                    ("blocks.0.down", "rowwise"),
                    ("head", "colwise-loss"),
                ),
                tp=2,
            ),
        ),
    ),
]


def _pipeline(
    name: str, blocks: tuple[str, ...], pipeline: PipelineParallel, **fields: object
) -> tuple[str, Scenario]:
    model = ShardedSpec(blocks=tuple(ShardedBlock(kind, 3) for kind in blocks), width=4)
    return name, Scenario(model, data=sequence_data, pipeline=pipeline, **fields)  # type: ignore[arg-type]


#: The battery of a target that runs pipeline schedules (``Target.pipelines``): each schedule
#: family once -- one stage per rank, looped, V-shaped -- with the stages, pieces and world sizes
#: torch accepts (pp=None: the whole world, so each runs where W has its stage count; a W=4
#: world runs "pp-gpipe" as dp=2 x pp=2), accumulation, clipping, Adam and float32 among them.
PIPELINE_BATTERY: list[tuple[str, Scenario]] = [
    # one stage per pipeline, every other rank another pipeline: the cheapest dp > 1 (at W=2)
    _pipeline(
        "pp-one-stage-dp",
        ("mlp",),
        PipelineParallel("GPipe", boundaries=(), microbatches=2, pp=1),
        global_batch=8,
        steps=2,
        seed=6,
    ),
    _pipeline(
        "pp-gpipe",
        ("mlp", "attention"),
        PipelineParallel("GPipe", boundaries=(2,), microbatches=2, pp=2),
        global_batch=8,
        steps=2,
    ),
    _pipeline(
        "pp-1f1b-accumulation-adam",
        ("mlp", "norm"),
        PipelineParallel("1F1B", boundaries=(1, 3), microbatches=3),
        optimizer=torch.optim.Adam,
        optimizer_kwargs={"lr": 0.01},
        global_batch=12,
        accumulation=2,
        steps=2,
        seed=3,
    ),
    _pipeline(
        "pp-interleaved-clipping",
        ("mlp", "mlp"),
        PipelineParallel(
            "Interleaved1F1B", boundaries=(1, 2, 3), microbatches=2, stages_per_rank=2
        ),
        global_batch=4,
        steps=2,
        max_grad_norm=0.5,
        seed=4,
    ),
    _pipeline(
        "pp-zbv-float32",
        ("attention", "mlp"),
        PipelineParallel("ZBVZeroBubble", boundaries=(1, 2, 3), microbatches=2, stages_per_rank=2),
        global_batch=4,
        steps=2,
        dtype="float32",
        lr_decay=0.5,
        seed=5,
    ),
]
