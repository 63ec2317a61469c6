"""``ddpcheck.strategies``: the public name of :mod:`ddpcheck._language.strategies`,
which lives on its floor (docs/architecture.md); the names are its ``__all__``, the same
objects."""

from ddpcheck._language.strategies import *  # noqa: F403
from ddpcheck._language.strategies import __all__ as __all__
