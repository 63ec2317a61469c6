"""Standalone reproduction of torch's DDP bug pytorch#69031 (also #42793): under
``find_unused_parameters=True``, a parameter that one rank used inside ``no_sync()`` and that no
rank used in the synchronising micro-step is never all-reduced. No ddpcheck involved: plain
torch, two processes, gloo, CPU.

    python bench/ddp_no_sync_unused.py      # exit 1 on a torch carrying the bug, 0 otherwise

Two micro-batches per step (gradient accumulation), the first under ``no_sync()``. A two-layer
model whose second layer ``b`` only rank 0's first micro-batch uses. Every rank must end the
step with the same gradient for ``b``: the global batch's, averaged over the ranks (what DDP
promises). With the bug rank 0 keeps its local gradient and rank 1 has ``None``, so the replicas
drift apart from the first step. Fixed by PR #124193 (the unused-parameter map is carried across
``no_sync`` micro-steps); docs/torch-releases.md lists the releases measured.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORLD_SIZE = 2


class Net(nn.Module):
    """``a`` always used; ``b`` only where the micro-batch asks for it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)

    def forward(self, x, use_b):
        y = self.a(x)
        return self.b(y) if use_b else y


def micro_batches(rank):
    """(x, use_b) per micro-batch: only rank 0's first micro-batch uses ``b``."""
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(2, 3, generator=g), rank == 0), (torch.randn(2, 3, generator=g), False)]


def expected_b_grad():
    """``b``'s gradient as DDP promises it: the sum over ranks' micro-batches, averaged over
    the ranks (each rank's loss is its own micro-batches' sum)."""
    torch.manual_seed(0)
    model = Net()
    for rank in range(WORLD_SIZE):
        for x, use_b in micro_batches(rank):
            (model(x, use_b).sum() / WORLD_SIZE).backward()
    return model.b.weight.grad.clone()


def worker(rank, store_path, queue):
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, WORLD_SIZE), rank=rank, world_size=WORLD_SIZE
    )
    torch.manual_seed(0)
    ddp = DDP(Net(), find_unused_parameters=True)
    (first, use_first), (second, use_second) = micro_batches(rank)
    with ddp.no_sync():
        ddp(first, use_first).sum().backward()
    ddp(second, use_second).sum().backward()  # the synchronising micro-step
    grad = ddp.module.b.weight.grad
    queue.put((rank, None if grad is None else grad.tolist()))
    queue.close()
    queue.join_thread()  # the gradient is on its way before this process leaves
    dist.barrier()
    os._exit(0)  # skip gloo's teardown


def run():
    """Each rank's gradient of ``b.weight`` after one accumulated step (None: no gradient)."""
    with tempfile.TemporaryDirectory() as folder:
        context = mp.get_context("spawn")
        queue = context.Queue()
        procs = [
            context.Process(target=worker, args=(r, f"{folder}/store", queue))
            for r in range(WORLD_SIZE)
        ]
        for p in procs:
            p.start()
        grads = dict(queue.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    return [None if grads[r] is None else torch.tensor(grads[r]) for r in range(WORLD_SIZE)]


def main():
    expected = expected_b_grad()
    grads = run()
    print(f"torch {torch.__version__}; find_unused_parameters=True, W={WORLD_SIZE}, accumulation 2")
    wrong = False
    for rank, grad in enumerate(grads):
        if grad is None:
            print(f"rank {rank}: b.weight.grad is None (WRONG: never all-reduced)")
            wrong = True
            continue
        diff = (grad - expected).abs().max().item()
        right = diff < 1e-6
        wrong |= not right
        verdict = "right" if right else "WRONG"
        print(f"rank {rank}: max |b.weight.grad - expected| = {diff:.3g} ({verdict})")
    print("pytorch#69031 (fixed by PR #124193):", "present" if wrong else "absent")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
