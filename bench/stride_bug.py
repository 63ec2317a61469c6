"""Standalone reproduction: torch DDP computes wrong gradients for a parameter whose strides change
after wrapping (torch 2.13, gloo, CPU). No ddpcheck involved: plain torch, two processes.

    python bench/stride_bug.py

Two triggers, each compared with the same model trained in one process on the whole batch:

1. ``ZeroRedundancyOptimizer(ddp.parameters(), parameters_as_bucket_view=True)`` built in the
   order torch's ZeRO documentation shows (DDP first), over a ``channels_last`` Conv2d: ZeRO
   replaces every ``param.data`` by a contiguous view of its flat bucket after DDP's Reducer laid
   out its gradient buckets for the ``channels_last`` strides. World size 2.
2. The same change made by hand: ``param.data = param.data.contiguous()`` after wrapping, with
   ``gradient_as_bucket_view=False`` (wrong) and ``True`` (right). World size 1.

DDP warns once ("Grad strides do not match bucket view strides ... This is not an error, but
may impair performance") and computes wrong gradients. The figures for torch 2.13.0+cpu are in
docs/stride-bug.md; the script prints each case's max |DDP gradient - reference gradient| of the
conv weight and exits 1 when any case it expects to be right is wrong.
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

BATCH = 8


class Net(nn.Module):
    """A conv layer in channels_last, as vision models are converted for speed, and a head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, kernel_size=3, padding=1)
        self.head = nn.Linear(8 * 4 * 4, 2)
        self.conv.to(memory_format=torch.channels_last)

    def forward(self, x):
        y = torch.tanh(self.conv(x.contiguous(memory_format=torch.channels_last)))
        return self.head(y.flatten(1))


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 3, 4, 4, generator=g), torch.randn(BATCH, 2, generator=g)


def loss_of(model, x, y, world_size):
    # each rank's share of the mean over the global batch: DDP averages over ranks
    return ((model(x) - y) ** 2).sum() * world_size / BATCH


def reference_grad():
    torch.manual_seed(0)
    model = Net()
    x, y = data()
    loss_of(model, x, y, 1).backward()
    return model.conv.weight.grad.clone()


def rank_grad(rank, world_size, case):
    torch.manual_seed(0)
    model = Net()
    if case == "zero_bucket_view":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = DDP(model)
        ZeroRedundancyOptimizer(
            ddp.parameters(),
            optimizer_class=torch.optim.SGD,
            lr=0.1,
            parameters_as_bucket_view=True,
        )
    else:
        ddp = DDP(model, gradient_as_bucket_view=case == "contiguous_after_wrap_bucket_view")
        with torch.no_grad():
            for p in model.parameters():  # what ZeRO's bucket view does, by hand
                p.data = p.data.contiguous()
    x, y = data()
    xs, ys = x.tensor_split(world_size)[rank], y.tensor_split(world_size)[rank]
    loss_of(ddp, xs, ys, world_size).backward()
    return model.conv.weight.grad.clone()


def worker(rank, world_size, store_path, case, queue):
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size
    )
    grad = rank_grad(rank, world_size, case)
    if rank == 0:
        queue.put(grad.tolist())
        queue.close()
        queue.join_thread()  # the grad is on its way before this process leaves
    dist.barrier()
    os._exit(0)  # skip gloo's teardown


def run(case, world_size):
    with tempfile.TemporaryDirectory() as folder:
        context = mp.get_context("spawn")
        queue = context.Queue()
        procs = [
            context.Process(target=worker, args=(r, world_size, f"{folder}/store", case, queue))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        grad = torch.tensor(queue.get(timeout=300))
        for p in procs:
            p.join(timeout=60)
    return grad


def main():
    expected = reference_grad()
    print(
        f"torch {torch.__version__}; conv weight {tuple(expected.shape)}, strides "
        f"{Net().conv.weight.stride()} (channels_last)"
    )
    wrong = False
    for case, world_size, should_hold in (
        ("zero_bucket_view", 2, False),
        ("contiguous_after_wrap", 1, False),
        ("contiguous_after_wrap_bucket_view", 1, True),
    ):
        got = run(case, world_size)
        diff = (got - expected).abs().max().item()
        holds = diff < 1e-5
        print(
            f"{case:36s} W={world_size}: max |grad - reference| = {diff:.3g} "
            f"({'right' if holds else 'WRONG'})"
        )
        wrong |= should_hold and not holds
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
