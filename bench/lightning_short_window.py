"""Standalone: Lightning's automatic optimization divides every micro-batch's loss by
``accumulate_grad_batches``, also in an epoch's short last window, so the samples of that window
weigh less than in a one-process loop over the same data. No ddpcheck involved: plain torch and
Lightning, two processes over gloo on the CPU.

    python bench/lightning_short_window.py        # in a venv with lightning

A dataset of 6 samples, a per-device batch of 1 at W=2 and ``accumulate_grad_batches=2``: an
optimizer step takes 4 samples (2 micro-batches of 2 across the ranks), so the epoch is a full
window (samples 0-3) and a short one (samples 4-5, one micro-batch). ``Trainer.fit`` runs one
epoch of SGD with ``DDPStrategy`` over a ``DataLoader`` with ``DistributedSampler(shuffle=False)``
(``use_distributed_sampler=False``, as Lightning's docs say to add one's own sampler), the
``training_step`` returning each batch's mean squared error as a user's does. A callback prints
the gradient after every optimizer step. Compared with one process training the same samples
in the same steps, each step on the mean loss of its samples (``loss.mean()`` per batch):

- ``reference``: the second step on the mean over samples 4-5 (each sample once per epoch);
- ``halved``: the same, its loss divided by 2 (what dividing by ``accumulate_grad_batches`` in a
  window of 1 micro-batch gives).

Measured with lightning 2.6.6, torch 2.13.0+cpu: the first step's gradient matches both (~1e-17
in float64); the second step's gradient is exactly half the reference's and matches ``halved``
(~1e-17). Lightning documents the division (``LightningModule.training_step``: "When
``accumulate_grad_batches`` > 1, the loss returned here will be automatically normalized by
``accumulate_grad_batches`` internally"), and steps on an epoch's last batch
(``training_epoch_loop._should_accumulate``: "Lightning steps on the final batch"), without
renormalising a window that holds fewer batches.

Exits 1 when the short window is weighed by ``1 / accumulate_grad_batches`` (the documented
convention shows), 0 when it matches the reference, 2 when it matches neither; every collective
waits at most ``DEADLINE`` seconds and the main process kills a rank still running after that.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

DEADLINE = 60  # seconds: the gloo timeout of every collective, and the join's
SAMPLES, PER_DEVICE, WORLD, ACCUMULATION, LR = 6, 1, 2, 2, 0.1
STEP = PER_DEVICE * WORLD * ACCUMULATION  # samples per optimizer step: 4


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 3, generator=generator, dtype=torch.float64)
    y = torch.randn(SAMPLES, 1, generator=generator, dtype=torch.float64)
    return x, y


def model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Linear(3, 1).double()


def grads(net: nn.Module) -> list[float]:
    return torch.cat([p.grad.flatten() for p in net.parameters()]).tolist()


def one_process(last_scale: float) -> list[list[float]]:
    """The gradients of each step of one process: the mean loss of the step's samples, the last
    step's times ``last_scale``."""
    net, (x, y) = model(), data()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    steps = []
    for start in range(0, SAMPLES, STEP):
        scale = last_scale if start + STEP > SAMPLES else 1.0
        xs, ys = x[start : start + STEP], y[start : start + STEP]
        (((net(xs) - ys) ** 2).mean() * scale).backward()
        steps.append(grads(net))
        optimizer.step()
        optimizer.zero_grad()
    return steps


def worker(rank: int, store_path: str, folder: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # never dialled: the group below exists before the Trainer looks
    )
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, WORLD),
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=DEADLINE),
    )

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model()

        def training_step(self, batch, batch_idx):
            xb, yb = batch
            return ((self.net(xb) - yb) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    steps: list[list[float]] = []

    class Gradients(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            steps.append(grads(pl_module.net))

    dataset = TensorDataset(*data())
    loader = DataLoader(
        dataset, batch_size=PER_DEVICE, sampler=DistributedSampler(dataset, shuffle=False)
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=DDPStrategy(),
        max_epochs=1,
        accumulate_grad_batches=ACCUMULATION,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=folder,
        callbacks=[Gradients()],
    )
    trainer.fit(Module(), train_dataloaders=loader)
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as out:
        json.dump(steps, out)
    dist.destroy_process_group()


def main() -> int:
    import lightning

    print(
        f"lightning {lightning.__version__}, torch {torch.__version__}, W={WORLD}, "
        f"{SAMPLES} samples, per-device batch {PER_DEVICE}, accumulate_grad_batches={ACCUMULATION}"
    )
    with tempfile.TemporaryDirectory() as folder:
        context = mp.spawn(
            worker,
            args=(os.path.join(folder, "store"), folder),
            nprocs=WORLD,
            join=False,
            start_method="spawn",
        )
        for process in context.processes:
            process.join(timeout=DEADLINE + 60)
            if process.is_alive():
                process.kill()
                sys.exit(f"a rank did not finish within {DEADLINE + 60} s")
        with open(os.path.join(folder, "rank0.json")) as f:
            got = torch.tensor(json.load(f), dtype=torch.float64)
    reference = torch.tensor(one_process(1.0), dtype=torch.float64)
    halved = torch.tensor(one_process(1.0 / ACCUMULATION), dtype=torch.float64)
    if got.shape != reference.shape:
        print(f"Lightning took {len(got)} optimizer step(s), the reference {len(reference)}")
        return 2
    for step in range(len(got)):
        print(
            f"step {step}: max |grad - reference| = "
            f"{float((got[step] - reference[step]).abs().max()):.3g}, "
            f"max |grad - halved| = {float((got[step] - halved[step]).abs().max()):.3g}"
        )
    if torch.allclose(got, reference, rtol=0, atol=1e-12):
        print("the short last window is weighed as the reference weighs it")
        return 0
    if torch.allclose(got, halved, rtol=0, atol=1e-12):
        print(
            "the epoch's short last window (1 of accumulate_grad_batches=2 micro-batches) is "
            "divided by accumulate_grad_batches: its samples weigh half (Lightning's convention)"
        )
        return 1
    print("the gradients match neither the reference nor the halved reference")
    return 2


if __name__ == "__main__":
    sys.exit(main())
