"""transformers' own FSDP2 x tensor parallelism (``from_pretrained(...,
distributed_config=DistributedConfig(tp_size=2, fsdp_size=2))``) on a tiny random Llama whose LM
head is tied to its token embedding, without ddpcheck: exit 1 when the tied model's losses leave
the one-process reference's after an optimizer step while the untied model's stay on it; 0 when
both stay on it; 2 otherwise.

Why it may break: ``maybe_distribute_model`` applies FSDP2 to the model as it was built, untied
(``init.no_tie_weights``), and ``from_pretrained`` ties afterwards (``tie_weights`` sets
``lm_head.weight`` to the embedding's parameter). The embedding's FSDP2 unit then manages the
parameter, but the head holds the sharded parameter object FSDP2 swaps out of the embedding
during forward, and the root unit still holds the head's old, now unused, parameter.

Here: W=4 (gloo, CPU, float64), ``dp=2 x tp=2``, every rank the same batch (so the average over
``dp`` is the one-process gradient), three SGD steps, the losses compared to the same model
trained in one process.

    python bench/hf_fsdp_tied.py
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS, LR = 3, 0.5


def _model_dir(folder: str, tied: bool) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=11,
        hidden_size=8,
        intermediate_size=6,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=2,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    path = os.path.join(folder, f"llama-tied-{tied}")
    LlamaForCausalLM(config).to(torch.float64).save_pretrained(path)
    return path


def _losses(model: torch.nn.Module) -> list[float]:
    tokens = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _rank(rank: int, store: str, path: str) -> None:
    from transformers import LlamaForCausalLM
    from transformers.distributed.configuration_utils import DistributedConfig

    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    config = DistributedConfig(tp_size=2, fsdp_size=2)
    model = LlamaForCausalLM.from_pretrained(
        path, distributed_config=config, dtype=torch.float64, attn_implementation="eager"
    )
    model.train()
    losses = _losses(model)
    reference = LlamaForCausalLM.from_pretrained(
        path, dtype=torch.float64, attn_implementation="eager"
    )
    reference.train()
    expected = _losses(reference)
    error = max(abs(a - b) for a, b in zip(losses, expected))
    if rank == 0:
        shown = [round(x, 6) for x in losses], [round(x, 6) for x in expected]
        print(f"  losses {shown[0]}, one process {shown[1]}")
    dist.barrier()
    dist.destroy_process_group()
    if error > 1e-9:
        sys.exit(3)


def trains_right(tied: bool) -> bool:
    folder = tempfile.mkdtemp(prefix="hf-fsdp-tied-")
    path = _model_dir(folder, tied)
    try:
        mp.spawn(_rank, (os.path.join(folder, "store"), path), nprocs=4)
        return True
    except (mp.ProcessExitedException, mp.ProcessRaisedException):
        return False


def main() -> int:
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    print("DistributedConfig(tp_size=2, fsdp_size=2), a head tied to the embedding:")
    tied = trains_right(tied=True)
    print("the same, untied:")
    untied = trains_right(tied=False)
    if untied and not tied:
        print("untied right, tied wrong after a step: the tie under FSDP2 (exit 1)")
        return 1
    if untied and tied:
        print("right tied and untied (exit 0)")
        return 0
    print("inconclusive (exit 2)")
    return 2


if __name__ == "__main__":
    sys.exit(main())
