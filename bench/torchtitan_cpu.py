"""Does torchtitan's own ``parallelize_llama`` train on the CPU with gloo? Standalone (no
ddpcheck): a tiny Llama 3 of torchtitan's model classes (dim 16, 2 heads, 2 layers, vocab 32)
parallelized by torchtitan over 2 processes, one forward and backward with torchtitan's loss
normalisation (per-token sum / global token count), every gradient against the same model trained
in one process on the whole batch.

    python bench/torchtitan_cpu.py          # the adapted runs, and spmd_types (obstacle 5)
    python bench/torchtitan_cpu.py --plain  # torchtitan exactly as shipped: stops at obstacle 2

Exit 0: every adapted run matches the reference; 1: a run computes wrong gradients; 2: torchtitan
does not import (obstacle 1), an adapted run does not start, or (--plain) a run as shipped fails.

Measured with torchtitan 0.3.0 (torch 2.13.0+cpu, triton 3.9.0): what stands
between torchtitan and a CPU run, each printed as an obstacle (docs/pipeline-parallel.md, "The
N-D option-space map"):

1. ``import triton`` at import of every model (``distributed/minimal_async_ep/kernels.py``;
   0.2.2: ``models/moe/kernels.py``): no import without the CUDA-only ``triton`` wheel installed
   (it imports on a CPU machine; no kernel runs here).
2. ``tools/utils.device_type`` is ``"cuda"`` where no accelerator is found, so
   ``ParallelDims.build_mesh`` calls ``init_device_mesh("cuda", ...)``: "AssertionError: Torch
   not compiled with CUDA enabled" (--plain stops there, at every layout).
3. The language models' attention: ``sdpa`` is refused ("no longer supported for language
   models"), ``flex`` has no backward on the CPU ("FlexAttention does not support backward on
   CPU"), ``varlen`` is a CUDA kernel. Adapted: the layers' ``inner_attention`` replaced by
   torchtitan's own ``ScaledDotProductAttention`` (causal, as the flex mask of one document).
4. FSDP (``data_parallel_shard_degree`` > 1): torchtitan sets ``gradient_divide_factor=1.0`` and
   FSDP2 then reduce-scatters with ``ReduceOp.PREMUL_SUM``: "Cannot use ReduceOp.PREMUL_SUM with
   Gloo". Adapted: ``set_force_sum_reduction_for_comms(True)`` (a SUM, then a division by 1.0).
5. ``spmd_backend="spmd_types"`` (0.3.0's default) refused this eager, non-meta build: "When
   dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh". The adapted
   runs use ``partial_dtensor``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import traceback
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB, DIM, HEADS, BATCH, SEQ = 32, 16, 2, 4, 8
#: (data_parallel_shard_degree, tensor_parallel_degree, enable_sequence_parallel): W = 2
LAYOUTS = ((2, 1, False), (1, 2, False), (1, 2, True))


def tiny_config(parallelism, sdpa: bool):
    """torchtitan's debug model, shrunk; its layers' attention swapped for SDPA when asked."""
    import torchtitan.models.llama3 as L
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    rope = ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=10000, scaling="none")
    config = L.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=L._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=L._NORM_INIT),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init=L._output_linear_init(DIM)
        ),
        layers=L._build_llama3_layers(
            n_layers=2, dim=DIM, n_heads=HEADS, hidden_dim=32, rope=rope, attn_backend="flex"
        ),
    )
    if sdpa:
        for layer in config.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    return config


def forward(model, tokens, sdpa: bool):
    positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
    masks = None if sdpa else model.get_attention_masks(positions)
    out = model(tokens, positions, masks)
    return out.full_tensor() if hasattr(out, "full_tensor") else out


def rank_main(rank: int, init: str, dp: int, tp: int, sp: bool, adapt: bool, backend: str, q):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=dp * tp)
    try:
        import torchtitan.distributed.parallel_dims as parallel_dims
        from torch.distributed.fsdp import FSDPModule
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.models.llama3 import parallelize_llama

        if adapt:
            parallel_dims.device_type = "cpu"  # obstacle 2
        par = ParallelismConfig(
            data_parallel_shard_degree=dp,
            tensor_parallel_degree=tp,
            enable_sequence_parallel=sp,
            spmd_backend=backend,
        )
        dims = parallel_dims.ParallelDims.from_config(par, dp * tp)
        dims.build_mesh()
        torch.manual_seed(0)
        reference = tiny_config(par, sdpa=adapt).build()
        with torch.no_grad():
            reference.init_weights(buffer_device=None)
        model = parallelize_llama(
            copy.deepcopy(reference),
            parallel_dims=dims,
            training=TrainingConfig(mixed_precision_param="float32"),
            parallelism=par,
            compile_config=CompileConfig(),
            ac_config=None,
            dump_folder=tempfile.gettempdir(),
        )
        if adapt:  # obstacle 4
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
        torch.manual_seed(1)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        ce = torch.nn.functional.cross_entropy
        out = forward(reference, inputs, adapt)
        ce(out.flatten(0, 1), labels.flatten(), reduction="sum").div(labels.numel()).backward()
        shard = BATCH // dp
        first = (dims.get_mesh("batch").get_local_rank() if dp > 1 else 0) * shard
        rows = slice(first, first + shard)
        out = forward(model, inputs[rows], adapt)
        loss = ce(out.flatten(0, 1), labels[rows].flatten(), reduction="sum") / labels.numel()
        loss.backward()
        worst, where = 0.0, ""
        for (name, p), q_ in zip(model.named_parameters(), reference.parameters()):
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            gap = (grad - q_.grad).abs().max().item()
            if gap > worst:
                worst, where = gap, name
        q.put((rank, "ran", f"worst gradient gap {worst:.2e} ({where})", worst))
    except Exception as error:  # an obstacle: its last line is what the docs quote
        last = traceback.format_exception_only(error)[-1].strip()
        q.put((rank, "failed", last[:300], None))
    finally:
        dist.destroy_process_group()


def run(dp: int, tp: int, sp: bool, adapt: bool, backend: str) -> tuple[str, str, float | None]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.NamedTemporaryFile(delete=False) as f:
        init = f"file://{f.name}"
    os.unlink(f.name)
    procs = [
        ctx.Process(target=rank_main, args=(r, init, dp, tp, sp, adapt, backend, q))
        for r in range(dp * tp)
    ]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    failed = [r for r in results if r[1] == "failed"]
    _rank, status, text, worst = (failed or results)[0]
    return status, text, worst if not failed else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plain", action="store_true", help="torchtitan as shipped")
    args = parser.parse_args()
    try:
        import torchtitan
        from torchtitan.models.llama3 import parallelize_llama  # noqa: F401  obstacle 1
    except Exception as error:
        print(f"torchtitan does not import: {traceback.format_exception_only(error)[-1].strip()}")
        return 2
    print(f"torchtitan {getattr(torchtitan, '__version__', '?')}, torch {torch.__version__}")
    status = 0
    cases = [(dp, tp, sp, not args.plain, "partial_dtensor") for dp, tp, sp in LAYOUTS]
    if not args.plain:
        cases += [(2, 1, False, True, "spmd_types")]  # obstacle 5
    for dp, tp, sp, adapt, backend in cases:
        what, text, worst = run(dp, tp, sp, adapt, backend)
        label = f"dp_shard={dp} tp={tp} sp={sp} {backend} {'adapted' if adapt else 'plain'}"
        print(f"{label}: {what}: {text}")
        if what == "ran" and worst is not None and worst > 1e-5:
            status = 1
        elif what == "failed" and backend == "partial_dtensor":
            status = max(status, 2)
    return status


if __name__ == "__main__":
    sys.exit(main())
