"""Device-correct worlds: the backend follows the tensors, never the machine.

On a machine without GPUs the CUDA side is simulated (``torch.cuda.is_available`` -> True,
``device_count`` -> 8): no code path may then choose NCCL for CPU tensors. What needs a real GPU
is skipped here and runs unchanged on a GPU machine (``GPU`` marks below).

Helpers defined here travel to rank processes by pickle (``tests.base.test_devices.X``).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import ddpcheck
from ddpcheck import check_example, targets
from ddpcheck._base import devices
from ddpcheck._base.devices import backend_for, check_fits
from ddpcheck._rank.runner import run_example_packed
from ddpcheck._rank.transport import unpack
from ddpcheck._runs.fuzz import fuzz
from ddpcheck._runs.replay import replay_command
from ddpcheck._world import registry
from ddpcheck._world.registry import get_world
from ddpcheck._world.worlds import World
from ddpcheck.scenario import Scenario
from tests.patience import patience

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
GPU = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
TWO_GPUS = pytest.mark.skipif(GPUS < 2, reason="needs two CUDA devices")
NO_GPU = pytest.mark.skipif(GPUS > 0, reason="checks the refusal on a machine without GPUs")
SMALL = Scenario(steps=1)

# Put into a subprocess's sys.path: every process it starts then sees 8 GPUs that are not there.
FAKE_GPUS = """
import torch, torch.distributed
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: {count}
torch.distributed.is_nccl_available = lambda: True
"""


@pytest.fixture
def eight_visible_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)


def subprocess_env(tmp_path, fake_gpus: int | None = None) -> dict[str, str]:
    """The environment of a subprocess (and every process it starts) that sees ``fake_gpus``
    GPUs that are not there (None: the machine's own)."""
    path = [os.path.join(ROOT, "src"), ROOT]
    if fake_gpus is not None:
        (tmp_path / "sitecustomize.py").write_text(FAKE_GPUS.format(count=fake_gpus))
        path.insert(0, str(tmp_path))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONWARNINGS": "ignore"}


# ---------------------------------------------------------------------------------------------
# The choice: one function, for spawned worlds and torchrun


def test_the_backend_follows_the_tensors_whatever_gpus_are_visible(eight_visible_gpus):
    assert backend_for("cpu") == "gloo"
    assert backend_for("cuda") == "nccl"
    assert backend_for("cuda", "gloo") == "gloo"
    assert World(2).backend == "gloo" and World(2).device == "cpu"
    assert World(2, device="cuda").backend == "nccl"
    assert check_fits("cpu", (1, 2, 3, 4)) == "gloo"
    assert check_fits("cuda", (8,)) == "nccl"
    assert check_fits("cuda", (9, 12), "gloo") == "gloo"  # gloo shares GPUs


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: backend_for("cpu", "nccl"), "backend='nccl' cannot carry CPU tensors"),
        (lambda: backend_for("cuda", "mpi"), "backend='mpi' is not a backend ddpcheck starts"),
        (lambda: backend_for("tpu"), "device='tpu' is not a device ddpcheck runs on"),
        (
            lambda: check_fits("cuda", (2, 9)),
            "a world of 9 ranks needs 9 GPUs with NCCL (one rank "
            "per GPU: NCCL refuses two ranks on one device), and 8 "
            "are visible",
        ),
        (lambda: World(2, device="gpu"), "device='gpu' is not a device"),
        (
            lambda: ddpcheck.assert_equivalent(targets.PARALLEL, device="cuda:0"),
            "device='cuda:0' is not a device",
        ),
    ],
)
def test_what_cannot_run_is_refused_naming_why(eight_visible_gpus, call, message):
    with pytest.raises(ddpcheck.InvalidArgument) as info:
        call()
    assert message in str(info.value)


def _placement() -> tuple:
    """In a rank: its backend, its device, and the precision flags it runs float32 at."""
    return (
        dist.get_backend(),
        str(devices.this_rank()),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )


def test_spawned_worlds_carry_cpu_tensors_over_gloo_when_gpus_are_visible(eight_visible_gpus):
    world = get_world(2)
    assert world.backend == "gloo" and world.device == "cpu"
    # the ranks joined a gloo group, compute on the CPU, with TF32 off
    assert world.run(_placement) == [("gloo", "cpu", False, False, "highest")] * 2
    check_example(targets.PARALLEL, SMALL, 2)  # and an example runs there


def test_worlds_are_kept_per_device(monkeypatch):
    """A CUDA world is never handed out for CPU examples (nor the reverse)."""

    def pretend_to_start(self, deadline=None):
        self._alive = True  # no process: this test is about which world is handed out
        return self

    monkeypatch.setattr(registry, "_WORLDS", {})
    monkeypatch.setattr(World, "start", pretend_to_start)
    cpu = get_world(2)
    assert get_world(2) is cpu and cpu.backend == "gloo"
    cuda = get_world(2, device="cuda")
    assert cuda is not cpu and (cuda.device, cuda.backend) == ("cuda", "nccl")
    shared = get_world(2, device="cuda", backend="gloo")
    assert shared not in (cpu, cuda) and shared.backend == "gloo"
    assert get_world(2) is cpu and get_world(2, device="cuda") is cuda


def test_torchrun_joins_over_gloo_for_cpu_tensors_when_gpus_are_visible(
    eight_visible_gpus, monkeypatch
):
    from ddpcheck._runs import torchrun

    joined = []
    monkeypatch.setattr(devices, "_rank_device", None)  # restored: this process is no rank
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        dist,
        "init_process_group",
        lambda backend, **kwargs: joined.append((backend, kwargs.get("device_id"))),
    )
    assert torchrun.init_world("cpu", None, 30.0) == "gloo"
    assert joined == [("gloo", None)]
    # on CUDA, NCCL with the rank's device (the binding itself needs a real GPU: see below)
    monkeypatch.setattr(torchrun, "enter_rank", lambda device, index: torch.device("cuda", index))
    assert torchrun.init_world("cuda", None, 30.0) == "nccl"
    assert torchrun.init_world("cuda", "gloo", 30.0) == "gloo"
    assert joined[1:] == [("nccl", torch.device("cuda", 0)), ("gloo", None)]
    # end to end, with 8 fake GPUs in every process: tests/runs/test_torchrun.py's first test


# ---------------------------------------------------------------------------------------------
# Refusals: exit 2, one line, seconds, before any process is spawned


@NO_GPU
def test_check_on_cuda_without_gpus_is_refused_in_seconds(tmp_path):
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "ddpcheck", "check", "parallel", "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=patience(60),
        cwd=tmp_path,
        env=subprocess_env(tmp_path),
    )
    took = time.monotonic() - started
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip().splitlines() == [
        "ddpcheck check: error: --device='cuda', but torch "
        f"{torch.__version__} sees no CUDA device (torch.cuda.is_available() is False); run on "
        "the CPU (the default) or on a machine with a GPU"
    ]
    assert took < patience(15), f"{took:.1f} s"  # interpreter + torch import, then one line
    assert not list(tmp_path.glob("ddpcheck-*"))


def test_nccl_with_more_ranks_than_gpus_is_refused_unless_gloo_is_asked_for(tmp_path):
    command = [
        sys.executable,
        "-m",
        "ddpcheck",
        "check",
        "parallel",
        "--device",
        "cuda",
        "--world-sizes",
        "1,2",
    ]
    out = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=patience(60),
        cwd=tmp_path,
        env=subprocess_env(tmp_path, fake_gpus=1),
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "a world of 2 ranks needs 2 GPUs with NCCL" in out.stderr
    assert "or the gloo backend to share GPUs" in out.stderr


@NO_GPU
def test_the_api_refuses_cuda_without_gpus_before_any_world_starts(no_process_started):
    for call in (
        lambda: ddpcheck.assert_equivalent(targets.PARALLEL, device="cuda"),
        lambda: check_example(targets.PARALLEL, SMALL, 1, device="cuda"),
        lambda: ddpcheck.survey(targets.PARALLEL, device="cuda"),
        lambda: fuzz(targets.PARALLEL, device="cuda"),
        lambda: World(1, device="cuda").start(),
    ):  # ddpcheck.get_world's worlds too
        with pytest.raises(ddpcheck.InvalidArgument, match="sees no CUDA device"):
            call()


def _pytest(tmp_path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_it.py").write_text("def test_nothing():\n    pass\n")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            str(tmp_path / "test_it.py"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=patience(120),
        cwd=tmp_path,
        env=subprocess_env(tmp_path),
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ddpcheck-device", "gpu"], "--ddpcheck-device='gpu' is not a device ddpcheck runs on"),
        (["--ddpcheck-backend", "nccl"], "--ddpcheck-backend='nccl' cannot carry CPU tensors"),
        pytest.param(
            ["--ddpcheck-device", "cuda"], "--ddpcheck-device='cuda', but torch", marks=NO_GPU
        ),
    ],
)
def test_the_plugin_validates_the_device_like_the_command_line(tmp_path, args, message):
    out = _pytest(tmp_path, *args)
    assert out.returncode == 4, out.stdout + out.stderr
    assert message in out.stderr


def test_replay_lines_name_the_device_only_when_it_is_not_the_cpu():
    cpu = replay_command(targets.LOCAL, SMALL, 2)
    assert "--device" not in cpu and "--backend" not in cpu
    cuda = replay_command(targets.LOCAL, SMALL, 2, device="cuda", backend="gloo")
    assert " --world-size 2 --device cuda --backend gloo --scenario " in cuda
    from ddpcheck.cli import build_parser

    args = build_parser().parse_args(shlex.split(cuda)[3:])
    assert (args.device, args.backend, args.world_size) == ("cuda", "gloo", 2)


# ---------------------------------------------------------------------------------------------
# On a GPU (skipped without one; written to run unchanged where there is one)


@dataclasses.dataclass(frozen=True)
class WrapsOnTheGpu(targets.ParallelTarget):
    """PARALLEL, refusing a model the runner did not move to this rank's GPU before wrapping."""

    def wrap(self, module):
        where = {str(t.device) for t in [*module.parameters(), *module.buffers()]}
        if where != {f"cuda:{torch.cuda.current_device()}"}:
            raise RuntimeError(f"the model was wrapped on {where}")
        return super().wrap(module)


@GPU
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_builtin_target_holds_on_one_gpu(dtype):
    scenario = Scenario(dtype=dtype)
    check_example(WrapsOnTheGpu(), scenario, 1, device="cuda")
    check_example(targets.TORCH_DDP, scenario, 1, device="cuda")


@GPU
def test_records_come_back_on_the_cpu_from_a_gpu_rank():
    world = get_world(1, device="cuda")
    assert world.run(_placement) == [("nccl", "cuda:0", False, False, "highest")]
    record = unpack(world.run(run_example_packed, targets.PARALLEL, Scenario())[0])
    tensors = [*record.initial.values()] + [
        t
        for step in record.steps
        for part in (step.params, step.grads, step.buffers)
        for t in part.values()
        if t is not None
    ]
    assert tensors and {t.device.type for t in tensors} == {"cpu"}


@GPU
def test_ranks_share_one_gpu_over_gloo():
    check_example(targets.PARALLEL, Scenario(), 2, device="cuda", backend="gloo")


@TWO_GPUS
@pytest.mark.parametrize("target", [WrapsOnTheGpu(), targets.TORCH_DDP, targets.TORCH_ZERO])
def test_the_builtin_targets_hold_on_two_gpus_over_nccl(target):
    ddpcheck.assert_equivalent(target, world_sizes=(2,), device="cuda")


@TWO_GPUS
def test_a_bug_found_on_gpus_replays_on_gpus():
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        check_example(targets.LOCAL, Scenario(), 2, device="cuda")
    assert "--world-size 2 --device cuda --scenario" in info.value.replay


@TWO_GPUS
def test_torchrun_on_two_gpus_uses_nccl(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "ddpcheck",
            "check",
            "--device",
            "cuda",
        ],
        capture_output=True,
        text=True,
        timeout=patience(600),
        cwd=tmp_path,
        env=subprocess_env(tmp_path),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "in the torchrun world of 2 (backend nccl, device cuda)" in out.stdout
