"""Slowness is not a bug: a deadline that passes while ranks still work -- on a CPU, or waiting
for one on a loaded machine -- extends the wait; ranks that work without end are no verdict
(``Inconclusive``, exit 5); ranks that wait on each other are a hang, as before.

Targets defined here travel to rank processes by pickle (``tests.world.test_slowness.X``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

import ddpcheck
from ddpcheck import check_example, targets
from ddpcheck._world import progress
from ddpcheck.scenario import Scenario
from tests.patience import patience

#: One step, one micro-batch: the hooks below run once per example.
ONE_STEP = Scenario(steps=1)

#: The CPU ranks starve on while loaded (``loaded``): the last one.
STARVED_CPU = max(os.sched_getaffinity(0))


def _spin(seconds: float) -> None:
    """Compute for ``seconds`` of this thread's CPU time, however long that takes on the wall."""
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        x += 1


@dataclasses.dataclass(frozen=True)
class StarvedOnRankOne(targets.ParallelTarget):
    """Rank 1 needs ``work`` seconds of CPU in its first step, on the CPU the load holds."""

    work: float = 1.5

    def after_backward(self, model: Any, optimizer: Any) -> None:
        if dist.get_rank() == 1:
            allowed = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {STARVED_CPU})
            try:
                _spin(self.work)
            finally:
                os.sched_setaffinity(0, allowed)
        super().after_backward(model, optimizer)


@dataclasses.dataclass(frozen=True)
class ComputesForeverOnRankOne(targets.ParallelTarget):
    def after_backward(self, model: Any, optimizer: Any) -> None:
        if dist.get_rank() == 1:
            _spin(3600)
        super().after_backward(model, optimizer)


@contextlib.contextmanager
def loaded(hogs: int) -> Iterator[None]:
    """``hogs`` CPU-bound processes on :data:`STARVED_CPU`, each in a session of its own (as
    other users' jobs are: the kernel shares a CPU between sessions, not processes)."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import os; os.sched_setaffinity(0, {{{STARVED_CPU}}})\nwhile True: pass",
            ],
            start_new_session=True,
        )
        for _ in range(hogs)
    ]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_rank_starved_past_its_deadline_is_waited_for_not_judged():
    deadline = 2.0  # the rank's work alone (1.5 s of CPU) fits; a quarter of a CPU does not
    check_example(targets.PARALLEL, Scenario(), 2)  # a warm world: start-up is not the deadline's
    with loaded(hogs=3):
        started = time.monotonic()
        check_example(StarvedOnRankOne(), ONE_STEP, 2, deadline=deadline)
        took = time.monotonic() - started
    # the load did slow the rank past its deadline: the wait was extended, and it passed
    assert took > deadline, f"{took:.1f} s: the load did not starve the rank; nothing was tested"


@pytest.mark.slow
def test_a_rank_that_computes_without_end_is_no_verdict():
    check_example(targets.PARALLEL, Scenario(), 2)
    started = time.monotonic()
    with pytest.raises(ddpcheck.Inconclusive) as info:
        check_example(ComputesForeverOnRankOne(), ONE_STEP, 2, deadline=1.0)
    # the deadline, then a deadline of CPU after it, read every progress.OBSERVE seconds
    assert time.monotonic() - started < patience(1.0 + 1.0 + 2 * progress.OBSERVE + 5)
    text = str(info.value)
    assert info.value.exit_code == ddpcheck.ExitCode.INCONCLUSIVE == 5
    assert "rank 1: still working when the wait ended; it was here:" in text
    assert "in _spin" in text
    assert "slowness is not a bug" in text
    # what ran, and how to run it again with more time (a random example has no other record)
    assert f"scenario: {ONE_STEP!r}" in text
    assert "replay with more time: python -m ddpcheck replay " in text
    assert text.endswith("--deadline SECONDS")
    check_example(targets.PARALLEL, Scenario(), 2)  # the world was replaced


# ---------------------------------------------------------------------------------------------
# What the kernel reads, and what Overtime decides from it


def _reading(at: float, waited: float = 0.0, **cpu: float) -> progress.Reading:
    """Ranks' CPU seconds by ``r<rank>=``; ``waited``: seconds each also waited for a CPU."""
    on = {int(r[1:]): v for r, v in cpu.items()}
    return progress.Reading(at, on, {r: v + waited for r, v in on.items()})


class _Script:
    """Readings handed out in turn, as ``Overtime``'s measure."""

    def __init__(self, *readings: tuple[progress.Reading | None, int]):
        self.readings = list(readings)

    def __call__(self, ranks: set[int]) -> tuple[progress.Reading | None, int]:
        return self.readings.pop(0)


def test_overtime_waits_while_ranks_work_and_calls_a_hang_when_they_wait():
    working = progress.Overtime(
        10.0,
        0.0,
        _Script(
            (_reading(10, r0=5.0, r1=5.0), 7),
            (_reading(12, r0=5.0, r1=7.0), 7),
            (_reading(14, r0=5.0, r1=7.0), 7),
        ),
    )
    assert working.decide(10.0, {0, 1}) == 10.0 + progress.OBSERVE  # first, a look
    assert working.decide(12.0, {0, 1}) == 12.0 + progress.OBSERVE  # rank 1 worked: wait on
    assert working.decide(14.0, {0, 1}) == "timeout"  # then nobody moved: hung
    issuing = progress.Overtime(
        10.0, 0.0, _Script((_reading(10, r0=1.0), 3), (_reading(12, r0=1.0), 4))
    )
    issuing.decide(10.0, {0})
    assert issuing.decide(12.0, {0}) == 14.0  # idle CPU, yet a collective went out: progress


def test_overtime_ends_a_wait_that_a_whole_deadline_of_cpu_did_not_finish():
    overtime = progress.Overtime(
        3.0,
        0.0,
        _Script((_reading(3, r0=1.0), 0), (_reading(5, r0=2.9), 0), (_reading(7, r0=4.1), 0)),
    )
    overtime.decide(3.0, {0})
    assert overtime.decide(5.0, {0}) == 7.0  # 1.9 s of CPU since the deadline
    assert overtime.decide(7.0, {0}) == "slow"  # 3.1 s: more than the deadline again
    assert "the busiest rank used 3.1 s of CPU" in overtime.describe(7.0)
    # starved: a twentieth of a CPU, waiting for one the rest of the time
    starved = progress.Overtime(
        1.0, 0.0, _Script(*[(_reading(t, waited=0.95 * t, r0=0.05 * t), 0) for t in range(1, 11)])
    )
    decisions = [starved.decide(float(t), {0}) for t in range(1, 11)]
    assert decisions[:-1] == [t + progress.OBSERVE for t in range(1, 10)]
    assert progress.MOST_DEADLINES == 10 and decisions[-1] == "slow"  # 10 deadlines in all


def test_overtime_without_the_kernels_word_keeps_the_deadline():
    assert progress.Overtime(1.0, 0.0, _Script((None, 0))).decide(1.0, {0}) == "timeout"


def test_the_kernel_tells_a_working_process_from_a_waiting_one():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    # waits on a pipe nobody writes to until it is killed below
    idle = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        time.sleep(patience(0.5))  # both past their start-up
        groups = {0: busy.pid, 1: idle.pid}
        first = progress.read(groups, time.monotonic())
        time.sleep(1.0)
        second = progress.read(groups, time.monotonic())
    finally:
        for proc in (busy, idle):
            proc.kill()
            proc.wait()
    assert first is not None and second is not None
    only = {r: dataclasses.replace(second, busy={r: second.busy[r]}) for r in (0, 1)}
    assert only[0].activity(first) > 0.8  # on a CPU or waiting for one, all the time
    assert only[1].activity(first) < 0.05  # asleep


def test_a_hangs_stack_dump_that_arrives_late_on_a_loaded_machine_is_still_read(tmp_path):
    # a rank off the CPU when asked for its stacks dumps them once it runs again: a stopped
    # process, continued after 3 s, stands for one starved that long (the wait was 2 s flat)
    from ddpcheck._world.processes import dump_stacks

    path = tmp_path / "stacks"
    code = (
        "import faulthandler, signal, sys, time\n"
        f"f = open({str(path)!r}, 'w')\n"
        "faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)\n"
        "def waiting_for_its_peers():\n"
        "    print('ready', flush=True); signal.pause()\n"
        "def rank_main():\n"  # a rank's task loop, below every frame a dump is read for
        "    waiting_for_its_peers()\n"
        "rank_main()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    resume = threading.Timer(3.0, os.kill, (proc.pid, signal.SIGCONT))
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        os.kill(proc.pid, signal.SIGSTOP)
        resume.start()
        dumps = dump_stacks([proc], [str(path)], [0], deadline=60.0)
        assert "in waiting_for_its_peers" in dumps[0], dumps
    finally:
        if resume.ident is not None:
            resume.join()  # continued before it is killed
        proc.kill()
        proc.wait()


def test_a_stack_dump_preempted_halfway_is_read_whole(tmp_path):
    # faulthandler writes thread by thread; on a loaded machine it may pause between two blocks
    # for longer than a quiet machine's gap -- the main thread's frames came after the pause
    from ddpcheck._world.processes import dump_stacks

    path = tmp_path / "stacks"
    path.write_text("")
    ignores = (
        "import signal, time; signal.signal(signal.SIGUSR1, signal.SIG_IGN); "
        "print('ready', flush=True); signal.pause()"
    )
    proc = subprocess.Popen([sys.executable, "-c", ignores], stdout=subprocess.PIPE, text=True)
    first = 'Thread 0x01 (most recent call first):\n  File "threading.py", line 1 in wait\n'
    main = (
        "Current thread 0x02 (most recent call first):\n"
        '  File "t.py", line 9 in after_backward\n  File "serve.py", line 3 in rank_main\n'
    )

    def faulthandler_preempted() -> None:
        path.write_text(first)
        time.sleep(1.0)
        path.write_text(first + main)

    writer = threading.Thread(target=faulthandler_preempted)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        writer.start()
        dumps = dump_stacks([proc], [str(path)], [0], deadline=60.0)
        assert "in after_backward" in dumps[0], dumps
    finally:
        if writer.ident is not None:
            writer.join()
        proc.kill()
        proc.wait()
