"""Sharding rules: which rank owns (holds the optimizer state of, and updates) each parameter.

A rule is a plain function ``rule(params, world_size) -> Sequence[int]`` called with the
parameters of *one* param group, in order. Invariant every rule must keep, checked by
:func:`check_owners` before any collective uses the answer:

* it returns exactly one owner per parameter, in the parameters' order;
* every owner is an integer in ``[0, world_size)`` (a rank of the optimizer's process group);
* it is a pure function of the parameters' shapes, dtypes and order and of ``world_size``, so every
  rank computes the same answer without communicating. (Ranks that disagree are caught by the
  optimizer's cross-rank fingerprint at ``add_param_group``.)

``world_size`` may exceed ``len(params)``; then some ranks own nothing in that group, which is
legal.
"""

from __future__ import annotations

import heapq
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

from parallel._checks import InvalidArgument

__all__ = ["Rule", "check_owners", "contiguous", "greedy", "modulo", "rule_name"]

Rule = Callable[[Sequence[torch.Tensor], int], Sequence[int]]


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def modulo(params: Sequence[torch.Tensor], world_size: int) -> list[int]:
    """Round robin, the seed's rule: parameter ``i`` is owned by rank ``i % world_size``.

    Invariant: owners cycle 0, 1, ..., W-1, 0, ...; counts per rank differ by at most one, bytes
    per rank are not balanced at all (a large embedding lands wherever its index says).
    """
    return [i % world_size for i in range(len(params))]


def contiguous(params: Sequence[torch.Tensor], world_size: int) -> list[int]:
    """Consecutive runs balanced by bytes: owners never decrease along the parameter list.

    Invariant: parameter ``i`` goes to the rank whose equal share of the group's total bytes
    contains the midpoint of ``i``'s bytes, so each rank owns one run of neighbouring parameters
    (useful when layers should stay together) and runs are as even as a cut between whole
    parameters allows. A group whose tensors are all empty is split by count instead.
    """
    sizes = [_nbytes(p) for p in params]
    total = sum(sizes)
    if total == 0:
        sizes, total = [1] * len(params), len(params)
    owners, before = [], 0
    for size in sizes:
        # midpoint of this parameter's byte range, scaled to ranks: 2*before+size over 2*total
        owners.append(min(world_size - 1, (2 * before + size) * world_size // (2 * total)))
        before += size
    return owners


def greedy(params: Sequence[torch.Tensor], world_size: int) -> list[int]:
    """Largest first to the least-loaded rank, by bytes (LPT scheduling).

    Invariant: parameters are visited by decreasing byte size (ties: lower index first) and each
    goes to the rank with the fewest bytes so far (ties: lower rank), so the answer depends only on
    sizes and order. The heaviest rank carries at most 4/3 of the optimum, and at most the ideal
    share plus the largest single tensor.
    """
    owners = [0] * len(params)
    loads = [(0, rank) for rank in range(world_size)]  # heap of (bytes owned so far, rank)
    order = sorted(range(len(params)), key=lambda i: (-_nbytes(params[i]), i))
    for i in order:
        load, rank = heapq.heappop(loads)
        owners[i] = rank
        heapq.heappush(loads, (load + _nbytes(params[i]), rank))
    return owners


def rule_name(rule: Any) -> str:
    """How error messages name a rule: ``module.qualname`` when it has one, else its repr."""
    name = getattr(rule, "__qualname__", None) or getattr(rule, "__name__", None)
    module = getattr(rule, "__module__", None)
    return f"{module}.{name}" if name and module else repr(rule)


def check_owners(
    answer: Any, params: Sequence[torch.Tensor], world_size: int, *, rule: Any, group_index: int
) -> list[int]:
    """Validate a rule's answer for param group ``group_index``; return it as a list of ints.

    Raises :class:`InvalidArgument` naming the rule, the param group and the parameter index when
    the answer has the wrong length, a non-integer owner, or an owner outside ``[0, world_size)``.
    """
    name = rule_name(rule)
    where = f"sharding_rule={name} for param group {group_index}"
    if isinstance(answer, torch.Tensor):
        answer = answer.tolist()
    if isinstance(answer, (str, bytes, dict)) or not hasattr(answer, "__iter__"):
        raise InvalidArgument(
            f"{where} returned {answer!r}; a sharding rule must return a "
            "sequence with one owner rank per parameter"
        )
    owners = list(answer)
    if len(owners) != len(params):
        raise InvalidArgument(
            f"{where} returned {len(owners)} owners for {len(params)} parameters ({owners!r}); "
            "a sharding rule must return exactly one owner rank per parameter, in order"
        )
    for i, owner in enumerate(owners):
        if isinstance(owner, bool) or not isinstance(owner, numbers.Integral):
            raise InvalidArgument(
                f"{where} returned owner {owner!r} (type {type(owner).__name__}) for parameter "
                f"{i}; owners must be integer ranks in [0, world_size={world_size})"
            )
        if not 0 <= int(owner) < world_size:
            raise InvalidArgument(
                f"{where} returned owner {owner!r} for parameter {i}, outside "
                f"[0, world_size={world_size}); owners are ranks of the optimizer's process group"
            )
    return [int(o) for o in owners]
