"""Who gets which samples: a target may own the split of the global batch (public API).

Real training code goes wrong where it shards and normalises the batch -- ``B // W`` dropping the
remainder, ``DistributedSampler`` padding by duplicating samples, ``drop_last`` dropping them, a
mean of per-rank means over uneven shards (docs/bug-catalogue.md, A3 and F1-F3). So the split is
a target hook, ``Target.shard_batch(batch)``: given the step's :class:`GlobalBatch` (the sample
indices ``0..B-1``, the step, this rank, W, the scenario's accumulation and reduction) it returns
this rank's :class:`BatchPlan` -- its micro-batches as lists of sample indices, and the scale of
each micro-batch's summed loss terms (per-sample losses; under ``loss="token_cross_entropy"`` the
cross-entropies of its non-padding tokens, whose counts per sample :attr:`GlobalBatch.tokens`
gives). The runner indexes the global batch with it, so the user's sampler and normalisation are
what run. :class:`TokenMean` builds the plans real loops use (a per-micro-batch, per-rank or
global mean), so a user can check the one theirs computes.

Invariant: the default, :func:`contiguous`, is the batch rule of ``ddpcheck.scenario`` -- W
contiguous shards as ``torch.tensor_split`` cuts them, each cut into ``accumulation`` micro-batches
the same way, every scale ``W / T`` (T the global batch's terms: B samples, or its non-padding
tokens; ``W`` for ``reduction="sum"``) -- bit for bit.

The oracle (``ddpcheck._oracle.sample_weights``) holds every plan to the full-batch
objective: summed over ranks and micro-batches, sample i's weight ``(1/W) * sum of the scales of the
micro-batches that hold it`` (data-parallel code averages gradients over W) -- the weight of each of
its terms -- must be ``1/T`` (``"mean"``) or ``1`` (``"sum"``). A plan that weighs a sample (or its
tokens) otherwise is the target's bug (``EquivalenceError``); a hook that raises, or returns
something that is not a valid plan (not a :class:`BatchPlan`, an index out of range, a non-finite
scale), is a setup error (``InvalidArgument``, exit 2), caught by :func:`check_plans` in the
checking process before any world runs -- which is why a hook must be a deterministic function of
its argument (read the rank from ``batch.rank``, not from ``torch.distributed``).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import SupportsFloat, SupportsIndex, cast

import torch
from torch.utils.data import Dataset, DistributedSampler

from ddpcheck._base.errors import InvalidArgument
from ddpcheck._base.options import named_fields
from ddpcheck._language.objective import is_token_loss, tokens
from ddpcheck._language.scenario import (
    Scenario,
    batch_size_of,
    data_rank,
    global_batch,
    micro_batches_of,
)

__all__ = [
    "BatchPlan",
    "DistributedSamplerBatches",
    "GlobalBatch",
    "TokenMean",
    "check_plans",
    "contiguous",
    "global_indices",
    "global_scale",
    "plan_for",
    "split",
    "strided",
]


@named_fields
@dataclasses.dataclass(frozen=True)
class GlobalBatch:
    """What a rank's ``shard_batch`` hook is told about one step's global batch."""

    indices: tuple[int, ...]  # the global batch's sample indices, 0..B-1
    step: int
    rank: int
    world_size: int
    #: the step's micro-batches: the scenario's accumulation, fewer in an epoch's short last step
    #: (a hook may use another number)
    accumulation: int
    reduction: str  # "mean" or "sum": the full-batch objective the plan must reproduce
    #: each sample's non-padding target tokens under ``loss="token_cross_entropy"``; None for a
    #: per-sample loss (every sample one term)
    tokens: tuple[int, ...] | None = None

    @property
    def size(self) -> int:
        return len(self.indices)

    @property
    def terms(self) -> tuple[int, ...]:
        """Each sample's terms of the objective: its tokens, or 1 for a per-sample loss."""
        return (1,) * self.size if self.tokens is None else self.tokens

    @property
    def total(self) -> int:
        """T, the terms of the whole global batch: ``"mean"`` divides their sum by it."""
        return self.size if self.tokens is None else sum(self.tokens)

    def terms_of(self, samples: Sequence[int]) -> int:
        """The terms the samples ``samples`` (indices) hold together."""
        return len(samples) if self.tokens is None else sum(self.tokens[i] for i in samples)


@named_fields
@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """One rank's share of a step: ``micro_batches[i]`` (sample indices; repeats count twice)
    back-propagates ``sum of their loss terms * scales[i]``. All but the last micro-batch
    run under ``no_sync``; a rank with no micro-batch runs no forward at all (as a loop whose
    loader ran dry). Lists, tuples and integer tensors are accepted and stored as tuples."""

    micro_batches: tuple[tuple[int, ...], ...]
    scales: tuple[float, ...]

    def __post_init__(self) -> None:
        try:
            micro = tuple(
                _micro_batch(mb, m)
                for m, mb in enumerate(_iterable(self.micro_batches, "micro_batches"))
            )
        except TypeError as exc:
            raise InvalidArgument(
                f"BatchPlan: micro_batches must be a sequence of sequences of "
                f"sample indices ({exc})"
            ) from None
        scales = tuple(_scale(s, m) for m, s in enumerate(_iterable(self.scales, "scales")))
        if len(scales) != len(micro):
            raise InvalidArgument(
                f"BatchPlan: {len(micro)} micro-batches but {len(scales)} "
                "scales; give one scale per micro-batch"
            )
        object.__setattr__(self, "micro_batches", micro)
        object.__setattr__(self, "scales", scales)

    @classmethod
    def uniform(cls, micro_batches: Iterable[tuple[int, ...]], scale: float) -> BatchPlan:
        """Every micro-batch scaled by the same ``scale``."""
        micro = tuple(micro_batches)
        return cls(micro, (scale,) * len(micro))


def _iterable(value: object, name: str) -> Iterable[object]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidArgument(f"BatchPlan: {name}={value!r} must be a sequence")
    return value


def _micro_batch(value: object, m: int) -> tuple[int, ...]:
    if type(value) is tuple and all(type(i) is int for i in value):
        return value  # already what a plan holds (the default plan's case: a rank's hot path)
    if not isinstance(value, Iterable):
        raise TypeError(f"'{type(value).__name__}' object is not iterable")
    return tuple(_index(i, m) for i in value)


def _index(value: object, micro_batch: int) -> int:
    if isinstance(value, bool):
        raise InvalidArgument(
            f"BatchPlan: micro-batch {micro_batch} holds {value!r}, not a sample index"
        )
    try:
        if not isinstance(value, SupportsIndex):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise InvalidArgument(
            f"BatchPlan: micro-batch {micro_batch} holds {value!r} "
            f"({type(value).__name__}), not an integer sample index"
        ) from None


def _scale(value: object, micro_batch: int) -> float:
    if type(value) is float and math.isfinite(value):
        return value
    try:
        number = (
            float(value)
            if isinstance(value, (SupportsFloat, SupportsIndex))
            and not isinstance(value, (bool, str, bytes))
            else None
        )
    except Exception:  # a tensor of several elements, an object float() refuses
        number = None
    if number is None or not math.isfinite(number):
        raise InvalidArgument(
            f"BatchPlan: the scale of micro-batch {micro_batch} is {value!r}; "
            "it must be a finite number (use 0.0 for an empty micro-batch)"
        )
    return number


def split(items: tuple, parts: int) -> list[tuple]:
    """``items`` cut into ``parts`` contiguous pieces as ``torch.tensor_split`` cuts them: the
    first ``len % parts`` pieces get one more, the last ones may be empty."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for part in range(parts):
        stop = start + size + (part < extra)
        out.append(items[start:stop])
        start = stop
    return out


def global_scale(batch: GlobalBatch) -> float:
    """The scale that weighs every term as the full-batch objective does once DDP averages over
    W: ``W / T`` (``"mean"``), ``W`` (``"sum"``)."""
    return batch.world_size / batch.total if batch.reduction == "mean" else batch.world_size


def contiguous(batch: GlobalBatch) -> BatchPlan:
    """The default plan, ``ddpcheck.scenario``'s batch rule (see the module's invariant)."""
    shard = split(batch.indices, batch.world_size)[batch.rank]
    return BatchPlan.uniform(split(shard, batch.accumulation), global_scale(batch))


def strided(batch: GlobalBatch) -> BatchPlan:
    """Every W-th sample from this rank's index on -- ``DistributedSampler(shuffle=False)``'s
    order without its padding -- each weighted as in the full batch (W/T, or W for "sum"): a
    correct plan whose shards are not contiguous (the soak's batch-owning target uses it)."""
    shard = batch.indices[batch.rank :: batch.world_size]
    return BatchPlan.uniform(split(shard, batch.accumulation), global_scale(batch))


@named_fields
@dataclasses.dataclass(frozen=True)
class TokenMean:
    """The plans real training loops compute: contiguous shards (the default split), and each
    micro-batch's summed loss divided by the terms -- tokens, or samples for a per-sample loss --
    ``over`` which the loop takes its mean:

    * ``"micro-batch"``: ``loss.mean() / accumulation`` on every micro-batch (a token mean per
      micro-batch, then averaged over micro-batches and, by DDP, over ranks): right only when
      every micro-batch holds as many tokens (huggingface/transformers #34191);
    * ``"rank"``: the summed loss over this rank's token count, averaged by DDP -- the average of
      per-rank token means, right only when every rank holds as many tokens
      (vllm-project/speculators #942);
    * ``"global"``: the summed loss over the global batch's token count T, times W (DDP divides
      by W): ``num_items_in_batch`` summed over ranks -- right whatever the split.

    ``reduction="sum"`` scales by ``W`` in every case (undoing DDP's average). Use it as a
    target's ``shard_batch`` to check a loop's normalisation: the oracle names every token it
    weighs otherwise than the full-batch objective.
    """

    over: str = "global"

    def __post_init__(self) -> None:
        if self.over not in ("micro-batch", "rank", "global"):
            raise InvalidArgument(f"over={self.over!r} must be 'micro-batch', 'rank' or 'global'")

    def __call__(self, batch: GlobalBatch) -> BatchPlan:
        shard = split(batch.indices, batch.world_size)[batch.rank]
        micro = split(shard, batch.accumulation)
        if batch.reduction == "sum" or self.over == "global":
            return BatchPlan.uniform(micro, global_scale(batch))
        if self.over == "rank":
            terms = batch.terms_of(shard)
            return BatchPlan.uniform(micro, 1.0 / terms if terms else 0.0)
        return BatchPlan(
            tuple(micro), tuple(_inverse(batch.terms_of(mb) * batch.accumulation) for mb in micro)
        )


def _inverse(count: int) -> float:
    return 1.0 / count if count else 0.0  # an empty micro-batch: nothing to normalise


@named_fields
@dataclasses.dataclass(frozen=True)
class DistributedSamplerBatches:
    """A hook that shards like a loop built on ``torch.utils.data.DistributedSampler``.

    A real ``DistributedSampler(num_replicas=W, rank=rank, shuffle, seed, drop_last)`` runs over
    the global batch's indices (``set_epoch(step)`` every step), and this rank's samples are cut
    into ``accumulation`` micro-batches as the default rule cuts them. With ``drop_last=False``
    the sampler pads an uneven batch by repeating samples (duplicated: counted twice); with
    ``drop_last=True`` it drops the tail -- the oracle names both.

    ``normalize``: ``"local"`` -- what most loops write, ``loss.mean() / accumulation`` on each
    micro-batch (right only when every micro-batch holds ``B / (W * accumulation)`` samples);
    ``"global"`` -- ``loss.sum() * W / B`` (right whenever every sample is used once).
    ``reduction="sum"`` scales by ``W`` either way (undoing the wrapper's average).
    """

    shuffle: bool = False
    seed: int = 0
    drop_last: bool = False
    normalize: str = "local"

    def __post_init__(self) -> None:
        if self.normalize not in ("local", "global"):
            raise InvalidArgument(f"normalize={self.normalize!r} must be 'local' or 'global'")

    def __call__(self, batch: GlobalBatch) -> BatchPlan:
        # a sampler needs only len() of what it samples, here the indices; torch's annotation
        # asks for a Dataset
        sampler: DistributedSampler[int] = DistributedSampler(
            cast("Dataset[int]", batch.indices),
            num_replicas=batch.world_size,
            rank=batch.rank,
            shuffle=self.shuffle,
            seed=self.seed,
            drop_last=self.drop_last,
        )
        sampler.set_epoch(batch.step)
        mine = tuple(batch.indices[i] for i in sampler)
        micro = split(mine, batch.accumulation)
        return BatchPlan(tuple(micro), tuple(self.scale(batch, batch.terms_of(mb)) for mb in micro))

    def scale(self, batch: GlobalBatch, samples: int) -> float:
        """The scale of a micro-batch of ``samples`` terms (samples, or tokens under a token
        loss)."""
        if batch.reduction == "sum":
            return float(batch.world_size)
        if self.normalize == "global":
            return global_scale(batch)
        return _inverse(samples * batch.accumulation)


def plan_for(
    hook: Callable[[GlobalBatch], object], batch: GlobalBatch, who: str = "Target.shard_batch"
) -> BatchPlan:
    """``hook(batch)``, checked: an :class:`InvalidArgument` naming the rank and the step when the
    hook raises or its answer is not a plan of this batch's samples."""

    def where() -> str:  # built on failure only: this runs every step of every rank
        return (
            f"{who} at step {batch.step} for rank {batch.rank} (W={batch.world_size}, "
            f"B={batch.size})"
        )

    try:
        plan = hook(batch)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where()}: {exc}") from exc
    except Exception as exc:
        raise InvalidArgument(
            f"{where()} raised {type(exc).__name__}: {exc}; the hook must "
            "return a ddpcheck.batches.BatchPlan for any global batch"
        ) from exc
    if not isinstance(plan, BatchPlan):
        raise InvalidArgument(
            f"{where()} returned {type(plan).__name__} {plan!r:.80}, not a "
            "ddpcheck.batches.BatchPlan(micro_batches, scales)"
        )
    for m, micro_batch in enumerate(plan.micro_batches):
        bad = [i for i in micro_batch if not 0 <= i < batch.size]
        if bad:
            raise InvalidArgument(
                f"{where()}: micro-batch {m} holds sample index {bad[0]}, "
                f"outside the global batch's 0..{batch.size - 1}"
            )
    return plan


def check_plans(
    hook: Callable[[GlobalBatch], object],
    scenario: Scenario,
    world_size: int,
    who: str = "Target.shard_batch",
) -> None:
    """Call the hook for every step and rank of ``scenario`` here, before any world runs, so a
    malformed answer is a setup error (see the module docstring), not a rank failure."""
    for step in range(scenario.steps):
        batch = global_indices(scenario, step, 0, world_size)
        for rank in range(world_size):
            at, _ = data_rank(scenario, rank, world_size)
            plan_for(hook, dataclasses.replace(batch, rank=at), who)


def global_indices(
    scenario: Scenario,
    step: int,
    rank: int,
    world_size: int,
    targets: torch.Tensor | None = None,
) -> GlobalBatch:
    """The :class:`GlobalBatch` a rank's hook receives at ``step`` of ``scenario``; ``targets``:
    the step's global targets when the caller has drawn them (a token loss counts their tokens;
    otherwise they are drawn here). Under tensor parallelism the hook is told the rank's ``dp``
    coordinate and ``dp`` (``ddpcheck._language.tensor_parallel``: the data follows the mesh)."""
    rank, world_size = data_rank(scenario, rank, world_size)
    counts = None
    if is_token_loss(scenario):
        if targets is None:
            targets = global_batch(scenario, step)[1]
        counts = tokens(scenario, targets)
    size = batch_size_of(scenario, step)  # an epoch's short last step: no draw to count it
    return GlobalBatch(
        tuple(range(size)),
        step,
        rank,
        world_size,
        micro_batches_of(scenario, step),
        scenario.reduction,
        counts,
    )
