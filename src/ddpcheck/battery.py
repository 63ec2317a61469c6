"""``ddpcheck.battery``: the public name of :mod:`ddpcheck._language.battery`,
which lives on its floor (docs/architecture.md); the names are its ``__all__``, the same
objects."""

from ddpcheck._language.battery import *  # noqa: F403
from ddpcheck._language.battery import __all__ as __all__
