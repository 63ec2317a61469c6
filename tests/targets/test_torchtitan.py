"""The ``torchtitan`` target: torchtitan's own ``parallelize_llama`` on its own tiny Llama 3
matches the one-process reference over FSDP2 x TP; a loop that back-propagates the harness's
``dp / T`` loss under torchtitan's summing FSDP (the global-token normalisation undone: each
gradient dp times too large) is caught; the user's ``ParallelismConfig`` is taken as given (its
degrees fix the mesh drawn, a field it does not have is refused, what cannot run here is declined
with its reason). Skipped where torchtitan (and the triton its models import) is not installed;
CI does not install it. Where torchtitan is absent, ``ddpcheck check torchtitan`` exits 2 naming
the pip command."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from torch import nn

import ddpcheck
from ddpcheck import EquivalenceError, Scenario
from ddpcheck._language.tensor_parallel import TensorParallel
from ddpcheck._language.zoo import token_data
from ddpcheck.errors import InvalidArgument
from ddpcheck.targets.catalogue import TORCHTITAN
from ddpcheck.targets.torchtitan import BATTERY, TitanLlama, TorchTitanTarget

#: two heads, FSDP2 over dp=2 at W=2 (tp=1) or the TP/SP plan at tp=2: accumulation of two
SCENARIO = Scenario(
    TitanLlama(heads=2, head_dim=2, layers=1),
    data=token_data,
    loss="token_cross_entropy",
    optimizer=torch.optim.SGD,
    optimizer_kwargs={"lr": 0.5},
    global_batch=4,
    steps=1,
    accumulation=2,
    dtype="float32",
    seed=7,
    tensor_parallel=TensorParallel((), 1),
)


def _needs_torchtitan() -> None:
    pytest.importorskip("triton", reason="torchtitan's models import triton")
    pytest.importorskip("torchtitan.models.llama3", reason="pip install torchtitan==0.3.0")


@dataclasses.dataclass(frozen=True)
class GlobalTokensUndone(TorchTitanTarget):
    """torchtitan's FSDP sums over dp (gradient_divide_factor=1.0) but the loop back-propagates
    a loss scaled for an averaging wrapper (``dp / T``, not torchtitan's ``1 / T``): every
    gradient dp times too large (the seeded bug; torchtitan #2323's double division, the other
    way round)."""

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        loss.backward()


def test_check_without_torchtitan_exits_2_naming_the_install(capsys):
    if importlib.util.find_spec("torchtitan") is not None:
        pytest.skip("torchtitan is installed here")
    from ddpcheck import cli

    assert cli.main(["check", "torchtitan", "--examples", "1"]) == 2
    assert "pip install 'torchtitan>=0.3.0'" in capsys.readouterr().err


def test_the_config_is_torchtitans_parallelism_section_and_its_degrees_fix_the_mesh():
    _needs_torchtitan()
    with pytest.raises(InvalidArgument, match="tensor_paralel_degree"):
        TorchTitanTarget(config={"tensor_paralel_degree": 2})
    with pytest.raises(InvalidArgument, match="'training' belong to the scenario"):
        TorchTitanTarget(config={"parallelism": {}, "training": {"local_batch_size": 8}})
    nested = TorchTitanTarget(config={"parallelism": {"tensor_parallel_degree": 2}})
    assert vars(nested)["_given"] == {"tensor_parallel_degree": 2}
    scenario = dataclasses.replace(SCENARIO, tensor_parallel=TensorParallel((), 1))
    assert "fixes the mesh" in (nested.supports_at(scenario, 2) or "")
    from hypothesis import find

    drawn = find(nested.drawn_scenarios(4, ("float32",), frozenset(), None), lambda s: True)
    assert drawn.tensor_parallel is not None and drawn.tensor_parallel.degree(4) == 2
    piped = TorchTitanTarget(config={"pipeline_parallel_degree": 2})
    assert "pipeline" in (piped.supports(SCENARIO) or "")
    backend = TorchTitanTarget(config={"spmd_backend": "spmd_types"})
    assert "bench/torchtitan_cpu.py" in (backend.supports(SCENARIO) or "")
    summed = dataclasses.replace(SCENARIO, reduction="sum")
    assert "global" in (TORCHTITAN.supports(summed) or "")


def test_the_model_is_torchtitans_llama_in_the_scenarios_dtype():
    _needs_torchtitan()
    from torchtitan.models.llama3 import Llama3Model

    model = ddpcheck.scenario.build_model(SCENARIO, 0)
    assert isinstance(model, Llama3Model)
    cache = next(m.cache for m in model.modules() if hasattr(m, "_precompute_cache"))
    assert cache.is_complex(), "RoPE's rotation survives the cast to the scenario's dtype"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert [name for name, _ in BATTERY]


@pytest.mark.slow  # two W=2 worlds importing torchtitan in each rank (tens of seconds)
def test_fsdp_and_tp_match_the_reference_and_undone_normalisation_is_caught():
    _needs_torchtitan()
    # each returns its notes (torchtitan's meshes are new process groups, destroyed after the
    # example) and raises on any divergence
    ddpcheck.check_example(TORCHTITAN, SCENARIO, 2)  # FSDP2 over dp=2
    tp = dataclasses.replace(SCENARIO, tensor_parallel=TensorParallel((), 2))
    ddpcheck.check_example(TORCHTITAN, tp, 2)  # the TP/SP plan over tp=2
    with pytest.raises(EquivalenceError) as caught:
        ddpcheck.check_example(GlobalTokensUndone(), SCENARIO, 2)
    kinds = {d.kind for d in caught.value.divergences}
    assert any(k.startswith("reference differs") for k in kinds), kinds
