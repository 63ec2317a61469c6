"""Does the installed torch's FSDP2 train on the CPU? Standalone (no ddpcheck): two processes,
gloo, one ``fully_shard``-ed two-layer model, one step of SGD against the same model trained in
one process on the whole batch.

    python bench/fsdp2_cpu.py      # exit 0: runs and is right; 1: runs, wrong; 2: does not run

``fully_shard`` is taken from ``torch.distributed.fsdp`` (torch 2.6 and later) or its older path
``torch.distributed._composable.fsdp`` (2.4, 2.5). What this prints on each release
(docs/torch-releases.md) sets ``ddpcheck.targets.fsdp.CPU_FLOOR``, the torch ``torch_fsdp``
needs on the CPU: the first release where it runs. Where it runs but its gradients are the
reference's times the world size, gloo took FSDP2's ReduceOp.AVG as a sum (pytorch#162338):
a torch bug ``ddpcheck check torch_fsdp`` reports as such (exit 1), not a floor.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD_SIZE = 2


def fully_shard_api():
    try:
        from torch.distributed.fsdp import fully_shard

        return fully_shard, "torch.distributed.fsdp"
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard

        return fully_shard, "torch.distributed._composable.fsdp"


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)


def reference():
    net = model()
    x, y = data()
    ((net(x) - y) ** 2).mean().backward()
    return net[0].weight.grad.clone()


def worker(rank, store_path, queue):
    try:
        dist.init_process_group(
            "gloo", store=dist.FileStore(store_path, WORLD_SIZE), rank=rank, world_size=WORLD_SIZE
        )
        fully_shard, _ = fully_shard_api()
        net = model()
        for layer in (net[0], net[2]):
            fully_shard(layer)
        fully_shard(net)
        x, y = data()
        xs, ys = x.tensor_split(WORLD_SIZE)[rank], y.tensor_split(WORLD_SIZE)[rank]
        ((net(xs) - ys) ** 2).mean().backward()  # FSDP2 averages over ranks
        queue.put((rank, net[0].weight.grad.full_tensor().tolist(), None))
    except Exception as exc:
        queue.put((rank, None, f"{type(exc).__name__}: {exc}".splitlines()[0]))
        traceback.print_exc()
    queue.close()
    queue.join_thread()
    os._exit(0)  # skip gloo's teardown (a failed rank leaves its peer waiting)


def main():
    print(f"torch {torch.__version__}", end="; ")
    try:
        _, path = fully_shard_api()
    except ImportError as exc:
        print(f"no FSDP2: {exc}")
        return 2
    print(f"fully_shard from {path}")
    with tempfile.TemporaryDirectory() as folder:
        context = mp.get_context("spawn")
        queue = context.Queue()
        procs = [
            context.Process(target=worker, args=(r, f"{folder}/store", queue))
            for r in range(WORLD_SIZE)
        ]
        for p in procs:
            p.start()
        answers = [queue.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = {error for _, _, error in answers if error}
    if errors:
        print("FSDP2 fails on the CPU:", "; ".join(sorted(errors)))
        return 2
    expected = reference()
    diff = max((torch.tensor(g) - expected).abs().max().item() for _, g, _ in answers)
    ratio = max((torch.tensor(g) / expected).max().item() for _, g, _ in answers)
    right = diff < 1e-5
    print(
        f"FSDP2 runs on the CPU: max |grad - reference| = {diff:.3g}"
        + ("" if right else f" (WRONG: up to {ratio:.3g} x the reference)")
    )
    return 0 if right else 1


if __name__ == "__main__":
    sys.exit(main())
