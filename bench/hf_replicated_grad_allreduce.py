"""transformers' ``replicated_with_grad_allreduce`` (the tensor-parallel style of Qwen3's
``q_norm``/``k_norm``) under gradient accumulation, without ddpcheck: exit 1 when the norm's
weight gradient after two accumulated backward passes is not the sum of both passes' gradients
over the ``tp`` ranks, while one pass alone is right; 0 when both are right; 2 otherwise.

The style all-reduces ``param.grad`` from a ``register_post_accumulate_grad_hook``, which fires
after every backward's accumulation into ``.grad`` -- so a second micro-batch's all-reduce sums
the first's already-reduced gradient again: ``tp * G1 + G2`` instead of ``G1 + G2``. Here: W=2,
gloo, float64, an ``nn.RMSNorm(2)`` given each rank's own heads (what a q/k norm sees once
attention is split over its heads), ``ReplicatedWithGradAllReduce().install_forward`` as
``apply_tensor_parallelism`` calls it, against the one-process sum over both ranks' heads.

    python bench/hf_replicated_grad_allreduce.py
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, path: str, passes: int) -> None:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.tensor_parallel import ReplicatedWithGradAllReduce

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    reference, norm = nn.RMSNorm(2).double(), nn.RMSNorm(2).double()
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
        norm.weight.copy_(reference.weight)
    ReplicatedWithGradAllReduce().install_forward(norm, mesh)
    generator = torch.Generator().manual_seed(1)
    # heads[p][r]: what rank r's norm sees in pass p (its own heads of a (batch, heads, dim) q)
    heads = torch.randn(passes, 2, 3, 2, 2, dtype=torch.float64, generator=generator)
    for p in range(passes):  # accumulated: no zero_grad between the passes
        (norm(heads[p, rank]) ** 3).sum().backward()
        for r in range(2):  # one process: every rank's heads
            (reference(heads[p, r]) ** 3).sum().backward()
    error = (norm.weight.grad - reference.weight.grad).abs().max().item()
    if rank == 0:
        print(f"  {passes} accumulated pass(es): weight-gradient error {error:.2e}")
    dist.destroy_process_group()
    if error > 1e-12:
        sys.exit(3)


def trains_right(passes: int) -> bool:
    folder = tempfile.mkdtemp(prefix="hf-grad-allreduce-")
    try:
        mp.spawn(_rank, (os.path.join(folder, "store"), passes), nprocs=2)
        return True
    except (mp.ProcessExitedException, mp.ProcessRaisedException):
        return False


def main() -> int:
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    print("replicated_with_grad_allreduce on a norm fed each rank's own heads (tp=2):")
    one = trains_right(passes=1)
    two = trains_right(passes=2)
    if one and not two:
        print("one pass right, accumulated passes wrong: the first counted tp times (exit 1)")
        return 1
    if one and two:
        print("right with and without accumulation (exit 0)")
        return 0
    print("inconclusive (exit 2)")
    return 2


if __name__ == "__main__":
    sys.exit(main())
