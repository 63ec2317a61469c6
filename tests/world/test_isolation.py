"""Isolation between examples, start-up and shutdown hygiene (``ddpcheck._rank.fitness``,
``ddpcheck._world.janitor``, ``world._refuse_nested_start``).

What a target leaves in its rank processes is put right (process groups destroyed, settings set
back) or answered with a fresh world, and noted -- never blamed, except a change that alters what
later code computes (a global module hook: "rank left unfit"), and only after the example's numbers
held. The next, correct example runs in a process as it started. A script that
calls ddpcheck at import time gets one line, fast. SIGTERM or SIGKILL of a process running
ddpcheck leaves no world directory and no rank process behind.

Targets travel to rank processes by pickle, so they are module-level classes here.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import pathlib
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
from ddpcheck import check_example, targets, zoo
from ddpcheck._rank import serve as rank_module
from ddpcheck._rank.fitness import FD_HEADROOM
from ddpcheck._world.registry import get_world
from ddpcheck.mutation import catalogue as mutants
from ddpcheck.scenario import Scenario
from tests.patience import patience

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCENARIO = Scenario(steps=1)

# ---------------------------------------------------------------------------------------------
# Targets that damage the rank process (each on every rank, as a careless target would)

_KEEP: list = []  # what the leaky targets keep alive in the rank process


def _noop_hook(module, inputs, output):
    return None


@dataclasses.dataclass(frozen=True)
class RegistersGlobalHook(targets.ParallelTarget):
    def wrap(self, module):
        torch.nn.modules.module.register_module_forward_hook(_noop_hook)
        return super().wrap(module)


@dataclasses.dataclass(frozen=True)
class DestroysDefaultGroup(targets.ParallelDDPTarget):
    def after_backward(self, model, optimizer):
        model.finish_gradient_sync()
        dist.barrier()
        dist.destroy_process_group()

    def reported_loss(self, model, optimizer, losses):
        return None  # its loop ends with the group: nothing reported after it


@dataclasses.dataclass(frozen=True)
class NewGroupPerExample(targets.ParallelTarget):
    def wrap(self, module):
        module.group = dist.new_group(list(range(dist.get_world_size())))  # kept by the model
        return super().wrap(module)


@dataclasses.dataclass(frozen=True)
class ChangesThreadCount(targets.ParallelTarget):
    def wrap(self, module):
        torch.set_num_threads(2)
        return super().wrap(module)


@dataclasses.dataclass(frozen=True)
class LeavesThreadRunning(targets.ParallelTarget):
    def wrap(self, module):
        stop = threading.Event()
        threading.Thread(target=stop.wait, name="leftover-worker", daemon=True).start()
        _KEEP.append(stop)
        return super().wrap(module)


@dataclasses.dataclass(frozen=True)
class LeaksFile(targets.ParallelTarget):
    count: int = 1

    def wrap(self, module):
        _KEEP.extend(open(os.devnull) for _ in range(self.count))  # noqa: SIM115 -- the leak
        return super().wrap(module)


@dataclasses.dataclass(frozen=True)
class StartsSubprocess(targets.ParallelTarget):
    """Starts a long-lived child on every rank and records its pid in ``marker``.<rank>."""

    marker: str = ""

    def wrap(self, module):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(f"{self.marker}.{dist.get_rank()}", "w") as f:
            f.write(str(child.pid))
        return super().wrap(module)


def _fd_count():
    from ddpcheck._rank import fitness

    return fitness.baseline().fds


#: What a target leaves in its ranks that ddpcheck puts right or answers with a new world: how a
#: framework lives in its process, never a verdict (case -> target, note, a new world?).
LEFTOVERS = {
    "destroyed default group": (DestroysDefaultGroup, "destroyed the default process group", True),
    "new_group per example": (
        NewGroupPerExample,
        "created 1 process group(s) and left them (destroyed after the example)",
        False,
    ),
    "set_num_threads": (
        ChangesThreadCount,
        "changed torch.get_num_threads() 1 -> 2 (set back)",
        False,
    ),
    "thread left running": (
        LeavesThreadRunning,
        "left 1 thread(s) running (leftover-worker)",
        True,
    ),
}


@pytest.mark.parametrize("case", list(LEFTOVERS))
def test_what_a_target_leaves_behind_is_put_right_and_noted_not_blamed(case):
    make, note, new_world = LEFTOVERS[case]
    check_example(targets.PARALLEL, SCENARIO, 2)  # a warm world
    old_pids = get_world(2).pids
    notes = check_example(make(), SCENARIO, 2, deadline=patience(30))
    assert any(n.startswith(note + " (ranks 0, 1)") for n in notes), notes
    assert (any(n.startswith("a new world for the next task") for n in notes)) == new_world, notes
    # The next, correct example passes, in a world that is as it started.
    assert check_example(targets.PARALLEL, SCENARIO, 2) == ()
    assert set(get_world(2).pids).isdisjoint(old_pids) == new_world


def test_descriptors_kept_open_are_noted_and_a_world_that_holds_too_many_is_replaced():
    # Libraries keep descriptors open for good (FSDP2's meshes); a leak would exhaust them.
    # A fresh world: one an earlier test used may have accepted more descriptors than it holds.
    get_world(2).kill()
    check_example(targets.PARALLEL, SCENARIO, 2)
    fds = get_world(2).run(_fd_count)[0]
    old_pids = get_world(2).pids
    notes = check_example(LeaksFile(), SCENARIO, 2, deadline=patience(30))
    assert any(
        n.startswith(f"file descriptors {fds} -> {fds + 1}, kept open by a library") for n in notes
    ), notes
    assert get_world(2).pids == old_pids
    notes = check_example(LeaksFile(count=FD_HEADROOM + 1), SCENARIO, 2, deadline=patience(30))
    assert any(f"more than {FD_HEADROOM} kept open" in n for n in notes), notes
    assert any(n.startswith("a new world for the next task") for n in notes), notes
    assert check_example(targets.PARALLEL, SCENARIO, 2) == ()
    assert set(get_world(2).pids).isdisjoint(old_pids)


def test_a_global_hook_left_behind_is_blamed_only_after_the_numbers_held():
    check_example(targets.PARALLEL, SCENARIO, 2)
    old_pids = get_world(2).pids
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        check_example(RegistersGlobalHook(), SCENARIO, 2, deadline=patience(30))
    err, text = info.value, str(info.value)
    assert err.kinds == ["rank left unfit"], text
    assert [d.rank for d in err.divergences] == [0, 1], text
    assert (
        "registered 1 global forward hook: every later model or step in this process would "
        "run it (the numbers of this example held)" in text
    ), text
    check_example(targets.PARALLEL, SCENARIO, 2)  # in a fresh world
    assert set(get_world(2).pids).isdisjoint(old_pids)


def test_numbers_are_judged_before_what_the_ranks_left_behind():
    # A bug in the numbers (weights all-reduced after the step, never the gradients) is the
    # verdict, whatever else the target left: the global hook must not hide it.
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        check_example(HookAndAveragesWeights(), SCENARIO, 2, deadline=patience(30))
    assert info.value.kinds[0].startswith(("replicas differ", "reference differs")), str(info.value)
    assert "rank left unfit" not in info.value.kinds, str(info.value)


@dataclasses.dataclass(frozen=True)
class HookAndAveragesWeights(targets.LocalTarget):
    def wrap(self, module):
        torch.nn.modules.module.register_module_forward_hook(_noop_hook)
        with torch.no_grad():  # rank 0's weights, as a DDP would broadcast them
            for p in module.parameters():
                dist.broadcast(p, 0)
        return module

    def after_step(self, model, optimizer):
        with torch.no_grad():
            for p in model.parameters():
                dist.all_reduce(p)
                p /= dist.get_world_size()


def test_the_fitness_check_is_cheap():
    """It runs after every task: it must cost well under a millisecond."""
    assert max(get_world(2).run(_fitness_check_seconds)) < 1e-3


def _fitness_check_seconds(n=500):
    from ddpcheck._rank import fitness, recorder

    base = fitness.baseline(tuple(recorder.wrapped()))
    started = time.perf_counter()
    for _ in range(n):
        found, base = fitness.restore(base)
        assert not found, found
    return (time.perf_counter() - started) / n


def _collector_load():
    return gc.get_freeze_count(), len(gc.get_objects())


def test_what_a_rank_imported_at_start_up_is_out_of_the_collectors_reach():
    """The full collection after a task that left a process group scans what tasks created, not
    torch's objects again (140 ms a collection on the 2-core machine when it did)."""
    check_example(targets.PARALLEL, SCENARIO, 2)
    frozen, tracked = get_world(2).run(_collector_load)[0]
    assert frozen > 5 * tracked, (frozen, tracked)


def test_processes_a_target_starts_die_with_the_world(tmp_path):
    marker = str(tmp_path / "child")
    check_example(StartsSubprocess(marker=marker), SCENARIO, 2, deadline=patience(30))
    pids = [int(pathlib.Path(f"{marker}.{r}").read_text()) for r in range(2)]
    assert all(_alive(p) for p in pids)
    get_world(2).kill()  # what a failure does: every rank's process group goes
    _wait_until(lambda: not any(_alive(p) for p in pids), patience(10))
    assert not any(_alive(p) for p in pids)


#: torch.get_num_threads() in every forward this process ran (the ranks' are in their processes).
THREADS_HERE: list[int] = []


class RecordsThreads(zoo.MLP):
    def forward(self, x):
        THREADS_HERE.append(torch.get_num_threads())
        return super().forward(x)


@pytest.mark.parametrize("passes", [True, False])
def test_the_checking_process_computes_on_one_thread_and_gives_the_callers_back(passes):
    # The reference and the oracle compute here while the ranks train on the same cores.
    target = targets.PARALLEL if passes else mutants.by_name("NoDivide").target
    THREADS_HERE.clear()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        if passes:
            check_example(target, Scenario(model=RecordsThreads, steps=2), 2, deadline=patience(30))
        else:
            with pytest.raises(ddpcheck.EquivalenceError):
                check_example(
                    target, Scenario(model=RecordsThreads, steps=2), 2, deadline=patience(30)
                )
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert THREADS_HERE and set(THREADS_HERE) == {1}, THREADS_HERE


# ---------------------------------------------------------------------------------------------
# Start-up: a script that calls ddpcheck at import time


@pytest.mark.slow
def test_a_script_without_main_guard_gets_one_line_fast(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(
        textwrap.dedent("""
        import ddpcheck
        from ddpcheck import targets
        print("the script ran", flush=True)
        ddpcheck.assert_equivalent(targets.PARALLEL, world_sizes=(2,))
    """)
    )
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=patience(120),
        cwd=tmp_path,
        env=_env(tmp_path),
    )
    elapsed = time.monotonic() - started
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert (
        "WorldStartError: " + str(script) + " calls ddpcheck when it is imported, and every "
        "rank process re-imports the main module (multiprocessing's spawn); put that call "
        'under `if __name__ == "__main__":`'
    ) in text, text
    assert out.stdout.count("the script ran") == 1, text  # the ranks' output is not shown
    assert "bootstrapping phase" not in text and "multiprocessing/spawn.py" not in text, text
    # Python's traceback of the script's call, ddpcheck's frames down to the world's start (the
    # door, the battery, the example, the world: 11): no frame of a rank, nor of
    # multiprocessing's start-up
    frames = [line for line in text.splitlines() if line.startswith("  File ")]
    assert len(frames) <= 11 and not any("multiprocessing" in f for f in frames), text
    assert not _leftover_dirs(tmp_path), text
    assert elapsed < patience(60), f"took {elapsed:.1f} s"
    print(
        f"\nNO-MAIN-GUARD: exit {out.returncode} in {elapsed:.1f} s, {len(text.splitlines())} lines"
    )


def test_a_world_cannot_be_started_inside_a_rank():
    results = get_world(2).run(_start_a_world_inside_a_rank)
    assert (
        results
        == [
            "WorldStartError: a ddpcheck world cannot be started from inside a "
            "ddpcheck rank process (a target or task called ddpcheck)"
        ]
        * 2
    )


def _start_a_world_inside_a_rank():
    try:
        get_world(2)
    except ddpcheck.WorldStartError as exc:
        return f"WorldStartError: {exc}"
    return "started"


# ---------------------------------------------------------------------------------------------
# Shutdown: SIGTERM and SIGKILL of the parent


@pytest.mark.slow
@pytest.mark.parametrize(
    # `make test`: SIGKILL, which only the janitor can answer (SIGTERM's status: in-process)
    "sig",
    [pytest.param(signal.SIGTERM, marks=pytest.mark.thorough), signal.SIGKILL],
)
def test_killing_ddpcheck_check_leaves_no_world_behind(tmp_path, sig):
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpcheck", "check", "--world-sizes", "2", "--examples", "1000"],
        cwd=tmp_path,
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        # worlds started: a world directory with a rank that joined (its sequence file exists)
        _wait_until(
            lambda: (
                any(
                    os.path.exists(os.path.join(tmp_path, d, "rank1.collectives"))
                    and os.path.getsize(os.path.join(tmp_path, d, "rank1.collectives"))
                    for d in _leftover_dirs(tmp_path)
                )
                or proc.poll() is not None
            ),
            patience(120),
        )
        assert proc.poll() is None, proc.stdout.read()
        ranks = [pid for pid in _world_processes(tmp_path) if _is_rank(pid)]
        assert len(ranks) >= 2, ranks
        started = time.monotonic()
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=patience(30))
        _wait_until(
            lambda: not _leftover_dirs(tmp_path) and not _world_processes(tmp_path), patience(10)
        )
        elapsed = time.monotonic() - started
        assert not _leftover_dirs(tmp_path), (_leftover_dirs(tmp_path), out)
        assert not _world_processes(tmp_path), out
        if sig == signal.SIGTERM:
            assert proc.returncode == 143, out
            assert "ddpcheck: terminated; every rank process was stopped" in out, out
            assert "Traceback" not in out, out
        print(f"\n{sig.name}: clean in {elapsed:.2f} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for pid in _world_processes(tmp_path):  # never leave anything, even on failure
            os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# Helpers


def _env(tmp_path) -> dict:
    return {
        **os.environ,
        "TMPDIR": str(tmp_path),
        "PYTHONPATH": os.pathsep.join(
            [os.path.join(ROOT, "src"), ROOT, os.environ.get("PYTHONPATH", "")]
        ),
    }


def _leftover_dirs(tmp_path) -> list[str]:
    """Worlds' directories, and multiprocessing's (the fork server's socket lives there)."""
    return sorted(d for d in os.listdir(tmp_path) if d.startswith(("ddpcheck-", "pymp-")))


def _world_processes(tmp_path) -> list[int]:
    """Live processes of a run whose temporary files go under ``tmp_path`` (``_env``): the
    command itself, the fork server, ranks and what they started all inherit that TMPDIR in
    their environment (a spawned rank its world's directory too); janitors show it on their
    command line."""
    found = []
    needles = (f"{rank_module.WORLD_DIR_ENV}={tmp_path}".encode(), f"TMPDIR={tmp_path}\0".encode())
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (
            any(needle in environ for needle in needles)
            or (b"janitor.py" in cmdline and str(tmp_path).encode() in cmdline)
        ):
            found.append(int(entry))
    return found


def _is_rank(pid: int) -> bool:
    """A rank leads its own session (so do janitors, which run janitor.py)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            session = int(f.read().rsplit(")", 1)[1].split()[3])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            janitor = b"janitor.py" in f.read()
    except OSError:
        return False
    return session == pid and not janitor


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_until(condition, seconds: float) -> None:
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.05)


def _reduce_scatter_list_bytes():
    """In a rank: ``dist.reduce_scatter(output, input_list)`` as the recorder logs it."""
    import torch
    import torch.distributed as dist

    from ddpcheck._rank import recorder

    recorder.reset()
    world = dist.get_world_size()
    inputs = [torch.ones(4) for _ in range(world)]
    dist.reduce_scatter(torch.empty(4), inputs)
    return [(c.op, c.nbytes) for c in recorder.records()]


def test_a_list_reduce_scatter_is_counted_by_its_input_as_the_budget_says():
    logged = get_world(2).run(_reduce_scatter_list_bytes)
    # 2 inputs of 4 float32 elements: 32 bytes on each rank, not the output's 16
    assert logged == [[("reduce_scatter", 32)]] * 2, logged
