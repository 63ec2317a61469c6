"""Standalone: accelerate's dispatching loader (``dispatch_batches=True``) completes a short last
batch from the first batch's first W samples only, so a dataset of fewer samples than that can
fill leaves a rank an empty slice -- and the evaluation loop of accelerate's guide, which
gathers every batch with ``gather_for_metrics``, then crashes or hangs. No ddpcheck involved:
plain torch and accelerate, three processes over gloo on the CPU.

    python bench/accelerate_dispatch_tiny_set.py        # in a venv with accelerate

One sample, a ``DataLoader`` of batch size 3 split across W=3 ranks
(``DataLoaderConfiguration(split_batches=True, dispatch_batches=True)``), as ddpcheck's
``accelerate`` target prepares an evaluation set of 1 sample at W=3. Each rank prints the batches
it is handed. Measured with accelerate 1.15.0, torch 2.13.0+cpu: ranks 0 and 1 get sample 0
(the second a repeat), rank 2 an empty batch; ``gather_for_metrics`` over those shapes does not
complete (gloo). With ``dispatch_batches=False`` every rank gets one sample (ranks 1 and 2 a
repeat, which ``gather_for_metrics`` drops).

Exits 1 when a rank is handed an empty batch (the bug), 0 otherwise; nothing is gathered, so
nothing hangs, and the main process kills a rank still running after ``DEADLINE`` seconds.
"""

from __future__ import annotations

import ast
import datetime
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

DEADLINE = 60  # seconds: the gloo timeout of every collective, and the join's
WORLD = 3


def worker(rank: int, store_path: str, dispatch: bool, folder: str) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1"
    )
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, WORLD),
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=DEADLINE),
    )
    config = DataLoaderConfiguration(split_batches=True, dispatch_batches=dispatch)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    loader = accelerator.prepare(DataLoader(torch.arange(1, dtype=torch.float64), batch_size=3))
    seen = [batch.tolist() for batch in loader]
    with open(os.path.join(folder, f"{dispatch}{rank}.txt"), "w") as out:
        out.write(repr(seen))
    dist.destroy_process_group()


def run(dispatch: bool, folder: str) -> list[list[list[float]]]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(probe.getsockname()[1])  # the spawned ranks inherit it
    context = mp.spawn(
        worker,
        args=(os.path.join(folder, f"store-{dispatch}"), dispatch, folder),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    for process in context.processes:
        process.join(timeout=DEADLINE + 30)
        if process.is_alive():
            process.kill()
            sys.exit(f"a rank did not finish within {DEADLINE + 30} s")
    seen = []
    for rank in range(WORLD):
        with open(os.path.join(folder, f"{dispatch}{rank}.txt")) as f:
            seen.append(ast.literal_eval(f.read()))
    return seen


def main() -> int:
    import accelerate

    print(f"accelerate {accelerate.__version__}, torch {torch.__version__}, W={WORLD}, 1 sample")
    empty = False
    with tempfile.TemporaryDirectory() as folder:
        for dispatch in (False, True):
            seen = run(dispatch, folder)
            print(f"dispatch_batches={dispatch}:")
            for rank, batches in enumerate(seen):
                print(f"  rank {rank} is handed {batches}")
            empty |= dispatch and any(batch == [] for batches in seen for batch in batches)
    print(
        "a dispatched rank is handed an empty batch: gather_for_metrics cannot pair its shapes"
        if empty
        else "every rank is handed a sample"
    )
    return 1 if empty else 0


if __name__ == "__main__":
    sys.exit(main())
