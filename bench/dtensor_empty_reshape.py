"""torch's DTensor never returns from reshaping an empty tensor of some shapes: confirmed without
ddpcheck (exit 1 when the installed torch hangs, 0 when it answers).

Found by ddpcheck's tensor-parallel examples: a rank whose micro-batch holds no sample (a global
batch smaller than dp x accumulation) runs a forward on a (0, ...) activation, and a Replicate
DTensor's ``reshape`` of ``(0, 2, 2)`` to ``(0, 2)`` loops forever in the sharding propagation's
``view_groups`` (torch/distributed/tensor/_ops/_view_ops.py, torch 2.13.0: with an empty dim the
sizes' products no longer pin the grouping, and a trailing size-1 target makes it backtrack for
good). ``(0, 3, 2) -> (0, 2)`` answers. The tensor-parallel targets decline scenarios with an
empty micro-batch (``ddpcheck.targets.tensor_parallel``), naming this script.

    python bench/dtensor_empty_reshape.py
"""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = (((0, 3, 2), (0, 2)), ((0, 2, 2), (0, 2)))
WAIT = 20.0  # seconds: a reshape of an empty tensor takes microseconds


def _rank(rank: int, path: str, src: tuple[int, ...], dst: tuple[int, ...]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    faulthandler.dump_traceback_later(WAIT, exit=True)  # a hang ends the process, not the run
    x = DTensor.from_local(torch.zeros(src), mesh, [Replicate()], run_check=False)
    x.reshape(dst)
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


def answers(src: tuple[int, ...], dst: tuple[int, ...]) -> bool:
    folder = tempfile.mkdtemp(prefix="dtensor-reshape-")
    try:
        mp.spawn(_rank, (os.path.join(folder, "store"), src, dst), nprocs=2)
        return True
    except mp.ProcessExitedException:
        return False
    except mp.ProcessRaisedException:
        return False


def main() -> int:
    print(f"torch {torch.__version__}")
    hung = []
    for src, dst in SHAPES:
        ok = answers(src, dst)
        verdict = "answers" if ok else f"no answer in {WAIT:.0f} s"
        print(f"Replicate DTensor {src}.reshape{dst}: {verdict}")
        if not ok:
            hung.append((src, dst))
    if hung:
        print("torch's DTensor reshape of an empty tensor hangs: the bug is present")
        return 1
    print("every reshape answered: the bug is absent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
