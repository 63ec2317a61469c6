"""A rank that issues one DTensor collective more than its peers: named ``collectives mismatched``
from the sequence files, before the deadline, never a hang.

``ExtraOnRankOne`` is ``torch_tp`` whose rank 1 all-reduces one more scalar over the tp group
after the backward (a functional collective, as DTensor issues them); rank 0 goes on to the
harness's gather of the gradients. The wait reads both ranks' sequence files every 0.3 s and
names the first collective where they differ, each side's call site beside it.

    python bench/dtensor_mismatch.py     # prints the verdict; 17.8 s with the world's start
"""

import dataclasses
import time

import torch.distributed as dist

import ddpcheck
from ddpcheck._language.sharded_models import ShardedBlock, ShardedSpec, sequence_data
from ddpcheck._language.tensor_parallel import TensorParallel
from ddpcheck.targets.tensor_parallel import TorchTPTarget


@dataclasses.dataclass(frozen=True)
class ExtraOnRankOne(TorchTPTarget):
    """rank 1 all-reduces one DTensor gradient more (a Partial redistributed on one rank only)."""

    def after_backward(self, model, optimizer):
        super().after_backward(model, optimizer)
        if dist.get_rank() == 1:
            from torch.distributed.tensor import DTensor

            g = next(p.grad for p in model.parameters() if isinstance(p.grad, DTensor))
            import torch.distributed._functional_collectives as funcol

            funcol.all_reduce(g.to_local().sum().reshape(1), "sum", (g.device_mesh, 0)).wait()


def main():
    sc = ddpcheck.Scenario(
        ShardedSpec(blocks=(ShardedBlock("mlp", 4),), width=4),
        data=sequence_data,
        global_batch=4,
        steps=1,
        rank_seeds=False,
        tensor_parallel=TensorParallel((("blocks.0.up", "colwise"), ("blocks.0.down", "rowwise"))),
    )
    t0 = time.time()
    try:
        ddpcheck.check_example(ExtraOnRankOne(), sc, 2, deadline=60)
        print("passed")
    except ddpcheck.DdpcheckError as e:
        print(type(e).__name__, time.time() - t0)
        print(e)


if __name__ == "__main__":
    main()
