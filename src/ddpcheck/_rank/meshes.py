"""The device meshes of a rank process: one per ``(dp, tp)`` shape, made once and kept.

Why kept: ``init_device_mesh`` creates a process group per mesh axis and coordinate (a collective
on every rank, and sockets that gloo keeps open), and a persistent world runs many tensor-parallel
examples of the same few shapes. These groups are the harness's, not the target's: the fitness
check (``ddpcheck._rank.fitness``) leaves them alone, where it destroys the groups an example
created and left behind.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ddpcheck._base.devices import this_rank
from ddpcheck._language.tensor_parallel import AXES

if TYPE_CHECKING:  # torch.distributed.device_mesh loads when a tensor-parallel example runs
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["harness_groups", "mesh", "opened_fds"]

_MESHES: dict[tuple[str, int, int], DeviceMesh] = {}
_GROUPS: set[int] = set()
_OPENED_FDS = [0]


def mesh(dp: int, tp: int) -> DeviceMesh:
    """This world's ``(dp, tp)`` mesh on the rank's device type. Collective the first time."""
    device = this_rank().type
    key = (device, dp, tp)
    if key not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        before = _fd_count()
        made = init_device_mesh(device, (dp, tp), mesh_dim_names=AXES)
        for axis in AXES:
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


def _fd_count() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0
