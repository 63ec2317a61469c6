"""The vocabulary follows the installed torch: what it cannot run (float16 CPU autocast on torch
2.1) is never drawn, the feature line says why, and a scenario asking for it is refused as
torch's limit, never charged to a target. torch 2.1 is simulated here by an autocast that raises
as 2.1's does; the torch matrix (bench/torch_matrix.py) runs the real one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import NoSuchExample

from ddpcheck import Scenario, ScenarioError
from ddpcheck import strategies as dst
from ddpcheck._language import features, torch_limits
from ddpcheck._oracle.judgeable import check_scenario
from tests.shrink import find

FAST = settings(
    max_examples=60,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture
def torch_2_1(monkeypatch):
    """CPU autocast as torch 2.1.2 has it: bfloat16 only."""
    real = torch.autocast

    def autocast(device_type, dtype=None, **kwargs):
        if device_type == "cpu" and dtype is torch.float16:
            raise RuntimeError("Currently, AutocastCPU only support Bfloat16")
        return real(device_type, dtype=dtype, **kwargs)

    torch_limits.autocast_unavailable.cache_clear()
    monkeypatch.setattr(torch_limits.torch, "autocast", autocast)
    monkeypatch.setattr(torch_limits.torch, "__version__", "2.1.2+cu121")
    yield
    monkeypatch.undo()
    torch_limits.autocast_unavailable.cache_clear()


def test_the_pinned_torch_runs_every_precision_policy():
    assert torch_limits.autocast_unavailable(torch.bfloat16) is None
    assert torch_limits.autocast_unavailable(torch.float16) is None
    assert torch_limits.unavailable() == []
    assert "autocast:" not in features.exercised(set())


def test_what_torch_cannot_run_is_named_on_the_feature_line(torch_2_1):
    assert torch_limits.unavailable() == ["float16 autocast: not available on torch 2.1.2"]
    line = features.exercised({"autocast"})
    assert line.endswith("; float16 autocast: not available on torch 2.1.2"), line


def test_what_torch_cannot_run_is_never_drawn(torch_2_1):
    with pytest.raises(NoSuchExample):
        find(
            dst.scenarios(dtypes=("float32",)),
            lambda s: s.autocast is torch.float16,
            settings=FAST,
        )
    # any scenario made to exercise autocast: the first drawn, not shrunk (its dtype is the point)
    forced = find(
        dst.exercising("autocast", world_size=2),
        lambda s: True,
        settings=settings(FAST, phases=[Phase.generate]),
    )
    assert forced.autocast is torch.bfloat16


@FAST
@given(dst.exercising("autocast", world_size=2))
def test_both_autocast_dtypes_are_drawn_where_torch_runs_them(scenario):
    assert scenario.autocast in (torch.bfloat16, torch.float16)


def test_a_scenario_torch_cannot_run_is_refused_as_torchs_limit(torch_2_1):
    with pytest.raises(ScenarioError, match=r"float16 autocast: not available on torch 2\.1\.2"):
        check_scenario(Scenario(dtype="float32", autocast=torch.float16))
