"""Is a world that missed its deadline hung, or only slow? What its processes did, read from
the kernel.

Why: a deadline is a guess at how long an example takes, and a loaded machine (a second test
suite, other users' jobs) can stretch any guess; read as a hang, slowness became exit 1 on a
correct target. The kernel tells the two apart. A hung rank waits for a peer that never comes --
in a collective, on a lock, asleep: its threads are off the CPU and do not ask for one (gloo's
own threads wake every few milliseconds: measured 0.002-0.006 CPU-seconds per second per rank,
quiet or at load 10). A rank that is working, or starved of a CPU by other processes, is on a
CPU or waiting in the run queue: about one second per second per busy thread, whatever the load
(``/proc/PID/task/TID/schedstat``: time on the CPU, time runnable but waiting for one). The
processes a rank started (a framework's compiler building an op) count as the rank's: a rank
leads its own process group.

Where the kernel does not say (no ``/proc``), :func:`read` returns None and the caller falls back
on the deadline alone.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

__all__ = ["ACTIVE", "MOST_DEADLINES", "OBSERVE", "Overtime", "Reading", "read"]

#: CPU-seconds per second -- on a CPU, or waiting for one -- summed over the ranks still
#: working, above which they are working, not waiting on each other: far above what blocked
#: ranks show (0.006 per rank), far below one busy or starved thread (~1.0).
ACTIVE = 0.25

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
#: Whether this kernel keeps per-thread scheduler statistics (CONFIG_SCHED_INFO).
_SCHEDSTAT = os.path.exists("/proc/self/schedstat")


@dataclasses.dataclass(frozen=True)
class Reading:
    """What the processes of some ranks had done by ``at`` (``time.monotonic()``), per rank:
    seconds on a CPU, and seconds on a CPU or waiting in the run queue for one."""

    at: float
    cpu: dict[int, float]
    busy: dict[int, float]

    def activity(self, earlier: Reading) -> float:
        """CPU-seconds per second (on a CPU or waiting for one) of these ranks since
        ``earlier``, summed over the ranks both readings hold."""
        elapsed = self.at - earlier.at
        if elapsed <= 0:
            return 0.0
        spent = sum(self.busy[r] - earlier.busy[r] for r in self.busy if r in earlier.busy)
        return max(spent, 0.0) / elapsed


def read(groups: dict[int, int], at: float) -> Reading | None:
    """Per rank, what every process of its process group (``groups``: rank -> the group's id,
    the rank's own pid) has done so far; None where the kernel does not say."""
    if not os.path.isdir("/proc/self/task"):
        return None
    members: dict[int, list[int]] = {rank: [] for rank in groups}
    rank_of = {group: rank for rank, group in groups.items()}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _stat(f"/proc/{entry}/stat")
        if stat is not None and int(stat[2]) in rank_of:  # fields after "(comm)": pgrp is 3rd
            members[rank_of[int(stat[2])]].append(int(entry))
    cpu: dict[int, float] = {}
    busy: dict[int, float] = {}
    for rank, pids in members.items():
        cpu[rank] = busy[rank] = 0.0
        for pid in pids:
            on, waiting = _threads(pid)
            cpu[rank] += on
            busy[rank] += on + waiting
    return Reading(at, cpu, busy)


def _stat(path: str) -> list[str] | None:
    """The fields of a ``/proc/.../stat`` file after the command name (which may hold spaces and
    parentheses): state, ppid, pgrp, ... utime is the 12th, stime the 13th."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):  # gone meanwhile
        return None


def _threads(pid: int) -> tuple[float, float]:
    """Seconds on a CPU and seconds waiting for one, summed over the process's threads (a thread
    gone meanwhile counts for nothing); without scheduler statistics, its CPU time alone."""
    if not _SCHEDSTAT:
        stat = _stat(f"/proc/{pid}/stat")
        return (0.0, 0.0) if stat is None else ((int(stat[11]) + int(stat[12])) / _TICKS, 0.0)
    on = waiting = 0.0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0, 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                fields = f.read().split()
            on += int(fields[0]) / 1e9
            waiting += int(fields[1]) / 1e9
        except (OSError, IndexError, ValueError):
            continue
    return on, waiting


#: Seconds between two readings once the deadline has passed: long enough to tell a thread that
#: works from one that waits, short beside any deadline.
OBSERVE = 2.0
#: However busy the ranks, no task is waited for beyond this many deadlines in all.
MOST_DEADLINES = 10


class Overtime:
    """What to do once a task's deadline has passed with ranks still out.

    The first call reads what the ranks have done; every later one, :data:`OBSERVE` seconds on,
    compares. Ranks that neither used nor waited for a CPU (:data:`ACTIVE`) and issued no
    collective meanwhile are hung: ``"timeout"``. Ranks that did are working, so the wait goes
    on -- until the busiest has used a whole further deadline of CPU time since the deadline
    passed (the example costs more than the deadline allows, or a rank computes without end)
    or :data:`MOST_DEADLINES` deadlines have passed in all: ``"slow"``, no verdict on the target.
    Where the kernel says nothing (:func:`read` is None) the deadline alone decides.
    """

    def __init__(
        self,
        deadline: float,
        started: float,
        measure: Callable[[set[int]], tuple[Reading | None, int]],
    ):
        self.deadline, self.started = deadline, started
        self._measure = measure  # pending ranks -> (a reading, collectives issued so far)
        self._first: Reading | None = None  # at the deadline
        self._last: tuple[Reading, int] | None = None

    def decide(self, now: float, pending: set[int]) -> float | str:
        """A new end to wait until, or ``"timeout"`` (hung) or ``"slow"`` (still working)."""
        reading, collectives = self._measure(pending)
        if reading is None:
            return "timeout"
        if self._first is None or self._last is None:
            self._first, self._last = reading, (reading, collectives)
            return now + OBSERVE
        last, issued = self._last
        if reading.activity(last) < ACTIVE and collectives == issued:
            return "timeout"
        self._last = reading, collectives
        if self.worked() >= self.deadline or now - self.started >= MOST_DEADLINES * self.deadline:
            return "slow"
        return now + OBSERVE

    def worked(self) -> float:
        """CPU seconds the busiest rank has used since the deadline passed."""
        if self._first is None or self._last is None:
            return 0.0
        first, last = self._first, self._last[0]
        return max((last.cpu[r] - first.cpu.get(r, last.cpu[r]) for r in last.cpu), default=0.0)

    def describe(self, now: float) -> str:
        """How long the wait went on and what the ranks did meanwhile (a ``"slow"`` end)."""
        return (
            f"its ranks were still working {now - self.started:.0f} s after it started (the "
            f"deadline: {self.deadline:g} s; the busiest rank used {self.worked():.1f} s of "
            "CPU after it passed)"
        )
