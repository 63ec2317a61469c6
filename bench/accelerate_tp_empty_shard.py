"""accelerate's ``prepare`` under a tensor-parallel ``ParallelismConfig`` re-points the optimizer
by each parameter's local storage address, and FSDP2 leaves a parameter with fewer rows than
ranks an empty local shard, whose address is 0 -- so two such parameters on one rank collide and
the optimizer ends up holding one of them twice and the other not at all. Without ddpcheck; exit
1 when some rank's optimizer after ``prepare`` does not hold exactly the model's parameters, 0
when it does.

Two gloo ranks on the CPU. accelerate refuses a ``ParallelismConfig`` in a CPU world
(``bench/accelerate_nd_cpu.py``), so, as ``bench/accelerate_nd_whatif.py`` does, this script
tells accelerate that a CPU world is multi-device (``Accelerator.multi_device`` patched): on a
GPU the same ``prepare`` runs unpatched. The model: ``nn.Linear(2, 1)`` -- a weight of one row
and a bias of one element -- under ``fully_shard`` over the two ranks (as transformers' FSDP2
leaves a model it distributed), marked tensor-parallel as transformers marks it (``tp_size``),
and ``Accelerator(parallelism_config=ParallelismConfig(tp_size=2)).prepare(model, optimizer)``.
Rank 1 holds both parameters' shards empty: ``_prepare_tp`` builds ``{address: parameter}``
(``_get_named_parameters`` then ``mapping[_get_tensor_address(p)]``), both addresses are 0, and
the optimizer's list becomes ``[bias, bias]``: the weight is never stepped there, and an
optimizer whose list differs across ranks issues different collectives (the what-if crashed with
a gloo size mismatch, "8 vs 4").

Measured 2026-12-08, torch 2.13.0 CPU, accelerate 1.15.0 and 1.16.0: rank 0 holds the weight
and the bias, rank 1 the bias twice: exit 1.

    python bench/accelerate_tp_empty_shard.py
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import torch.multiprocessing as mp

WORLD = 2


def _rank(rank: int, port: str, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
    )
    import accelerate.accelerator as acc
    import torch
    from accelerate import Accelerator, ParallelismConfig
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    # the what-if: a CPU world counted as multi-device (bench/accelerate_nd_cpu.py: refused)
    acc.Accelerator.multi_device = property(lambda self: self.use_distributed)
    accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig(tp_size=2))
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    fully_shard(model, mesh=accelerator.torch_device_mesh["tp"])
    model.tp_size = 2  # what transformers' PreTrainedModel.tp_size says of a model it sharded
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    held = [names.get(id(p), "(not the model's)") for p in optimizer.param_groups[0]["params"]]
    local = {
        n: tuple((p._local_tensor if isinstance(p, DTensor) else p).shape)
        for n, p in model.named_parameters()
    }
    line = f"rank {rank}: local shards {local}; the optimizer holds {held}"
    with open(f"{out}.{rank}", "w") as f:
        f.write(f"{line}\t{sorted(held) == sorted(names.values())}")


def main() -> int:
    import accelerate
    import torch

    print(f"accelerate {accelerate.__version__}, torch {torch.__version__}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "out")
        mp.spawn(_rank, args=(port, out), nprocs=WORLD)
        lines = []
        for rank in range(WORLD):
            with open(f"{out}.{rank}") as f:
                lines.append(f.read().split("\t"))
    for line, _ in lines:
        print(line)
    wrong = [line for line, right in lines if right != "True"]
    print(f"{len(wrong)} of {WORLD} ranks' optimizers do not hold the model's parameters")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
