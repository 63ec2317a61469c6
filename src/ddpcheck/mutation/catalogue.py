"""The mutant catalogue: the built-in ``parallel`` target with exactly one seeded bug each.

Invariant: every entry of :data:`CATALOGUE` is :class:`~ddpcheck.targets.ParallelTarget` (or,
where noted, :class:`~ddpcheck.targets.ParallelDDPTarget`, or ``ShardedOptimizer`` with no DDP
in front) whose ``parallel.DDP`` or ``parallel.ShardedOptimizer`` is replaced by a subclass
overriding one method (rarely two, always named in the docstring; ``broken_ddp``,
``broken_optimizer``) with a copy that carries one bug of a class in ``docs/bug-catalogue.md``
-- or whose batch plan (``Target.shard_batch``) is a hook of ``broken_batches`` carrying one bug
of the training loop's data split or loss normalisation (A3, F1-F3, J1, J2), or whose target hooks
``save_checkpoint`` / ``load_checkpoint`` are those of a mixin of ``broken_checkpoint`` (E7, E8),
or whose ``reported_loss`` is a mixin of ``broken_loss`` (family L: the loss a loop logs; its
metrics, L6 and L7, are torch DDP's evaluation loop with one bug each, ``broken_metrics``).
Family I (sharded parameters) is :class:`~ddpcheck.targets.TorchFSDPTarget` subclasses overriding
one method (``broken_fsdp``), and so is J3 (a mixed-precision policy that reduces in bfloat16).
Each docstring says what the bug is and which real report it mirrors. ``ddpcheck mutants``
(and ``tests/mutation/test_mutants.py``) hold the harness to killing all of them.

Classes of the catalogue without a mutant here, and why:

* B5 (a hook firing twice) and "no already-marked guard": the guard only matters where the
  unmutated ``DDP`` *raises* (a second synchronised backward, reentrant checkpointing); within
  what the target supports the mutant is equivalent. Killing it needs "misuse must raise"
  examples, which the oracle does not have.
* B7 "wait only on the last handle": not included. On gloo, work of one process group is queued
  in launch order, so the earlier buckets have very likely finished when the last one has: at
  best a flaky kill (expected, not measured). ``ReadsBeforeWait`` covers B7.
* B12 (bypassing the wrapper): the runner always calls the wrapper's forward and
  ``finish_gradient_sync``; the bypass is a training-loop bug.
* C2 (sync/step flag logic of trainers) and E3 (a group-level step counter skipped on empty
  shards): ``parallel`` has no trainer flags and torch's optimizers count steps per parameter, so
  there is no such counter to skip.
* H6 (an inner optimizer over an empty shard): ``parallel.ShardedOptimizer`` builds its inner
  optimizer even when this rank owns nothing; breaking that means rewriting construction, not
  overriding a seam.
"""

from __future__ import annotations

import contextlib
import dataclasses
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from ddpcheck._base.errors import InvalidArgument
from ddpcheck._language.batches import BatchPlan, GlobalBatch
from ddpcheck._language.features import FEATURES
from ddpcheck._language.training import OptimizerLike, Params
from ddpcheck.mutation import broken_batches as S
from ddpcheck.mutation import broken_checkpoint as K
from ddpcheck.mutation import broken_data as B
from ddpcheck.mutation import broken_ddp as D
from ddpcheck.mutation import broken_fsdp as F
from ddpcheck.mutation import broken_loop as L
from ddpcheck.mutation import broken_loss as R
from ddpcheck.mutation import broken_metrics as M
from ddpcheck.mutation import broken_nd as ND
from ddpcheck.mutation import broken_optimizer as O
from ddpcheck.mutation import broken_options as P
from ddpcheck.mutation import broken_pp as PP
from ddpcheck.mutation import broken_tp as T
from ddpcheck.targets import (
    ACCELERATE,
    HF_TRAINER,
    LIGHTNING,
    TORCH_DDP,
    ParallelDDPTarget,
    ParallelTarget,
    Target,
    TorchFSDPTarget,
)
from ddpcheck.targets.catalogue import PARALLEL_TP, TORCH_ND, TORCH_PP, TORCH_TP
from parallel import DDP, ShardedOptimizer

__all__ = ["CATALOGUE", "ND_CATALOGUE", "OPTION_CATALOGUE", "Mutant", "by_name", "stale_overrides"]


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One entry of the catalogue: a target with one seeded bug, and what the bug is."""

    name: str  # the target class's name, e.g. "NoDivide"
    bug_class: str  # catalogue id, e.g. "A1"
    description: str  # one line
    target: Target
    #: the unmutated target it must be told apart from (None: ``parallel``)
    control: Target | None = None


# ---------------------------------------------------------------------------------------------
# How a mutant target swaps in its broken class


@dataclasses.dataclass(frozen=True)
class _Seeded(ParallelTarget):
    """``ParallelTarget`` driving ``ddp_class`` and ``optimizer_class`` instead of the originals."""

    ddp_class = DDP
    optimizer_class = ShardedOptimizer

    def wrap(self, module: nn.Module) -> nn.Module:
        return self.ddp_class(module, bucket_size_mb=self.bucket_size_mb or 25.0)

    def make_optimizer(
        self,
        params: Params,
        optimizer_cls: type[torch.optim.Optimizer],
        **kwargs: Any,  # the scenario's options, for its optimizer class
    ) -> ShardedOptimizer:
        if self.sharding_rule is not None:
            kwargs["sharding_rule"] = self.sharding_rule
        return self.optimizer_class(params, optimizer_cls, **kwargs)


@dataclasses.dataclass(frozen=True)
class _SeededDDPOnly(ParallelDDPTarget):
    """``ParallelDDPTarget`` (plain optimizer) driving ``ddp_class``."""

    ddp_class = DDP

    def wrap(self, module: nn.Module) -> nn.Module:
        return self.ddp_class(module, bucket_size_mb=self.bucket_size_mb or 25.0)


@dataclasses.dataclass(frozen=True)
class _SeededOptimizerOnly(_Seeded):
    """``optimizer_class`` with no DDP in front, averaging gradients itself -- in ``step()``, or
    in ``clip_grad_norm_`` -- as Horovod's DistributedOptimizer does. Rank 0's initial state is
    broadcast here, as DDP's construction would."""

    ddp_class = None  # type: ignore[assignment]  # no DDP in front (stale_overrides reads it)
    gradients_synchronized_in_step = True
    # No DDP in front: nothing tells ShardedOptimizer rank 0's order (parallel.handover), and the
    # broadcast below pairs tensors by this rank's registration order.
    supported_features = frozenset(FEATURES) - {"rank-orders"}

    def wrap(self, module: nn.Module) -> nn.Module:
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                buffer = tensor.detach().contiguous()
                # broadcast each parameter and buffer from rank 0 to every rank, once, before
                # the first step: every replica starts from rank 0's state
                dist.broadcast(buffer, src=0)
                tensor.copy_(buffer)
        return module

    def after_backward(self, model: nn.Module, optimizer: OptimizerLike) -> None:
        pass  # nothing to finish: the optimizer averages

    def no_sync(self, model: nn.Module) -> AbstractContextManager[object]:
        return contextlib.nullcontext()  # gradients accumulate locally until the optimizer's


@dataclasses.dataclass(frozen=True)
class _SeededBatches(_Seeded):
    """The unmutated ``parallel`` target with ``batches_class()`` as its batch plan."""

    batches_class: ClassVar[type]  # a class of broken_batches (set by _target)
    # declared with the plan, so token scenarios judge it too (ddpcheck.features.supported_by)
    supported_features = ParallelTarget.supported_features

    def shard_batch(self, batch: GlobalBatch) -> BatchPlan:
        return self.batches_class()(batch)


# =============================================================================================
# The targets, and the catalogue


def _target(
    name: str,
    *,
    ddp: type = DDP,
    optimizer: type = ShardedOptimizer,
    ddp_only: bool = False,
    optimizer_only: bool = False,
    batches: type | None = None,
    hooks: type | None = None,
) -> type:
    base = (
        _SeededDDPOnly
        if ddp_only
        else _SeededOptimizerOnly
        if optimizer_only
        else _Seeded
        if batches is None
        else _SeededBatches
    )
    attrs: dict[str, object] = {"__module__": __name__, "__qualname__": name}
    if batches is not None:
        attrs["batches_class"] = batches
    if not optimizer_only:
        attrs["ddp_class"] = ddp
    if not ddp_only:
        attrs["optimizer_class"] = optimizer
    cls = type(name, (base,) if hooks is None else (hooks, base), attrs)
    return dataclasses.dataclass(frozen=True)(cls)


_ENTRIES: list[tuple[str, str, str, dict]] = [
    ("NoDivide", "A1", "gloo SUM without the /W", {"ddp": D.NoDivideDDP}),
    ("DivideTwice", "A1", "gradients divided by W twice", {"ddp": D.DivideTwiceDDP}),
    (
        "AveragesAgain",
        "A1",
        "ShardedOptimizer averages gradients DDP already averaged",
        {"optimizer": O.AveragesAgainOptimizer},
    ),
    (
        "DivideByNumel",
        "A2",
        "gloo SUM divided by the bucket's numel instead of W",
        {"ddp": D.DivideByNumelDDP},
    ),
    (
        "LocalShardNorm",
        "A4",
        "gradients clipped by this rank's shard of the norm (no all-reduce)",
        {"optimizer": O.LocalShardNormOptimizer},
    ),
    (
        "NormCountsReplicas",
        "A4",
        "every rank adds every replicated gradient: norm sqrt(W) too large",
        {"optimizer": O.NormCountsReplicasOptimizer},
    ),
    (
        "MeanOfRankMeans",
        "A3",
        "each rank's loss is its own mean: uneven shards weigh samples unequally",
        {"batches": S.MeanOfRankMeans},
    ),
    (
        "ClipsBeforeAveraging",
        "A4",
        "clipped by the norm of rank-local gradients, then averaged",
        {"optimizer": O.ClipsBeforeAveragingOptimizer, "optimizer_only": True},
    ),
    (
        "NoFinalFlush",
        "B1",
        "finish_gradient_sync never flushes incomplete buckets",
        {"ddp": D.NoFinalFlushDDP},
    ),
    (
        "DropsEarlierMicroBatches",
        "B2",
        "no_sync grads of params unused in the last micro-batch are dropped",
        {"ddp": D.DropsEarlierMicroBatchesDDP},
    ),
    (
        "ZeroFillsUnused",
        "B3",
        "globally unused params get zero grads (not None)",
        {"ddp": D.ZeroFillsUnusedDDP},
    ),
    (
        "LocallyUnusedStaysNone",
        "B3",
        "a param unused here but used elsewhere keeps grad=None (DDP + plain optimizer)",
        {"ddp": D.LocallyUnusedStaysNoneDDP, "ddp_only": True},
    ),
    (
        "TiedListedTwice",
        "B4",
        "buckets by name: a tied weight is reduced twice",
        {"ddp": D.TiedListedTwiceDDP},
    ),
    (
        "ReadinessOrder",
        "B6",
        "buckets launched in this rank's readiness order",
        {"ddp": D.ReadinessOrderDDP},
    ),
    (
        "ReadsBeforeWait",
        "B7",
        "bucket averages read before its all-reduce is waited on",
        {"ddp": D.ReadsBeforeWaitDDP},
    ),
    (
        "AssumesGradIsView",
        "B8",
        "after the first sync, grads assumed to be bucket views: not copied in",
        {"ddp": D.AssumesGradIsViewDDP},
    ),
    (
        "ReshapeWriteBack",
        "B9",
        "write-back through grad.reshape(-1), lost for non-contiguous grads",
        {"ddp": D.ReshapeWriteBackDDP},
    ),
    (
        "MixedDtypeBuckets",
        "B10",
        "float64 grads put in a float32 bucket (buckets ignore dtype)",
        {"ddp": D.MixedDtypeBucketsDDP},
    ),
    (
        "BucketsFrozen",
        "B11",
        "frozen params bucketed: their zeros are all-reduced every step",
        {"ddp": D.BucketsFrozenDDP},
    ),
    (
        "FreesNoSyncGrads",
        "C1",
        "no_sync micro-batch grads freed: only the last micro-batch counts",
        {"ddp": D.FreesNoSyncGradsDDP},
    ),
    (
        "SkipsZeroGrad",
        "C1",
        "zero_grad does nothing: grads accumulate across steps",
        {"optimizer": O.SkipsZeroGradOptimizer},
    ),
    (
        "SumsEachMicroBatch",
        "C3",
        "every micro-batch all-reduced with SUM, then averaged again",
        {"ddp": D.SumsEachMicroBatchDDP},
    ),
    ("SkipsBuffers", "D1", "buffers not broadcast at construction", {"ddp": D.SkipsBuffersDDP}),
    (
        "BroadcastsFromLastRank",
        "D2",
        "initial state broadcast from the last rank, not rank 0",
        {"ddp": D.BroadcastsFromLastRankDDP},
    ),
    (
        "NoInitialBroadcast",
        "D2",
        "no broadcast of the initial state at construction",
        {"ddp": D.NoInitialBroadcastDDP},
    ),
    (
        "OwnersFromReversedOrder",
        "E1",
        "broadcast owners computed over a different param order",
        {"optimizer": O.OwnersFromReversedOrderOptimizer},
    ),
    (
        "BroadcastsFromWrongRank",
        "E1",
        "owner i's slab broadcast from rank i % (W-1)",
        {"optimizer": O.BroadcastsFromWrongRankOptimizer},
    ),
    (
        "LastShardNeverBroadcast",
        "E2",
        "the last rank's shard is never broadcast",
        {"optimizer": O.LastShardNeverBroadcastOptimizer},
    ),
    (
        "GroupZeroHyperparameters",
        "E4",
        "every param group stepped with group 0's hyperparameters",
        {"optimizer": O.GroupZeroHyperparametersOptimizer},
    ),
    (
        "SchedulerNeverReaches",
        "E5",
        "LR scheduler edits never reach the inner optimizer",
        {"optimizer": O.SchedulerNeverReachesOptimizer},
    ),
    (
        "EveryRankStepsEverything",
        "E6",
        "every rank keeps state for and steps every param",
        {"optimizer": O.EveryRankStepsEverythingOptimizer},
    ),
    (
        "NeverBroadcasts",
        "E6",
        "owners never broadcast their updated params",
        {"optimizer": O.NeverBroadcastsOptimizer},
    ),
    (
        "PerParameterBroadcast",
        "E6",
        "one broadcast per param instead of per (owner, dtype)",
        {"optimizer": O.PerParameterBroadcastOptimizer},
    ),
    (
        "SamplerSeededPerRank",
        "F1",
        "samples shuffled with a per-rank seed: overlaps and gaps",
        {"batches": S.SamplerSeededPerRank},
    ),
    (
        "FlooredShards",
        "F2",
        "every rank takes B // W samples: the remainder is never trained on",
        {"batches": S.FlooredShards},
    ),
    (
        "PaddingSampler",
        "F2",
        "DistributedSampler(drop_last=False) pads uneven batches with repeats",
        {"batches": S.PaddingSampler},
    ),
    (
        "SkipsEmptyShard",
        "F3",
        "a rank with no samples (B < W) skips forward and backward",
        {"batches": S.SkipsEmptyShard},
    ),
    (
        "OwnRegistrationOrder",
        "G1",
        "gradient buckets laid out in this rank's registration order, not rank 0's",
        {"ddp": D.OwnRegistrationOrderDDP},
    ),
    (
        "ReducesParameter",
        "H1",
        "post-accumulate hook reduces the parameter it gets, not its grad",
        {"ddp": D.ReducesParameterDDP},
    ),
    (
        "AddsIntoAliasedBuffer",
        "H2",
        "fill adds into the bucket buffer that .grad aliases: kept grads count twice",
        {"ddp": D.AddsIntoAliasedBufferDDP},
    ),
    (
        "ReducesLastMicroBatchOnly",
        "H3",
        "per-tensor register_hook reduction: earlier micro-batches stay local",
        {"ddp": D.ReducesLastMicroBatchOnlyDDP},
    ),
    (
        "ZeroGradOwnedOnly",
        "H4",
        "zero_grad clears only the owned params: stale grads re-reduced",
        {"optimizer": O.ZeroGradOwnedOnlyOptimizer},
    ),
    (
        "ConsolidatesOwnShard",
        "E7",
        "consolidate_state_dict gathers nothing: the checkpoint holds one shard's state",
        {"optimizer": O.ConsolidatesOwnShardOptimizer},
    ),
    (
        "ForgetsScheduler",
        "E7",
        "the LR scheduler's state is not checkpointed: its count restarts",
        {"hooks": K.ForgetsSchedulerHooks},
    ),
    (
        "SavesWrappedModel",
        "E8",
        "the wrapper's module.x keys saved, loaded with strict=False: no weight loads",
        {"hooks": K.SavesWrappedModelHooks},
    ),
    (
        "CopiedGroups",
        "H5",
        "defaults={} wrapper, inner built from copied groups, never synced",
        {"optimizer": O.CopiedGroupsOptimizer},
    ),
    (
        "MicroBatchTokenMean",
        "J1",
        "each micro-batch's loss is its own token mean: accumulation weighs tokens unequally",
        {"batches": S.MicroBatchTokenMean},
    ),
    (
        "RankTokenMean",
        "J2",
        "each rank's loss is its own token mean, averaged by DDP: ranks' token counts differ",
        {"batches": S.RankTokenMean},
    ),
    (
        "RankMeanBonus",
        "J5",
        "entropy bonus and KL term normalised over the rank's own tokens, not the global batch's",
        {"hooks": S.RankMeanBonusHooks},
    ),
    (
        "LastMicroBatchAfterReduce",
        "J4",
        "fp32 accumulator all-reduced before the last micro-batch is added: it stays local",
        {"ddp": D.LastMicroBatchAfterReduceDDP},
    ),
    # Family L: the loss the loop reports (``broken_loss``), every gradient right
    (
        "RankZeroLoss",
        "L1",
        "the logged loss is rank 0's own mean; the other ranks report none",
        {"hooks": R.RankZeroLossHooks},
    ),
    (
        "SummedLoss",
        "L2",
        "the logged loss all-reduced with SUM and never divided by W",
        {"hooks": R.SummedLossHooks},
    ),
    (
        "MicroBatchMeanLoss",
        "L3",
        "the logged loss is the mean of micro-batch means: short micro-batches weigh as much",
        {"hooks": R.MicroBatchMeanLossHooks},
    ),
    (
        "LastMicroBatchLoss",
        "L4",
        "the logged loss is the window's last micro-batch's, times the accumulation steps",
        {"hooks": R.LastMicroBatchLossHooks},
    ),
    (
        "RankMeanLoss",
        "L5",
        "the logged loss averages each rank's own mean: a smaller share's terms weigh more",
        {"hooks": R.RankMeanLossHooks},
    ),
]


def _entry(name: str, bug_class: str, description: str, swap: dict) -> Mutant:
    """The mutant of one row of :data:`_ENTRIES`, its class a name of this module (pickle)."""
    cls = _target(name, **swap)
    globals()[name] = cls
    return Mutant(name, bug_class, description, cls())


CATALOGUE: list[Mutant] = [_entry(*entry) for entry in _ENTRIES]

# Family I: torch's FSDP2 (``TorchFSDPTarget``) with one seeded bug each (``broken_fsdp``).
CATALOGUE += [
    Mutant(
        "BroadcastsFromLastRankFSDP",
        "I1",
        "FSDP2: initial state broadcast from the last rank before sharding",
        F.BroadcastsFromLastRankFSDP(),
    ),
    Mutant(
        "NoGradientDivideFSDP",
        "I2",
        "FSDP2: gradients reduce-scattered with SUM, divide factor 1",
        F.NoGradientDivideFSDP(),
    ),
    Mutant(
        "NeighbourGradientShardFSDP",
        "I3",
        "FSDP2: each local shard stepped with the next rank's gradient slice",
        F.NeighbourGradientShardFSDP(),
    ),
    Mutant(
        "StaleUnshardedParamsFSDP",
        "I4",
        "FSDP2: unshard() before optimizer.step: the next forward uses stale parameters",
        F.StaleUnshardedParamsFSDP(),
    ),
    Mutant(
        "ReducesInParamDtypeFSDP",
        "J3",
        "FSDP2: MixedPrecisionPolicy without reduce_dtype: gradients reduced in bfloat16",
        F.ReducesInParamDtypeFSDP(),
    ),
]


# The loop hooks and sharded gradients (``broken_loop``): DeepSpeed's engine in miniature, driven
# as accelerate and DeepSpeed are, and ZeRO-2 in miniature, each with its own unmutated control.
LOOP_CONTROL = L.EngineTarget()
ZERO2_CONTROL = L.Zero2Target()
CATALOGUE += [
    Mutant(
        "SkipsFirstReduce",
        "B12",
        "backward wrapper skips the reduce after a step's first micro-batch, even the only one",
        L.SkipsFirstReduceTarget(),
        LOOP_CONTROL,
    ),
    Mutant(
        "StepsInsideWindow",
        "C2",
        "the framework's gated optimizer steps inside the accumulation window",
        L.StepsInsideWindowTarget(),
        LOOP_CONTROL,
    ),
    Mutant(
        "SchedulerPerMicroBatch",
        "C2",
        "the framework's gated LR scheduler steps after every micro-batch",
        L.SchedulerPerMicroBatchTarget(),
        LOOP_CONTROL,
    ),
    Mutant(
        "ReducesTwiceZero2",
        "C3",
        "ZeRO-2: every gradient all-reduced, then reduced to its owner again",
        L.ReducesTwiceZero2Target(),
        ZERO2_CONTROL,
    ),
]


# The data path (``broken_data``): torch's DDP driving its own DistributedSampler and DataLoader
# over a scenario's epochs, with the unmutated torch_ddp as the control. Only scenarios with
# epochs reach the seeded method.
DATA_CONTROL = TORCH_DDP
CATALOGUE += [
    Mutant(
        "SeedPerRank",
        "F1",
        "each rank's sampler shuffles with its own seed: samples overlap and go missing",
        B.SeedPerRankTarget(),
        DATA_CONTROL,
    ),
    Mutant(
        "PadsCounted",
        "F2",
        "DistributedSampler's padding of a dataset W does not divide trains as real samples",
        B.PadsCountedTarget(),
        DATA_CONTROL,
    ),
    Mutant(
        "ShortWindowAsFull",
        "F4",
        "an epoch's short last window normalised as if it held every micro-batch",
        B.ShortWindowAsFullTarget(),
        DATA_CONTROL,
    ),
    Mutant(
        "IgnoresSplit",
        "F5",
        "a batch meant to be split across the ranks loaded whole by each of them",
        B.IgnoresSplitTarget(),
        DATA_CONTROL,
    ),
    Mutant(
        "DividesBatchTwice",
        "F5",
        "the per-device batch divided by W twice: each step trains too few samples",
        B.DividesBatchTwiceTarget(),
        DATA_CONTROL,
    ),
    Mutant(
        "LastMicroBatchUnreduced",
        "C1",
        "an epoch's short last window never syncs: its step runs on local gradients",
        B.LastMicroBatchUnreducedTarget(),
        DATA_CONTROL,
    ),
]


# Family L's metrics (``broken_metrics``): torch's DDP evaluating a scenario's evaluation set after
# every epoch, every parameter right; only scenarios with an evaluation set reach them.
CATALOGUE += [
    Mutant(
        "PaddingCountedMetric",
        "L6",
        "the evaluation sampler's padding counted in the metric: gather, not gather_for_metrics",
        M.PaddingCountedTarget(),
        DATA_CONTROL,
    ),
    Mutant(
        "DropsUnevenLastBatch",
        "L7",
        "each rank's evaluation loader drops a short last batch: the uneven end lost on some ranks",
        M.DropsUnevenLastBatchTarget(),
        DATA_CONTROL,
    ),
]


# Tensor parallelism (``broken_tp``): this repository's column/row layers (``parallel_tp``) with
# one seeded bug each -- in a layer, or in one hook of the target -- against the unmutated
# ``parallel_tp``. Only tensor-parallel scenarios reach them (``tensor_parallel_scenarios``, the
# tensor-parallel battery).
TP_CONTROL = PARALLEL_TP
CATALOGUE += [
    Mutant(name, bug_class, description, getattr(T, name)(), TP_CONTROL)
    for name, bug_class, description in T.ENTRIES
] + [  # seeded into torch's tensor parallelism: loss_parallel(), which parallel_tp has not
    Mutant(name, bug_class, description, getattr(T, name)(), TORCH_TP)
    for name, bug_class, description in T.TORCH_ENTRIES
]


# Pipeline parallelism (``broken_pp``): torch_pp with one seeded bug each, in one method of the
# target, against the unmutated torch_pp. Only pipeline scenarios reach them (the pipeline
# battery, ``pipeline_scenarios``).
CATALOGUE += [
    Mutant(name, bug_class, description, getattr(PP, name)(), TORCH_PP)
    for name, bug_class, description in PP.ENTRIES
]
# A pipeline of tensor-parallel stages (``broken_nd``), against the unmutated torch_nd. Not in
# CATALOGUE: pp x tp needs W=4, beyond the CI battery search's W=2,3; ``ddpcheck mutants`` adds
# it where its world sizes reach 4 (the default 1-4), and ``by_name`` finds it.
ND_CATALOGUE = [
    Mutant(name, bug_class, description, getattr(ND, name)(), TORCH_ND)
    for name, bug_class, description in ND.ENTRIES
]


# Behind an option (``broken_options``): each a framework target (or parallel_ddp with a bf16
# option) whose bug only a configuration its config_space() draws reaches, with the unmutated
# target as its control. Not in CATALOGUE: ``ddpcheck mutants`` checks each target as given, which
# misses them by construction; ``search.shrinking_search(..., fuzz_config=True)`` kills them
# (tests/mutation/test_option_mutants.py). Their frameworks must be installed.
OPTION_CATALOGUE: list[Mutant] = [
    Mutant(
        "StepsInsideWindowUnlessSplit",
        "C2",
        "accelerate, split_batches=False: the prepared optimizer steps inside the window",
        P.StepsInsideWindowUnlessSplit(),
        ACCELERATE,
    ),
    Mutant(
        "SkipsFirstReduceStaticManual",
        "B12",
        "Lightning, manual=True with static_graph=True: the first all-reduce is skipped",
        P.SkipsFirstReduceStaticManual(),
        LIGHTNING,
    ),
    Mutant(
        "PerMicroBatchLossCountingTokens",
        "J1",
        "Trainer, include_num_input_tokens_seen: the loss normalised per micro-batch",
        P.PerMicroBatchLossCountingTokens(),
        HF_TRAINER,
    ),
    Mutant(
        "LastMicroBatchAfterReduceBf16",
        "J4",
        "bf16=True: the last micro-batch's gradient added after the reduction",
        P.LastMicroBatchAfterReduceBf16(),
        P.Bf16PathTarget(),
    ),
]


def by_name(name: str) -> Mutant:
    """The catalogue entry called ``name`` (case-insensitive)."""
    for mutant in CATALOGUE + ND_CATALOGUE:
        if mutant.name.lower() == name.lower():
            return mutant

    raise InvalidArgument(
        f"mutant {name!r} is not in the catalogue; known: {', '.join(m.name for m in CATALOGUE)}"
    )


def stale_overrides() -> list[str]:
    """Methods a mutant overrides that ``parallel`` (or the target it mutates) no longer has:
    when a seam is renamed, such a mutant silently stops being a mutant (and "survives").
    ``tests/mutation/test_mutants.py`` requires this to be empty."""
    stale = []
    for mutant in CATALOGUE + ND_CATALOGUE:
        if isinstance(mutant.target, TorchFSDPTarget):  # family I: overrides TorchFSDPTarget's
            stale += _stale(mutant, type(mutant.target), TorchFSDPTarget)
            continue
        if mutant.control is not None:  # broken_loop: the control's class and its pieces
            control = type(mutant.control)
            stale += _stale(mutant, type(mutant.target), control)
            for piece in (
                "optimizer_class",
                "scheduler_class",
                "column_class",
                "row_class",
                "norm_class",
            ):
                broken, original = (
                    getattr(type(mutant.target), piece, None),
                    getattr(control, piece, None),
                )
                # a piece the control lacks is reported above: the class attribute itself
                if broken is not None and original is not None and broken is not original:
                    stale += _stale(mutant, broken, original)
            continue
        for broken in (
            getattr(type(mutant.target), "ddp_class", None),
            getattr(type(mutant.target), "optimizer_class", ShardedOptimizer),
        ):
            if broken is None:  # no DDP in front
                continue
            original = DDP if issubclass(broken, DDP) else ShardedOptimizer
            stale += _stale(mutant, broken, original)
        for hooks in type(mutant.target).__mro__:
            if hooks.__module__ in (K.__name__, R.__name__, S.__name__):
                stale += _stale(mutant, hooks, Target)
    return stale


def _stale(mutant: Mutant, broken: type, original: type) -> list[str]:
    return [
        f"mutant {mutant.name}: {broken.__qualname__}.{name} overrides nothing in "
        f"{original.__module__}.{original.__qualname__}"
        for name, value in vars(broken).items()
        if callable(value) and not name.startswith("__") and not hasattr(original, name)
    ]
