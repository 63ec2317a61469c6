"""Does one TrainingArguments(bf16=True) leave bfloat16 on for the next TrainingArguments in the
same process? Standalone (no ddpcheck): transformers 4.x (4.46.3 and 4.57.6 tried) writes
``ACCELERATE_MIXED_PRECISION`` into ``os.environ`` in ``TrainingArguments.__post_init__`` and reads
it back as the default of the next one, so a second ``Trainer`` built with ``bf16=False`` -- a
sweep, or ddpcheck's next example in a persistent rank -- still trains under bfloat16 autocast;
transformers 5 reads the variable but never writes it.

    python bench/hf_mixed_precision_env.py      # with the transformers release to try installed

Prints, after the second arguments, the variable, the mixed precision of their ``Trainer``'s
accelerator, and the dtype a float32 ``Linear`` computes in inside the model that accelerator
prepares (what autocast does to it).
"""

from __future__ import annotations

import os
import tempfile

import torch
import transformers
from transformers import Trainer, TrainingArguments


def main() -> None:
    os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
    folder = tempfile.mkdtemp()
    common = {"output_dir": folder, "use_cpu": True, "report_to": "none"}
    TrainingArguments(bf16=True, **common)
    second = TrainingArguments(bf16=False, **common)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    trainer = Trainer(model=model, args=second)
    seen = []  # the Linear's own output, inside the forward accelerate wraps in autocast
    model[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    trainer.accelerator.prepare_model(model)(torch.ones(1, 2))
    print(
        f"transformers {transformers.__version__}: after TrainingArguments(bf16=True), "
        f"TrainingArguments(bf16=False) leaves ACCELERATE_MIXED_PRECISION="
        f"{os.environ.get('ACCELERATE_MIXED_PRECISION')!r}; its Trainer's accelerator runs "
        f"{trainer.accelerator.mixed_precision!r} mixed precision, and a float32 Linear "
        f"computes in {seen[0]}"
    )


if __name__ == "__main__":
    main()
