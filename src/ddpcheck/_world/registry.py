"""The registry of persistent worlds: one per world size, backend, device and start method,
started on first use and again after a failure, every one stopped at interpreter exit -- so a
run of many examples pays a world's start-up once, and a process that ends leaves nothing
running."""

from __future__ import annotations

import atexit
import threading
from collections.abc import Iterable

from ddpcheck._base.devices import backend_for
from ddpcheck._base.options import check_world_size
from ddpcheck._world import forking, interrupts
from ddpcheck._world.processes import refuse_nested_start
from ddpcheck._world.worlds import LIVE_WORLDS, World, rank_warnings

__all__ = ["get_world", "launch_worlds", "shutdown_worlds", "world_of"]


_WORLDS: dict[tuple, World] = {}
_LOCK = threading.Lock()


def get_world(
    world_size: int, *, backend: str | None = None, device: str = "cpu", start_method: str = "auto"
) -> World:
    """The persistent world of this size on ``device`` ("cpu" or "cuda"), spawned on first use
    and after a failure; a CUDA world is never handed out for CPU examples, nor the reverse.
    A door of its own (``ddpcheck.get_world``, the ``ddpcheck_world`` fixture): ``world_size``
    is checked here; a run admitted at another door takes :func:`world_of`."""
    check_world_size("world_size", world_size)
    return world_of(world_size, backend=backend, device=device, start_method=start_method)


def world_of(
    world_size: int, *, backend: str | None = None, device: str = "cpu", start_method: str = "auto"
) -> World:
    """:func:`get_world` for a world size a door admitted (``_runs.admission``): not checked
    again."""
    return _registered(world_size, backend, device, start_method).start()


def launch_worlds(
    world_sizes: Iterable[int], *, backend: str | None = None, device: str = "cpu"
) -> None:
    """Launch the persistent worlds of these sizes that are not running yet, without waiting:
    they boot side by side, while this process goes on (``World.launch``). While ddpcheck's fork
    server is still importing torch (``forking``), launching is starting it: a world forks its
    ranks in milliseconds when it is first used."""
    refuse_nested_start()  # before the fork server: a rank must not start one
    if forking.start_method(rank_warnings()) == "forkserver" and forking.booting():
        return
    for world_size in world_sizes:
        _registered(world_size, backend, device, "auto").launch()


def _registered(world_size: int, backend: str | None, device: str, start_method: str) -> World:
    """The registry's world of this key, a new (unstarted) one when it has none alive."""
    refuse_nested_start()
    key = (world_size, backend_for(device, backend), device, start_method)
    with _LOCK:
        world = _WORLDS.get(key)
        if world is None or not world.alive:
            world = World(world_size, backend=key[1], device=device, start_method=start_method)
            _WORLDS[key] = world
    return world


def shutdown_worlds() -> None:
    """Stop every world this process started. Runs at interpreter exit too."""
    with _LOCK:
        worlds = list(LIVE_WORLDS)
        _WORLDS.clear()
    for world in worlds:
        world.close()


def _at_exit() -> None:
    """Every world, then ddpcheck's fork server: a process that ends leaves nothing running --
    a second Ctrl-C (the first one ended the caller's script) does not stop this half-way."""
    with interrupts.held(deliver=False):
        shutdown_worlds()
        forking.stop()


atexit.register(_at_exit)
