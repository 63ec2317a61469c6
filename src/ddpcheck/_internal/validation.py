"""Shared argument validators: every misuse message names the argument, the value and the rule.

All checks run before the first collective or process spawn, so a bad argument fails the same way
everywhere instead of hanging half a world.
"""

from __future__ import annotations

import numbers
from typing import Any, Iterable

from ddpcheck.errors import InvalidArgument  # re-exported for the validators' callers

__all__ = ["InvalidArgument", "check_deadline", "check_positive_number", "check_process_group",
           "check_world_size", "check_world_sizes"]


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_world_size(name: str, value: Any) -> int:
    if not _is_int(value):
        raise InvalidArgument(f"{name}={value!r} must be a positive integer (a number of ranks)")
    if value < 1:
        raise InvalidArgument(f"{name}={value!r} must be at least 1")
    return int(value)


def check_world_sizes(name: str, values: Any) -> tuple[int, ...]:
    if _is_int(values):
        values = (values,)
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidArgument(f"{name}={values!r} must be a sequence of positive integers, "
                              "such as (1, 2, 3, 4)")
    values = tuple(values)
    if not values:
        raise InvalidArgument(f"{name}={values!r} is empty; give at least one world size")
    for v in values:
        if not _is_int(v) or v < 1:
            raise InvalidArgument(f"{name}={values!r} contains {v!r}; every world size must be a "
                                  "positive integer")
    return tuple(dict.fromkeys(int(v) for v in values))


def check_positive_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise InvalidArgument(f"{name}={value!r} must be a positive number")
    return float(value)


def check_deadline(name: str, value: Any) -> float:
    """Seconds to wait: positive and finite (every wait has a deadline)."""
    seconds = check_positive_number(name, value)
    if seconds == float("inf"):
        raise InvalidArgument(f"{name}={value!r} must be finite: every wait has a deadline; "
                              "use a large number of seconds, such as 3600")
    return seconds


def check_process_group(name: str, value: Any) -> None:
    """None (the default group) or a ``torch.distributed`` process group."""
    if value is None:
        return
    import torch.distributed as dist  # here, not at import: the pytest plugin must not load torch

    # new_group() hands ranks outside the group a sentinel; the callers say "not a member".
    if value is dist.GroupMember.NON_GROUP_MEMBER:
        return
    if not isinstance(value, dist.ProcessGroup):
        raise InvalidArgument(f"{name}={value!r} must be a torch.distributed ProcessGroup, such "
                              "as dist.new_group(ranks), or None for the default group")
