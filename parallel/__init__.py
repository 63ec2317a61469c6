"""The implementations under test: a readable DDP, a ZeRO-1 style sharded optimizer and a
tensor-parallel column/row layer pair.

Every collective is visible at its call site; see ``ddp.py``, ``sharded_optimizer.py`` and
``tensor_parallel.py``.
"""

from parallel import sharding, tensor_parallel
from parallel._checks import InvalidArgument
from parallel.ddp import DDP
from parallel.sharded_optimizer import ShardedOptimizer

__all__ = ["DDP", "InvalidArgument", "ShardedOptimizer", "sharding", "tensor_parallel"]
