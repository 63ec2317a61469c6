"""transformers' row-wise style fails on a non-contiguous input that torch's takes: confirmed
without ddpcheck (exit 1 when the installed transformers fails, 0 when it trains the layer as
torch's ``RowwiseParallel`` does).

Found by ddpcheck's ``hf_tp`` target: an attention block with one feature per head hands its
output projection ``(weights @ v).transpose(1, 2).reshape(b, L, heads)``, which ``reshape``
returns as a non-contiguous *view* (the merged head dimension has size 1). transformers 5.25.0's
``RowwiseParallel`` wraps its input with ``_from_local_last_dim_shard``
(transformers/distributed/tensor_parallel.py), which passes ``DTensor.from_local`` the stride
of a *contiguous* tensor of the global shape whatever the local tensor's own: DTensor then plans
the linear's ``view`` for a contiguous input, and the local ``view`` fails ("view size is not
compatible with input tensor's size and stride"). torch's ``RowwiseParallel`` (no stride given)
trains the same layer on the same input, and matches the one-process layer. transformers' own
models call ``.contiguous()`` before ``o_proj``, which hides it; a model of your own does not.
transformers 5.20.0 (``from_local`` without a shape or stride) trains it: exit 0 (2026-12-07).

    python bench/hf_tp_noncontiguous.py
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _input() -> torch.Tensor:
    """(batch 2, 3 positions, 4 features), a non-contiguous view as attention hands it on."""
    g = torch.Generator().manual_seed(0)
    heads = torch.randn(2, 4, 3, 1, generator=g, dtype=torch.float64)  # (b, heads, L, 1)
    x = heads.transpose(1, 2).reshape(2, 3, 4)
    assert not x.is_contiguous()
    return x


def _layer() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3, dtype=torch.float64)


def _rank(rank: int, path: str, which: str, answers: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    layer, reference = _layer(), _layer()
    full = _input()
    local = full.chunk(WORLD, dim=-1)[rank]  # this rank's input features, as a colwise layer's
    if which == "torch":
        from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

        parallelize_module(layer, mesh, RowwiseParallel())
    else:
        from transformers import PretrainedConfig
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        layer.config = PretrainedConfig()
        layer._mesh_manager = None
        plan = {"weight": "rowwise", "bias": "rowwise", "": "rowwise"}  # expanded, as transformers
        apply_tensor_parallelism(layer, mesh, plan)
    try:
        out = layer(local.detach().requires_grad_())
        out.sum().backward()
    except RuntimeError as error:
        answers[rank] = f"fails: {str(error).splitlines()[0]}"
        dist.destroy_process_group()
        return
    expected = reference(full)
    expected.sum().backward()
    grad = layer.weight.grad
    grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
    off = (out - expected).abs().max().item()
    off = max(off, (grad - reference.weight.grad).abs().max().item())
    answers[rank] = f"trains: {off:.1e} from the one-process layer"
    dist.destroy_process_group()


def run(which: str) -> str:
    folder = tempfile.mkdtemp(prefix="hf-tp-noncontiguous-")
    with mp.Manager() as manager:
        answers = manager.dict()
        mp.spawn(_rank, (os.path.join(folder, "store"), which, answers), nprocs=WORLD)
        return answers[0]


def main() -> int:
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    print("input: (2, 3, 4) float64, a non-contiguous view, its features sharded over 2 ranks")
    verdicts = {which: run(which) for which in ("torch", "transformers")}
    for which, verdict in verdicts.items():
        print(f"{which:>12}'s rowwise: {verdict}")
    if verdicts["transformers"].startswith("fails") and verdicts["torch"].startswith("trains"):
        print("transformers' RowwiseParallel fails where torch's trains: the bug shows")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
