"""Per-rank registration orders (``Scenario.rank_orders``): same names, shapes and values, but
every rank lists its parameters and buffers in its own order.

Why: data-parallel code pairs tensors across ranks in collectives. Pairing by position in
``module.parameters()`` works only while every rank registers in the same order; torch DDP
documents that it must. A wrapper meant to pair by a rank-independent order (rank 0's, or names)
is only tested by ranks whose orders differ.

Invariant: :func:`permute_registration` changes nothing but dictionary order -- no tensor is
created, copied or re-initialised, every ``named_parameters()`` / ``named_buffers()`` name stays
the same (a shared tensor keeps the name of its first registration), and what ``forward``
computes is unchanged because only attribute-accessed children are reordered. (A model whose own
``forward`` iterates ``self.children()`` or ``self.parameters()`` would compute something else
per rank: leave ``rank_orders`` off for it. ddpcheck's models reach every child by name.)
"""

from __future__ import annotations

import random

from torch import nn

__all__ = ["ORDER_SEED_STRIDE", "permute_registration"]

#: Seed offset between ranks: every rank (rank 0 too) gets its own permutation.
ORDER_SEED_STRIDE = 104_729

#: Containers whose ``forward`` -- or their users' -- iterates children by registration order.
_ORDERED_CONTAINERS = (
    nn.Sequential,
    nn.ModuleList,
    nn.ModuleDict,
    nn.ParameterList,
    nn.ParameterDict,
)


def permute_registration(module: nn.Module, seed: int) -> None:
    """Shuffle, in place and deterministically from ``seed``, the registration order of every
    submodule's parameters and buffers, and of its children unless it is an ordered container.

    NOTE: ``_parameters``, ``_buffers`` and ``_modules`` are the dicts ``nn.Module`` registers
    into (and iterates in ``parameters()``, ``named_buffers()``, ``children()``); there is no
    public API to reorder a registration, so this reads and rebuilds those attributes -- here and
    nowhere else. A reordering that would rename a shared tensor (a tied weight is named after
    its first registration) is undone for that module.
    """
    rng = random.Random(seed)
    names = _names(module)
    for sub in list(module.modules()):
        kinds = ["_parameters", "_buffers"]
        if not isinstance(sub, _ORDERED_CONTAINERS):
            kinds.append("_modules")
        for kind in kinds:
            registered = getattr(sub, kind)  # reordered in place: the module keeps its dict
            if len(registered) < 2:
                continue
            before = dict(registered)
            keys = list(before)
            rng.shuffle(keys)
            _refill(registered, [(k, before[k]) for k in keys])
            if _names(module) != names:
                _refill(registered, list(before.items()))


def _refill(registered: dict, items: list) -> None:
    registered.clear()
    registered.update(items)


def _names(module: nn.Module) -> tuple[frozenset[str], frozenset[str]]:
    return (
        frozenset(n for n, _ in module.named_parameters()),
        frozenset(n for n, _ in module.named_buffers()),
    )
