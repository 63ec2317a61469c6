"""``ddpcheck.strategies``: the public name of :mod:`ddpcheck._language.strategies`, which lives
on its floor (docs/architecture.md), with ``examples(target)`` from
:mod:`ddpcheck.targets.support`, beside the targets whose support it reads; the names are
``_language.strategies``' ``__all__`` and ``examples``, the same objects."""

from ddpcheck._language.strategies import *  # noqa: F403
from ddpcheck.targets.support import examples as examples
