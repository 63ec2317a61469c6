"""``ddpcheck.scenario``: the public name of :mod:`ddpcheck._language.scenario`,
which lives on its floor (docs/architecture.md); the names are its ``__all__``, the same
objects."""

from ddpcheck._language.scenario import *  # noqa: F403
from ddpcheck._language.scenario import __all__ as __all__
