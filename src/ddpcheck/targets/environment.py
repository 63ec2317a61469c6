"""How a framework target joins the process group ddpcheck's world already built.

Frameworks start their own distributed world unless they find one: accelerate's ``PartialState``
and Lightning's ``_init_dist_connection`` skip ``init_process_group`` when
``torch.distributed.is_initialized()``, but still read the launcher's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``...) to decide that they run distributed at all, and Lightning
spawns processes of its own unless ``LOCAL_RANK`` says a launcher created them. So a framework
target sets, in each rank, what ``torchrun`` would have set, describing the world that exists --
and ``OMP_NUM_THREADS=1``, without which accelerate changes the rank's thread count.

Invariant: :func:`join_existing_group` is idempotent and deterministic (every rank sets the same
keys, with its own rank), and never initialises or replaces a process group.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import torch.distributed as dist

from ddpcheck._base.errors import SetupError

__all__ = ["installed_version", "join_existing_group"]


def join_existing_group() -> None:
    """Describe the existing default group in the launcher's environment variables."""
    if not dist.is_initialized():
        raise SetupError(
            "a framework target runs inside a ddpcheck world, whose process "
            "group is initialised before any target runs"
        )
    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "NODE_RANK": "0",
            "GROUP_RANK": "0",
            # read by frameworks that would rendezvous; the group exists, so no port is opened
            "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": os.environ.get("MASTER_PORT", "29500"),
            "OMP_NUM_THREADS": "1",
        }
    )


def installed_version(distribution: str, module: str | None = None) -> str | None:
    """The installed version of ``distribution`` (None when its ``module`` is not importable)."""
    if importlib.util.find_spec(module or distribution) is None:
        return None
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"
