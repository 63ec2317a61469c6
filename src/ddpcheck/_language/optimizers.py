"""The optimizers random scenarios draw, data-parallel and tensor-parallel alike."""

from __future__ import annotations

import functools

import torch
from hypothesis import strategies as st

__all__ = ["optimizers"]


@functools.cache
def optimizers() -> st.SearchStrategy[tuple[type, dict]]:
    """``(optimizer_cls, kwargs)``: SGD (plain, momentum, nesterov, weight decay), Adam, AdamW.
    Shrinks towards plain SGD (the optimizer that shows constant-scale bugs).

    Built once: every scenario draws it, and a strategy built anew is validated anew by
    Hypothesis -- its two ``builds`` were a third of a scenario's draw (5.4 -> 3.6 ms each,
    2026-12-07); the same object draws the same choices, so the examples do not change."""
    sgd = st.builds(
        lambda momentum, nesterov, weight_decay: (
            torch.optim.SGD,
            {
                "lr": 0.1,
                **({"momentum": momentum} if momentum else {}),
                **({"nesterov": True} if nesterov and momentum else {}),
                **({"weight_decay": weight_decay} if weight_decay else {}),
            },
        ),
        st.sampled_from((0.0, 0.9)),
        st.booleans(),
        st.sampled_from((0.0, 0.01)),
    )
    adam = st.builds(
        lambda cls, wd: (cls, {"lr": 0.01, **({"weight_decay": wd} if wd else {})}),
        st.sampled_from((torch.optim.Adam, torch.optim.AdamW)),
        st.sampled_from((0.0, 0.1)),
    )
    return st.one_of(sgd, adam)
