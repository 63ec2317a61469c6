"""What crosses the boundary between a rank process and its parent, as types whose fields say
what each part means: the :class:`Launch` a rank starts from, and the answer it sends back for
each task -- the parent reads which answer it is by its type, not by a string in a tuple's first
slot.

A rank answers with :class:`Returned` (the task's result, and what the task left behind),
:class:`Refused` (ddpcheck's own code in the rank raised one of its outcomes: a decline, or the
glue's ``InternalError``) or :class:`Raised` (anything else: the traceback). Plain data, pickled
across the pipe (``serve``); the parent's side is ``ddpcheck._world.worlds``.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Answer", "Launch", "Raised", "Refused", "Returned"]


@dataclasses.dataclass(frozen=True)
class Launch:
    """What a rank process starts from (``serve.rank_main``), pickled to it by the parent."""

    rank: int
    world_size: int
    backend: str
    store_path: str  # the FileStore the ranks rendezvous through
    log_path: str  # the rank's stdout and stderr, whose tail a failure reports
    stack_path: str  # where faulthandler dumps its stacks on SIGUSR1 (a hang's diagnosis)
    parent_pid: int  # the process the rank dies with (the fork server, for a forked rank)
    sequence_path: str  # the collective sequence file of task slot 0 (``recorder``)
    device: str = "cpu"
    #: the parent's environment as it launched the world, for a rank forked from a server that
    #: started with an older one; None: spawned, the environment is the parent's already
    environ: dict[str, str] | None = None


@dataclasses.dataclass(frozen=True)
class Returned:
    """The task returned: its ``result`` (at start-up, the rank's pid), the user files it
    imported (``freshness``), and what it left behind (``fitness.restore``)."""

    result: object
    files: dict[str, int] = dataclasses.field(default_factory=dict)  # path -> mtime (ns)
    #: changes to what later code computes, which could not be put right: the rank is unfit
    unfit: tuple[str, ...] = ()
    #: what the task left and ddpcheck put right (a process group, a setting)
    notes: tuple[str, ...] = ()
    #: the process cannot be put back as it started: replace the world after this task
    replace: bool = False


@dataclasses.dataclass(frozen=True)
class Refused:
    """ddpcheck's own outcome, raised in the rank: rebuilt in the parent by its class name."""

    outcome: str  # the DdpcheckError subclass's name
    message: str
    replace: bool = False


@dataclasses.dataclass(frozen=True)
class Raised:
    """The task raised anything else (SystemExit included): the rank's traceback."""

    traceback: str


Answer = Returned | Refused | Raised
