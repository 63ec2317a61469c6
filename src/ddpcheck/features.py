"""``ddpcheck.features``: the public name of :mod:`ddpcheck._language.features`, which lives on its
floor (docs/architecture.md), with the decisions that read a target -- ``declines``,
``supported_by``, ``unsupported``, ``why_unsupported``, ``owns_batch_plan`` -- from
:mod:`ddpcheck.targets.support`, beside the targets; the names are those modules' ``__all__``,
the same objects."""

from ddpcheck._language.features import *  # noqa: F403
from ddpcheck.targets.support import declines as declines
from ddpcheck.targets.support import owns_batch_plan as owns_batch_plan
from ddpcheck.targets.support import supported_by as supported_by
from ddpcheck.targets.support import unsupported as unsupported
from ddpcheck.targets.support import why_unsupported as why_unsupported
