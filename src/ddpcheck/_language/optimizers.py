"""The optimizers random scenarios draw, data-parallel and tensor-parallel alike."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

__all__ = ["optimizers"]


def optimizers() -> st.SearchStrategy[tuple[type, dict]]:
    """``(optimizer_cls, kwargs)``: SGD (plain, momentum, nesterov, weight decay), Adam, AdamW.
    Shrinks towards plain SGD (the optimizer that shows constant-scale bugs)."""
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
