"""The device meshes of a rank process: one per shape (``(dp, tp)``, ``(dp, pp)``), made once and
kept.

Why kept: ``init_device_mesh`` creates a process group per mesh axis and coordinate (a collective
on every rank, and sockets that gloo keeps open), and a persistent world runs many tensor-parallel
examples of the same few shapes. These groups -- every group ``init_device_mesh`` adds to torch's
``pg_map``, the axes' and any other -- are the harness's, not the target's: the fitness check
(``ddpcheck._rank.fitness``) leaves them alone, where it destroys the groups an example created
and left behind.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ddpcheck._base.devices import this_rank
from ddpcheck._language.tensor_parallel import AXES

if TYPE_CHECKING:  # torch.distributed.device_mesh loads when a tensor-parallel example runs
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["harness_groups", "mesh", "opened_fds"]

_MESHES: dict[tuple[str, tuple[str, ...], tuple[int, ...]], DeviceMesh] = {}
_GROUPS: set[int] = set()
_OPENED_FDS = [0]


def mesh(dp: int, tp: int, axes: tuple[str, str] = AXES) -> DeviceMesh:
    """This world's ``(dp, tp)`` mesh on the rank's device type, its axes named ``axes`` (a
    pipeline's: ``("dp", "pp")``). Collective the first time."""
    return grid((dp, tp), axes)


def grid(shape: tuple[int, ...], axes: tuple[str, ...]) -> DeviceMesh:
    """This world's mesh of ``shape`` (any number of axes, named ``axes``: a pipeline of
    tensor-parallel stages' ``("dp", "pp", "tp")``). Collective the first time."""
    device = this_rank().type
    key = (device, axes, shape)
    if key not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        before, groups_before = _fd_count(), _group_ids()
        made = init_device_mesh(device, shape, mesh_dim_names=axes)
        # every group it made, not only each axis's: on torch 2.13 they are the same ones
        # (measured for (1,2), (1,3), (2,2), (1,4), (4,1)), but a release that splits or keeps
        # a helper group would otherwise see it destroyed as an example's leftover
        _GROUPS.update(_group_ids() - groups_before)
        for axis in axes:
            _GROUPS.add(id(made.get_group(axis)))
        _OPENED_FDS[0] += max(0, _fd_count() - before)
        _MESHES[key] = made
    return _MESHES[key]


def harness_groups() -> frozenset[int]:
    """The ids of the process groups the meshes hold: not an example's leftovers."""
    return frozenset(_GROUPS)


def opened_fds() -> int:
    """The file descriptors the meshes' groups opened: not an example's leftovers either."""
    return _OPENED_FDS[0]


def _group_ids() -> set[int]:
    """The ids of every process group this process holds (torch's own bookkeeping, as
    ``_rank.fitness`` reads it)."""
    import torch.distributed as dist

    try:
        return {id(g) for g in dist.distributed_c10d._world.pg_map}
    except Exception:  # torch moved its bookkeeping: the axes' groups are still recorded
        return set()


def _fd_count() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0
