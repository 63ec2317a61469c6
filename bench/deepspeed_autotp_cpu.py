"""Does DeepSpeed's AutoTP *training* (``"tensor_parallel": {"autotp_size": N}`` in the config,
DeepSpeed >= 0.16.4) run on the CPU with gloo? Standalone (no ddpcheck): a tiny random
transformers ``LlamaForCausalLM`` (hidden 16, 2 layers, 2 heads, vocab 32) given to
``deepspeed.initialize`` with ``autotp_size=2`` over 2 processes (tp = 2, dp = 1, ZeRO stage 0),
three SGD steps on the same batch everywhere, every parameter gathered back and compared with the
same model stepped in one process.

    TORCH_EXTENSIONS_DIR=$(mktemp -d) python bench/deepspeed_autotp_cpu.py   # a venv with DeepSpeed
    python bench/deepspeed_autotp_cpu.py --no-shm-op     # skip the C++ op's build (see below)
    python bench/deepspeed_autotp_cpu.py --no-shm-op --architecture phi3 [--wrapped]

``--architecture NAME``: a tiny random model of another transformers architecture (its
``model_type``: qwen3, gemma3_text, phi3, olmo2, ...) instead of Llama; ``--wrapped``: hand
``deepspeed.initialize`` a module that returns the model's logits and has no ``config`` (AutoTP
then parses its linear layers instead of reading the model's own plan). The loss is the tokens'
next-token cross-entropy, computed from the logits in both ways.

``--no-shm-op`` makes ``deepspeed.comm.torch.build_shm_op`` return None, as it does where the op
is incompatible: DeepSpeed then all-reduces through torch.distributed (gloo) instead of its CPU
shared-memory op, whose first build takes minutes on a loaded machine (100-285 s at load 6-11,
over 5 min at load ~50). It changes how a sum travels, not what AutoTP shards.

Measured 2026-12-08 (DeepSpeed 0.19.8, transformers 5.25.0, torch 2.13.0+cpu, --no-shm-op):
llama, qwen3 handed whole and llama wrapped: exit 0 (within 1.5e-08); **qwen3 --wrapped: exit
1** -- the parser splits q/k over heads and leaves q_norm/k_norm with each rank's partial
gradient (2.4e-04 off after 3 steps, the two ranks apart); phi3 and olmo2 handed whole: exit 2
(their plans' 'rowwise_split_input' refused by TPPlanConverter), wrapped: exit 2 (phi3: the
packed qkv_proj, TypeError; olmo2: its q/k norms over the whole projection, RuntimeError).

Exit 0: AutoTP trains and matches the reference; 1: it runs and the weights differ; 2: it does not
run (the error printed is what docs/pipeline-parallel.md quotes).
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
STEPS = 3
HANG_SECONDS = 150


class Wrapped(torch.nn.Module):
    """A causal LM behind a module of its own: logits out, no ``config`` for AutoTP to read."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids, use_cache=False).logits


def tiny_model(architecture: str = "llama", wrapped: bool = False):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        architecture,
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    lm = AutoModelForCausalLM.from_config(config).float()
    return Wrapped(lm) if wrapped else lm


def logits_of(model, tokens):
    out = model(input_ids=tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


def next_token_loss(model, tokens):
    logits = logits_of(model, tokens)[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1))


def rank_main(rank: int, init: str, q, no_shm_op: bool, architecture: str, wrapped: bool) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)  # a hang: where each rank waits
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        import deepspeed

        if no_shm_op:
            import importlib

            importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        reference = tiny_model(architecture, wrapped)
        model = tiny_model(architecture, wrapped)
        torch.manual_seed(1)
        tokens = torch.randint(0, 32, (2, 8))
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 0},
            "tensor_parallel": {"autotp_size": WORLD},
            "gradient_clipping": 0.0,
        }
        engine, *_ = deepspeed.initialize(model=model, config=config, dist_init_required=False)
        opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for _ in range(STEPS):
            engine.backward(next_token_loss(engine, tokens))
            engine.step()
            opt.zero_grad()
            next_token_loss(reference, tokens).backward()
            opt.step()
        worst, where, sharded = 0.0, "", 0
        named = dict(reference.named_parameters())
        for name, p in engine.module.named_parameters():
            full = p.data
            want = named[name].data
            if full.shape != want.shape:  # a tensor-parallel shard: gather it
                dim = next(i for i, (a, b) in enumerate(zip(full.shape, want.shape)) if a != b)
                parts = [torch.empty_like(full) for _ in range(WORLD)]
                dist.all_gather(parts, full.contiguous())
                full = torch.cat(parts, dim)
                sharded += 1
            gap = (full - want).abs().max().item()
            if gap > worst:
                worst, where = gap, name
        if not sharded:  # AutoTP did nothing: a match would prove nothing
            raise RuntimeError("AutoTP sharded no parameter")
        text = f"{sharded} parameters sharded, worst weight gap after {STEPS} steps {worst:.2e}"
        q.put((rank, "ran", f"{text} ({where})", worst))
    except Exception as error:
        q.put((rank, "failed", traceback.format_exception_only(error)[-1].strip()[:400], None))
        traceback.print_exc()
    finally:
        dist.destroy_process_group()


def main() -> int:
    no_shm_op, wrapped = "--no-shm-op" in sys.argv[1:], "--wrapped" in sys.argv[1:]
    args = sys.argv[1:]
    architecture = args[args.index("--architecture") + 1] if "--architecture" in args else "llama"
    try:
        import deepspeed
    except Exception as error:
        print(f"deepspeed does not import: {error}")
        return 2
    print(
        f"deepspeed {deepspeed.__version__}, torch {torch.__version__}: {architecture}"
        f"{' wrapped' if wrapped else ''}"
    )
    if not no_shm_op:
        from deepspeed.accelerator import get_accelerator

        # the CPU accelerator's shared-memory op, built once here (minutes on a loaded machine)
        # rather than by both ranks inside initialize, where the build reads as a hang
        get_accelerator().create_op_builder("ShareMemCommBuilder").load()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.NamedTemporaryFile(delete=False) as f:
        init = f"file://{f.name}"
    os.unlink(f.name)
    procs = [
        ctx.Process(target=rank_main, args=(r, init, q, no_shm_op, architecture, wrapped))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    try:
        results = sorted(q.get(timeout=HANG_SECONDS + 30) for _ in procs)
    except Exception:  # queue.Empty: a rank hung (faulthandler printed its stack) or died
        for p in procs:
            p.join(timeout=30)
        print(f"no result within {HANG_SECONDS} s: exit codes {[p.exitcode for p in procs]}")
        return 2
    for p in procs:
        p.join(timeout=60)
    for rank, status, text, _ in results:
        print(f"rank {rank}: {status}: {text}")
    if any(s == "failed" for _, s, _, _ in results):
        return 2
    return 1 if any(w is not None and w > 1e-5 for *_, w in results) else 0


if __name__ == "__main__":
    sys.exit(main())
