"""What a loss curve shows of the quick start's seeded bug: gradients summed over ranks instead of
averaged. No ddpcheck involved: one process, plain torch.

    python bench/loss_curves.py [--world-size 2] [--steps 300]

Summing W ranks' mean gradients gives exactly W times the global mean gradient, so the bug is
emulated exactly by multiplying the correct gradient by W before the optimizer step. Two runs from
the same weights on the same data, correct and buggy, per optimizer; the script prints the largest
relative gap between their loss curves and the final losses. Under Adam (scale-invariant up to its
eps) the two curves coincide to a few parts in a million: the curve cannot show the bug, which
``ddpcheck`` reports at step 0 (README's quick start). Under SGD the bug is a W-times learning
rate, which a loss curve shows as faster (or unstable) training, not as a bug. Figures in
docs/comparison.md.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


def train(optimizer_cls: type, scale: float, steps: int, **kwargs: float) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    data = torch.randn(256, 16)
    target = torch.sin(data.sum(1, keepdim=True))
    optimizer = optimizer_cls(model.parameters(), **kwargs)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(data), target)
        loss.backward()
        for p in model.parameters():
            p.grad *= scale  # scale = W: summed over W ranks instead of averaged
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    for name, cls, kwargs in [
        ("Adam", torch.optim.Adam, {"lr": 1e-3}),
        ("AdamW", torch.optim.AdamW, {"lr": 1e-3}),
        ("SGD", torch.optim.SGD, {"lr": 0.05}),
    ]:
        right = train(cls, 1.0, args.steps, **kwargs)
        wrong = train(cls, float(args.world_size), args.steps, **kwargs)
        gap = max(abs(a - b) / a for a, b in zip(right, wrong))
        print(
            f"{name:5s}  averaged: final loss {right[-1]:.6f}   summed over W={args.world_size}: "
            f"final loss {wrong[-1]:.6f}   largest relative gap over {args.steps} steps "
            f"{gap:.1e}"
        )


if __name__ == "__main__":
    main()
