"""Tensor-parallel mutants: ``parallel_tp`` (``ddpcheck.targets.parallel_tp.ParallelTPTarget``
over ``parallel.tensor_parallel`` and ``parallel.sequence_parallel``) with one seeded bug each
(family K of ``docs/bug-catalogue.md``), and ``torch_tp`` with one (:data:`TORCH_ENTRIES`).

Each mutant overrides one method: of the column or row layer or the sequence-parallel norm (the
target then swaps that class in, ``column_class`` / ``row_class`` / ``norm_class``;
``FlooredShardsTP`` swaps both layers, each with the same one method), or of the target itself
(``shard_batch``, ``clip_grad_norm``, ``apply_plan``, ``backward``, ``after_backward``,
``loss_context``). Each docstring names the method and says the bug. The unmutated target is
their control, and ``catalogue.stale_overrides`` checks that every override still overrides a
method of the class it mutates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddpcheck._language.batches import BatchPlan, GlobalBatch, contiguous
from ddpcheck._language.scenario import Scenario, batch_size_of, micro_batches_of
from ddpcheck._language.sharded_models import VOCABULARY_STYLES
from ddpcheck._language.training import OptimizerLike
from ddpcheck.targets.parallel_tp import ParallelTPTarget
from ddpcheck.targets.tensor_parallel import TorchTPTarget, torch_plan
from parallel import sequence_parallel as sp
from parallel import tensor_parallel as tp

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Placement
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = [
    "ENTRIES",
    "ColumnInputGradUnreducedTP",
    "DataNotFollowingMeshTP",
    "EmbeddingUnmaskedTP",
    "EmbeddingUnreducedTP",
    "FlooredShardsTP",
    "GatherReversedTP",
    "LocalVocabularyLogSoftmaxTP",
    "LocalNormsSummedTP",
    "LocalVocabularyLossTP",
    "LossScaledByTpTP",
    "NormCountsReplicasTP",
    "NormNotReducedTP",
    "ReplicatedGradsSummedTP",
    "ReplicatedNotBroadcastTP",
    "RowBiasGradOverTpTP",
    "RowBiasOnEveryRankTP",
    "RowOutputAveragedTP",
    "RowOutputUnreducedTP",
    "SequenceNormGradUnreducedTP",
    "ShardsFromOwnInitTP",
    "ShardsScatteredReversedTP",
    "TORCH_ENTRIES",
    "QKNormAloneTP",
    "TieLostTP",
    "UnmaskedLookup",
    "UnreducedLookup",
    "VocabularyLookup",
    "home_made_vocabulary",
]


# -- the broken layers -------------------------------------------------------------------------


class BiasOnEveryRankRow(tp.RowParallelLinear):
    """``forward``: the bias added by ``F.linear`` on every rank, before the all-reduce sums the
    partial products -- it counts ``tp`` times (the classic row-parallel bias bug)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = self._scatter_in(x)
        return self._reduce_out(F.linear(x, self.weight, self.bias))  # BUG: bias in each part


class BiasOverTpRow(tp.RowParallelLinear):
    """``forward``: the "fix" for the bias counted ``tp`` times -- each rank adds ``bias / tp``
    before the all-reduce: the output is right, the bias gradient ``1 / tp`` of the truth."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = self._scatter_in(x)
        bias = None if self.bias is None else self.bias / self.tp  # BUG: its gradient too
        return self._reduce_out(F.linear(x, self.weight, bias))


class OutputUnreducedRow(tp.RowParallelLinear):
    """``_reduce_out``: the partial products are never all-reduced: each rank goes on with its
    own part of the output."""

    def _reduce_out(self, partial: torch.Tensor) -> torch.Tensor:
        return partial  # BUG: no all-reduce


class OutputAveragedRow(tp.RowParallelLinear):
    """``_reduce_out``: the partial products are averaged (all-reduced, divided by ``tp``) as
    data-parallel gradients are, where they must be summed."""

    def _reduce_out(self, partial: torch.Tensor) -> torch.Tensor:
        return tp.reduce_from_group(partial, self.group) / self.tp  # BUG: a mean, not the sum


class InputGradUnreducedColumn(tp.ColumnParallelLinear):
    """``_copy_in``: the input enters as a plain tensor, so its gradient is never all-reduced:
    each rank back-propagates only the part its own output features give."""

    def _copy_in(self, x: torch.Tensor) -> torch.Tensor:
        return x  # BUG: no CopyToGroup, no all-reduce in backward


class GatherReversedColumn(tp.ColumnParallelLinear):
    """``_gather_out``: the all-gathered output chunks concatenated in reverse rank order (the
    gathered list read back to front); its backward slices the gradient to match."""

    def _gather_out(self, y: torch.Tensor) -> torch.Tensor:
        bounds = self._layout(self.out_features)
        whole = tp.gather_from_group(y, bounds, self.out_features, self.group)
        # BUG: rank tp-1's chunk first, rank 0's last
        order = [i for start, stop in reversed(bounds) for i in range(start, stop)]
        return whole[..., order]


class ScatteredReversedColumn(tp.ColumnParallelLinear):
    """``_scatter``: rank 0 builds its scatter list back to front, so rank ``r`` receives chunk
    ``tp - 1 - r`` of the weight (the part of it that fits its own chunk's size)."""

    @torch.no_grad()
    def _scatter(self, full: torch.Tensor, dim: int) -> nn.Parameter:
        size = full.shape[dim]
        layout = self._layout(size)
        start, stop = layout[self.rank]
        shape = list(full.shape)
        shape[dim] = max(b - a for a, b in layout)
        mine = torch.zeros(shape, dtype=full.dtype, device=full.device)
        pieces = None
        if self.rank == 0:
            pieces = []
            for a, b in reversed(layout):  # BUG: the list in reverse rank order
                piece = torch.zeros_like(mine)
                piece.narrow(dim, 0, b - a).copy_(full.narrow(dim, a, b - a))
                pieces.append(piece)
        dist.scatter(mine, pieces, src=dist.get_global_rank(self.group, 0), group=self.group)
        return nn.Parameter(mine.narrow(dim, 0, stop - start).clone())


class OwnInitColumn(tp.ColumnParallelLinear):
    """``_scatter``: each rank slices its chunk out of its *own* initialisation; nothing comes
    from rank 0, so the sharded weight is no rank's initial weight."""

    @torch.no_grad()
    def _scatter(self, full: torch.Tensor, dim: int) -> nn.Parameter:
        start, stop = self._bounds(full.shape[dim], self.rank)
        return nn.Parameter(full.detach().narrow(dim, start, stop - start).clone())  # BUG


def _floored(size: int, tp_size: int, rank: int) -> tuple[int, int]:
    chunk = size // tp_size  # BUG: size // tp per rank, the remainder held by nobody
    return rank * chunk, (rank + 1) * chunk


class FlooredColumn(tp.ColumnParallelLinear):
    """``_bounds``: every rank holds ``size // tp`` features; the remainder is dropped."""

    def _bounds(self, size: int, rank: int) -> tuple[int, int]:
        return _floored(size, self.tp, rank)


class FlooredRow(tp.RowParallelLinear):
    """``_bounds``: every rank holds ``size // tp`` features; the remainder is dropped."""

    def _bounds(self, size: int, rank: int) -> tuple[int, int]:
        return _floored(size, self.tp, rank)


class UnreducedGradNorm(sp.SequenceParallelNorm):
    """``_share``: the norm's weights used as they are on this rank's tokens, their gradients
    never all-reduced over the group: each rank's holds its own tokens' part (Megatron's
    sequence-parallel norms left out of the all-reduce of their gradients)."""

    def _share(self, param: torch.Tensor) -> torch.Tensor:
        return param  # BUG: no copy_to_group, no all-reduce in backward


class _LocalVocabularyCrossEntropy(torch.overrides.TorchFunctionMode):
    """A home-made vocabulary-parallel cross-entropy: each rank's log-softmax over its own shard
    of the vocabulary, the target logit's term taken where it lives, the terms summed over the
    ranks -- the all-reduces of the maximum and of the sum of exponentials left out."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        from torch.distributed.tensor import DTensor, Partial

        kwargs = kwargs or {}
        if func is not F.cross_entropy or not isinstance(args[0], DTensor):
            return func(*args, **kwargs)
        logits, target = args[0], args[1]
        mesh = logits.device_mesh
        local = logits.to_local()  # (tokens, this rank's vocabulary)
        start = math.ceil(logits.shape[-1] / mesh.size()) * mesh.get_local_rank()
        mine = (target >= start) & (target < start + local.shape[-1])
        logp = local.log_softmax(-1)  # BUG: normalised over this rank's vocabulary only
        index = (target - start).clamp(0, local.shape[-1] - 1)[:, None]
        terms = torch.where(mine, -logp.gather(-1, index).squeeze(-1), 0.0)
        return DTensor.from_local(terms.sum(), mesh, [Partial()]).full_tensor()


class VocabularyLookup:
    """A home-made vocabulary-parallel embedding (Megatron's ``VocabParallelEmbedding``) put in
    place of torch's lookup by :meth:`apply` after ``RowwiseParallel`` has sharded the rows:
    each rank looks up the ids of its own rows (ids shifted by its first row, the others clamped
    in range and their rows zeroed: :meth:`mask`), and hands on the result as a ``Partial``
    DTensor, which the style's output hook all-reduces (or reduce-scatters: :meth:`placement`).
    Unmutated, it computes what torch's does; each mutant overrides one method."""

    def apply(self, module: nn.Module) -> None:
        """``module.forward`` replaced by :meth:`lookup` (the style's hooks kept)."""
        module.forward = lambda ids: self.lookup(module, ids)

    def lookup(self, module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        ids = ids.to_local() if isinstance(ids, DTensor) else ids
        weight = module.weight
        assert isinstance(weight, DTensor)
        mesh, rows = weight.device_mesh, weight.to_local()
        start = math.ceil(weight.shape[0] / mesh.size()) * mesh.get_local_rank()
        local = ids - start
        outside = (local < 0) | (local >= rows.shape[0])
        found = self.mask(F.embedding(local.clamp(0, rows.shape[0] - 1), rows), outside)
        return DTensor.from_local(found, mesh, [self.placement()], run_check=False)

    def mask(self, found: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
        """The rows of ids another rank holds, zeroed."""
        return found.masked_fill(outside[..., None], 0.0)

    def placement(self) -> Placement:
        """What the lookups are: partial sums, all-reduced by the style's output hook."""
        from torch.distributed.tensor import Partial

        return Partial()


class UnmaskedLookup(VocabularyLookup):
    """``mask``: ids of other ranks' rows are clamped into this rank's range and looked up, but
    their rows are never zeroed: the all-reduce adds a wrong row per rank that holds none."""

    def mask(self, found: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
        return found  # BUG: out-of-shard ids' rows kept


class UnreducedLookup(VocabularyLookup):
    """``placement``: the lookups declared ``Replicate``, so the style's output hook never
    all-reduces them: each rank goes on with only its own rows' embeddings."""

    def placement(self) -> Placement:
        from torch.distributed.tensor import Replicate

        return Replicate()  # BUG: partial sums taken for the whole


def home_made_vocabulary(
    plan: tuple[tuple[str, str], ...], lookup: VocabularyLookup
) -> dict[str, ParallelStyle]:
    """torch's styles for ``plan`` (``torch_plan``), each vocabulary-parallel embedding's
    ``RowwiseParallel`` running ``lookup`` after it shards the rows."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    class HomeMade(RowwiseParallel):
        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            module = super()._apply(module, device_mesh)
            lookup.apply(module)
            return module

    styles = torch_plan(plan)
    for name, style in plan:
        if style in VOCABULARY_STYLES:
            new = HomeMade()
            vars(new).update(vars(styles[name]))  # its layouts and use_local_output
            styles[name] = new
    return styles


class _LocalVocabularyLogSoftmax(torch.overrides.TorchFunctionMode):
    """A home-made vocabulary-parallel log-softmax, inside torch's ``loss_parallel()``: each
    rank's log-probabilities normalised over its own shard of the vocabulary (the maximum and the
    sum of exponentials never all-reduced), handed on as the same ``Shard(-1)`` DTensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if func is not F.log_softmax or not isinstance(args[0], DTensor):
            return func(*args, **kwargs)
        logits = args[0]
        local = logits.to_local().log_softmax(-1)  # BUG: this rank's vocabulary only
        return DTensor.from_local(
            local, logits.device_mesh, logits.placements, shape=logits.shape, stride=logits.stride()
        )


# -- the targets -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RowBiasOnEveryRankTP(ParallelTPTarget):
    """K1: the row-parallel bias added on every rank before the all-reduce
    (``BiasOnEveryRankRow``)."""

    row_class = BiasOnEveryRankRow


@dataclasses.dataclass(frozen=True)
class RowBiasGradOverTpTP(ParallelTPTarget):
    """K2: ``bias / tp`` added on every rank: the bias gradient ``1 / tp`` of the truth
    (``BiasOverTpRow``)."""

    row_class = BiasOverTpRow


@dataclasses.dataclass(frozen=True)
class ColumnInputGradUnreducedTP(ParallelTPTarget):
    """K3: the column layer's input gradient never all-reduced (``InputGradUnreducedColumn``)."""

    column_class = InputGradUnreducedColumn


@dataclasses.dataclass(frozen=True)
class RowOutputUnreducedTP(ParallelTPTarget):
    """K4: the row layer's partial outputs never all-reduced (``OutputUnreducedRow``)."""

    row_class = OutputUnreducedRow


@dataclasses.dataclass(frozen=True)
class RowOutputAveragedTP(ParallelTPTarget):
    """K4: the row layer's partial outputs averaged instead of summed (``OutputAveragedRow``)."""

    row_class = OutputAveragedRow


@dataclasses.dataclass(frozen=True)
class GatherReversedTP(ParallelTPTarget):
    """K5: a column layer's gathered output in the wrong rank order (``GatherReversedColumn``)."""

    column_class = GatherReversedColumn


@dataclasses.dataclass(frozen=True)
class ShardsScatteredReversedTP(ParallelTPTarget):
    """K6: column shards scattered to the ranks in reverse order (``ScatteredReversedColumn``)."""

    column_class = ScatteredReversedColumn


@dataclasses.dataclass(frozen=True)
class ShardsFromOwnInitTP(ParallelTPTarget):
    """K6: each rank's column shard cut from its own initialisation, not scattered from rank 0
    (``OwnInitColumn``)."""

    column_class = OwnInitColumn


@dataclasses.dataclass(frozen=True)
class FlooredShardsTP(ParallelTPTarget):
    """K7: uneven shards of ``size // tp`` features, the remainder dropped (``FlooredColumn``,
    ``FlooredRow``: the same ``_bounds`` in both layers, so a column/row pair stays consistent
    and trains silently on fewer features)."""

    column_class = FlooredColumn
    row_class = FlooredRow


@dataclasses.dataclass(frozen=True)
class DataNotFollowingMeshTP(ParallelTPTarget):
    """K8 (``shard_batch``; ``supports_at`` states its loader's precondition): the batch
    split over the whole world, as if every rank were a data-parallel replica -- the ranks of one
    ``tp`` group train on different samples (a ``DistributedSampler(num_replicas=world_size,
    rank=global_rank)`` under tensor parallelism). Every sample is still weighed once in total;
    the replicas can stay bitwise identical (every rank-specific tensor reduced), and only the
    reference sees the numbers.

    In the checking process (no world: the hook is also called there to validate the plan) it
    follows the mesh, as the harness tells it; inside the ranks it reads the world's own rank.
    Its loader hands every rank the same number of samples per micro-batch (a per-device batch
    size, as a ``DataLoader`` over such a sampler does), so ``supports_at`` declines a batch
    that ``W x micro-batches`` does not divide: there the ranks of a group would run different
    numbers of forwards, and the world would hang before any number could be compared."""

    def supports_at(self, scenario: Scenario, world_size: int) -> str | None:
        for step in range(scenario.steps):
            size, micro = batch_size_of(scenario, step), micro_batches_of(scenario, step)
            if size % (world_size * micro):
                return (
                    f"step {step}: a per-device batch over the whole world needs B={size} to be "
                    f"a multiple of W={world_size} x {micro} micro-batch(es)"
                )
        return super().supports_at(scenario, world_size)

    def shard_batch(self, batch: GlobalBatch) -> BatchPlan:
        if dist.is_initialized():  # BUG: the world's rank and size, not the dp coordinate
            batch = dataclasses.replace(
                batch, rank=dist.get_rank(), world_size=dist.get_world_size()
            )
        return contiguous(batch)


@dataclasses.dataclass(frozen=True)
class NormCountsReplicasTP(ParallelTPTarget):
    """K9 (``clip_grad_norm``): every gradient's |g|^p all-reduced over the ``tp`` group, the
    replicated ones too, which every rank holds whole: each counted ``tp`` times, the norm too
    large, the clipping too strong."""

    def clip_grad_norm(
        self, model: nn.Module, optimizer: OptimizerLike, max_norm: float, norm_type: float
    ) -> object:
        state = self._state()
        grads = [p.grad for p in state["module"].parameters() if p.grad is not None]
        norms = torch.stack([torch.linalg.vector_norm(g.double(), norm_type) for g in grads])
        share = norms.max() if norm_type == math.inf else (norms**norm_type).sum()
        op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
        dist.all_reduce(share, op=op, group=state["tp_group"])  # BUG: replicas counted tp times
        norm = share if norm_type == math.inf else share ** (1.0 / norm_type)
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coefficient.to(g.dtype))
        return norm


@dataclasses.dataclass(frozen=True)
class NormNotReducedTP(ParallelTPTarget):
    """K9 (``clip_grad_norm``): ``torch.nn.utils.clip_grad_norm_`` over the local tensors, as
    if they were the model: each rank clips by the norm of its own shards, and the ranks scale
    their replicated gradients by different coefficients."""

    def clip_grad_norm(
        self, model: nn.Module, optimizer: OptimizerLike, max_norm: float, norm_type: float
    ) -> object:
        module = self._state()["module"]
        return torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm, norm_type)  # BUG


@dataclasses.dataclass(frozen=True)
class ReplicatedNotBroadcastTP(ParallelTPTarget):
    """K10 (``apply_plan``): the replicated parameters are never broadcast from rank 0
    (``broadcast_replicated`` left out), so every rank keeps its own initialisation of them and
    the replicas drift apart from step 0."""

    def apply_plan(self, module: nn.Module, group: dist.ProcessGroup) -> nn.Module:
        plan = tp.check_plan(module, self.plan)  # BUG: no broadcast_replicated(module, ...)
        tp.shard_linears(module, group, plan, column=self.column_class, row=self.row_class)
        return sp.apply_regions(module, group, plan, norm=self.norm_class)


@dataclasses.dataclass(frozen=True)
class LossScaledByTpTP(ParallelTPTarget):
    """K11 (``backward``): the loss divided by ``tp`` as if the ``tp`` ranks were data-parallel
    replicas whose gradients are summed: every gradient ``1 / tp`` of the truth."""

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        tp_size = dist.get_world_size(self._state()["tp_group"])
        (loss / tp_size).backward()  # BUG: the tp ranks see the same samples: nothing to average


@dataclasses.dataclass(frozen=True)
class ReplicatedGradsSummedTP(ParallelTPTarget):
    """K12 (``after_backward``): the replicated parameters' gradients all-reduced (summed) over
    the ``tp`` group, as sequence-parallel norm weights' must be -- but here every rank already
    holds the whole gradient: ``tp`` times the truth."""

    def after_backward(self, model: nn.Module, optimizer: OptimizerLike) -> None:
        super().after_backward(model, optimizer)
        state = self._state()
        sharded = {id(p) for p, _, _ in state["shards"]}
        for p in state["module"].parameters():
            if p.grad is not None and id(p) not in sharded:
                dist.all_reduce(p.grad, group=state["tp_group"])  # BUG: already whole


@dataclasses.dataclass(frozen=True)
class SequenceNormGradUnreducedTP(ParallelTPTarget):
    """K13: the sequence-parallel norms' weight gradients never all-reduced over the ``tp``
    group (``UnreducedGradNorm``): each rank's holds only its share of the sequence."""

    norm_class = UnreducedGradNorm


@dataclasses.dataclass(frozen=True)
class LocalVocabularyLossTP(TorchTPTarget):
    """K14 (``loss_context``): logits sharded over the vocabulary go through a home-made
    vocabulary-parallel cross-entropy (``_LocalVocabularyCrossEntropy``) instead of torch's
    ``loss_parallel()``, each rank's softmax normalised over its own shard of the vocabulary."""

    def loss_context(self) -> AbstractContextManager[object]:
        return _LocalVocabularyCrossEntropy()  # BUG: the softmax's sums never all-reduced


@dataclasses.dataclass(frozen=True)
class EmbeddingUnmaskedTP(TorchTPTarget):
    """K15 (``plan_styles``): a vocabulary-parallel embedding looked up by a home-made lookup
    that never zeroes the rows of ids another rank holds (``UnmaskedLookup``)."""

    def plan_styles(self) -> dict[str, ParallelStyle]:
        return home_made_vocabulary(self.plan, UnmaskedLookup())  # BUG: in the lookup


@dataclasses.dataclass(frozen=True)
class EmbeddingUnreducedTP(TorchTPTarget):
    """K15 (``plan_styles``): a vocabulary-parallel embedding whose partial lookups are never
    all-reduced (``UnreducedLookup``)."""

    def plan_styles(self) -> dict[str, ParallelStyle]:
        return home_made_vocabulary(self.plan, UnreducedLookup())  # BUG: in the lookup


@dataclasses.dataclass(frozen=True)
class TieLostTP(TorchTPTarget):
    """K16 (``retie``): the tied embedding and head never tied again after
    ``parallelize_module``, which distributes each module's parameters separately: the two uses
    train as two matrices, each with only its own gradient (HF transformers' models re-tie in
    ``tie_weights``)."""

    def retie(self, module: nn.Module, ties: list[list[tuple[str, str]]]) -> None:
        pass  # BUG: the tie parallelize_module broke stays broken


@dataclasses.dataclass(frozen=True)
class QKNormAloneTP(TorchTPTarget):
    """K18 (``plan_styles``): attention split over its heads with its q/k norms left out of the
    plan -- replicated, each rank normalising only the heads it holds, so the norms' weights
    get each rank's partial gradient, never summed over ``tp`` (bench/tp_qk_norm.py)."""

    def plan_styles(self) -> dict[str, ParallelStyle]:
        styles = super().plan_styles()
        return {n: s for n, s in styles.items() if not n.endswith(("q_norm", "k_norm"))}  # BUG


@dataclasses.dataclass(frozen=True)
class LocalVocabularyLogSoftmaxTP(TorchTPTarget):
    """K17 (``loss_context``): the policy gradient's log-probabilities of logits sharded over
    the vocabulary from a home-made log-softmax (``_LocalVocabularyLogSoftmax``) inside torch's
    ``loss_parallel()``, normalised over each rank's own shard of the vocabulary (the
    cross-entropy, computed by ``F.cross_entropy``, is untouched: only ``log_softmax`` users)."""

    def loss_context(self) -> AbstractContextManager[object]:
        stack = contextlib.ExitStack()
        stack.enter_context(super().loss_context())
        stack.enter_context(_LocalVocabularyLogSoftmax())  # BUG: normalised per shard
        return stack


@dataclasses.dataclass(frozen=True)
class LocalNormsSummedTP(TorchTPTarget):
    """K9 (``clip_grad_norm``) over DTensors: each gradient's local tensor (``to_local()``), its
    |g|^p summed and all-reduced over the ``tp`` group, as hand-written clipping does -- the
    ``Replicate`` gradients, whole on every rank, counted tp times: the norm too large, the
    clipping too strong (torch's ``clip_grad_norm_`` counts each placement once)."""

    def clip_grad_norm(
        self, model: nn.Module, optimizer: OptimizerLike, max_norm: float, norm_type: float
    ) -> object:
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in model.parameters() if p.grad is not None]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        norms = torch.stack([torch.linalg.vector_norm(g.double(), norm_type) for g in local])
        share = norms.max() if norm_type == math.inf else (norms**norm_type).sum()
        op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
        mesh = next(g.device_mesh for g in grads if isinstance(g, DTensor))
        dist.all_reduce(share, op=op, group=mesh.get_group())  # BUG: replicas counted tp times
        norm = share if norm_type == math.inf else share ** (1.0 / norm_type)
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in local:
            g.mul_(coefficient.to(g.dtype))
        return norm


#: The catalogue's rows of this family: ``(mutant class name, bug class, one line)``, in
#: catalogue order (``ddpcheck.mutation.catalogue`` builds each mutant from its class).
ENTRIES: list[tuple[str, str, str]] = [
    (
        "RowBiasOnEveryRankTP",
        "K1",
        "row-parallel bias added on every rank before the all-reduce: tp times the bias",
    ),
    (
        "RowBiasGradOverTpTP",
        "K2",
        "row-parallel bias / tp added before the all-reduce: its gradient 1/tp of the truth",
    ),
    ("ColumnInputGradUnreducedTP", "K3", "column layer's input gradient never all-reduced over tp"),
    ("RowOutputUnreducedTP", "K4", "row layer's partial outputs never all-reduced"),
    ("RowOutputAveragedTP", "K4", "row layer's partial outputs averaged over tp instead of summed"),
    (
        "GatherReversedTP",
        "K5",
        "column layer's gathered output chunks concatenated in reverse rank order",
    ),
    ("ShardsScatteredReversedTP", "K6", "rank 0 scatters the column shards in reverse rank order"),
    (
        "ShardsFromOwnInitTP",
        "K6",
        "each rank cuts its column shard from its own initialisation, not rank 0's",
    ),
    (
        "FlooredShardsTP",
        "K7",
        "uneven shards of size // tp features: the remainder is held by nobody",
    ),
    (
        "DataNotFollowingMeshTP",
        "K8",
        "the batch split over the whole world: the ranks of a tp group see other samples",
    ),
    (
        "NormCountsReplicasTP",
        "K9",
        "gradient norm all-reduced over tp with the replicated gradients: counted tp times",
    ),
    (
        "NormNotReducedTP",
        "K9",
        "clip_grad_norm_ over the local shards: each rank clips by its own norm",
    ),
    (
        "ReplicatedNotBroadcastTP",
        "K10",
        "replicated parameters never broadcast from rank 0: the replicas drift apart",
    ),
    (
        "LossScaledByTpTP",
        "K11",
        "the loss divided by tp as if the tp ranks were data-parallel replicas",
    ),
    (
        "ReplicatedGradsSummedTP",
        "K12",
        "replicated gradients all-reduced over tp as sequence-parallel norms' are: tp times",
    ),
    (
        "SequenceNormGradUnreducedTP",
        "K13",
        "sequence-parallel norm weights' gradients never all-reduced over tp",
    ),
]

#: The family's rows seeded into ``torch_tp`` (its control): ``(name, bug class, one line)``.
TORCH_ENTRIES: list[tuple[str, str, str]] = [
    (
        "LocalVocabularyLossTP",
        "K14",
        "vocabulary-parallel cross-entropy normalised over each rank's own vocabulary shard",
    ),
    (
        "EmbeddingUnmaskedTP",
        "K15",
        "vocabulary-parallel embedding: rows of ids other ranks hold never masked to zero",
    ),
    (
        "EmbeddingUnreducedTP",
        "K15",
        "vocabulary-parallel embedding: partial lookups never all-reduced over tp",
    ),
    (
        "TieLostTP",
        "K16",
        "tied embedding and head not re-tied after parallelize_module: two matrices",
    ),
    (
        "QKNormAloneTP",
        "K18",
        "q/k norms over head_dim left out of the plan: their weights' gradients never summed",
    ),
    (
        "LocalVocabularyLogSoftmaxTP",
        "K17",
        "policy gradient's vocabulary-parallel log-softmax normalised over the rank's own shard",
    ),
    (
        "LocalNormsSummedTP",
        "K9",
        "norm over DTensors from each rank's local tensors summed over tp: replicas tp times",
    ),
]
