"""Fault table: nothing hangs, nothing is lost.

Each fault is injected on one rank (the last one) at world sizes 2 and 3. Every row must give an
``EquivalenceError`` of the right kind within the deadline + 5 s, naming the guilty rank (for
mismatched collectives, what each side issued, no rank singled out) with its
stack (or its exit status, for a process that could not leave one) and the first collective where
the ranks disagree; the world is replaced, the next example runs normally, no rank process is left
and no listening TCP socket of the dead world stays bound. A collective that can never complete
(one rank in a barrier the others finished without) is reported as soon as the ranks' sequence
files prove it -- seconds -- not at the deadline.

Then interrupts: Ctrl-C of ``ddpcheck check`` and of a pytest run leaves no process behind.

Fault targets travel to rank processes by pickle, so they are module-level classes here.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

import ddpcheck
from ddpcheck import check_example, targets
from ddpcheck._world.registry import get_world
from ddpcheck.scenario import Scenario
from tests.patience import patience

DEADLINE = 3.0
#: One step, so "after the last collective" is literal; one bucket per parameter, so buckets are
#: in flight during backward when a hook raises.
FAULT_SCENARIO = Scenario(steps=1, bucket_size_mb=1e-6)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------------------------
# Fault targets (the guilty rank is a field, so one class serves every world size)


@dataclasses.dataclass(frozen=True)
class _Faulty(targets.ParallelDDPTarget):
    """``parallel_ddp`` reporting no loss: each fault's collectives are the step's last, as the
    messages under test say ("after its last collective", "issued nothing at index")."""

    def reported_loss(self, model, optimizer, losses):
        return None


@dataclasses.dataclass(frozen=True)
class RaisesBeforeCollective(_Faulty):
    guilty: int = 1

    def after_backward(self, model, optimizer):
        if dist.get_rank() == self.guilty:
            raise RuntimeError(f"deliberate failure on rank {self.guilty} before a collective")
        model.finish_gradient_sync()


def _raise_in_hook(grad):
    raise RuntimeError("deliberate failure in a gradient hook")


@dataclasses.dataclass(frozen=True)
class _HookOnGuiltyRank(_Faulty):
    """Registers ``fault`` as a gradient hook of fc1.weight on rank ``guilty`` only: it runs in
    backward, after the later layers' buckets were launched (tiny buckets)."""

    guilty: int = 1
    fault = None  # a module-level gradient hook, set by each subclass

    def wrap(self, module):
        model = super().wrap(module)
        if dist.get_rank() == self.guilty:
            module.fc1.weight.register_hook(type(self).fault)
        return model


@dataclasses.dataclass(frozen=True)
class RaisesInBackwardHook(_HookOnGuiltyRank):
    """Raises in backward after the later layers' buckets were launched (tiny buckets)."""

    fault = staticmethod(_raise_in_hook)


class _ExitingSGD(torch.optim.SGD):
    """Steps, then the guilty rank exits with status 3: after its last collective."""

    def __init__(self, params, guilty, **kwargs):
        super().__init__(params, **kwargs)
        self.guilty = guilty

    def step(self, closure=None):
        super().step(closure)
        if dist.get_rank() == self.guilty:
            sys.stdout.flush()
            os._exit(3)


@dataclasses.dataclass(frozen=True)
class ExitsAfterLastCollective(_Faulty):
    guilty: int = 1

    def make_optimizer(self, params, optimizer_cls, **kwargs):
        return _ExitingSGD(params, self.guilty, **kwargs)


class _KilledSGD(torch.optim.SGD):
    """After stepping, every rank all-reduces 16 MB; the guilty rank SIGKILLs itself while the
    transfer is in flight and the others wait in it."""

    def __init__(self, params, guilty, **kwargs):
        super().__init__(params, **kwargs)
        self.guilty = guilty

    def step(self, closure=None):
        super().step(closure)
        work = dist.all_reduce(torch.ones(1 << 22), async_op=True)
        if dist.get_rank() == self.guilty:
            os.kill(os.getpid(), signal.SIGKILL)
        work.wait()


@dataclasses.dataclass(frozen=True)
class KilledMidCollective(_Faulty):
    guilty: int = 1

    def make_optimizer(self, params, optimizer_cls, **kwargs):
        return _KilledSGD(params, self.guilty, **kwargs)


def _sleep_in_hook(grad):
    time.sleep(3600)


@dataclasses.dataclass(frozen=True)
class SleepsForever(_HookOnGuiltyRank):
    """Sleeps in backward before its last bucket launches, so the others wait for it."""

    fault = staticmethod(_sleep_in_hook)


@dataclasses.dataclass(frozen=True)
class MismatchedCollective(_Faulty):
    """After a correct gradient sync, the guilty rank's next collective differs from the others'."""

    how: str = "op"
    guilty: int = 1

    def after_backward(self, model, optimizer):
        model.finish_gradient_sync()
        odd = dist.get_rank() == self.guilty
        t = torch.zeros(4, dtype=torch.float64)
        if self.how == "op":
            dist.broadcast(t, src=0) if odd else dist.all_reduce(t)
        elif self.how == "shape":
            dist.all_reduce(torch.zeros(5, dtype=torch.float64) if odd else t)
        elif self.how == "dtype":  # same bytes on the wire, so gloo cannot tell
            dist.all_reduce(torch.zeros(4, dtype=torch.int64) if odd else t)
        elif self.how == "count" and not odd:  # the guilty rank skips one the others issue
            dist.all_reduce(t)
        elif self.how == "never-launched" and odd:  # it waits on a handle no other rank launched
            dist.all_reduce(t, async_op=True).wait()


@dataclasses.dataclass(frozen=True)
class ExtraBarrier(_Faulty):
    """The guilty rank enters one barrier nobody else does, after a correct gradient sync."""

    guilty: int = 1

    def after_backward(self, model, optimizer):
        model.finish_gradient_sync()
        if dist.get_rank() == self.guilty:
            dist.barrier()  # EXTRA-BARRIER


# (target factory, kind, what the message must show about the guilty rank)
FAULTS = {
    "raises before a collective": (
        RaisesBeforeCollective,
        "rank failed",
        [
            "RuntimeError: deliberate failure on rank {g} before a collective",
            'test_faults.py", line',
            "in after_backward",
        ],
    ),
    "raises inside backward (hook)": (
        RaisesInBackwardHook,
        "rank failed",
        ["RuntimeError: deliberate failure in a gradient hook", "in _raise_in_hook"],
    ),
    "exits 3 after its last collective": (
        ExitsAfterLastCollective,
        "rank failed",
        ["rank {g}: process exited (exit code 3)", "every rank issued the same"],
    ),
    "SIGKILLed mid-collective": (
        KilledMidCollective,
        "rank failed",
        ["rank {g}: process exited (killed by signal SIGKILL)", "all_reduce SUM 4194304 float32"],
    ),
    "sleeps forever": (
        SleepsForever,
        "rank timed out",
        [
            "rank {g}: did not return in time; it was here:",
            "in _sleep_in_hook",
            "rank {g} issued nothing at index",
        ],
    ),
    "mismatched op": (
        lambda guilty: MismatchedCollective(how="op", guilty=guilty),
        "collectives mismatched",
        ["rank {g}: broadcast 4 float64 root=0", "all_reduce SUM 4 float64"],
    ),
    "mismatched shape": (
        lambda guilty: MismatchedCollective(how="shape", guilty=guilty),
        "collectives mismatched",
        ["rank {g}: all_reduce SUM 5 float64", "all_reduce SUM 4 float64"],
    ),
    "mismatched dtype": (
        lambda guilty: MismatchedCollective(how="dtype", guilty=guilty),
        "collectives mismatched",
        ["rank {g}: all_reduce SUM 4 int64", "all_reduce SUM 4 float64"],
    ),
    "mismatched count": (
        lambda guilty: MismatchedCollective(how="count", guilty=guilty),
        "collectives mismatched",
        ["rank {g} issued nothing at index"],
    ),
    "waits on a handle never launched elsewhere": (
        lambda guilty: MismatchedCollective(how="never-launched", guilty=guilty),
        "collectives mismatched",
        ["rank {g}: all_reduce SUM 4 float64", "issued nothing at index", "in after_backward"],
    ),
}


# ---------------------------------------------------------------------------------------------
# Process and socket inspection (Linux /proc)


def _processes(match) -> set[int]:
    """Pids whose ``/proc/PID/stat`` fields after the command name satisfy ``match``: state,
    ppid, pgrp, session... (``fields[0]`` is the state, ``fields[1]`` the parent)."""
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if match(fields):
            out.add(int(entry))
    return out


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid``, zombies included (an unreaped rank is a leftover too): ranks
    are children of the fork server, a child of this process."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):  # gone, or not a process
            continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _listening_inodes() -> set[int]:
    inodes = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                inodes.add(int(fields[9]))
    return inodes


def _socket_inodes(pids: list[int]) -> set[int]:
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(int(link[len("socket:[") : -1]))
    return inodes


# ---------------------------------------------------------------------------------------------
# The table


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_is_reported_fast_and_leaves_nothing_behind(fault, world_size):
    make, kind, fragments = FAULTS[fault]
    guilty = world_size - 1
    # A warm world: started, and torch's lazy imports (the first optimizer pulls in dynamo, seconds
    # on a busy machine) done before the clock runs.
    check_example(targets.PARALLEL, FAULT_SCENARIO, world_size, deadline=patience(60))
    # and the one-process world a rank's raise is tried in (does it need a second rank?)
    check_example(targets.PARALLEL, FAULT_SCENARIO, 1, deadline=patience(60))
    world = get_world(world_size)
    old_pids, old_janitor_pid = world.pids, world.janitor_pid
    before_children = _descendants(os.getpid())
    listening = _socket_inodes(old_pids) & _listening_inodes()
    assert listening, "gloo ranks should hold listening sockets; the port check would be vacuous"

    started = time.monotonic()
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        check_example(make(guilty=guilty), FAULT_SCENARIO, world_size, deadline=DEADLINE)
    elapsed = time.monotonic() - started
    err, text = info.value, str(info.value)

    assert elapsed < DEADLINE + patience(5), f"{fault}: took {elapsed:.1f} s\n{text}"
    assert err.kinds == [kind], text
    if kind == "collectives mismatched":  # no side singled out (issue 50): every rank a row
        assert [d.rank for d in err.divergences] == list(range(world_size)), text
        assert "guilty rank(s)" not in text, text
    else:
        assert [d.rank for d in err.divergences] == [guilty], text
    for fragment in fragments:
        assert fragment.format(g=guilty) in text, (fragment, text)
    assert "first collective where" in text or "every rank issued the same" in text, text

    # The dead world is gone: processes reaped, listening sockets closed.
    assert not (_descendants(os.getpid()) & set(old_pids)), text
    assert not (listening & _listening_inodes())
    # A fresh world runs the next example normally, and only its ranks (and its janitor, which
    # replaced the dead world's) are new children.
    check_example(targets.PARALLEL, Scenario(), world_size, deadline=patience(60))
    new_pids = get_world(world_size).pids
    assert set(new_pids).isdisjoint(old_pids)
    old_janitor, new_janitor = {old_janitor_pid}, {get_world(world_size).janitor_pid}
    assert _descendants(os.getpid()) <= (
        (before_children - set(old_pids) - old_janitor) | set(new_pids) | new_janitor
    )
    print(f"\nFAULT-TABLE W={world_size} {fault!r}: {err.kinds[0]} in {elapsed:.2f} s")


@pytest.mark.parametrize("world_size", [2, 3])
def test_an_extra_collective_is_reported_at_the_speed_of_the_evidence(world_size):
    """The other ranks finish; the sequence files show rank 1 in a barrier none of them issued.
    That is reported within seconds, naming the barrier and its line, not at the deadline."""
    deadline = 60
    # a warm world
    check_example(targets.PARALLEL, FAULT_SCENARIO, world_size, deadline=patience(60))
    started = time.monotonic()
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        check_example(ExtraBarrier(guilty=1), FAULT_SCENARIO, world_size, deadline=deadline)
    elapsed = time.monotonic() - started
    err, text = info.value, str(info.value)
    with open(__file__) as f:
        line = next(i for i, text_line in enumerate(f, 1) if "# EXTRA-BARRIER" in text_line)
    assert elapsed < patience(min(15, deadline / 4)), f"took {elapsed:.1f} s\n{text}"
    assert err.kinds == ["collectives mismatched"], text
    # no rank singled out (issue 50): rank 1 alone is blocked, but a rank alone in a collective
    # the others never issued is also what a correct rank looks like when the others skip one
    assert [d.rank for d in err.divergences] == list(range(world_size)), text
    site = f"test_faults.py:{line} in after_backward)"  # relative to the current directory
    assert re.search(r"rank 1: barrier \(at \S*" + re.escape(site), text), text
    row = err.divergences[1].detail  # rank 1's row (the first row shown is rank 0's)
    assert re.search(r"issued barrier \(at \S*" + re.escape(site), row), row
    others = "rank 0" if world_size == 2 else "ranks 0, 2"
    they = "it" if world_size == 2 else "they"
    assert re.search(
        f"{others} never issued the barrier that rank 1 issued at \\S*"
        + re.escape(site[:-1])
        + f"; {they} issued no further collective and returned",
        text,
    ), text
    check_example(targets.PARALLEL, FAULT_SCENARIO, world_size, deadline=patience(60))
    print(f"\nEXTRA-BARRIER W={world_size}: {err.kinds[0]} in {elapsed:.2f} s")


def test_a_rank_dying_between_tasks_is_not_blamed_on_the_next_example():
    """gloo's teardown race can SIGABRT an idle rank (docs/platform.md): no task was running, so
    the next example gets a fresh world instead of a "rank failed" it did not cause."""
    world = get_world(2)
    victim = world.pids[1]
    os.kill(victim, signal.SIGABRT)
    world._procs[1].join(10)  # reaped: the world sees the exit status before the next run
    assert world._procs[1].exitcode == -signal.SIGABRT
    check_example(targets.PARALLEL, Scenario(), 2, deadline=patience(60))
    assert victim not in get_world(2).pids


def test_a_real_abort_inside_a_task_is_still_reported():
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        check_example(AbortsInStep(), FAULT_SCENARIO, 2, deadline=DEADLINE)
    text = str(info.value)
    assert info.value.kinds == ["rank failed"]
    assert "rank 1: process exited (killed by signal SIGABRT)" in text
    # faulthandler wrote the crashing rank's Python stack into its log
    assert "Fatal Python error: Aborted" in text and "in step" in text, text
    assert "(the stacks of 4 other threads left out)" in text, text


class _AbortingSGD(torch.optim.SGD):
    def step(self, closure=None):
        super().step(closure)
        if dist.get_rank() == 1:
            # threads alive at the crash: faulthandler dumps each, after the crashing one's
            # header -- the report must still show the header and the crashing frames
            for _ in range(4):
                threading.Thread(target=threading.Event().wait, daemon=True).start()
            os.abort()


@dataclasses.dataclass(frozen=True)
class AbortsInStep(_Faulty):
    def make_optimizer(self, params, optimizer_cls, **kwargs):
        return _AbortingSGD(params, **kwargs)


def _running(pids: list[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.add(pid)
        except OSError:
            pass
    return alive


# ---------------------------------------------------------------------------------------------
# Interrupts: Ctrl-C reaches the whole foreground process group, as at a terminal


def _session_processes(sid: int) -> set[int]:
    """Live (non-zombie) processes of session ``sid``."""
    return _processes(lambda fields: int(fields[3]) == sid and fields[0] != "Z")


def _interrupt_when(cmd: list[str], ready: str, cwd: str, timeout: float = 120.0):
    """Start ``cmd`` in its own session, wait until ``ready`` appears in a rank's log (the
    ranks are busy), Ctrl-C the whole group; return (exit status, output, leftover pids)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    # Ctrl-C as a terminal gives it: a suite started in the background (`make test &`, nohup)
    # ignores SIGINT, and a child inherits that -- Python then installs no KeyboardInterrupt
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        end = time.monotonic() + patience(timeout)
        marker = os.path.join(cwd, ready)
        while not os.path.exists(marker):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < end, "the ranks never got busy"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=patience(60))
        end = time.monotonic() + patience(15)
        while _session_processes(proc.pid) and time.monotonic() < end:
            time.sleep(0.1)
        return proc.returncode, out, _session_processes(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for pid in _session_processes(proc.pid):  # never leave anything, even on failure
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@dataclasses.dataclass(frozen=True)
class BusyTarget(_Faulty):
    """Every rank touches a marker file, then computes (not sleeps) for a long time."""

    marker: str = ""

    def after_backward(self, model, optimizer):
        open(f"{self.marker}.{dist.get_rank()}", "w").close()
        if dist.get_rank() == 0:
            open(self.marker, "w").close()
        end = time.monotonic() + 600
        while time.monotonic() < end:
            sum(range(10_000))
        model.finish_gradient_sync()


@pytest.mark.slow
@pytest.mark.thorough  # make test: Ctrl-C of check at three moments (front/test_interrupts.py)
def test_ctrl_c_of_ddpcheck_check_leaves_no_process(tmp_path):
    spec = f"tests.world.test_faults:BusyTarget(marker={str(tmp_path / 'busy')!r})"
    status, out, left = _interrupt_when(
        [
            sys.executable,
            "-m",
            "ddpcheck",
            "check",
            spec,
            "--world-sizes",
            "2",
            "--deadline",
            "600",
        ],
        "busy",
        str(tmp_path),
    )
    assert not left, f"left running: {left}\n{out}"
    assert status == 130, out
    assert "interrupted; every rank process was stopped" in out
    assert "Traceback" not in out, out


@pytest.mark.slow
@pytest.mark.thorough  # `make test`: the same under xdist (below), its workers pytest processes
def test_ctrl_c_of_a_pytest_run_leaves_no_process(tmp_path):
    (tmp_path / "test_busy.py").write_text(
        textwrap.dedent(f"""
        from ddpcheck import check_example
        from ddpcheck.scenario import Scenario
        from tests.world.test_faults import BusyTarget

        def test_busy():
            check_example(BusyTarget(marker={str(tmp_path / "busy")!r}), Scenario(), 2,
                          deadline=600)
    """)
    )
    status, out, left = _interrupt_when(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_busy.py"],
        "busy",
        str(tmp_path),
    )
    assert not left, f"left running: {left}\n{out}"
    assert status == 2, out  # pytest's "interrupted"
    assert "KeyboardInterrupt" in out, out


@pytest.mark.slow
def test_ctrl_c_of_a_pytest_xdist_run_leaves_no_process(tmp_path):
    (tmp_path / "test_busy.py").write_text(
        textwrap.dedent(f"""
        import pytest
        from ddpcheck import check_example
        from ddpcheck.scenario import Scenario
        from tests.world.test_faults import BusyTarget

        @pytest.mark.parametrize("i", [0, 1])
        def test_busy(i):
            check_example(BusyTarget(marker={str(tmp_path / "busy")!r} + str(i)), Scenario(), 2,
                          deadline=600)
    """)
    )
    status, out, left = _interrupt_when(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "test_busy.py"],
        "busy0",
        str(tmp_path),
    )
    assert not left, f"left running: {left}\n{out}"
    assert status != 0, out
