"""ddpcheck: finds bugs in data-parallel training code.

It runs a target (a DDP wrapper, a sharded optimizer, or both) in real multi-process
``torch.distributed`` worlds and checks that every replica stays bitwise identical and that all of
them match a single-process full-batch reference step.
"""

from ddpcheck._validation import InvalidArgument
from ddpcheck.api import Report, assert_equivalent
from ddpcheck.report import Divergence, EquivalenceError
from ddpcheck.scenario import Scenario
from ddpcheck.targets import Target

__version__ = "0.1.0"

__all__ = ["Divergence", "EquivalenceError", "InvalidArgument", "Report", "Scenario", "Target",
           "__version__", "assert_equivalent"]
