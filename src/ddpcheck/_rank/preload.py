"""Imported once by the fork server the ranks are forked from (``_world.forking``).

What every rank would otherwise import itself -- torch, torch.distributed, and dynamo, which the
first optimizer a process builds pulls in: ~2.4 s of a spawned W=2 world's start-up on the
2-core machine, ~0.1 s forked. Also sends a rank's output to its log from the first line
multiprocessing runs in it (re-importing the parent's main module comes before ``rank_main``),
as spawning under ``output_to`` does.

Runs in the fork server only: nothing here starts a thread or touches a GPU -- a fork copies
neither.
"""

from __future__ import annotations

import gc
import multiprocessing.spawn
import os
import signal
from collections.abc import Mapping

from ddpcheck._rank.serve import READY_ENV, log_of

__all__: list[str] = []

# Ctrl-C reaches the whole foreground process group, this server included: ddpcheck decides when
# its processes stop. The server started with SIGINT blocked (``_world.interrupts``), so
# one sent meanwhile is pending: ignored now, it is dropped; then unblocked, for every rank too.
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

# Importing torch and dynamo creates ~300,000 objects that live as long as the process: at the
# interpreter's default threshold (a collection every 700 allocations) the collector ran ~800
# times meanwhile and freed nothing, 0.3-0.5 s of CPU in every fork server (measured 2026-12-07:
# 0.50-0.65 s of collections while importing, 0.20-0.26 s at 10,000). Collections are rarer while
# it imports; afterwards the interpreter's threshold is back, and the ranks forked from here start
# with it, as spawned ones do.
_THRESHOLD = gc.get_threshold()
gc.set_threshold(max(_THRESHOLD[0], 10_000), *_THRESHOLD[1:])
try:  # never fail the server: a rank that then cannot import torch says why in its log
    import torch
    import torch.distributed
    import torch.distributed._functional_collectives  # the recorder wraps them (80 ms)

    # The first optimizer a process builds imports dynamo (what rank_main does at start-up
    # too); one tensor of one element runs no parallel region, so no thread starts.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
except Exception:  # each rank imports again, and reports what fails
    pass
finally:
    gc.set_threshold(*_THRESHOLD)

_prepare = multiprocessing.spawn.prepare


def _prepare_into_log(data: Mapping[str, object]) -> None:
    name = data.get("name", "")
    log = log_of(name) if isinstance(name, str) else None
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    _prepare(data)


# looked up by multiprocessing.spawn._main in every process this server forks
multiprocessing.spawn.prepare = _prepare_into_log

if os.environ.get(READY_ENV):
    try:
        open(os.environ[READY_ENV], "w").close()
    except OSError:  # the parent has left and its temporary directory with it: nobody waits
        pass
