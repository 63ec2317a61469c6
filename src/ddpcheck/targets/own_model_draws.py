"""Tensor-parallel scenarios of a target that trains models of its own kind -- torchtitan's
Llama 3, the transformers architectures DeepSpeed's AutoTP shards -- by their own plan: the
scenario's plan stays empty and says only the mesh (``TensorParallel(plan=(), tp=...)``), the
model is drawn per degree by the target (``models(tp)``), and everything else is drawn as
ddpcheck's tensor-parallel scenarios draw it (``ddpcheck._language.plans``), shrinking the same
way: towards the smallest degree, SGD, one step, float64 where it is asked for. Every
micro-batch of every ``dp`` group holds a sample or more (a transformers model runs no forward
on an empty batch; torchtitan's loader never hands one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ddpcheck._language.plans import clip_norm, divisors, optimizer_for, token_losses
from ddpcheck._language.scenario import Scenario
from ddpcheck._language.tensor_parallel import TensorParallel
from ddpcheck._language.zoo import token_data

if TYPE_CHECKING:  # hypothesis loads only when examples are drawn: never in a rank
    from hypothesis import strategies as st
    from torch import nn

__all__ = ["own_model_scenarios"]


def own_model_scenarios(
    *,
    world_size: int,
    dtypes: Sequence[str],
    without: frozenset[str],
    degrees: Sequence[int] | None,
    models: Callable[[int], st.SearchStrategy[Callable[[], nn.Module]]],
    losses: Callable[[int], st.SearchStrategy[str]] | None = None,
    max_batch: int = 8,
    max_steps: int = 3,
    max_accumulation: int = 2,
) -> st.SearchStrategy[Scenario]:
    """Scenarios at ``world_size`` training a model ``models(tp)`` draws on ``zoo.token_data``
    with a token loss (``losses(tp)``; default: every token loss), over a ``(dp, tp)`` mesh
    whose ``tp`` is one of ``degrees`` (default: the divisors of the world), none of the
    features ``without``, in one of ``dtypes``."""
    from hypothesis import strategies as st

    tps = tuple(degrees) if degrees else divisors(world_size)
    kept = tuple(dtypes)

    @st.composite
    def drawn(draw: st.DrawFn) -> Scenario:
        tp = draw(st.sampled_from(tps))
        model = draw(models(tp))
        dtype = draw(st.sampled_from(kept))
        optimizer, kwargs = optimizer_for(draw, dtype)
        accumulation = 1 if "accumulation" in without else draw(st.integers(1, max_accumulation))
        least = world_size // tp * accumulation
        if "uneven-batches" in without:
            batch = least * draw(st.integers(1, max(1, max_batch // least)))
        else:
            batch = draw(st.integers(least, max(least, max_batch)))
        return Scenario(
            model=model,
            data=token_data,
            loss=draw(token_losses() if losses is None else losses(tp)),
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
