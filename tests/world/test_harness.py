"""The harness core: built-in targets pass the battery, broken ones fail loudly and fast.

Targets defined here travel to rank processes by pickle (``tests.world.test_harness.X``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import ddpcheck
from ddpcheck import check_example, cli, targets, zoo
from ddpcheck._runs.replay import from_repr
from ddpcheck._world import forking
from ddpcheck._world.registry import get_world
from ddpcheck.scenario import Scenario
from ddpcheck.targets.data_path import SAMPLER_PADS
from tests.patience import patience

ALL_SIZES = (1, 2, 3, 4)


# ---------------------------------------------------------------------------------------------
# Built-in targets


@pytest.mark.slow
@pytest.mark.parametrize("name", ["PARALLEL", "PARALLEL_DDP", "TORCH_DDP", "TORCH_ZERO"])
def test_builtin_targets_pass_the_battery(name):
    report = ddpcheck.assert_equivalent(getattr(targets, name), world_sizes=ALL_SIZES)
    from ddpcheck.battery import BATTERY

    assert report.count + len(report.skipped) == len(BATTERY) * len(ALL_SIZES)
    # torch's DDP declines per-rank registration orders; ZeRO also rejects mixed dtypes, and
    # checkpoints where its consolidate_state_dict cannot run (it needs numpy)
    # (each with the reason its class declares: Target.declined_features)
    declined = {
        "TORCH_ZERO": [
            "mixed-dtypes-sum (W=1,2,3,4): needs mixed-dtypes (TorchZeroTarget "
            "declines it: ZeroRedundancyOptimizer rejects parameters of "
            "several dtypes)"
        ],
        "TORCH_DDP": [],
    }.get(name)
    cls = type(getattr(targets, name)).__name__
    # bfloat16 parameters are the target's to apply: opt-in, and none of these opts in
    opt_in = [
        f"tokens-param-dtype-bf16 (W=1,2,3,4): needs param-dtype (opt-in: "
        f"{cls}.applies_param_dtype is not set)"
    ]
    if declined is not None:
        no_numpy = name == "TORCH_ZERO" and importlib.util.find_spec("numpy") is None
        assert sorted(report.skipped_lines()) == sorted(
            declined
            + opt_in
            + [
                f"rank-orders-adam (W=1,2,3,4): needs rank-orders ({cls} declines it: torch DDP "
                'requires "the exact same parameter registration order" on every process)'
            ]
            # its own DistributedSampler pads 26 samples at W=3, 4: declined (Target.supports_at)
            + [
                f"epochs-short-last (W={w}): 26 samples over {w} ranks: {SAMPLER_PADS}"
                for w in (3, 4)
            ]
            + [
                "checkpoint-resume (W=1,2,3,4): checkpoint: ZeroRedundancyOptimizer."
                "consolidate_state_dict decodes every rank's shard through numpy (torch 2.13), "
                "which is not installed here"
            ]
            * no_numpy
        )
    else:
        assert report.skipped_lines() == opt_in


def test_local_passes_alone_and_fails_with_replicas_diverging():
    # (not the checkpoint scenario: it resumes at W=2, where LOCAL is not alone any more)
    ddpcheck.assert_equivalent(targets.LOCAL, world_sizes=(1,), without=("checkpoint",))
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        ddpcheck.assert_equivalent(targets.LOCAL, world_sizes=(2,))
    err = info.value
    assert err.world_size == 2
    assert err.kinds[0] == "replicas differ (initial state)"
    text = str(err)
    assert "step  W  rank  parameter" in text
    assert "Tensor-likes are not equal!" in text
    assert "replay: python -m ddpcheck replay ddpcheck.targets:LOCAL --world-size 2" in text


@dataclasses.dataclass(frozen=True)
class SameInitLocal(targets.LocalTarget):
    """Identical initial weights, but still no synchronisation: the reference catches it."""


def test_unsynchronised_training_is_caught_by_the_reference_and_replicas():
    scenario = Scenario(zoo.MLP, rank_seeds=False)
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        check_example(SameInitLocal(), scenario, 2)
    kinds = info.value.kinds
    assert "replicas differ (gradient)" in kinds
    assert "reference differs (gradient)" in kinds


# ---------------------------------------------------------------------------------------------
# Numerically invisible bugs: the state-placement and communication-budget checks


@dataclasses.dataclass(frozen=True)
class AveragesTwice(targets.ParallelDDPTarget):
    """Averages the already averaged gradients again: no number changes at W=2."""

    def after_backward(self, model, optimizer):
        model.finish_gradient_sync()
        for p in model.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(dist.get_world_size())


@dataclasses.dataclass(frozen=True)
class EveryRankStepsEverything(targets.ParallelDDPTarget):
    """Claims to shard optimizer state but keeps all of it on every rank."""

    shards_optimizer_state = True


@dataclasses.dataclass(frozen=True)
class BroadcastsEachParameter(targets.ParallelDDPTarget):
    """Broadcasts every parameter on its own after the step (correct numbers, wasted calls)."""

    flattened_broadcasts = True

    def make_optimizer(self, params, optimizer_cls, **kwargs):
        return _BroadcastingSGD(params, **kwargs)


class _BroadcastingSGD(torch.optim.SGD):
    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                dist.broadcast(p.data, src=0)


@pytest.mark.parametrize(
    "target, kind",
    [
        (AveragesTwice(), "communication over budget"),
        (EveryRankStepsEverything(), "optimizer state misplaced"),
        (BroadcastsEachParameter(), "communication over budget"),
    ],
)
def test_bugs_that_change_no_number_are_still_caught(target, kind):
    scenario = Scenario(zoo.MLP, optimizer_kwargs={"lr": 0.1, "momentum": 0.9})
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        check_example(target, scenario, 2)
    assert info.value.kinds == [kind]


# ---------------------------------------------------------------------------------------------
# Failing and hanging ranks


@dataclasses.dataclass(frozen=True)
class RaisesOnRankOne(targets.ParallelDDPTarget):
    def after_backward(self, model, optimizer):
        if dist.get_rank() == 1:
            raise RuntimeError("deliberate failure on rank 1")
        model.finish_gradient_sync()


@dataclasses.dataclass(frozen=True)
class HangsOnRankZero(targets.ParallelDDPTarget):
    def after_backward(self, model, optimizer):
        if dist.get_rank() == 0:
            time.sleep(3600)
        model.finish_gradient_sync()


def test_a_rank_that_raises_is_reported_and_the_world_replaced():
    old_pids = get_world(2).pids
    started = time.monotonic()
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        check_example(RaisesOnRankOne(), Scenario(), 2, deadline=patience(20))
    assert time.monotonic() - started < patience(20) + patience(5)
    err = info.value
    assert err.kinds == ["rank failed"]
    assert [d.rank for d in err.divergences] == [1]
    assert "RuntimeError: deliberate failure on rank 1" in str(err)
    assert "rank 0: did not return in time; it was here:" in str(err)
    assert not any(_alive(pid) for pid in old_pids)
    check_example(targets.PARALLEL, Scenario(), 2)  # a fresh world works
    assert set(get_world(2).pids).isdisjoint(old_pids)


def _unpicklable_result() -> object:
    return lambda: None


def test_a_result_that_cannot_travel_is_ddpchecks_failure_not_a_rank_error():
    # (a record ddpcheck cannot send back -- once, numpy missing in the ranks -- read as a
    # rank error became the target's verdict)
    with pytest.raises(ddpcheck.WorldFailure) as info:
        get_world(2).run(_unpicklable_result, deadline=patience(20))
    assert info.value.kind == "refused"
    assert "ddpcheck could not send this rank's result back" in str(info.value)
    assert [s.status for s in info.value.ranks] == ["refused", "refused"]


def test_a_rank_that_hangs_times_out_with_its_stack():
    check_example(targets.PARALLEL, Scenario(), 2)  # a warm world: start-up is not the deadline's
    started = time.monotonic()
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        check_example(HangsOnRankZero(), Scenario(), 2, deadline=patience(3))
    assert time.monotonic() - started < patience(3) + patience(5)
    err = info.value
    assert "rank timed out" in err.kinds
    assert 'test_harness.py", line' in str(err) and "in after_backward" in str(err)
    check_example(targets.PARALLEL, Scenario(), 2)


class ResetsSignalsAsLightningDoes(targets.ParallelDDPTarget):
    """Lightning's ``Trainer`` puts every signal back, at the end of ``fit``, to what Python's
    ``signal.getsignal`` said before it -- ``SIG_DFL`` where faulthandler had installed its own."""

    def after_step(self, model, optimizer):
        for signum in (signal.SIGUSR1, signal.SIGABRT, signal.SIGSEGV):
            signal.signal(signum, signal.getsignal(signum) or signal.SIG_DFL)
        return super().after_step(model, optimizer)


def test_a_hang_after_a_library_reset_the_signal_handlers_still_shows_its_stack():
    # (after a Lightning example in the same world, a hang's SIGUSR1 killed the ranks:
    # "(no stack dump arrived)")
    check_example(ResetsSignalsAsLightningDoes(), Scenario(), 2)
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        check_example(HangsOnRankZero(), Scenario(), 2, deadline=patience(3))
    assert "in after_backward" in str(info.value), str(info.value)


def test_worlds_persist_across_examples():
    pids = get_world(3).pids
    for seed in range(10):
        check_example(targets.PARALLEL, Scenario(zoo.Tied, seed=seed), 3)
    assert get_world(3).pids == pids


def _setting_and_parent(name: str) -> tuple[str | None, int]:
    return os.environ.get(name), os.getppid()


def test_ranks_see_this_processs_environment_as_their_world_starts(monkeypatch):
    # Forked ranks start from the fork server's environment, older than this process's.
    server = forking.start_method()
    monkeypatch.setenv("DDPCHECK_TEST_SETTING", "set after the fork server started")
    world = ddpcheck.World(2).start()
    try:
        answers = world.run(_setting_and_parent, "DDPCHECK_TEST_SETTING")
    finally:
        world.close()
    assert [setting for setting, _ in answers] == ["set after the fork server started"] * 2
    if server == "forkserver":  # forked from the server, which imported torch once
        assert {parent for _, parent in answers} == {forking.parent_of_ranks(server)}
        assert forking.parent_of_ranks(server) != os.getpid()


@pytest.mark.slow
def test_a_ranks_output_goes_to_its_log_from_its_first_line(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent("""
        import os
        print("imported as", __name__, flush=True)
        if __name__ == "__main__":
            from ddpcheck._world.registry import get_world
            world = get_world(2)
            for rank in range(2):
                print(rank, open(os.path.join(world._dir, f"rank{rank}.log")).read().strip())
    """)
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=patience(120),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "imported as __main__",
        "0 imported as __mp_main__",
        "1 imported as __mp_main__",
    ], out.stdout + out.stderr


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone as far as we are concerned.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_no_rank_outlives_its_harness_process(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent("""
        import ddpcheck
        from ddpcheck import targets
        from ddpcheck._world.registry import get_world
        if __name__ == "__main__":
            ddpcheck.assert_equivalent(targets.PARALLEL, world_sizes=(2,))
            print(" ".join(map(str, get_world(2).pids)), flush=True)
    """)
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=patience(120),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def test_ranks_die_with_a_killed_harness(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent("""
        import time
        from ddpcheck._world.registry import get_world
        if __name__ == "__main__":
            print(" ".join(map(str, get_world(2).pids)), flush=True)
            time.sleep(600)
    """)
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids)
    finally:
        proc.kill()


# ---------------------------------------------------------------------------------------------
# Replay and bad input


def test_scenario_repr_is_code_that_rebuilds_it():
    scenario = Scenario(
        zoo.WithBuffers,
        optimizer=torch.optim.Adam,
        optimizer_kwargs={"lr": 0.02, "betas": (0.8, 0.9)},
        param_groups=zoo.BiasGroups(lr=0.5),
        lr_decay=0.5,
        global_batch=5,
    )
    assert from_repr(repr(scenario)) == scenario


def test_the_replay_line_replays(capsys):
    # in this process: the line run as a shell command, in a process of its own, is
    # tests/runs/test_replay.py's (a plain-class target, its divergence table compared)
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        check_example(targets.LOCAL, Scenario(seed=3), 2)
    argv = shlex.split(info.value.replay)
    assert argv[:4] == ["python", "-m", "ddpcheck", "replay"], info.value.replay
    capsys.readouterr()
    assert cli.main(argv[3:]) == 1
    assert "replicas differ (initial state)" in capsys.readouterr().out


def not_a_module():
    return 42


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"world_sizes": (0,)},
            "world_sizes=(0,) contains 0; every world size must be a positive integer",
        ),
        ({"world_sizes": (2, -1)}, "world_sizes=(2, -1) contains -1"),
        ({"world_sizes": (1.5,)}, "world_sizes=(1.5,) contains 1.5"),
        ({"world_sizes": "2"}, "world_sizes='2' must be a sequence of positive integers"),
        ({"world_sizes": ()}, "world_sizes=() is empty"),
        ({"deadline": 0}, "deadline=0 must be a positive number"),
        ({"scenario": "mlp"}, "scenario='mlp' must be a ddpcheck.Scenario"),
        (
            {"scenario": Scenario(not_a_module)},
            "model=tests.world.test_harness.not_a_module returned int, not a torch.nn.Module",
        ),
        (
            {"scenario": Scenario(optimizer_kwargs={"lr": 0.1, "momentum_typo": 0.9})},
            "optimizer_kwargs={'lr': 0.1, 'momentum_typo': 0.9} were rejected by torch.optim.SGD",
        ),
        ({"scenario": Scenario(optimizer_kwargs={"lr": -1.0})}, "Invalid learning rate: -1.0"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, message):
    with pytest.raises(ddpcheck.InvalidArgument) as info:
        ddpcheck.assert_equivalent(targets.PARALLEL, **{"world_sizes": (1,), **kwargs})
    assert message in str(info.value)


def test_bad_targets_are_clear_errors():
    with pytest.raises(
        ddpcheck.InvalidArgument,
        match=r"is a class; pass an instance, such as "
        r"ParallelTarget\(\)",
    ):
        ddpcheck.assert_equivalent(targets.ParallelTarget, world_sizes=(1,))

    class Local(ddpcheck.Target):
        pass

    with pytest.raises(ddpcheck.InvalidArgument, match="define the class at module level"):
        ddpcheck.assert_equivalent(Local(), world_sizes=(1,))
    with pytest.raises(ddpcheck.InvalidArgument, match=r"lacks \['configure', 'supports'"):
        ddpcheck.assert_equivalent(object(), world_sizes=(1,))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("global_batch", 0, "global_batch=0 must be an integer >= 1"),
        ("steps", 1.5, "steps=1.5 must be an integer >= 1"),
        ("dtype", "float16", "dtype='float16' must be one of ['float32', 'float64']"),
        ("optimizer", "sgd", "optimizer='sgd' must be a torch.optim.Optimizer subclass"),
        ("reduction", "max", "reduction='max' must be 'mean' or 'sum'"),
    ],
)
def test_bad_scenarios_are_clear_errors(field, value, message):
    with pytest.raises(ddpcheck.InvalidArgument) as info:
        Scenario(**{field: value})
    assert message in str(info.value)


def test_a_fork_server_that_never_gets_ready_is_a_start_error(monkeypatch, tmp_path):
    # forking before the server's imports end would block without a deadline: wait_ready bounds it
    # a process that waits for input it never gets: alive until killed, no sleep
    stuck = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        monkeypatch.setattr(forking, "_started_pid", stuck.pid)
        monkeypatch.setattr(forking, "_has_forked", False)
        monkeypatch.setattr(forking, "_ready_path", str(tmp_path / "never"))
        started = time.monotonic()
        with pytest.raises(ddpcheck.WorldStartError, match="did not import torch within 1 s"):
            forking.wait_ready(1.0)
        assert time.monotonic() - started < patience(5)
        stuck.kill()
        stuck.wait(10)
        with pytest.raises(ddpcheck.WorldStartError, match="exited while importing torch"):
            forking.wait_ready(patience(30))
        (tmp_path / "never").touch()  # ready: no wait at all
        monkeypatch.setattr(forking, "_started_pid", os.getpid())
        forking.wait_ready(0.0)
    finally:
        stuck.kill()
        stuck.wait(10)
        stuck.stdin.close()


def _numpy_draw() -> float:
    import numpy

    return float(numpy.random.random())


def _seed_everything() -> None:
    """What transformers' ``set_seed(42)`` does in every rank of a Trainer example."""
    import random

    import numpy

    random.seed(42)
    numpy.random.seed(42)
    torch.manual_seed(42)


def _draws() -> tuple[float, float, float]:
    import random

    import numpy

    return float(numpy.random.random()), random.random(), float(torch.rand(()))


def test_every_rank_draws_its_own_numpy_randomness():
    # forked from one server, ranks would share its numpy state; spawned ones never did
    pytest.importorskip("numpy")
    world = ddpcheck.World(3).start()
    try:
        draws = world.run(_numpy_draw)
    finally:
        world.close()
    assert len(set(draws)) == 3, draws


def test_a_task_that_seeds_the_global_generators_leaves_later_tasks_a_new_ranks_randomness():
    # transformers' Trainer calls set_seed(42) on every rank: every later example of the world
    # drew numpy's 0.3745401188473625 on every rank, where its replay line's fresh world would not
    pytest.importorskip("numpy")
    world = get_world(3)
    before = world.run(_draws)
    world.run(_seed_everything)
    after, again = world.run(_draws), world.run(_draws)
    for draws in (after, again):
        assert len({d[0] for d in draws}) == 3 and len({d[1] for d in draws}) == 3, draws
        assert 0.3745401188473625 not in {d[0] for d in draws}, draws
    # torch's generator: the rank's start-up state, alike on every rank as in a fresh world
    assert {d[2] for d in before} == {d[2] for d in after} == {d[2] for d in again}, (before, after)
    assert len({d[2] for d in after}) == 1, after
