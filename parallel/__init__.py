"""The implementations under test: a readable DDP, a ZeRO-1 style sharded optimizer, a
tensor-parallel column/row layer pair and sequence-parallel norms beside it.

Every collective is visible at its call site; see ``ddp.py``, ``sharded_optimizer.py``,
``tensor_parallel.py`` and ``sequence_parallel.py``.
"""

from parallel import sequence_parallel, sharding, tensor_parallel
from parallel._checks import InvalidArgument
from parallel.ddp import DDP
from parallel.sharded_optimizer import ShardedOptimizer

__all__ = [
    "DDP",
    "InvalidArgument",
    "ShardedOptimizer",
    "sequence_parallel",
    "sharding",
    "tensor_parallel",
]
