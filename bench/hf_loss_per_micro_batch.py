"""Does the Trainer weigh every token alike under gradient accumulation? Standalone (no ddpcheck),
one process: two micro-batches of one sequence each, 4 labelled tokens in the first and 1 in the
second (the rest ``-100``), ``gradient_accumulation_steps=2``, one SGD step at lr 1. The right
update is minus the gradient of the mean over the 5 tokens. transformers 4.45.2 passes the model
no ``num_items_in_batch`` -- each micro-batch's loss is its own mean, divided by the accumulation
steps, so the lone token of the second weighs 4 times a token of the first (the bug
huggingface/transformers #34191, fixed in 4.46) -- whatever the model's forward takes; from 4.46
a forward with ``**loss_kwargs`` gets the step's token count and the update is right.

    python bench/hf_loss_per_micro_batch.py    # with the transformers release to try installed

Prints the release, whether the Trainer passed ``num_items_in_batch``, and the largest
difference between the Trainer's update and the right one (0 up to rounding where it is right).
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch
import transformers
from transformers import Trainer, TrainingArguments

VOCAB, LENGTH = 5, 4


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
        self.counts.append(count)
        terms = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        return {"loss": terms / (labels.ne(-100).sum() if count is None else count)}


def main() -> None:
    ids = torch.tensor([[1, 2, 3, 4], [4, 3, 2, 1]])
    labels = torch.tensor([[2, 3, 4, 0], [-100, -100, -100, 0]])  # 4 tokens, then 1
    batches = [{"input_ids": ids[i : i + 1], "labels": labels[i : i + 1]} for i in range(2)]

    model = TinyLM()
    before = [p.detach().clone() for p in model.parameters()]
    # the right update: minus the gradient of the mean over all 5 tokens
    logits = model.head(model.embed(ids))
    mean = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100
    )
    right = [-g for g in torch.autograd.grad(mean, list(model.parameters()))]

    class InOrder(Trainer):
        def get_train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(batches, batch_size=None)  # type: ignore[arg-type]

    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        max_steps=1,
        gradient_accumulation_steps=2,
        max_grad_norm=0.0,
    )
    constant = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    InOrder(model=model, args=args, optimizers=(optimizer, constant)).train()
    update = [p.detach() - b for p, b in zip(model.parameters(), before)]
    off = max((u - r).abs().max().item() for u, r in zip(update, right))
    print(
        f"transformers {transformers.__version__}: num_items_in_batch passed "
        f"{model.counts}; the Trainer's update differs from the 5-token mean's by {off:.3g} "
        f"(largest entry of the right update: "
        f"{max(r.abs().max().item() for r in right):.3g})"
    )


if __name__ == "__main__":
    main()
