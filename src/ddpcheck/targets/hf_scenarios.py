"""Tensor-parallel scenarios of tiny transformers causal LMs (:class:`HfCausalLM`), for the
targets that shard a model by its architecture -- DeepSpeed's AutoTP reads a transformers model's
own plan or parses its layers -- rather than by a plan ddpcheck draws: the plan stays empty and
the scenario says only the mesh (``TensorParallel(plan=(), tp=...)``).

Drawn as ddpcheck's tensor-parallel scenarios are (``ddpcheck._language.plans``) and shrinking
the same way -- towards the smallest degree, one layer, SGD, one step, float64 -- over one of
the architectures asked for. Every shape gives each ``tp`` rank a share of every layer AutoTP
splits: key/value heads a multiple of ``tp`` (query heads 1 or 2 per key/value head), an MLP at
least ``tp`` wide (and often not a multiple of it: uneven shards); head widths even (rotary
embeddings rotate pairs of features); every micro-batch of every ``dp`` group a sample or more
(a transformers model runs no forward on an empty batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ddpcheck._language.plans import clip_norm, divisors, optimizer_for, token_losses
from ddpcheck._language.scenario import Scenario
from ddpcheck._language.tensor_parallel import TensorParallel
from ddpcheck._language.zoo import token_data
from ddpcheck.targets.hf_models import ARCHITECTURES, HfCausalLM

if TYPE_CHECKING:  # hypothesis loads only when examples are drawn: never in a rank
    from hypothesis import strategies as st

__all__ = ["causal_lm_scenarios"]


def causal_lm_scenarios(
    *,
    world_size: int,
    dtypes: Sequence[str] = ("float64", "float32"),
    without: frozenset[str] = frozenset(),
    degrees: Sequence[int] | None = None,
    architectures: Sequence[str] = tuple(ARCHITECTURES),
    max_batch: int = 8,
    max_steps: int = 3,
    max_accumulation: int = 2,
) -> st.SearchStrategy[Scenario]:
    """Scenarios at ``world_size`` training an :class:`HfCausalLM` of one of ``architectures``
    on ``zoo.token_data`` with a token loss, over a ``(dp, tp)`` mesh whose ``tp`` is one of
    ``degrees`` (default: the divisors of the world), none of the features ``without``."""
    from hypothesis import strategies as st

    tps = tuple(degrees) if degrees else divisors(world_size)
    kept = tuple(dtypes)

    @st.composite
    def drawn(draw: st.DrawFn) -> Scenario:
        tp = draw(st.sampled_from(tps))
        kv_heads = tp * draw(st.integers(1, 2))
        model = HfCausalLM(
            architecture=draw(st.sampled_from(tuple(architectures))),
            layers=draw(st.integers(1, 2)),
            heads=kv_heads * draw(st.integers(1, 2)),
            kv_heads=kv_heads,
            head_dim=draw(st.sampled_from((2, 4))),
            intermediate=draw(st.integers(tp, tp + 5)),
            tied="tied" not in without and draw(st.booleans()),
        )
        dtype = draw(st.sampled_from(kept))
        optimizer, kwargs = optimizer_for(draw, dtype)
        # every micro-batch holds a sample: a transformers model runs no forward on none
        accumulation = 1 if "accumulation" in without else draw(st.integers(1, max_accumulation))
        least = world_size // tp * accumulation
        if "uneven-batches" in without:
            batch = least * draw(st.integers(1, max(1, max_batch // least)))
        else:
            batch = draw(st.integers(least, max(least, max_batch)))
        return Scenario(
            model=model,
            data=token_data,
            loss=draw(token_losses()),
            optimizer=optimizer,
            optimizer_kwargs=kwargs,
            lr_decay=None if "lr-schedule" in without else draw(st.sampled_from((None, 0.5))),
            global_batch=batch,
            steps=draw(st.integers(1, min(max_steps, 2) if dtype == "float32" else max_steps)),
            accumulation=accumulation,
            dtype=dtype,
            seed=draw(st.integers(0, 2**16)),
            rank_seeds="broadcast" not in without,
            max_grad_norm=clip_norm(draw, without),
            tensor_parallel=TensorParallel((), None if tp == world_size else tp),
        )

    return drawn()
