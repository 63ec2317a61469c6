"""Sharded gradients, made whole: each gradient as the rank that owns it holds it.

Why: ZeRO-2 optimizers, fairscale's OSS/ShardedDDP and DeepSpeed stage 2 reduce each gradient to
its owner only (a reduce, or a reduce-scatter of a flat buffer); the other ranks keep their local
gradient, or none. Comparing every rank's ``.grad`` would blame them for that by design, and
comparing nothing would let a wrongly reduced gradient through. So a target that declares
``sharded_gradients`` names the pieces this rank owns (``Target.gradient_shards``), and every
rank records the gradient assembled from the owners' pieces: the replica and reference checks
then judge exactly what the owners hold.

Invariant: :func:`owned_gradients` is collective (two ``all_gather`` calls, issued by the
harness inside ``recorder.paused()``, so it is no part of the target's communication budget) and
returns, by parameter name, the owners' pieces put together -- the first rank's piece wins where
two overlap; None where no rank owns any of it or the owner holds no gradient (unused
everywhere). A parameter covered only in part is the target's declaration failing, raised here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ddpcheck._rank.pickled import all_gathered

#: One rank's piece of a gradient: (parameter name, offset in its flattened gradient, piece).
Piece = tuple[str, int, torch.Tensor | None]

__all__ = ["owned_gradients"]


def owned_gradients(
    module: nn.Module, pieces: Iterable[tuple[torch.Tensor, int, torch.Tensor | None]]
) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient as its owners hold it (see the module's invariant);
    ``pieces``: this rank's ``(parameter, offset, flat piece or None)`` triples."""
    names = {id(p): n for n, p in module.named_parameters()}
    mine: list[Piece] = []
    for param, offset, piece in pieces:
        name = names.get(id(param))
        if name is None:
            raise ValueError(
                "Target.gradient_shards returned a tensor that is not a parameter "
                "of the model (return (parameter, offset, piece) triples)"
            )
        mine.append(
            (name, int(offset), None if piece is None else piece.detach().reshape(-1).clone())
        )
    everyone = all_gathered(mine)
    held: dict[str, list] = {}
    for rank_pieces in everyone:
        for name, offset, piece in rank_pieces:
            held.setdefault(name, []).append((offset, piece))
    out: dict[str, torch.Tensor | None] = {}
    with torch.no_grad():
        for name, param in module.named_parameters():
            found = held.get(name, [])
            if not found or all(piece is None for _, piece in found):
                out[name] = None
                continue
            first = next(piece for _, piece in found if piece is not None)
            flat = torch.zeros(param.numel(), dtype=first.dtype, device=first.device)
            covered = torch.zeros(param.numel(), dtype=torch.bool)
            for offset, piece in found:
                if piece is None:
                    continue
                stop = offset + piece.numel()
                if offset < 0 or stop > param.numel():
                    raise ValueError(
                        f"Target.gradient_shards: the piece [{offset}:{stop}] of "
                        f"{name!r}'s gradient lies outside its {param.numel()} "
                        "elements"
                    )
                fresh = ~covered[offset:stop]
                flat[offset:stop][fresh] = piece[fresh.to(piece.device)]
                covered[offset:stop] = True
            if not bool(covered.all()):
                missing = int((~covered).sum())
                raise ValueError(
                    f"Target.gradient_shards: {missing} of the {param.numel()} "
                    f"elements of {name!r}'s gradient are owned by no rank"
                )
            out[name] = flat.reshape(param.shape)
    return out
