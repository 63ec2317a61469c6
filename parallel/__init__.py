"""The implementations under test: a readable DDP and a ZeRO-1 style sharded optimizer.

Every collective is visible at its call site; see ``ddp.py`` and ``sharded_optimizer.py``.
"""

from parallel import sharding
from parallel._checks import InvalidArgument
from parallel.ddp import DDP
from parallel.sharded_optimizer import ShardedOptimizer

__all__ = ["DDP", "InvalidArgument", "ShardedOptimizer", "sharding"]
