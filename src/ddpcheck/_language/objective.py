"""The scenario's objective: what one micro-batch back-propagates, in one place.

Every party computes the objective through this module -- the ranks and the single-process
reference (``ddpcheck._language.training``), the oracle's validity probe
(``ddpcheck._oracle.judgeable``), the feature inspection (``ddpcheck.features``) and
the batch plans (``ddpcheck.batches``, which weigh its *terms*) -- so none of them can train a
different loss than the others.

``Scenario.loss`` names the terms of the objective:

* ``"squared_error"`` (the default): one term per sample, its squared error summed over the
  outputs (the model returns a tensor shaped like the targets);
* ``"token_cross_entropy"``: one term per non-padding target token (:data:`IGNORE_INDEX` marks
  padding), its cross-entropy against the model's logits ``(B, L, V)`` for targets ``(B, L)``;
* the other language-model losses of :data:`TOKEN_LOSSES`, each also one term per non-padding
  token, so batch plans and their normalisation apply unchanged: ``"label_smoothing"``,
  ``"token_kl"`` (cross-entropy plus a KL term to a fixed reference distribution),
  ``"entropy_bonus"`` and ``"policy_gradient"``. Their constants, reference distribution and
  advantages are deterministic functions of the vocabulary, the target token and its position:
  the same on every party, nothing to pickle.

Invariant: the full-batch objective is the mean of the global batch's T terms
(``reduction="mean"``: their sum divided by T -- B for squared error, the number of non-padding
tokens for tokens) or their sum. A micro-batch back-propagates :func:`micro_batch_loss`, the *sum*
of its terms, times the scale its batch plan gives it: normalisation lives in the plan
(``ddpcheck.batches``), where real training loops get it wrong, and the oracle checks it per term.

The precision policy, the same on every party: ``Scenario.autocast`` runs the forward under
``torch.autocast`` as the user's loop would (every target runs it); ``Scenario.param_dtype``
keeps float32 master weights and runs forward and backward on copies cast to ``param_dtype``,
with gradients accumulated and reduced in float32 -- a target implements it (FSDP2's
``MixedPrecisionPolicy``), and the reference emulates it here (``emulate=True``): every module
holding parameters of its own sees them, and its floating-point inputs, cast, as FSDP2 casts them
per sharded module. The loss itself is computed in at least float32, outside autocast.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.func import functional_call

__all__ = [
    "IGNORE_INDEX",
    "LOSSES",
    "LOSS_PARALLEL",
    "LOW_PRECISION",
    "TOKEN_LOSSES",
    "advantages",
    "check_output",
    "count",
    "forward",
    "is_token_loss",
    "micro_batch_loss",
    "per_sample_loss",
    "reference_log_probs",
    "sample_terms",
    "summed",
    "terms",
    "tokens",
]

#: The scenario losses, with what each term is.
LOSSES: dict[str, str] = {
    "squared_error": "one term per sample: its squared error summed over the outputs",
    "token_cross_entropy": "one term per non-padding target token: its cross-entropy",
    "label_smoothing": "per token: its cross-entropy with label smoothing 0.1",
    "token_kl": "per token: its cross-entropy + 0.1 x KL(p || a fixed reference distribution)",
    "entropy_bonus": "per token: its cross-entropy - 0.1 x the entropy of its predicted p",
    "policy_gradient": "per token: a fixed advantage of (token, position) x -log p(token)",
}
#: The losses whose terms are tokens (every one but ``squared_error``), token cross-entropy first:
#: what random language-model scenarios draw, shrinking towards it.
TOKEN_LOSSES = tuple(name for name in LOSSES if name != "squared_error")
#: The token losses torch's ``loss_parallel()`` computes right on logits sharded over the
#: vocabulary (``Shard(-1)``): those whose log-probabilities only ``nll_loss`` consumes. Its
#: docstring: "label_smoothing: Currently not supported"; and its ``log_softmax`` backward is the
#: identity, fused into ``nll_loss``'s, so an entropy or KL term of the same log-probabilities
#: gets a silently wrong gradient (``bench/loss_parallel_entropy.py`` exits 1 where it shows).
LOSS_PARALLEL = ("token_cross_entropy", "policy_gradient")
#: The constants of the losses: label smoothing, the KL term's and the entropy bonus's weights.
LABEL_SMOOTHING, KL_WEIGHT, ENTROPY_WEIGHT = 0.1, 0.1, 0.1
#: The target token that marks padding: no term of the objective (``torch``'s default).
IGNORE_INDEX = -100
#: The dtypes of the precision policies (``Scenario.autocast``, ``Scenario.param_dtype``).
LOW_PRECISION = (torch.bfloat16, torch.float16)


def is_token_loss(scenario: object) -> bool:
    return getattr(scenario, "loss", "squared_error") in TOKEN_LOSSES


# ---------------------------------------------------------------------------------------------
# The terms of the objective


def terms(scenario: object, y: torch.Tensor) -> torch.Tensor | None:
    """Each sample's number of terms, ``(B,)`` int64 -- its non-padding target tokens -- or
    None for a per-sample loss (one term each)."""
    if not is_token_loss(scenario):
        return None
    return (y != IGNORE_INDEX).flatten(1).sum(dim=1)


def tokens(scenario: object, y: torch.Tensor) -> tuple[int, ...] | None:
    """:func:`terms` as plain integers (what ``ddpcheck.batches.GlobalBatch.tokens`` holds)."""
    found = terms(scenario, y)
    return None if found is None else tuple(found.tolist())


def count(scenario: object, y: torch.Tensor) -> int:
    """T, the number of terms of the batch ``y``: the mean objective divides their sum by it."""
    found = terms(scenario, y)
    return y.shape[0] if found is None else int(found.sum())


def per_sample_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Squared error per sample, ``(b,)``, accumulated in the output's dtype."""
    return ((out - y) ** 2).flatten(1).sum(dim=1)


def summed(scenario: object, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The sum of the terms of the samples ``(out, y)``: a scalar (0 for no sample)."""
    if not is_token_loss(scenario):
        return per_sample_loss(out, y).sum()
    name = getattr(scenario, "loss", "token_cross_entropy")
    wide = torch.promote_types(out.dtype, torch.float32)  # bf16 logits: the loss in float32
    if name != "token_cross_entropy":
        return token_terms(name, out.to(wide), y).sum()
    loss = F.cross_entropy(
        out.reshape(-1, out.shape[-1]).to(wide),
        y.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    # logits sharded over the vocabulary under loss_parallel(): a replicated DTensor, handed on
    # as its local value (the same on every rank), through which the gradient still flows
    local = getattr(loss, "to_local", None)
    return loss if local is None else local()


def sample_terms(scenario: object, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each sample's summed terms and its number of terms, ``(B, 2)`` in the loss's dtype: what an
    evaluation loop computes per sample and gathers, so that the mean of the terms over a whole
    evaluation set -- the first column summed over the second -- counts each sample once."""
    if not is_token_loss(scenario):
        losses = per_sample_loss(out, y)
        return torch.stack([losses, torch.ones_like(losses)], dim=1)
    wide = torch.promote_types(out.dtype, torch.float32)
    name = getattr(scenario, "loss", "token_cross_entropy")
    each = token_terms(name, out.to(wide), y).reshape(y.shape[0], -1)
    counted = terms(scenario, y)
    assert counted is not None  # a token loss
    return torch.stack([each.sum(dim=1), counted.to(each.dtype)], dim=1)


def token_terms(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The term of every target token of the token loss ``name``, flattened ``(B * L,)``, 0 for
    padding: logits ``out`` ``(B, L, V)``, targets ``y`` ``(B, L)``. On logits sharded over the
    vocabulary (a ``DTensor`` under ``loss_parallel()``) only :data:`LOSS_PARALLEL`."""
    logits, flat = out.reshape(-1, out.shape[-1]), y.reshape(-1)
    if name not in LOSS_PARALLEL and hasattr(logits, "placements"):
        raise TypeError(
            f"loss={name!r} cannot be computed under loss_parallel() on logits sharded over the "
            "vocabulary (a DTensor): torch supports only the cross-entropy there"
        )
    if name == "label_smoothing":
        return F.cross_entropy(
            logits,
            flat,
            ignore_index=IGNORE_INDEX,
            reduction="none",
            label_smoothing=LABEL_SMOOTHING,
        )
    logp = F.log_softmax(logits, dim=-1)
    nll = F.nll_loss(logp, flat, ignore_index=IGNORE_INDEX, reduction="none")
    local = getattr(nll, "to_local", None)  # under loss_parallel(): Replicate, whole on each rank
    nll = nll if local is None else local()
    if name == "token_cross_entropy":
        return nll
    positions = torch.arange(y.shape[-1], device=y.device).expand_as(y).reshape(-1)
    if name == "policy_gradient":
        return advantages(flat, positions, nll.dtype) * nll
    real = (flat != IGNORE_INDEX).to(nll.dtype)
    p = logp.exp()
    if name == "entropy_bonus":
        return nll + ENTROPY_WEIGHT * real * (p * logp).sum(dim=-1)  # minus beta x entropy
    if name == "token_kl":
        reference = reference_log_probs(flat, positions, logits.shape[-1], logp.dtype)
        return nll + KL_WEIGHT * real * (p * (logp - reference)).sum(dim=-1)
    raise ValueError(f"loss={name!r} is not a token loss (one of {TOKEN_LOSSES})")


def reference_log_probs(
    tokens: torch.Tensor, positions: torch.Tensor, vocabulary: int, dtype: torch.dtype
) -> torch.Tensor:
    """The KL term's fixed reference distribution for each target token, as log-probabilities
    ``(N, vocabulary)``: a row of a table seeded by the vocabulary alone, picked by ``(token +
    position) % vocabulary`` (padding: any row, its term masked) -- every party computes it."""
    table = _reference_table(vocabulary).to(device=tokens.device, dtype=dtype)
    return table[(tokens.clamp(min=0) + positions) % vocabulary]


@functools.lru_cache(maxsize=8)
def _reference_table(vocabulary: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(48_005 + vocabulary)
    return torch.randn(vocabulary, vocabulary, generator=g, dtype=torch.float64).log_softmax(-1)


def advantages(tokens: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The policy gradient's advantage of each target token, a fixed function of the token and
    its position in ``[-0.5, 1.5]``: mostly positive, some negative (RL's centred advantages;
    all negative would push every probability towards 0 without bound)."""
    return 0.5 + torch.cos(1.3 * tokens.clamp(min=0).to(dtype) + 0.7 * positions.to(dtype))


def check_output(scenario: object, out: torch.Tensor, y: torch.Tensor) -> str | None:
    """Why the loss cannot take the model's output ``out`` for targets ``y`` (None: it can)."""
    if not is_token_loss(scenario):
        if out.shape != y.shape:
            return (
                f"the model's forward returned shape {tuple(out.shape)} for targets of shape "
                f"{tuple(y.shape)}; they must match (the loss is the squared error of each "
                "sample)"
            )
        return None
    if y.is_floating_point() or y.is_complex():
        return (
            f"loss={getattr(scenario, 'loss', '')!r} needs integer target tokens, but the "
            f"targets are {str(y.dtype).replace('torch.', '')}"
        )
    if out.dim() != y.dim() + 1 or out.shape[:-1] != y.shape:
        return (
            f"the model's forward returned shape {tuple(out.shape)} for target tokens of "
            f"shape {tuple(y.shape)}; loss={getattr(scenario, 'loss', '')!r} needs logits of shape "
            f"{tuple(y.shape)} + (vocabulary,)"
        )
    return None


# ---------------------------------------------------------------------------------------------
# The forward under the scenario's precision policy


def forward(
    scenario: object, model: torch.nn.Module, x: torch.Tensor, *, emulate: bool = False
) -> torch.Tensor:
    """``model(x)`` as the scenario computes it: under its ``autocast``; with ``emulate`` (the
    reference) also under its ``param_dtype`` policy, which a rank's target implements itself."""
    dtype = getattr(scenario, "autocast", None)
    context = (
        torch.autocast(x.device.type, dtype=dtype)
        if dtype is not None
        else contextlib.nullcontext()
    )
    with context:
        param_dtype = getattr(scenario, "param_dtype", None)
        if emulate and param_dtype is not None:
            return _cast_forward(model, x, param_dtype)
        return model(x)


def micro_batch_loss(
    scenario: object,
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    emulate: bool = False,
) -> torch.Tensor:
    """The summed terms of one micro-batch ``(x, y)`` (what its plan's scale multiplies)."""
    return summed(scenario, forward(scenario, model, x, emulate=emulate), y)


def _cast_forward(model: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``model(x)`` on copies of its parameters cast to ``dtype``, which the gradients go back
    through to the master weights (in their dtype); every module holding parameters of its own
    gets its floating-point inputs cast too (FSDP2's ``cast_forward_inputs``, per sharded
    module: ``ddpcheck.targets.fsdp.shard_leaves`` shards exactly those, and the root)."""
    owners = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    hooks = [
        m.register_forward_pre_hook(lambda _, args: _cast_inputs(args, dtype))
        for m in [model, *owners]
    ]
    try:
        cast = {name: p.to(dtype) for name, p in model.named_parameters()}
        return functional_call(model, cast, (x,))
    finally:
        for hook in hooks:
            hook.remove()


def _cast_inputs(args: tuple, dtype: torch.dtype) -> tuple:
    return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
