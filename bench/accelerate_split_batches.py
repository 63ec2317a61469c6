"""Standalone: accelerate accepts ``Accelerator(split_batches=True)`` and ignores it, so each rank
loads a whole batch instead of its share. No ddpcheck involved: plain torch and accelerate, two
processes over gloo on the CPU.

    python bench/accelerate_split_batches.py        # in a venv with accelerate

The same loop -- a ``DataLoader`` of batch size 8 (the global batch, as ``split_batches`` means),
``accelerator.prepare(model, optimizer, dataloader)``, one epoch of SGD over 16 samples -- runs
twice at W=2: with the keyword ``Accelerator(split_batches=True)``, and with
``Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True))``. Each rank prints
the sample indices of every batch it loaded; the final weights are compared with one process
training the same 16 samples in batches of 8 (two steps of full-batch gradient descent).

Measured with accelerate 1.15.0, torch 2.13.0+cpu: through ``DataLoaderConfiguration`` each rank
loads 4 of each 8 and the weights match the reference (difference ~1e-16 in float64); through
the keyword each rank loads 8 (rank 0 samples 0-7, rank 1 8-15), the epoch takes 1 step instead
of 2, and the weights are ~0.1 off. accelerate's ``__init__`` takes ``split_batches`` with a
sentinel default and never reads it (the value lives in ``DataLoaderConfiguration`` since 1.0).

Exits 1 when the keyword is ignored (the bug), 0 when both spellings split; every collective
waits at most ``DEADLINE`` seconds and the main process kills a rank still running after that.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

DEADLINE = 60  # seconds: the gloo timeout of every collective, and the join's
SAMPLES, BATCH, LR = 16, 8, 0.1


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 3, generator=generator, dtype=torch.float64)
    y = torch.randn(SAMPLES, 1, generator=generator, dtype=torch.float64)
    return x, y


def model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Linear(3, 1).double()


def reference() -> torch.Tensor:
    """One process: two steps of SGD, each on the mean loss of 8 samples."""
    net, (x, y) = model(), data()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for start in range(0, SAMPLES, BATCH):
        loss = ((net(x[start : start + BATCH]) - y[start : start + BATCH]) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().flatten() for p in net.parameters()])


def worker(rank: int, store_path: str, spelling: str, folder: str) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, 2),
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=DEADLINE),
    )
    if spelling == "keyword":
        accelerator = Accelerator(cpu=True, split_batches=True)
    else:
        accelerator = Accelerator(
            cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True)
        )
    x, y = data()
    indices = torch.arange(SAMPLES)
    loader = DataLoader(TensorDataset(x, y, indices), batch_size=BATCH)
    net = model()
    net, optimizer, loader = accelerator.prepare(
        net, torch.optim.SGD(net.parameters(), lr=LR), loader
    )
    loaded, steps = [], 0
    for xb, yb, ib in loader:
        loaded.append(ib.tolist())
        loss = ((net(xb) - yb) ** 2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    weights = torch.cat([p.detach().flatten() for p in net.parameters()])
    with open(os.path.join(folder, f"{spelling}{rank}.txt"), "w") as out:
        out.write(f"{loaded}|{steps}|{json.dumps(weights.tolist())}\n")
    dist.destroy_process_group()


def run(spelling: str, folder: str) -> tuple[list[str], torch.Tensor]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(probe.getsockname()[1])  # the spawned ranks inherit it
    context = mp.spawn(
        worker,
        args=(os.path.join(folder, f"store-{spelling}"), spelling, folder),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    for process in context.processes:
        process.join(timeout=DEADLINE + 30)
        if process.is_alive():
            process.kill()
            sys.exit(f"a rank of the {spelling} run did not finish within {DEADLINE + 30} s")
    lines, weights = [], None
    for rank in range(2):
        with open(os.path.join(folder, f"{spelling}{rank}.txt")) as f:
            loaded, steps, values = f.read().strip().split("|")
        lines.append(f"rank {rank} loaded {loaded} in {steps} step(s)")
        weights = torch.tensor(json.loads(values), dtype=torch.float64)
    assert weights is not None
    return lines, weights


def main() -> int:
    import accelerate

    print(f"accelerate {accelerate.__version__}, torch {torch.__version__}, W=2, {SAMPLES} samples")
    expected = reference()
    wrong = {}
    with tempfile.TemporaryDirectory() as folder:
        for spelling, label in (
            ("keyword", "Accelerator(split_batches=True)"),
            (
                "config",
                "Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True))",
            ),
        ):
            lines, weights = run(spelling, folder)
            off = float((weights - expected).abs().max())
            wrong[spelling] = off > 1e-9
            print(f"{label}: max |weights - reference| = {off:.3g}")
            for line in lines:
                print(f"  {line}")
    if wrong["config"]:
        print("DataLoaderConfiguration(split_batches=True) is off the reference too: not this bug")
        return 2
    print(
        "the keyword is ignored: each rank loads the whole batch (accelerate's bug)"
        if wrong["keyword"]
        else "both spellings split the batch: the keyword is honoured"
    )
    return 1 if wrong["keyword"] else 0


if __name__ == "__main__":
    sys.exit(main())
