"""``ddpcheck.tensor_parallel``: the public name of :mod:`ddpcheck._language.tensor_parallel`,
which lives on its floor (docs/architecture.md); the names are its ``__all__``, the same
objects."""

from ddpcheck._language.tensor_parallel import *  # noqa: F403
from ddpcheck._language.tensor_parallel import __all__ as __all__
