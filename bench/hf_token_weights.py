"""Does the Trainer weigh every token alike, across micro-batches and across ranks? Standalone (no
ddpcheck): 5 labelled tokens, 4 in one sequence and 1 in the other (the rest ``-100``), one SGD
step at lr 1; the right update is minus the gradient of the mean over the 5 tokens. The model's
forward takes ``**loss_kwargs``, so a Trainer that passes ``num_items_in_batch`` (the step's token
count) gets a sum over it, and one that does not gets each micro-batch's own mean.

    python bench/hf_token_weights.py             # one process, the sequences two micro-batches
    python bench/hf_token_weights.py --ranks 2   # two processes (gloo), a sequence each
    python bench/hf_token_weights.py --ranks 2 --tokens-seen   # include_num_input_tokens_seen

One process, ``gradient_accumulation_steps=2``: transformers 4.45.2 passes no
``num_items_in_batch``, so each micro-batch's mean is divided by the accumulation steps and the
lone token of the second weighs 4 times a token of the first (huggingface/transformers #34191,
fixed in 4.46). Two ranks: 4.46.0 and 4.46.1 pass each rank its own count (they have no
``average_tokens_across_devices``, added in 4.46.2, issue #34242), so DDP averages the two
ranks' means. 4.46.2 has it, but runs a step's last micro-batch under ``no_sync`` rather than
the others (its only one here), so the ranks' gradients are never averaged (fixed in 4.46.3).
From 4.46.3, with ``average_tokens_across_devices=True``, the count is the world's and the update
right. ``--tokens-seen`` adds ``include_num_input_tokens_seen=True``: 4.46.x gathers each rank's
input token count and calls ``.item()`` on the world's -- a tensor of one count per rank, so
the ranks raise "a Tensor with 2 elements cannot be converted to Scalar" (4.47.0 sums first).

Prints the release, the ``num_items_in_batch`` the model got, and the largest difference between
the Trainer's update and the right one (0 up to float32 rounding where it is right).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import tempfile
from typing import Any

import torch

VOCAB = 5
IDS = torch.tensor([[1, 2, 3, 4, 0], [4, 3, 2, 1, 0]])
# 4 tokens, then 1; none at position 0, which 4.46.0 and 4.46.1 leave out of their count (they
# count labels[..., 1:], as a causal LM that shifts its labels inside would)
LABELS = torch.tensor([[-100, 2, 3, 4, 0], [-100, -100, -100, -100, 0]])


class TinyLM(torch.nn.Module):
    """Embedding then Linear; the loss is the sum of the token cross-entropies over the step's
    token count where the Trainer passes it (transformers' own models' convention), else the
    micro-batch's mean."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 3)
        self.head = torch.nn.Linear(3, VOCAB)
        self.counts: list = []  # num_items_in_batch, as passed

    def forward(self, input_ids: Any, labels: Any = None, **loss_kwargs: Any) -> dict:
        logits = self.head(self.embed(input_ids))
        count = loss_kwargs.get("num_items_in_batch")
        self.counts.append(None if count is None else int(count))
        terms = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        return {"loss": terms / (labels.ne(-100).sum() if count is None else count)}


def train(rank: int, ranks: int, tokens_seen: bool = False) -> str:
    """One Trainer step on this rank's sequences; the line to print."""
    import transformers
    from transformers import Trainer, TrainingArguments

    mine = [0, 1] if ranks == 1 else [rank]
    batches = [{"input_ids": IDS[i : i + 1], "labels": LABELS[i : i + 1]} for i in mine]
    model = TinyLM()
    before = [p.detach().clone() for p in model.parameters()]
    logits = model.head(model.embed(IDS))  # the right update: the 5-token mean's
    mean = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), LABELS.flatten(), ignore_index=-100
    )
    right = [-g for g in torch.autograd.grad(mean, list(model.parameters()))]

    class InOrder(Trainer):
        def get_train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(batches, batch_size=None)  # type: ignore[arg-type]

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    across = {"average_tokens_across_devices": True} if ranks > 1 else {}
    if tokens_seen:
        across["include_num_input_tokens_seen"] = True
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        max_steps=1,
        gradient_accumulation_steps=len(mine),
        max_grad_norm=0.0,
        **{k: v for k, v in across.items() if k in fields},
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    constant = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    InOrder(model=model, args=args, optimizers=(optimizer, constant)).train()
    update = [p.detach() - b for p, b in zip(model.parameters(), before)]
    off = max((u - r).abs().max().item() for u, r in zip(update, right))
    given = ", ".join(f"{k}={v}" for k, v in across.items() if k in fields) or "nothing more"
    return (
        f"transformers {transformers.__version__}, {ranks} rank(s), rank {rank} (given "
        f"{given}): num_items_in_batch passed {model.counts}; the Trainer's update differs "
        f"from the 5-token mean's by {off:.3g} (largest entry of the right update: "
        f"{max(r.abs().max().item() for r in right):.3g})"
    )


def rank_main(rank: int, ranks: int, port: int, tokens_seen: bool) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(ranks),
        LOCAL_WORLD_SIZE=str(ranks),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    print(train(rank, ranks, tokens_seen), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, choices=(1, 2), default=1)
    parser.add_argument("--tokens-seen", action="store_true")
    given = parser.parse_args()
    ranks = given.ranks
    if ranks == 1:
        print(train(0, 1, given.tokens_seen))
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(rank_main, args=(ranks, port, given.tokens_seen), nprocs=ranks)


if __name__ == "__main__":
    main()
