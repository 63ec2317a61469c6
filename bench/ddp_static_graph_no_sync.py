"""Standalone: torch DDP with ``static_graph=True`` and ``find_unused_parameters=True`` trips an
internal assert when gradients accumulate under ``no_sync()`` (torch 2.13, gloo, CPU). No ddpcheck
involved; this is what Lightning's ``DDPStrategy(static_graph=True)`` does with
``accumulate_grad_batches > 1``.

    python bench/ddp_static_graph_no_sync.py

Two steps of two micro-batches each on a two-layer MLP at W=2, the first micro-batch of each
step under ``no_sync()``; prints, per ``find_unused_parameters`` setting, whether the steps ran
or the error torch raised (torch 2.13.0+cpu: ``find_unused_parameters=True`` raises
"expect_autograd_hooks_ INTERNAL ASSERT FAILED at .../reducer.cpp:1732, please report a bug to
PyTorch"). Exits 0 either way: it reports what torch does.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def worker(rank, world_size, store_path, find_unused, queue):
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size
    )
    torch.manual_seed(0)
    model = DDP(
        nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
        static_graph=True,
        find_unused_parameters=find_unused,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outcome = "ran 2 steps of 2 micro-batches"
    try:
        for step in range(2):
            for micro in range(2):
                with model.no_sync() if micro == 0 else contextlib.nullcontext():
                    seeded = torch.Generator().manual_seed(step * 10 + micro)
                    x = torch.randn(3, 4, generator=seeded)
                    model(x).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    except Exception as exc:  # what torch raises, reported as such
        outcome = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    if rank == 0:
        queue.put(outcome)
        queue.close()
        queue.join_thread()
    os._exit(0)  # a failed reducer leaves the ranks unpaired: no barrier, no teardown


def run(find_unused, world_size=2):
    with tempfile.TemporaryDirectory() as folder:
        context = mp.get_context("spawn")
        queue = context.Queue()
        procs = [
            context.Process(
                target=worker, args=(r, world_size, f"{folder}/store", find_unused, queue)
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outcome = queue.get(timeout=300)
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return outcome


def main():
    print(
        f"torch {torch.__version__}; DDP(static_graph=True), no_sync() on the first of 2 "
        "micro-batches, W=2"
    )
    for find_unused in (False, True):
        print(f"find_unused_parameters={find_unused}: {run(find_unused)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
