"""Argument checks of ``DDP``, ``ShardedOptimizer`` and ``sharding``, kept out of the algorithms.

Every message names the argument, the value and the rule. The checks run before the first
collective, so a bad argument fails the same way on every rank instead of hanging half a world.
No collective happens here.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "InvalidArgument",
    "check_consolidation_rank",
    "check_ddp_arguments",
    "check_has_a_param",
    "check_loadable",
    "check_optimizer_cls",
    "check_optimizer_process_group",
    "check_param_group",
    "check_params",
    "check_positive_number",
    "check_process_group",
    "check_sharding_rule",
    "describe",
    "probe_defaults",
]


class InvalidArgument(ValueError):
    """An argument passed to parallel/ is invalid; the message says which and why."""


# ---------------------------------------------------------------------------------- shared


def check_positive_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) > 0:
        raise InvalidArgument(f"{name}={value!r} must be a positive number")
    return float(value)


def check_process_group(name: str, value: Any) -> None:
    """None (the default group) or a ``torch.distributed`` process group."""
    if value is None:
        return
    # new_group() hands ranks outside the group a sentinel; the callers say "not a member".
    if value is dist.GroupMember.NON_GROUP_MEMBER:
        return
    if not isinstance(value, dist.ProcessGroup):
        raise InvalidArgument(
            f"{name}={value!r} must be a torch.distributed ProcessGroup, such "
            "as dist.new_group(ranks), or None for the default group"
        )


def describe(t: Any) -> str:
    """A tensor as its shape and dtype (its values would flood a message), anything else as repr."""
    if isinstance(t, torch.Tensor):
        return f"<tensor shape={tuple(t.shape)} dtype={t.dtype}>"
    return repr(t)


# ------------------------------------------------------------------------------------- DDP


def check_ddp_arguments(module: Any, bucket_size_mb: Any, process_group: Any) -> list[nn.Parameter]:
    """Validate ``DDP(module, bucket_size_mb, process_group)``; return the trainable parameters.

    Raises RuntimeError (not InvalidArgument) when ``torch.distributed`` is not initialised: no
    argument is wrong then, a setup step is missing.
    """
    if not isinstance(module, nn.Module):
        raise InvalidArgument(f"module={module!r} must be a torch.nn.Module")
    check_positive_number("bucket_size_mb", bucket_size_mb)
    if bucket_size_mb == float("inf"):
        raise InvalidArgument(
            "bucket_size_mb=inf must be finite; use a large value such as "
            "1e6 for one bucket per dtype"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "DDP needs an initialised default process group: call "
            "torch.distributed.init_process_group(...) on every rank first"
        )
    check_process_group("process_group", process_group)
    if process_group is not None and dist.get_rank(process_group) < 0:
        raise InvalidArgument(
            f"process_group={process_group!r} does not contain this rank "
            f"(global rank {dist.get_rank()}); wrap the module only on the "
            "group's ranks"
        )
    params = [p for p in module.parameters() if p.requires_grad]  # tied weights appear once
    if not params:
        raise InvalidArgument(
            f"module={type(module).__name__} has no parameter with "
            "requires_grad=True; there is nothing to synchronise"
        )
    return params


# ------------------------------------------------------------------------ ShardedOptimizer


def check_optimizer_cls(optimizer_cls: Any, *, sharded_cls: type) -> None:
    """A plain ``torch.optim.Optimizer`` subclass: not an instance, not ``sharded_cls`` again."""
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        if isinstance(optimizer_cls, torch.optim.Optimizer):
            name = type(optimizer_cls).__name__
            raise InvalidArgument(
                f"optimizer_cls=<{name} instance> must be a subclass of torch.optim.Optimizer, "
                f"not an instance; pass its class, {name}, and its hyperparameters as keywords"
            )
        raise InvalidArgument(
            f"optimizer_cls={optimizer_cls!r} must be a subclass of "
            "torch.optim.Optimizer, such as torch.optim.AdamW"
        )
    if issubclass(optimizer_cls, sharded_cls):
        raise InvalidArgument(
            f"optimizer_cls={optimizer_cls!r} is already sharded; pass the "
            "plain optimizer class, such as torch.optim.AdamW"
        )


def check_sharding_rule(sharding_rule: Any) -> None:
    if not callable(sharding_rule):
        raise InvalidArgument(
            f"sharding_rule={sharding_rule!r} is not callable; pass a function "
            "rule(params, world_size) -> owners, such as parallel.sharding.greedy"
        )


def check_optimizer_process_group(process_group: Any) -> tuple[int, int, list[int]]:
    """This rank's group rank, the group's size, and group rank -> global rank."""
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidArgument(
            "ShardedOptimizer needs torch.distributed: call "
            "torch.distributed.init_process_group(...) first"
        )
    check_process_group("process_group", process_group)
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise InvalidArgument(
            f"process_group={process_group!r} (global ranks "
            f"{dist.get_process_group_ranks(process_group)}) does not contain this rank "
            f"(global rank {dist.get_rank()}); construct ShardedOptimizer only on its members"
        )
    world_size = dist.get_world_size(process_group)
    if process_group is None:
        return rank, world_size, list(range(world_size))
    return rank, world_size, [dist.get_global_rank(process_group, r) for r in range(world_size)]


def check_params(params: Any, group_offset: int = 0) -> list[dict[str, Any]]:
    """Normalise to a list of group dicts with list params; reject what would mis-shard."""
    if isinstance(params, torch.Tensor):
        raise InvalidArgument(
            f"params={describe(params)} is a single tensor; pass an iterable "
            "of tensors, such as model.parameters() or [tensor]"
        )
    if isinstance(params, (set, frozenset)) or not isinstance(params, Iterable):
        raise InvalidArgument(
            f"params={params!r} must be an ordered iterable of tensors or of "
            "param-group dicts (a set's order differs across ranks)"
        )
    items = list(params)
    if not items:
        raise InvalidArgument(
            "params=[] is empty; pass the parameters to optimize, such as "
            "model.parameters() (was a generator consumed already?)"
        )
    groups = items if all(isinstance(g, dict) for g in items) else [{"params": items}]
    out = []
    for index, group in enumerate(groups, group_offset):
        if not isinstance(group, dict) or "params" not in group:
            raise InvalidArgument(
                f"param group {index}={group!r} must be a dict with a 'params' "
                "key; do not mix tensors and dicts in params"
            )
        members = group["params"]
        if isinstance(members, torch.Tensor):
            members = [members]
        elif isinstance(members, (set, frozenset)):
            raise InvalidArgument(
                f"param group {index}: params={members!r} is a set; pass a "
                "list, so every rank sees the same order"
            )
        members, seen = list(members), set()
        for i, p in enumerate(members):
            tensor = p[1] if isinstance(p, tuple) and len(p) == 2 else p  # (name, param) pairs
            if not isinstance(tensor, torch.Tensor):
                raise InvalidArgument(
                    f"param group {index}, parameter {i} is {p!r}; parameters must be tensors"
                )
            if id(tensor) in seen:
                raise InvalidArgument(
                    f"param group {index}, parameter {i} repeats an earlier parameter "
                    "(a tied weight listed twice?); list each tensor once, e.g. "
                    "list(dict.fromkeys(params)), or it would be stepped and broadcast twice"
                )
            seen.add(id(tensor))
        out.append({**group, "params": members})
    return out


def check_has_a_param(groups: list[dict[str, Any]]) -> Any:
    """The first parameter of ``groups`` (normalised by ``check_params``); there must be one."""
    first = next((p for group in groups for p in group["params"]), None)
    if first is None:
        raise InvalidArgument(
            f"params={groups!r} holds no parameter in any group; pass the "
            "parameters to optimize, such as model.parameters()"
        )
    return first


def check_param_group(param_group: Any, index: int) -> dict[str, Any]:
    """``add_param_group``'s argument, normalised like one group of ``check_params``."""
    if not isinstance(param_group, dict) or "params" not in param_group:
        raise InvalidArgument(
            f"param_group={param_group!r} must be a dict with a 'params' "
            "key, such as {'params': [tensor], 'lr': 0.01}"
        )
    return check_params([param_group], group_offset=index)[0]


def probe_defaults(optimizer_cls: type, kwargs: dict[str, Any], like: Any) -> dict[str, Any]:
    """Build ``optimizer_cls`` on an empty tensor: validates kwargs early and yields its
    defaults."""
    like = like[1] if isinstance(like, tuple) else like
    try:
        probe = optimizer_cls([torch.empty(0, dtype=like.dtype, device=like.device)], **kwargs)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(
            f"optimizer_cls={optimizer_cls.__name__} rejected optimizer_kwargs={kwargs!r}: {e}"
        ) from e
    return dict(probe.defaults)


def check_consolidation_rank(to: Any, world_size: int) -> None:
    if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < world_size:
        raise InvalidArgument(
            f"to={to!r} must be a rank of the optimizer's process group, "
            f"an integer in [0, {world_size})"
        )


def check_loadable(state_dict: Any, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The saved param groups, once ``state_dict`` is known to match ``groups`` in shape."""
    if (
        not isinstance(state_dict, dict)
        or not isinstance(state_dict.get("state"), dict)
        or not isinstance(state_dict.get("param_groups"), list)
    ):
        described = (
            f"state_dict with keys {sorted(state_dict)}"
            if isinstance(state_dict, dict)
            else f"state_dict={state_dict!r:.80}"
        )
        raise InvalidArgument(
            f"{described} is not an optimizer state dict; pass what "
            "ShardedOptimizer.state_dict() (after consolidate_state_dict) or a plain optimizer's "
            "state_dict() returned"
        )
    saved = state_dict["param_groups"]
    if len(saved) != len(groups):
        raise InvalidArgument(
            f"state_dict has {len(saved)} param groups, this optimizer has "
            f"{len(groups)}; load a checkpoint of the same param groups"
        )
    for index, (s, g) in enumerate(zip(saved, groups)):
        if len(s.get("params", ())) != len(g["params"]):
            raise InvalidArgument(
                f"param group {index} has {len(g['params'])} parameters but the state_dict's has "
                f"{len(s.get('params', ()))}; load a checkpoint of the same parameters"
            )
    known = {i for s in saved for i in s["params"]}
    stray = sorted(set(state_dict["state"]) - known, key=repr)
    if stray:
        raise InvalidArgument(
            f"state_dict['state'] has keys {stray!r} that no param group lists; "
            "the checkpoint is corrupt or from another optimizer"
        )
    return saved
