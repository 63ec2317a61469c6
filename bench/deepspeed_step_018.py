"""Standalone: DeepSpeed 0.18.9's ZeRO-1 and ZeRO-2 ``engine.step()`` raise under torch 2.13 on
its CPU accelerator over gloo. No ddpcheck involved: plain torch and DeepSpeed, two processes.

    python bench/deepspeed_step_018.py        # in a venv with the DeepSpeed release to try

A two-layer MLP, SGD as DeepSpeed's client optimizer, one micro-batch through
``engine.backward`` and one ``engine.step()`` at W=2, per ZeRO stage; prints, per stage and
rank, whether the step ran or what it raised. With deepspeed 0.18.9 and torch 2.13.0+cpu both
stages raise "Output 0 of Split is a view and is being modified inplace..." in the all-gather
after the optimizer step (``all_gather_into_tensor_dp_groups``); 0.19.0 and 0.19.8 step. Read in
DeepSpeed's source: 0.19.0 detaches ZeRO's flattened parameter buffer
(``stage_1_and_2.py``, ``flatten_dense_tensors_aligned(...).detach()``), 0.18.9 does not, so the
all-gather writes into views of a tensor with autograd history. Why ``deepspeed_zero1/2`` require
0.19.0 (docs/frameworks.md). The first run after an install builds DeepSpeed's C++ op (minutes).
Exits 0 either way: it reports what DeepSpeed does.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def worker(rank, world_size, store_path, stage, queue):
    os.environ.update(
        DS_ACCELERATOR="cpu",
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
    )  # MASTER_PORT: main's
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size
    )
    import deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "steps_per_print": 2**31,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        config=config,
        dist_init_required=False,
    )
    engine.backward(engine(torch.randn(3, 4)).pow(2).mean())
    try:
        engine.step()
        outcome = "stepped"
    except RuntimeError as exc:
        outcome = f"raised {exc}"
    queue.put((stage, rank, outcome))


def main():
    import deepspeed

    print(f"deepspeed {deepspeed.__version__}, torch {torch.__version__}")
    context = mp.get_context("spawn")
    with socket.socket() as probe:  # a free port for DeepSpeed's env checks (the group is a file)
        probe.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(probe.getsockname()[1])  # the spawned ranks inherit it
    for stage in (1, 2):
        queue = context.Queue()
        with tempfile.TemporaryDirectory() as folder:
            mp.start_processes(
                worker,
                args=(2, os.path.join(folder, "store"), stage, queue),
                nprocs=2,
                start_method="spawn",
            )
        for _ in range(2):
            stage_, rank, outcome = queue.get()
            print(f"ZeRO-{stage_} rank {rank}: engine.step() {outcome}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
