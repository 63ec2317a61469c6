"""accelerate 1.15's ParallelismConfig on the CPU, without ddpcheck: what it refuses (exit 1 when
any of the three shows, 0 when accelerate runs them all).

Two gloo ranks on the CPU, accelerate's own process-group set-up (``Accelerator(cpu=True)``
under the usual ``MASTER_ADDR``/``RANK``/``WORLD_SIZE`` environment), and three cases:

1. ``Accelerator(parallelism_config=ParallelismConfig(tp_size=2))``: a CPU world is
   ``DistributedType.MULTI_CPU``, which ``Accelerator.multi_device`` does not count, so
   ``ParallelismConfig._validate_accelerator`` raises "is only compatible DistributedType.FSDP
   (version 2) or DistributedType.Multi{Device} or DistributedType.DEEPSPEED, but got
   DistributedType.MULTI_CPU";
2. ``ParallelismConfig(dp_shard_size=2)`` with ``fsdp_plugin=FullyShardedDataParallelPlugin(
   fsdp_version=2)``: accelerate's state turns a plugin into ``DistributedType.FSDP`` only for
   the GPU-like types (``state.py``), so the plugin is ignored and the same ValueError follows;
3. the import that accelerate's FSDP2 x TP path makes (``Accelerator._prepare_tp``, when
   ``is_fsdp2``): ``from transformers.integrations.tensor_parallel import ReplicateParallel``,
   which transformers 5 no longer has (it moved its styles to ``transformers.distributed``):
   an ImportError, on any device, for every tensor-parallel model.

Measured 2026-12-07, torch 2.13.0 CPU, accelerate 1.15.0, transformers 5.25.0: all three shown,
exit 1. (ddpcheck's ``accelerate_nd`` declines with these reasons; ``hf_tp`` at ``dp > 1`` checks
transformers' own TP x FSDP2 composition, which runs on the CPU.)

    python bench/accelerate_nd_cpu.py
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch.multiprocessing as mp

WORLD = 2


def _case(name: str, make: object) -> str:
    try:
        make()  # type: ignore[operator]
    except (ValueError, ImportError) as error:
        return f"{name}: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return f"{name}: ran"


def _rank(rank: int, store: str, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=store,
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
    )
    from accelerate import Accelerator, ParallelismConfig
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import FullyShardedDataParallelPlugin

    def reset() -> None:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        os.environ.pop("ACCELERATE_USE_FSDP", None)

    def tp_alone() -> None:
        try:
            Accelerator(cpu=True, parallelism_config=ParallelismConfig(tp_size=2))
        finally:
            reset()

    def fsdp2_tp() -> None:
        try:
            Accelerator(
                cpu=True,
                parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=1),
                fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
            )
        finally:
            reset()

    def replicate_import() -> None:
        from transformers.integrations.tensor_parallel import (  # noqa: F401
            ReplicateParallel,  # type: ignore[attr-defined]
        )

    lines = [
        _case("ParallelismConfig(tp_size=2), no plugin", tp_alone),
        _case("ParallelismConfig(dp_shard_size=2) with an FSDP2 plugin", fsdp2_tp),
        _case("accelerate's _prepare_tp import under FSDP2", replicate_import),
    ]
    if rank == 0:
        with open(out, "w") as f:
            f.write("\n".join(lines))


def main() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "out.txt")
        mp.spawn(_rank, args=(port, out), nprocs=WORLD)
        with open(out) as f:
            lines = f.read().splitlines()
    for line in lines:
        print(line)
    refused = [line for line in lines if not line.endswith(": ran")]
    print(f"{len(refused)} of {len(lines)} refused")
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
