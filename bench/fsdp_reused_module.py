"""Standalone: torch FSDP2 reduce-scatters a module called twice in forward twice per step when
gradients accumulate over micro-batches (torch 2.13, gloo, CPU). No ddpcheck involved.

    python bench/fsdp_reused_module.py

A model whose ``fc`` layer runs twice in every forward, ``fully_shard`` on ``fc`` and on the root,
trained one step at W=2 with 1 and with 2 micro-batches (the earlier ones under
``set_requires_gradient_sync(False)``, as FSDP2's docs prescribe for accumulation). The script
counts the reduce-scatters of the last micro-batch (the one that synchronises) and checks ``fc``'s
gradient against the same model trained in one process. ``fc``'s gradient is 24 bytes, the
head's 48 once padded to W rows. Measured (torch 2.13.0+cpu):

    1 micro-batch(es): reduce-scatters in the last micro-batch [48, 24] bytes; ... right
    2 micro-batch(es): reduce-scatters in the last micro-batch [24, 48, 24] bytes; ... right

With accumulation, ``fc`` is reduce-scattered twice: the right numbers, its gradient's bytes
twice on the wire. Exits 1 if a gradient is wrong.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

BATCH = 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.head = nn.Linear(2, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(torch.tanh(self.fc(x)))))  # fc used twice


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 2, generator=g), torch.randn(BATCH, 3, generator=g)


def reference_grad():
    torch.manual_seed(0)
    model = Net()
    x, y = data()
    ((model(x) - y) ** 2).sum().div(BATCH).backward()
    return model.fc.weight.grad.clone()


def worker(rank, world_size, store_path, micro_batches, queue):
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size
    )
    torch.manual_seed(0)
    model = Net()
    fully_shard(model.fc)
    fully_shard(model)
    calls = []
    original = dist.reduce_scatter_single

    def counting(output, input, *args, **kwargs):  # FSDP2's reduce-scatter goes through here
        calls.append(input.numel() * input.element_size())
        return original(output, input, *args, **kwargs)

    x, y = data()
    xs, ys = x.tensor_split(world_size)[rank], y.tensor_split(world_size)[rank]
    micro = zip(xs.tensor_split(micro_batches), ys.tensor_split(micro_batches))
    for i, (xm, ym) in enumerate(micro):
        last = i == micro_batches - 1
        model.set_requires_gradient_sync(last)
        dist.reduce_scatter_single = counting if last else original
        ((model(xm) - ym) ** 2).sum().mul(world_size / BATCH).backward()
    dist.reduce_scatter_single = original
    grad = model.fc.weight.grad.full_tensor()
    if rank == 0:
        queue.put((calls, grad.tolist()))
        queue.close()
        queue.join_thread()
    dist.barrier()
    os._exit(0)


def run(micro_batches, world_size=2):
    with tempfile.TemporaryDirectory() as folder:
        context = mp.get_context("spawn")
        queue = context.Queue()
        procs = [
            context.Process(
                target=worker, args=(r, world_size, f"{folder}/store", micro_batches, queue)
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        calls, grad = queue.get(timeout=300)
        for p in procs:
            p.join(timeout=60)
    return calls, torch.tensor(grad)


def main():
    expected = reference_grad()
    print(f"torch {torch.__version__}; fc's gradient is 24 bytes, padded to W=2 rows: 48")
    wrong = False
    for micro_batches in (1, 2):
        calls, grad = run(micro_batches)
        right = torch.allclose(grad, expected, atol=1e-6)
        wrong |= not right
        print(
            f"{micro_batches} micro-batch(es): reduce-scatters in the last micro-batch "
            f"{calls} bytes; fc.weight's gradient {'right' if right else 'WRONG'}"
        )
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
