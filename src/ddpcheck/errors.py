"""``ddpcheck.errors``: the public name of :mod:`ddpcheck._base.errors`,
which lives on its floor (docs/architecture.md); the names are its ``__all__``, the same
objects."""

from ddpcheck._base.errors import *  # noqa: F403
from ddpcheck._base.errors import __all__ as __all__
