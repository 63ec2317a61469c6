"""``ddpcheck check`` under torchrun uses torchrun's world (env:// rendezvous on a free port)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.base.test_devices import subprocess_env
from tests.patience import patience

TORCHRUN = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc-per-node",
    "2",
    "-m",
    "ddpcheck",
    "check",
]


def _torchrun(*args: str, cwd, env=None) -> subprocess.CompletedProcess:
    env = env or {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [*TORCHRUN, *args], capture_output=True, text=True, timeout=patience(240), cwd=cwd, env=env
    )


@pytest.mark.slow
def test_the_builtin_target_passes_in_torchruns_world(tmp_path):
    # every process sees 8 GPUs that are not there: CPU tensors must still travel by gloo
    out = _torchrun("--world-sizes", "2", cwd=tmp_path, env=subprocess_env(tmp_path, fake_gpus=8))
    assert out.returncode == 0, out.stdout + out.stderr
    # printed once (rank 0), naming the world torchrun built
    assert out.stdout.count("examples equivalent in the torchrun world of 2 (backend gloo)") == 1


@pytest.mark.slow
def test_a_mutant_fails_on_every_rank_with_one_report(tmp_path):
    out = _torchrun("ddpcheck.mutation.catalogue:NoDivide()", cwd=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert (
        out.stdout.count(
            "NoDivide diverged at world size 2 (mlp-sgd): reference differs (gradient)"
        )
        == 1
    )
    assert "replay: python -m ddpcheck replay" in out.stdout


@pytest.mark.slow
@pytest.mark.thorough  # make test: world sizes refused at admission (front/test_admission.py)
def test_world_sizes_must_contain_torchruns_size(tmp_path):
    sizes = "1,3"  # (one list stands for all: a size alone is a list of one, the same test)
    out = _torchrun("--world-sizes", sizes, cwd=tmp_path)
    # every rank exits 2; torchrun itself reports any failed rank as 1 (ChildFailedError)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "exitcode  : 2" in out.stderr
    assert f"--world-sizes={sizes} does not contain torchrun's world size 2" in out.stdout, (
        out.stdout
    )


@pytest.mark.slow
@pytest.mark.thorough  # `make test`: a mutant under torchrun; this fault in ddpcheck's worlds
def test_collectives_that_pair_wrongly_but_complete_are_caught_under_torchrun():
    # gloo pairs an int64 all-reduce with a float64 one of the same bytes: the numbers are
    # garbage and nothing hangs. Spawned worlds catch it from the sequence files; torchrun must
    # reach the same verdict through the same judge (ddpcheck._runs.example.verdict).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = _torchrun('tests.world.test_faults:MismatchedCollective(how="dtype")', cwd=root)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "collectives mismatched" in out.stdout
    assert "rank 1: all_reduce SUM 4 int64" in out.stdout, out.stdout
