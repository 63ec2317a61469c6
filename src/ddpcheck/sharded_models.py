"""``ddpcheck.sharded_models``: the public name of :mod:`ddpcheck._language.sharded_models`,
which lives on its floor (docs/architecture.md); the names are its ``__all__``, the same
objects."""

from ddpcheck._language.sharded_models import *  # noqa: F403
from ddpcheck._language.sharded_models import __all__ as __all__
