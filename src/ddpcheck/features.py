"""``ddpcheck.features``: the public name of :mod:`ddpcheck._language.features`,
which lives on its floor (docs/architecture.md); the names are its ``__all__``, the same
objects."""

from ddpcheck._language.features import *  # noqa: F403
from ddpcheck._language.features import __all__ as __all__
