"""torch's FSDP2 over a tensor-parallel shard that is empty on one rank loses the shard's shape,
and gathering it then hangs: confirmed without ddpcheck (exit 1 when the installed torch shows
the bug, 0 when it does not).

Found by ddpcheck's battery scenario "tp-uneven-adam-clip" under ``torch_2d`` at W=4 (a ``(dp,
tp) = (1, 4)`` mesh: ``TensorParallel(tp=None)`` is the whole world): an MLP's hidden width of 5
over tp=4 is ``torch.chunk``-ed 2, 2, 1 and *nothing* for the last rank, so its row-wise
``down.weight`` shard is ``(3, 0)``. ``fully_shard`` turns that into a ``(0, 0)`` local tensor
(``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``, ``_init_sharded_param``: ``length =
sharded_param.size(shard_dim) if sharded_param.numel() > 0 else 0`` zeroes the FSDP shard dim
when *another* dim is empty). ``full_tensor()`` then pads it to ``(0, 2)`` -- 0 elements where
the other ranks all-gather 6 -- and gloo lets the empty rank return at once (with a ``(0, 5)``
"full" tensor) while the others wait for it for ever: the ranks' collective sequences part.
Without FSDP2 (``torch_tp``) the same shard is ``(3, 0)`` and the same scenario trains right.

Here: W=2, a ``(dp, tp) = (1, 2)`` mesh, ``nn.Linear(1, 3)`` row-wise (weight ``(3, 1)``, sharded
on dim 1: ``(3, 1)`` on tp rank 0, ``(3, 0)`` on tp rank 1), then ``fully_shard`` over ``dp``.
``torch_2d`` declines plans that leave a tp rank an empty shard
(``ddpcheck.targets.tensor_parallel.empty_shard``), naming this script.

    python bench/fsdp2_empty_tp_shard.py
"""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WAIT = 20.0  # seconds: gathering a (3, 1) weight takes milliseconds


def _rank(rank: int, path: str, fsdp: bool) -> None:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    layer = parallelize_module(nn.Linear(1, 3, bias=False), mesh["tp"], RowwiseParallel())
    expected = (3, 1 - rank)  # torch.chunk(1 column, 2): one column, then none
    if fsdp:
        fully_shard(layer, mesh=mesh["dp"])  # dp=1: every rank keeps its whole tp shard
    local = tuple(layer.weight.to_local().shape)
    print(f"  rank {rank}: {layer.weight.placements} local {local} (expected {expected})")
    faulthandler.dump_traceback_later(WAIT, exit=True)  # a hang ends the process, not the run
    full = tuple(layer.weight.full_tensor().shape)
    faulthandler.cancel_dump_traceback_later()
    print(f"  rank {rank}: full_tensor() {full}")
    dist.barrier()
    dist.destroy_process_group()
    if local != expected or full != (3, 1):
        sys.exit(2)


def answers(fsdp: bool) -> bool:
    folder = tempfile.mkdtemp(prefix="fsdp2-empty-shard-")
    try:
        mp.spawn(_rank, (os.path.join(folder, "store"), fsdp), nprocs=2)
        return True
    except (mp.ProcessExitedException, mp.ProcessRaisedException):
        return False


def main() -> int:
    print(f"torch {torch.__version__}")
    print("row-wise Linear(1, 3) over tp=2, without FSDP2:")
    plain = answers(fsdp=False)
    print("  " + ("right" if plain else "wrong shape or no answer"))
    print("the same, then fully_shard over dp=1:")
    sharded = answers(fsdp=True)
    print("  " + ("right" if sharded else f"wrong shape, or no answer in {WAIT:.0f} s"))
    if plain and not sharded:
        print("torch's FSDP2 breaks an empty tensor-parallel shard: the bug is present")
        return 1
    print("FSDP2 keeps the empty shard's shape and gathers it: the bug is absent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
