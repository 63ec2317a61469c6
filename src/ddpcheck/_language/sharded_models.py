"""Random models that tensor-parallel plans apply to, and the plans valid for each.

A :class:`ShardedSpec` is a transformer-shaped stack on sequences: an input projection, blocks --
``"mlp"`` (a column/row pair of linears around a GELU), ``"attention"`` (q, k, v and an output
projection; heads split by ``view`` from the *local* width, as tensor-parallel code must), or
``"norm"`` / ``"rmsnorm"`` (a LayerNorm or an RMSNorm) -- the MLP and attention with a residual
connection -- and a linear head: regression outputs, or with ``tokens=True`` the logits of a
:data:`VOCABULARY`-token vocabulary trained by token cross-entropy (:func:`sequence_tokens`).
Widths, hidden sizes and head counts are drawn, **including ones the tensor-parallel degree does not
divide** (first-class, as an uneven batch is for data parallelism): torch shards them as
``torch.chunk`` does, and a plan must still train the one-process model.

:func:`plan_choices` says, per module group, which styles keep the model computing the same
function under tensor parallelism (valid by construction): a column-wise layer whose output stays
sharded must be consumed by its row-wise partner; attention may be split only along whole heads;
a lone linear may be column-wise with its output all-gathered or row-wise on a replicated input.

**Sequence parallelism** (torch's ``SequenceParallel``, Megatron's "sequence parallel"): a norm
runs on its ``tp`` rank's share of the sequence (dim 1), its weights replicated -- their gradients
are then partial sums over each rank's tokens, which must be all-reduced over the group. A
*region* is a run of consecutive norm blocks under ``"sequence"``; the activations entering it
are cut along the sequence -- the replicated stream sliced by the norm block's
``PrepareModuleInput`` (``"sequence-in"``), or the input projection's partial outputs
reduce-scattered (``"rowwise-sequence"``) when the region opens the model -- and leave it
all-gathered -- by the block's ``PrepareModuleOutput`` (``"sequence-out"``), or by the head
gathering its input (``"colwise-sequence"``) when the region closes the model. Every rank must
hold a token: the sequence (:data:`SEQUENCE`) over ``tp`` leaves none empty.

**Loss parallelism** (``loss_parallel()``): with ``tokens=True`` the head may be column-wise with
its logits left sharded over the vocabulary (``"colwise-loss"``, ``Shard(-1)`` DTensor logits),
the cross-entropy then computed under ``torch.distributed.tensor.parallel.loss_parallel()``
without gathering them (``"colwise-sequence-loss"``: the same, its input from a region).

**Vocabulary-parallel embeddings** (``embedding=True``): the input projection is an
``nn.Embedding`` of the :data:`VOCABULARY` (5: uneven over 2 and 3 ranks) on token ids
(:func:`sequence_ids`, :func:`id_tokens`), which a plan may shard over the vocabulary --
``RowwiseParallel(input_layouts=Replicate())`` (``"vocab"``: each rank looks up the ids of its
rows, the others masked to zero, the partial sums all-reduced), or with ``Shard(1)`` output
into a sequence-parallel region (``"vocab-sequence"``, torchtitan's ``tok_embeddings``). With
``tied=True`` the head's weight *is* the embedding's (a ``(VOCABULARY, width)`` matrix both
ways). A tied weight has one placement: ``parallelize_module`` distributes each module's
parameters separately, so the tie must be restored afterwards (the targets' ``retie``), and the
two uses must agree -- the embedding row-wise and the head column-wise both shard that matrix
along the vocabulary (``Shard(0)``), or neither is sharded; a row-wise head (``Shard(1)``)
beside a vocabulary-parallel embedding cannot be tied, and is not drawn.

**Grouped-query attention** (``ShardedBlock(kv_heads=...)``): fewer k and v heads than q heads,
each serving ``heads // kv_heads`` consecutive q heads (``repeat_interleave``, as Llama's
``repeat_kv``). Split along heads only where ``tp`` divides the kv heads (then the q heads
too): Megatron-core's rule (``num_query_groups_per_partition = divide(num_query_groups,
world_size)``). Replicating kv heads when ``tp`` exceeds them (vLLM's ``tp % kv_heads == 0``
layout) needs each rank to pick the kv heads of its q heads by its rank, which torch's
column-wise style on an unmodified model cannot express: such attention stays replicated (its
output projection may still be row-wise).

Invariant (as in ``zoo``): every model is a deterministic function of its weights and of each
sample separately, so W ranks and the reference compute the same objective.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from ddpcheck._base.errors import InvalidArgument
from ddpcheck._base.options import named_fields
from ddpcheck._language.objective import IGNORE_INDEX

__all__ = [
    "BLOCK_KINDS",
    "IN_FEATURES",
    "HEAD_NORM",
    "LOSS_STYLES",
    "NORM_KINDS",
    "OUT_FEATURES",
    "REGION_STYLES",
    "SEQUENCE",
    "SHARD0_HEADS",
    "SEQUENCE_STYLES",
    "VOCABULARY",
    "ShardedBlock",
    "ShardedModel",
    "ShardedSpec",
    "plan_choices",
    "VOCABULARY_STYLES",
    "every_rank_holds",
    "holders",
    "id_tokens",
    "sequence_data",
    "sequence_ids",
    "sequence_tokens",
]

IN_FEATURES, OUT_FEATURES, SEQUENCE = 5, 3, 3
#: The vocabulary of a model with ``tokens=True``: 5 is uneven over 2 and 3 ranks (3+2, 2+2+1).
VOCABULARY = 5
BLOCK_KINDS = ("mlp", "attention", "norm", "rmsnorm")
NORM_KINDS = ("norm", "rmsnorm")
#: The styles of a sequence-parallel region (:func:`plan_choices`), and the heads whose logits
#: stay sharded over the vocabulary for ``loss_parallel()``.
SEQUENCE_STYLES = frozenset(
    {
        "sequence",
        "sequence-in",
        "sequence-out",
        "sequence-in-out",
        "rowwise-sequence",
        "vocab-sequence",
        "colwise-sequence",
        "colwise-sequence-loss",
    }
)
LOSS_STYLES = frozenset({"colwise-loss", "colwise-sequence-loss"})
#: The style of a q/k norm in attention split over its heads: ``SequenceParallel`` over the
#: heads dimension of ``(batch, heads, length, head_dim)``, so that its replicated weight's
#: gradient is summed over ``tp`` (bench/tp_qk_norm.py: left alone, 0.58 off at tp=2)
HEAD_NORM = "heads-norm"
#: The styles a plan gives a region's norm or its block (no linear).
REGION_STYLES = frozenset({"sequence", "sequence-in", "sequence-out", "sequence-in-out"})
#: The styles of an embedding sharded over the vocabulary (its weight ``Shard(0)``).
VOCABULARY_STYLES = frozenset({"vocab", "vocab-sequence"})
#: The head's styles that shard its weight along the vocabulary (``Shard(0)``), as a
#: vocabulary-parallel embedding shards the same matrix: the only ones a tied head may take.
SHARD0_HEADS = frozenset(
    {"colwise-replicate", "colwise-loss", "colwise-sequence", "colwise-sequence-loss"}
)


def sequence_data(seed: int, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of sequences: x ``(B, 3, 5)``, y ``(B, 3, 3)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, SEQUENCE, IN_FEATURES, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(batch, SEQUENCE, OUT_FEATURES, generator=g, dtype=torch.float64).to(dtype)
    return x, y


def sequence_tokens(seed: int, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of sequences and their target tokens: x ``(B, 3, 5)``, y ``(B, 3)`` int64
    in ``[0, VOCABULARY)``, each sample 1 to 3 tokens long and padded on the right with
    ``IGNORE_INDEX`` (no loss term), as ``zoo.token_data`` pads (for ``tokens=True`` models)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, SEQUENCE, IN_FEATURES, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randint(0, VOCABULARY, (batch, SEQUENCE), generator=g)
    lengths = torch.randint(1, SEQUENCE + 1, (batch,), generator=g)
    y[torch.arange(SEQUENCE)[None, :] >= lengths[:, None]] = IGNORE_INDEX
    return x, y


def sequence_ids(seed: int, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of token ids and regression targets: x ``(B, 3)`` int64 in
    ``[0, VOCABULARY)``, y ``(B, 3, 3)`` (for ``embedding=True`` models)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCABULARY, (batch, SEQUENCE), generator=g)
    y = torch.randn(batch, SEQUENCE, OUT_FEATURES, generator=g, dtype=torch.float64).to(dtype)
    return x, y


def id_tokens(seed: int, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and padded target tokens, both ``(B, 3)`` int64 (as :func:`sequence_tokens`
    pads them; for ``embedding=True, tokens=True`` models)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCABULARY, (batch, SEQUENCE), generator=g)
    y = torch.randint(0, VOCABULARY, (batch, SEQUENCE), generator=g)
    lengths = torch.randint(1, SEQUENCE + 1, (batch,), generator=g)
    y[torch.arange(SEQUENCE)[None, :] >= lengths[:, None]] = IGNORE_INDEX
    return x, y


@named_fields
@dataclasses.dataclass(frozen=True)
class ShardedBlock:
    """One block: ``kind`` one of :data:`BLOCK_KINDS`; ``size``: an MLP's hidden width or the
    number of attention heads (unused by a norm); ``bias``: whether its linears have biases;
    ``kv_heads``: an attention block's k and v heads (grouped-query attention; None: ``size``),
    a divisor of ``size``; ``qk_norm``: its q and k normalised over ``head_dim`` (an RMSNorm
    each, shared by the heads: Qwen3's and OLMo-2's ``q_norm``/``k_norm``)."""

    kind: str = "mlp"
    size: int = 4
    bias: bool = True
    kv_heads: int | None = None
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if self.kind not in BLOCK_KINDS:
            raise InvalidArgument(f"ShardedBlock(kind={self.kind!r}) must be one of {BLOCK_KINDS}")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise InvalidArgument(f"ShardedBlock(size={self.size!r}) must be an integer >= 1")
        kv = self.kv_heads
        if kv is not None and (
            self.kind != "attention"
            or isinstance(kv, bool)
            or not isinstance(kv, int)
            or kv < 1
            or self.size % kv
        ):
            raise InvalidArgument(
                f"ShardedBlock(kv_heads={kv!r}) must be a divisor of an attention block's "
                f"size={self.size} (its q heads), or None"
            )
        if self.qk_norm is not False and (self.kind != "attention" or self.qk_norm is not True):
            raise InvalidArgument(
                f"ShardedBlock(qk_norm={self.qk_norm!r}) must be a bool, True only for an "
                "attention block"
            )


@named_fields
@dataclasses.dataclass(frozen=True)
class ShardedSpec:
    """A whole model (see the module docstring); ``head_dim``: each attention head's width;
    ``tokens``: the head returns :data:`VOCABULARY` logits (train it with
    ``loss="token_cross_entropy"`` on :func:`sequence_tokens`); ``embedding``: the input is
    token ids through an ``nn.Embedding`` (data :func:`sequence_ids` or :func:`id_tokens`);
    ``tied``: the head's weight is the embedding's (needs both)."""

    blocks: tuple[ShardedBlock, ...] = (ShardedBlock(),)
    width: int = 4
    head_dim: int = 2
    tokens: bool = False
    embedding: bool = False
    tied: bool = False

    def __post_init__(self) -> None:
        for name in ("width", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"ShardedSpec({name}={value!r}) must be an integer >= 1")
        if self.tied and not (self.embedding and self.tokens):
            raise InvalidArgument(
                "ShardedSpec(tied=True) ties the head to the embedding: it needs embedding=True "
                "and tokens=True"
            )

    def __call__(self) -> ShardedModel:
        return ShardedModel(self)


class _MLP(nn.Module):
    def __init__(self, width: int, hidden: int, bias: bool):
        super().__init__()
        self.up = nn.Linear(width, hidden, bias=bias)
        self.down = nn.Linear(hidden, width, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class _Attention(nn.Module):
    """Causal self-attention; the heads come from the local width (``width // head_dim``),
    so column-wise q, k, v hold whole heads on each rank when the plan splits along heads."""

    def __init__(
        self, width: int, heads: int, head_dim: int, bias: bool, kv_heads: int, qk_norm: bool
    ):
        super().__init__()
        self.head_dim = head_dim
        self.q = nn.Linear(width, heads * head_dim, bias=bias)
        self.k = nn.Linear(width, kv_heads * head_dim, bias=bias)
        self.v = nn.Linear(width, kv_heads * head_dim, bias=bias)
        self.out = nn.Linear(heads * head_dim, width, bias=bias)
        # over head_dim, shared by every head: split over its heads, a rank's norm sees only its
        # own, and the plan must sum the weight's gradient over tp (HEAD_NORM)
        self.q_norm = nn.RMSNorm(head_dim) if qk_norm else None
        self.k_norm = nn.RMSNorm(head_dim) if qk_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            local_heads = t.shape[-1] // self.head_dim  # this rank's share of the heads
            return t.view(b, length, local_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        if self.q_norm is not None and self.k_norm is not None:  # (batch, heads, length, dim)
            q, k = self.q_norm(q), self.k_norm(k)
        if k.shape[1] != q.shape[1]:  # grouped-query: a kv head per run of q heads (repeat_kv)
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = (weights @ v).transpose(1, 2).reshape(b, length, v.shape[1] * self.head_dim)
        return x + self.out(y)


class _Norm(nn.Module):
    """A norm alone in its block: what a plan puts under ``SequenceParallel`` (``.norm``), and
    the block around it where the sequence is cut and gathered (``PrepareModuleInput/Output``)."""

    def __init__(self, width: int, rms: bool):
        super().__init__()
        self.norm: nn.Module = nn.RMSNorm(width) if rms else nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class ShardedModel(nn.Module):
    """The module a :class:`ShardedSpec` describes: ``inp``, ``blocks.<i>``, ``head``."""

    def __init__(self, spec: ShardedSpec):
        super().__init__()
        w = spec.width
        self.inp: nn.Module = (
            nn.Embedding(VOCABULARY, w) if spec.embedding else nn.Linear(IN_FEATURES, w)
        )
        self.blocks = nn.ModuleList(_block(b, w, spec.head_dim) for b in spec.blocks)
        self.head = nn.Linear(w, VOCABULARY if spec.tokens else OUT_FEATURES)
        if spec.tied:
            self.head.weight = self.inp.weight  # one (VOCABULARY, width) matrix, used twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _block(block: ShardedBlock, width: int, head_dim: int) -> nn.Module:
    if block.kind == "mlp":
        return _MLP(width, block.size, block.bias)
    if block.kind == "attention":
        kv = block.kv_heads or block.size
        return _Attention(width, block.size, head_dim, block.bias, kv, block.qk_norm)
    return _Norm(width, rms=block.kind == "rmsnorm")


def holders(size: int, tp: int) -> int:
    """How many of ``tp`` ranks hold a piece of ``size`` features as torch shards them
    (``torch.chunk``: ``ceil(size / tp)`` each while they last -- 5 over 4 is 2, 2, 1, nothing;
    6 over 4 is 2, 2, 2, nothing)."""
    return 0 if size <= 0 else math.ceil(size / math.ceil(size / tp))


def every_rank_holds(size: int, tp: int) -> bool:
    """Whether sharding ``size`` features over ``tp`` ranks leaves no rank empty-handed."""
    return holders(size, tp) == tp


def _lone(
    name: str, outputs: int, inputs: int, tp: int, *styles: str
) -> list[tuple[tuple[str, str], ...]]:
    """A lone linear's fragments: left alone, column-wise with its output all-gathered, row-wise
    on its replicated input (``styles``: those allowed; default both) -- each only where every
    rank holds at least one feature (an empty shard is no plan anybody writes, and torch 2.13
    then fails in the optimizer's step)."""
    allowed = styles or ("colwise-replicate", "rowwise-replicate")
    found: list[tuple[tuple[str, str], ...]] = [()]
    if every_rank_holds(outputs, tp) and "colwise-replicate" in allowed:
        found.append(((name, "colwise-replicate"),))
    if every_rank_holds(inputs, tp) and "rowwise-replicate" in allowed:
        found.append(((name, "rowwise-replicate"),))
    return found


Fragment = tuple[tuple[str, str], ...]


def plan_choices(spec: ShardedSpec, tp: int, loss_head: bool = True) -> list[list[Fragment]]:
    """Per module group of ``spec``'s model, the plan fragments that keep it computing the same
    function over a ``tp``-way axis (the first of each: nothing sharded). A plan is one fragment
    of each group, concatenated. A run of norm blocks is one group with the input projection
    (when it opens the model) and the head (when it closes it): a sequence-parallel region's
    ends depend on its neighbours (:func:`_regions`). ``loss_head=False``: no head leaves its
    logits sharded for ``loss_parallel()`` (a loss it cannot compute)."""
    w = spec.width
    out = VOCABULARY if spec.tokens else OUT_FEATURES
    units: list[list[Fragment]] = [_lone("inp", w, IN_FEATURES, tp)]
    if spec.embedding:  # its vocabulary sharded, or nothing
        vocab = tp > 1 and every_rank_holds(VOCABULARY, tp)
        units = [[(), (("inp", "vocab"),)] if vocab else [()]]
    for i, block in enumerate(spec.blocks):
        at = f"blocks.{i}"
        if block.kind == "mlp":
            ups = _lone(f"{at}.up", block.size, w, tp, "colwise-replicate")
            downs = _lone(f"{at}.down", w, block.size, tp, "rowwise-replicate")
            fragments = [up + down for up in ups for down in downs]
            if every_rank_holds(block.size, tp):  # the pair keeps the hidden features sharded
                even = ("colwise",) if block.size % tp == 0 else ()  # uneven: as a DTensor
                fragments += [
                    ((f"{at}.up", up), (f"{at}.down", "rowwise"))
                    for up in (*even, "colwise-dtensor")
                ]
            units.append(fragments)
        elif block.kind == "attention":
            width = block.size * spec.head_dim
            fragments = _lone(f"{at}.out", w, width, tp, "rowwise-replicate")
            if (block.kv_heads or block.size) % tp == 0:  # whole kv and q heads on every rank
                norms = ((f"{at}.q_norm", HEAD_NORM), (f"{at}.k_norm", HEAD_NORM))
                fragments.append(
                    (
                        *((f"{at}.{n}", "colwise") for n in "qkv"),
                        *(norms if block.qk_norm else ()),
                        (f"{at}.out", "rowwise"),
                    )
                )
            units.append(fragments)
        else:  # a norm: replicated, or on this rank's tokens (a region's ends added below)
            sequence = tp > 1 and every_rank_holds(SEQUENCE, tp)
            units.append([(), ((f"{at}.norm", "sequence"),)] if sequence else [()])
    head = _lone("head", out, w, tp)
    if spec.tokens and loss_head and tp > 1 and every_rank_holds(out, tp):
        head.append((("head", "colwise-loss"),))  # logits sharded over the vocabulary
    units.append(head)
    return _tie(spec, _regions(spec, tp, units, loss_head))


def _tie(spec: ShardedSpec, groups: list[list[Fragment]]) -> list[list[Fragment]]:
    """``groups`` with, for a tied model, the embedding's and the head's joined into one (first)
    group, keeping only the combinations where the shared matrix gets one placement: both
    sharded along the vocabulary (:data:`VOCABULARY_STYLES`, :data:`SHARD0_HEADS`) or neither
    (see the module docstring)."""
    if not spec.tied:
        return groups
    first, last = groups[0], groups[-1]
    pairs = [first] if len(groups) == 1 else [first, last]
    joined = [tuple(p for f in choice for p in f) for choice in itertools.product(*pairs)]

    def one_placement(fragment: Fragment) -> bool:
        styles = dict(fragment)
        if styles.get("inp") in VOCABULARY_STYLES:
            return styles.get("head") in SHARD0_HEADS
        return "head" not in styles

    kept = sorted((f for f in joined if one_placement(f)), key=len)
    return [kept, *groups[1 : len(groups) - (len(pairs) - 1)]]


def _regions(
    spec: ShardedSpec, tp: int, units: list[list[Fragment]], loss_head: bool = True
) -> list[list[Fragment]]:
    """``units`` (the input projection, each block, the head) grouped: each run of norm blocks
    with its neighbours that can carry the sequence shards in and out, its fragments every valid
    combination of theirs with the region's ends filled in (:func:`_ends`), fewest modules
    first (what shrinking goes towards)."""
    kinds = [b.kind for b in spec.blocks]
    last = len(kinds)  # units: 0 the input projection, i + 1 block i, last + 1 the head
    groups: list[list[Fragment]] = []
    i = 0
    while i < last + 2:
        opens = i == 0 and last and kinds[0] in NORM_KINDS and len(units[1]) > 1
        if not opens and not (1 <= i <= last and kinds[i - 1] in NORM_KINDS and len(units[i]) > 1):
            groups.append(units[i])  # no region here
            i += 1
            continue
        j = i + 1 if i else 2  # past the run: [i, j) are its units
        while j <= last and kinds[j - 1] in NORM_KINDS:
            j += 1
        if j == last + 1:
            j += 1  # the head closes the model's last region
        members = [list(units[k]) for k in range(i, j)]
        if i == 0 and spec.embedding and every_rank_holds(VOCABULARY, tp):
            members[0].append((("inp", "vocab-sequence"),))  # torchtitan's tok_embeddings
        elif i == 0 and not spec.embedding and every_rank_holds(IN_FEATURES, tp):
            members[0].append((("inp", "rowwise-sequence"),))
        width = VOCABULARY if spec.tokens else OUT_FEATURES
        if j == last + 2 and every_rank_holds(width, tp):  # the head gathers the sequence
            members[-1].append((("head", "colwise-sequence"),))
            if spec.tokens and loss_head:
                members[-1].append((("head", "colwise-sequence-loss"),))
        combined = [
            fragment
            for choice in itertools.product(*members)
            if (fragment := _ends(choice, last - 1)) is not None
        ]
        groups.append(sorted(combined, key=len))
        i = j
    return groups


#: A norm block's end style by ``(its input is cut, its output is gathered)``.
_END_STYLES = {
    (True, True): "sequence-in-out",
    (True, False): "sequence-in",
    (False, True): "sequence-out",
}


def _ends(choice: tuple[Fragment, ...], last: int) -> Fragment | None:
    """One combination of a region group's fragments with the ends of its sequence-parallel
    norms filled in: a norm block whose input arrives replicated cuts it (``sequence-in``), one
    whose output goes on replicated gathers it (``sequence-out``); None when a reduce-scatter
    into the region or a gather out of it has no sequence-parallel norm beside it (the first
    block's, the ``last`` block's)."""
    pairs = [pair for fragment in choice for pair in fragment]
    styles = dict(pairs)
    norms = sorted(int(name.split(".")[1]) for name, style in pairs if style == "sequence")
    into = styles.get("inp") in ("rowwise-sequence", "vocab-sequence")
    head = styles.get("head", "").startswith("colwise-sequence")
    if (into and 0 not in norms) or (head and last not in norms):
        return None
    ends: list[tuple[str, str]] = []
    for i in norms:
        cut = not (i - 1 in norms or (i == 0 and into))
        gathered = not (i + 1 in norms or (head and i == last))
        style = _END_STYLES.get((cut, gathered))
        if style is not None:  # (a norm between two of the region's norms has no end)
            ends.append((f"blocks.{i}", style))
    return tuple(pairs) + tuple(ends)
