"""Standalone: transformers' Trainer with ``accelerator_config={"split_batches": True,
"even_batches": False}`` over a dataset whose last batch does not reach every rank. No ddpcheck
involved: plain torch, transformers and accelerate, two processes over gloo on the CPU.

    python bench/hf_split_uneven_batches.py          # in a venv with transformers

accelerate's ``BatchSamplerShard.__len__`` under ``split_batches=True`` is the number of batches
of the whole loader on every rank, but with ``even_batches=False`` a short last batch is only
yielded to the ranks it reaches (``_iter_with_split``: ``len(batch) > batch_length *
process_index``): a rank it does not reach is told one batch more than it gets
(huggingface/accelerate#4122, closed; its fixes #4127 and #4194 closed unmerged). The Trainer
takes an epoch's optimizer step at ``(step + 1) % gradient_accumulation_steps == 0 or (step + 1)
== steps_in_epoch``, with ``steps_in_epoch = len(dataloader)``: on that rank the epoch's last
window ends one batch early and never steps. Here: 6 samples, a batch of 4 split over W=2 (2
per rank), ``gradient_accumulation_steps=2``, 2 epochs, SGD. Rank 0 gets samples 0-1 and 4-5,
rank 1 samples 2-3 and no part of the last batch, while both loaders say 2 batches. Each rank's
micro-batches are trained (DDP reduces at the window's last), but rank 1 takes no optimizer step
at the end of the epoch: it carries the epoch's gradient into the next one, and its parameters
fall behind rank 0's. The same run with ``BatchSamplerShard.__len__`` counting what it yields
(``--fixed``) steps alike on both ranks and matches one process training the same samples in the
same steps (each step the mean loss of its samples).

Exits 1 when the ranks' optimizer steps or parameters differ (or a rank fails), 0 when both
match the one-process reference, 2 when they agree with each other but not with it. Every
collective waits at most ``DEADLINE`` seconds and a rank still running after that is killed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

DEADLINE = 60  # seconds: the gloo timeout of every collective, and the join's
SAMPLES, MICRO, WORLD, ACCUMULATION, EPOCHS, LR = 6, 4, 2, 2, 2, 0.1


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 3, generator=generator, dtype=torch.float64)
    y = torch.randn(SAMPLES, 1, generator=generator, dtype=torch.float64)
    return x, y


class Regression(nn.Module):
    """A linear model whose loss is the step's squared errors summed over the items the Trainer
    counts in the step (``num_items_in_batch``: its labels across the ranks)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.linear = nn.Linear(3, 1).double()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **loss_kwargs: object):
        errors = ((self.linear(input_ids) - labels) ** 2).sum()
        return {"loss": errors / loss_kwargs["num_items_in_batch"]}


class Samples(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x, self.y = data()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.y[i]}


def one_process() -> list[float]:
    """The parameters after the epochs: each step the mean loss of its samples (4, then 2)."""
    net, (x, y) = Regression(), data()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for _ in range(EPOCHS):
        for start in range(0, SAMPLES, MICRO * ACCUMULATION):
            xs, ys = (
                x[start : start + MICRO * ACCUMULATION],
                y[start : start + MICRO * ACCUMULATION],
            )
            ((net.linear(xs) - ys) ** 2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return [float(v) for p in net.parameters() for v in p.detach().flatten()]


def counted_length(self) -> int:
    """``BatchSamplerShard.__len__`` as the batches it yields (``--fixed``)."""
    return sum(1 for _ in iter(self))


def worker(rank: int, store_path: str, folder: str, fixed: bool) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(WORLD),
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
    from accelerate.data_loader import BatchSamplerShard
    from transformers import Trainer, TrainerCallback, TrainingArguments

    if fixed:
        BatchSamplerShard.__len__ = counted_length

    steps: list[int] = []

    class Steps(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            steps.append(state.global_step)

    args = TrainingArguments(
        output_dir=folder,
        use_cpu=True,
        per_device_train_batch_size=MICRO,  # split across the ranks: 2 samples each
        gradient_accumulation_steps=ACCUMULATION,
        num_train_epochs=EPOCHS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,  # no clipping (the Trainer's default clips at 1)
        train_sampling_strategy="sequential",
        accelerator_config={"split_batches": True, "even_batches": False},
        average_tokens_across_devices=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1000,  # no logging gather during the run
        disable_tqdm=True,
    )
    model = Regression()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Samples(),
        optimizers=(torch.optim.SGD(model.parameters(), lr=LR), None),
        callbacks=[Steps()],
    )
    trainer.train()
    loader = trainer.get_train_dataloader()
    result = {
        "length": len(loader),
        "batches": sum(1 for _ in loader),
        "steps": len(steps),
        "parameters": [float(v) for p in model.parameters() for v in p.detach().flatten()],
    }
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as out:
        json.dump(result, out)
    dist.destroy_process_group()


def main() -> int:
    import accelerate
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="a __len__ counting what it yields")
    fixed = parser.parse_args().fixed
    print(
        f"transformers {transformers.__version__}, accelerate {accelerate.__version__}, torch "
        f"{torch.__version__}, W={WORLD}, {SAMPLES} samples, batch {MICRO} split over the ranks, "
        f"gradient_accumulation_steps={ACCUMULATION}, {EPOCHS} epochs"
        + (", BatchSamplerShard.__len__ counting its batches" if fixed else "")
    )
    with tempfile.TemporaryDirectory() as folder:
        context = mp.spawn(
            worker,
            args=(os.path.join(folder, "store"), folder, fixed),
            nprocs=WORLD,
            join=False,
            start_method="spawn",
        )
        for process in context.processes:
            process.join(timeout=DEADLINE + 60)
            if process.is_alive():
                process.kill()
                print(f"a rank did not finish within {DEADLINE + 60} s")
                return 1
        if any(process.exitcode != 0 for process in context.processes):
            print(f"a rank failed: exit codes {[p.exitcode for p in context.processes]}")
            return 1
        ranks = []
        for rank in range(WORLD):
            with open(os.path.join(folder, f"rank{rank}.json")) as f:
                ranks.append(json.load(f))
    reference = torch.tensor(one_process(), dtype=torch.float64)
    for rank, got in enumerate(ranks):
        off = float((torch.tensor(got["parameters"], dtype=torch.float64) - reference).abs().max())
        print(
            f"rank {rank}: its loader says {got['length']} batches and yields {got['batches']}; "
            f"{got['steps']} optimizer steps; parameters {off:.3g} off the one-process reference"
        )
    if len({r["steps"] for r in ranks}) > 1 or ranks[0]["parameters"] != ranks[1]["parameters"]:
        print(
            "the ranks took different optimizer steps and their parameters differ: a rank told "
            "one batch more than it gets never steps at its epoch's end"
        )
        return 1
    if torch.allclose(torch.tensor(ranks[0]["parameters"], dtype=torch.float64), reference):
        print("both ranks match the one-process reference")
        return 0
    print("the ranks agree with each other but not with the one-process reference")
    return 2


if __name__ == "__main__":
    sys.exit(main())
