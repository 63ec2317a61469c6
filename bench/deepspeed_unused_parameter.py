"""Standalone: DeepSpeed's ZeRO-1 and ZeRO-2 abort when a parameter is used on some ranks only,
though ``zero_optimization.ignore_unused_parameters`` (True by default) is documented as "Unused
parameters in modules may be unexpected in static networks, but could be normal in dynamic
networks. This controls whether or not training should terminate with an error message when
unused parameters are detected. ... set to True by default, which means unused parameters are
ignored and training continues" (DeepSpeed's config-json docs; ``zero/config.py``). No ddpcheck
involved: plain torch and DeepSpeed, two processes over gloo on DeepSpeed's CPU accelerator.

    python bench/deepspeed_unused_parameter.py        # in a venv with DeepSpeed

The model: ``trunk`` (Linear 4->8, 40 elements) and ``head`` (Linear 8->1, 9 elements) every rank
uses, and ``extra`` (Linear 8->1, 9 elements) that rank 0 uses and rank 1 does not (a branch
taken by some ranks' data: mixture-of-experts routing, a modality missing from a batch). One
micro-batch through ``engine.backward``, one ``engine.step()``, per stage; every
``torch.distributed`` reduction the ranks issue is logged with its element count, then each
rank reports whether the step ran or what it raised. Each rank reduces the gradients it
produced: rank 1 leaves ``extra``'s out of the bucket, so the ranks' all-reduces have different
sizes. Measured with deepspeed 0.19.8, torch 2.13.0+cpu, at both stages: rank 0 all-reduces 58
float32 elements, rank 1 49, both in ``reduce_ipg_grads > average_tensor > ... >
allreduce_bucket``; gloo aborts rank 1 ("op.preamble.length <= op.nbytes. 60 vs 52. Received
data size doesn't match expected size. Is there a distributed collective mismatch in your
code?", SIGABRT) and rank 0 raises "Connection reset by peer". ``ignore_unused_parameters`` only
silences DeepSpeed's own check; the reduction still assumes every rank reduces the same bucket.
torch DDP (``find_unused_parameters=True``) marks such a parameter ready on the ranks that skip
it, with a zero gradient, and so does ``parallel``.

Exits 0 either way (it reports what DeepSpeed does); every rank waits at most ``DEADLINE``
seconds for a collective (the process group's timeout), and the main process kills a rank still
running 90 s after that (a rank whose peer aborted may wait in gloo past its timeout).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

DEADLINE = 30  # seconds: the gloo timeout of every collective, and the join's


class Branchy(nn.Module):
    """``extra`` runs only where ``use_extra``: rank 0 here."""

    def __init__(self, use_extra: bool):
        super().__init__()
        self.trunk = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)
        self.extra = nn.Linear(8, 1)
        self.use_extra = use_extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        out = self.head(h)
        return out + self.extra(h) if self.use_extra else out


def _logged(name, report):
    """``torch.distributed.NAME`` reporting what each call reduces, before it runs (gloo may
    abort the process inside it)."""
    original = getattr(dist, name)

    def call(tensor, *args, **kwargs):
        if torch.is_tensor(tensor):
            caller = (
                " > ".join(
                    f.name
                    for f in traceback.extract_stack()  # ZeRO's functions
                    if f"{os.sep}zero{os.sep}" in f.filename
                )
                or "?"
            )
            report(
                f"{name} {tensor.numel()} {str(tensor.dtype).replace('torch.', '')} (in {caller})"
            )
        return original(tensor, *args, **kwargs)

    return call


def worker(rank, world_size, store_path, stage, folder):
    os.environ.update(
        DS_ACCELERATOR="cpu",
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
    )  # MASTER_PORT: main's
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world_size),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=DEADLINE),
    )
    import deepspeed

    torch.manual_seed(0)
    model = Branchy(use_extra=rank == 0)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "ignore_unused_parameters": True},
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

    def report(line):  # to a file, flushed: gloo may abort the process in the next call
        with open(os.path.join(folder, f"rank{rank}.log"), "a") as f:
            f.write(line + "\n")

    for name in ("all_reduce", "reduce", "reduce_scatter_tensor"):
        setattr(dist, name, _logged(name, report))  # deepspeed.comm calls torch.distributed's
    try:
        engine.backward(engine(torch.randn(3, 4)).pow(2).mean())
        engine.step()
        report("backward and step ran")
    except Exception as exc:  # what DeepSpeed raises is the finding
        report(f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    os._exit(0)  # a rank whose peer aborted mid-collective must not wait in the group's teardown


def main():
    import deepspeed

    print(
        f"deepspeed {deepspeed.__version__}, torch {torch.__version__}; parameters: trunk 40 "
        "elements, head 9, extra 9 (used on rank 0 only)"
    )
    with socket.socket() as probe:  # a free port for DeepSpeed's env checks (the group is a file)
        probe.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(probe.getsockname()[1])  # the spawned ranks inherit it
    for stage in (1, 2):
        with tempfile.TemporaryDirectory() as folder:
            ranks = mp.start_processes(
                worker,
                args=(2, os.path.join(folder, "store"), stage, folder),
                nprocs=2,
                start_method="spawn",
                join=False,
            )
            ends = time.monotonic() + DEADLINE + 90  # import and initialize included
            for process in ranks.processes:
                process.join(timeout=max(0.0, ends - time.monotonic()))
                if process.is_alive():
                    process.kill()
                    process.join()
            lines: dict[int, list[str]] = {0: [], 1: []}
            for rank in range(2):
                path = os.path.join(folder, f"rank{rank}.log")
                if os.path.exists(path):
                    with open(path) as f:
                        lines[rank] = f.read().splitlines()
        for rank, process in enumerate(ranks.processes):
            code = process.exitcode
            end = (
                ""
                if code == 0
                else f"; the process ended with exit code {code}"
                + (
                    {-6: " (SIGABRT: gloo aborted it)", -9: " (killed at the deadline)"}.get(
                        code, ""
                    )
                )
            )
            print(f"ZeRO-{stage} rank {rank}: {'; '.join(lines[rank])}{end}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
