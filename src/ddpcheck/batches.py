"""``ddpcheck.batches``: the public name of :mod:`ddpcheck._language.batches`,
which lives on its floor (docs/architecture.md); the names are its ``__all__``, the same
objects."""

from ddpcheck._language.batches import *  # noqa: F403
from ddpcheck._language.batches import __all__ as __all__
