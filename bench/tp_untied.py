"""torch's ``parallelize_module`` unties a tied embedding and output head: confirmed without
ddpcheck (exit 1 when the installed torch leaves the two modules with two parameters after the
plan, 0 when it keeps the tie).

Not a crash and not torch's promise either way (its docs say nothing of tied weights): each
style distributes its own module's parameters (``distribute_module`` registers a new
``nn.Parameter`` per module), so ``head.weight is embedding.weight`` no longer holds, and
training goes on with two matrices, each receiving only its own use's gradient. Here: W=2, a
vocabulary of 5 (3+2 rows), the embedding ``RowwiseParallel(input_layouts=Replicate())`` and
the head ``ColwiseParallel(output_layouts=Replicate())`` -- both ``Shard(0)`` on the same
``(5, 4)`` matrix -- one step's gradient of a token loss compared with a one-process copy's:
untied it differs; re-tied after the plan (``head.weight = embedding.weight``, what
ddpcheck's ready-made targets do, ``retie``) it matches. ddpcheck's mutant K16 (``TieLostTP``)
is a ``torch_tp`` that skips that re-tie.

    python bench/tp_untied.py
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, path: str, retie: bool) -> None:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding, self.head = nn.Embedding(5, 4), nn.Linear(4, 5)
            self.head.weight = self.embedding.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.embedding(ids)))

    torch.manual_seed(0)
    reference = Tied().double()
    model = Tied().double()
    model.load_state_dict(reference.state_dict())
    plan = {
        "embedding": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }
    parallelize_module(model, mesh, plan)
    tied = model.head.weight is model.embedding.weight
    if retie:
        model.head.weight = model.embedding.weight
    ids, targets = torch.tensor([[0, 1, 4], [3, 2, 2]]), torch.tensor([[1, 2, 0], [4, 4, 3]])
    for m in (model, reference):
        nn.functional.cross_entropy(m(ids).flatten(0, 1), targets.flatten()).backward()
    grad = model.embedding.weight.grad.full_tensor()
    error = (grad - reference.embedding.weight.grad).abs().max().item()
    if rank == 0:
        print(f"  tied after the plan: {tied}; re-tied: {retie}; gradient error {error:.2e}")
    dist.destroy_process_group()
    if error > 1e-12:
        sys.exit(3)


def trains_right(retie: bool) -> bool:
    folder = tempfile.mkdtemp(prefix="tp-untied-")
    try:
        mp.spawn(_rank, (os.path.join(folder, "store"), retie), nprocs=2)
        return True
    except (mp.ProcessExitedException, mp.ProcessRaisedException):
        return False


def main() -> int:
    print(f"torch {torch.__version__}")
    print("a tied embedding and head, both sharded over the vocabulary by parallelize_module:")
    plain = trains_right(retie=False)
    print("  " + ("matches the one-process gradient" if plain else "the gradient differs"))
    print("the same, tied again after the plan:")
    retied = trains_right(retie=True)
    print("  " + ("matches the one-process gradient" if retied else "the gradient differs"))
    if retied and not plain:
        print("parallelize_module unties the weight: the bug shows (exit 1)")
        return 1
    print("the tie survives the plan here (exit 0)" if plain else "inconclusive (exit 2)")
    return 0 if plain else 2


if __name__ == "__main__":
    sys.exit(main())
