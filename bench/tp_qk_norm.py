"""q/k norms under tensor parallelism, without ddpcheck: a norm over ``head_dim`` shared by the
attention heads (Qwen3's and OLMo-2's ``q_norm``/``k_norm``) sees only the heads its rank holds
once q and k are split column-wise, so its replicated weight's gradient is each rank's partial
sum -- silently wrong (the loss is right) unless the plan reduces it over ``tp``.

W=2, gloo, float64: an attention block of 2 heads of width 3 (q, k, v ``ColwiseParallel``, the
output projection ``RowwiseParallel``), its q and k each normalised by an ``nn.RMSNorm(3)``,
one backward of a squared loss against a one-process copy's, under two plans for the norms:

* left alone (plain parameters, each rank normalising its own heads): the norms' weight
  gradients differ from the one-process ones and between the ranks;
* ``SequenceParallel(sequence_dim=1, use_local_output=True)``: the ``(batch, heads, length,
  head_dim)`` input taken as sharded over its heads, the weight ``Replicate``, so its gradient
  is all-reduced over ``tp`` as a sequence-parallel norm's is: it matches.

Exit 1 when the first plan is wrong and the second right (the class shows, and the style that
avoids it works on this torch), 0 when the first is right too, 2 otherwise. The ground for
drawing q/k norms in ddpcheck's tensor-parallel models (not drawn yet: docs/tensor-parallel.md).

    python bench/tp_qk_norm.py
"""

from __future__ import annotations

import math
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, path: str, heads_style: bool) -> None:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))

    class Attention(nn.Module):
        def __init__(self, width: int = 4, heads: int = 2, head_dim: int = 3) -> None:
            super().__init__()
            self.head_dim = head_dim
            self.q, self.k, self.v = (nn.Linear(width, heads * head_dim) for _ in range(3))
            self.out = nn.Linear(heads * head_dim, width)
            self.q_norm, self.k_norm = nn.RMSNorm(head_dim), nn.RMSNorm(head_dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, length, _ = x.shape

            def split(t: torch.Tensor) -> torch.Tensor:  # this rank's heads
                return t.view(b, length, t.shape[-1] // self.head_dim, self.head_dim)

            q = self.q_norm(split(self.q(x)).transpose(1, 2))
            k = self.k_norm(split(self.k(x)).transpose(1, 2))
            v = split(self.v(x)).transpose(1, 2)
            weights = (q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)).softmax(-1)
            return self.out((weights @ v).transpose(1, 2).reshape(b, length, -1))

    torch.manual_seed(0)
    reference = Attention().double()
    with torch.no_grad():  # norm weights away from 1, so their gradients are not all alike
        for norm in (reference.q_norm, reference.k_norm):
            norm.weight.uniform_(0.5, 1.5)
    model = Attention().double()
    model.load_state_dict(reference.state_dict())
    plan = {
        "q": ColwiseParallel(),
        "k": ColwiseParallel(),
        "v": ColwiseParallel(),
        "out": RowwiseParallel(),
    }
    if heads_style:
        for name in ("q_norm", "k_norm"):
            plan[name] = SequenceParallel(sequence_dim=1, use_local_output=True)
    parallelize_module(model, mesh, plan)
    x = torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for m in (model, reference):
        (m(x) ** 2).sum().backward()
    error = 0.0
    for name in ("q_norm", "k_norm"):
        grad = getattr(model, name).weight.grad
        grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
        error = max(error, (grad - getattr(reference, name).weight.grad).abs().max().item())
    if rank == 0:
        style = "SequenceParallel over the heads" if heads_style else "left alone"
        print(f"  q/k norms {style}: largest norm-weight gradient error {error:.2e}")
    dist.destroy_process_group()
    if error > 1e-12:
        sys.exit(3)


def trains_right(heads_style: bool) -> bool:
    folder = tempfile.mkdtemp(prefix="tp-qk-norm-")
    try:
        mp.spawn(_rank, (os.path.join(folder, "store"), heads_style), nprocs=2)
        return True
    except (mp.ProcessExitedException, mp.ProcessRaisedException):
        return False


def main() -> int:
    print(f"torch {torch.__version__}")
    print("attention split over its heads (tp=2), q and k normalised over head_dim:")
    alone = trains_right(heads_style=False)
    sharded = trains_right(heads_style=True)
    if sharded and not alone:
        print("norms left alone train wrong; SequenceParallel over the heads trains right (exit 1)")
        return 1
    if alone and sharded:
        print("both plans match the one-process gradients (exit 0)")
        return 0
    print("inconclusive (exit 2)")
    return 2


if __name__ == "__main__":
    sys.exit(main())
