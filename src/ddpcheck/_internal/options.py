"""Defaults and option parsing shared by every front end (API, command line, pytest plugin).

One place for the numbers a user can change, and one parser for world-size text, so the CLI
and the plugin cannot drift apart. Imports no torch: the pytest plugin loads it in every run.
"""

from __future__ import annotations

import os

from ddpcheck._internal.validation import InvalidArgument

__all__ = ["DEFAULT_DEADLINE", "DEFAULT_WORLD_SIZES", "MAX_RANKS_PER_CORE", "STARTUP_DEADLINE",
           "check_fits_machine", "parse_world_sizes"]

#: World sizes checked when none are given: 1 (the wrapper is a no-op), 2 (the cheapest world
#: where replicas can disagree), 3 (divisor and ordering bugs 2 hides), 4.
DEFAULT_WORLD_SIZES = (1, 2, 3, 4)
#: Seconds one example may take before its world is declared hung.
DEFAULT_DEADLINE = 60.0
#: Seconds a freshly spawned world may take to import torch and rendezvous (W=8 took 11.4 s on
#: our 2-core machines; see docs/platform.md).
STARTUP_DEADLINE = 120.0
#: More rank processes than this per core are refused: they would mostly wait for each other.
MAX_RANKS_PER_CORE = 16


def parse_world_sizes(text: str, flag: str = "--world-sizes") -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``; anything else is an :class:`InvalidArgument` naming ``flag``."""
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise InvalidArgument(f"{flag}={text!r} must be comma-separated integers, such as "
                              "1,2,3,4") from None
    if not sizes or any(s < 1 for s in sizes):
        raise InvalidArgument(f"{flag}={text!r} must list positive integers")
    return tuple(dict.fromkeys(sizes))


def check_fits_machine(world_sizes: tuple[int, ...], *, workers: int = 1,
                       flag: str = "--world-sizes") -> None:
    """Refuse worlds that cannot fit this machine: ``workers`` processes each keep a world of the
    largest size alive, and more than :data:`MAX_RANKS_PER_CORE` ranks per core would spend the
    deadline waiting for each other (and a 64-rank world needs ~10 GB just to import torch)."""
    cores = os.cpu_count() or 1
    ranks = workers * max(world_sizes)
    if ranks > MAX_RANKS_PER_CORE * cores:
        who = f"{workers} workers with " if workers > 1 else ""
        raise InvalidArgument(
            f"{who}{flag} up to {max(world_sizes)} would start {ranks} rank processes on "
            f"{cores} core(s) (at most {MAX_RANKS_PER_CORE} per core); lower the largest world "
            "size" + (" or the number of workers" if workers > 1 else ""))
