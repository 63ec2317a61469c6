"""The ``accelerate_nd`` target: accelerate's ``ParallelismConfig`` over a model transformers
distributed. On the CPU every accelerate release with one (1.10.0 to 1.16.0) refuses a
``ParallelismConfig`` (a MULTI_CPU world: bench/accelerate_nd_cpu.py), so here the target declines
with that reason; the user's configuration is checked when the target is built (accelerate's
own refusals, the keys the scenario or the harness sets, the FSDP plugin whose FSDP2 x TP path
transformers 5.1 and later break)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from ddpcheck import InvalidArgument, Scenario
from ddpcheck._language.sharded_models import ShardedBlock, ShardedSpec, sequence_data
from ddpcheck._language.tensor_parallel import TensorParallel

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed"
)

MLP = Scenario(
    ShardedSpec(blocks=(ShardedBlock("mlp", 4),), width=4),
    data=sequence_data,
    global_batch=4,
    steps=2,
    seed=3,
    tensor_parallel=TensorParallel((("blocks.0.up", "colwise"), ("blocks.0.down", "rowwise"))),
)


def test_on_the_cpu_every_example_is_declined_with_accelerates_reason():
    from ddpcheck.targets.accelerate_nd import CPU_REFUSED, AccelerateNDTarget

    if torch.cuda.is_available():
        pytest.skip("a CUDA host: the target runs there")
    assert AccelerateNDTarget().supports(MLP) == CPU_REFUSED
    assert "MULTI_CPU" in CPU_REFUSED and "bench/accelerate_nd_cpu.py" in CPU_REFUSED


def test_the_mesh_decides_the_sizes_and_tp_1_is_declined():
    from ddpcheck.targets.accelerate_nd import AccelerateNDTarget

    target = AccelerateNDTarget()
    assert target.supports_at(MLP, 2) is None  # tp=2: ParallelismConfig(tp_size=2)
    data_only = dataclasses.replace(
        MLP, tensor_parallel=TensorParallel(MLP.tensor_parallel.plan, tp=1)
    )
    assert "tp=1" in (target.supports_at(data_only, 2) or "")
    fixed = AccelerateNDTarget(config={"parallelism_config": {"dp_shard_size": 2, "tp_size": 2}})
    assert "fixes the mesh" in (fixed.supports_at(MLP, 2) or "")
    two_by_two = dataclasses.replace(
        MLP, tensor_parallel=TensorParallel(MLP.tensor_parallel.plan, tp=2)
    )
    assert fixed.supports_at(two_by_two, 4) is None


@pytest.mark.parametrize(
    ("config", "said"),
    [
        ({"fsdp_plugin": {"fsdp_version": 2}}, "ReplicateParallel"),
        ({"parallelism_config": {"dp_replicate_size": 2, "tp_size": 2}}, "pure data parallelism"),
        ({"parallelism_config": {"cp_size": 2, "dp_shard_size": 2}}, "context"),
        ({"gradient_accumulation_steps": 2}, "accumulation"),
    ],
)
def test_the_users_config_is_refused_where_accelerate_or_the_rule_refuses_it(config, said):
    from ddpcheck.targets.accelerate_nd import AccelerateNDTarget

    with pytest.raises(InvalidArgument) as refused:
        AccelerateNDTarget(config=config)
    assert said in str(refused.value)


def test_the_option_space_draws_the_fsdp_plan_and_accelerates_accumulation():
    from ddpcheck.targets.accelerate_nd import AccelerateNDTarget

    assert AccelerateNDTarget().config_space() is not None
