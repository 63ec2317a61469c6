"""Torch floors per target (issue 53): every built-in target states the torch it needs, FSDP2's
per device; below it the target is refused before any world runs (exit 2, the release needed
named), and an API the installed torch lacks -- an ImportError or AttributeError out of torch
inside any target -- is a set-up error, never a verdict. Older releases are simulated here (the
installed release read as another, a name torch lacks); bench/torch_matrix.py runs real ones."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn

import ddpcheck
from ddpcheck import cli, targets, zoo
from ddpcheck.errors import ExitCode
from ddpcheck.scenario import Scenario
from ddpcheck.targets import catalogue, framework
from ddpcheck.targets.fsdp import CPU_FLOOR, CUDA_FLOOR

SCENARIO = Scenario(zoo.MLP, dtype="float32", global_batch=4, steps=1)


@dataclasses.dataclass(frozen=True)
class LacksAnApi(ddpcheck.Target):
    """A target using an API this torch does not have (as fully_shard on torch 2.1)."""

    attribute: bool = False

    def wrap(self, module: nn.Module) -> nn.Module:
        if self.attribute:
            return torch.distributed.fully_shard_of_a_later_torch(module)  # type: ignore[attr-defined]
        from torch.distributed import fully_shard_of_a_later_torch  # type: ignore[attr-defined]

        return fully_shard_of_a_later_torch(module)


def test_every_torch_target_states_its_floor():
    for entry in catalogue.READY_MADE:
        if entry.framework == "torch":
            assert entry.minimum is not None, entry.name
    assert framework.requirements(targets.TORCH_DDP) == (("torch", "2.1"),)
    assert framework.requirements(targets.TORCH_FSDP, "cpu") == (("torch", CPU_FLOOR),)
    assert framework.requirements(targets.TORCH_FSDP, "cuda:1") == (("torch", CUDA_FLOOR),)
    assert framework.requirements(targets.ACCELERATE) == targets.ACCELERATE.requires


def test_below_its_floor_a_target_is_refused_naming_the_release(monkeypatch, capsys):
    real = framework._release
    monkeypatch.setattr(
        framework, "_release", lambda name: "2.5.1" if name == "torch" else real(name)
    )

    def no_world(*args, **kwargs):
        raise AssertionError("a world was asked for")

    monkeypatch.setattr("ddpcheck._runs.example.world_of", no_world)
    needed = f"torch {re.escape(CPU_FLOOR)} and later on cpu; torch 2.5.1 is installed"
    with pytest.raises(ddpcheck.SetupError, match=needed):
        ddpcheck.check_example(targets.TORCH_FSDP, SCENARIO, 2)
    assert cli.main(["check", "torch_fsdp", "--examples", "1", "--world-sizes", "2"]) == 2
    err = capsys.readouterr().err
    assert f"pip install 'torch>={CPU_FLOOR}'" in err and "Traceback" not in err
    framework.check_requirements(targets.TORCH_DDP)  # 2.5.1 is above the others' floor


def test_an_api_torch_lacks_is_named_as_torchs_not_a_data_parallel_bug():
    def raised(error):
        try:
            raise error
        except Exception as exc:
            return exc

    missing = framework.torch_api_missing(
        targets.TORCH_FSDP,
        raised(ImportError("cannot import name 'fully_shard'", name="torch.distributed.fsdp")),
    )
    assert isinstance(missing, ddpcheck.SetupError)
    assert f"torch {CPU_FLOOR} and later" in str(missing)
    assert "not a data-parallel bug" in str(missing)
    no_attribute = raised(AttributeError("module 'torch.distributed' has no attribute 'x'"))
    assert framework.torch_api_missing(LacksAnApi(), no_attribute) is not None
    for other in (ValueError("x"), AttributeError("'NoneType' object has no attribute 'add_'")):
        assert framework.torch_api_missing(targets.TORCH_DDP, raised(other)) is None
    assert (
        framework.torch_api_missing(targets.TORCH_DDP, raised(ImportError("x", name="y"))) is None
    )
    # nn.Module.__getattr__ raises inside torch for a module's own missing attribute: the
    # target's miss ("'MLP' object has no attribute 'reduce_loss'"), not torch's API
    try:
        torch.nn.Linear(1, 1).reduce_loss  # noqa: B018
    except AttributeError as exc:
        assert framework.torch_api_missing(targets.TORCH_DDP, exc) is None


@pytest.mark.slow  # two examples in a world of 2: ~4 s of CPU
@pytest.mark.parametrize("attribute", [False, True])
def test_a_target_meeting_a_missing_torch_api_is_a_setup_error(attribute):
    with pytest.raises(ddpcheck.SetupError, match=r"lacks.*not a data-parallel bug") as info:
        ddpcheck.check_example(LacksAnApi(attribute=attribute), SCENARIO, 2)
    assert info.value.exit_code == ExitCode.SETUP
    assert "fully_shard_of_a_later_torch" in str(info.value)
