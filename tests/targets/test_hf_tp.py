"""The ``hf_tp`` target: transformers' own tensor-parallel styles, the scenario's plan written as
a transformers plan, match the one-process reference; a transformers row-wise style that drops
its all-reduce (the seeded bug) is caught; plans no transformers plan can say, and the layout
transformers' row-wise style fails on (bench/hf_tp_noncontiguous.py), are declined with their
reason; clipping takes the Trainer's own mixed-mesh norm. Without transformers the tests that
run it skip, naming ddpcheck's install hint."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

import ddpcheck
from ddpcheck import EquivalenceError, Scenario, targets
from ddpcheck._language.sharded_models import ShardedBlock, ShardedSpec, sequence_data
from ddpcheck._language.tensor_parallel import TensorParallel
from ddpcheck.targets.catalogue import HF_TP
from ddpcheck.targets.hf_tp import (
    FSDP_PLANS,
    HfTPTarget,
    fsdp_problem,
    hf_plan,
    noncontiguous_rowwise,
    uniform_plan,
)

#: an uneven MLP (5 hidden features over 2 ranks) between two lone linears, biases everywhere:
#: every drawn style of the plans at once
MLP = Scenario(
    ShardedSpec(blocks=(ShardedBlock("mlp", 5),), width=4),
    data=sequence_data,
    global_batch=4,
    steps=2,
    seed=3,
    tensor_parallel=TensorParallel(
        (
            ("inp", "rowwise-replicate"),
            ("blocks.0.up", "colwise-dtensor"),
            ("blocks.0.down", "rowwise"),
            ("head", "colwise-replicate"),
        )
    ),
)


@dataclasses.dataclass(frozen=True)
class RowwiseUnreduced(HfTPTarget):
    """hf_tp whose ``"rowwise"`` is a transformers ``RowwiseParallel`` handing on its partial
    output without the all-reduce (the seeded bug: each rank keeps its own partial product)."""

    def transformers_plan(self) -> dict[str, str]:
        from torch.distributed.tensor import DTensor
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, RowwiseParallel

        class Unreduced(RowwiseParallel):
            def transform_output_post_forward(self, module, output, mesh, config=None):
                return output.to_local() if isinstance(output, DTensor) else output

        ALL_PARALLEL_STYLES.register("ddpcheck_rowwise_unreduced", Unreduced())
        plan = super().transformers_plan()
        return {k: "ddpcheck_rowwise_unreduced" if v == "rowwise" else v for k, v in plan.items()}


def _needs_transformers() -> None:
    if importlib.util.find_spec("transformers") is None:
        entry = next(e for e in targets.READY_MADE if e.name == "hf_tp")
        pytest.skip(f"transformers is not installed ({entry.install})")


@pytest.mark.slow  # a W=2 world importing transformers (and its Trainer) in each rank
def test_transformers_styles_match_the_reference_and_a_dropped_all_reduce_is_caught():
    _needs_transformers()
    # clipped as the Trainer clips: its mixed-mesh norm over DTensor shards and plain tensors
    assert ddpcheck.check_example(HF_TP, dataclasses.replace(MLP, max_grad_norm=0.5), 2) == ()
    with pytest.raises(EquivalenceError) as caught:
        ddpcheck.check_example(RowwiseUnreduced(), MLP, 2)
    kinds = {d.kind for d in caught.value.divergences}
    assert any(k.startswith("reference differs") for k in kinds), kinds


def test_the_plan_is_written_in_transformers_vocabulary_with_generic_names():
    assert hf_plan(MLP.tensor_parallel.plan) == {
        "inp": "rowwise_rep",
        "blocks.*.up": "colwise",
        "blocks.*.down": "rowwise",
        "head": "colwise_rep",
    }
    assert uniform_plan(MLP) is None
    two = ShardedSpec(blocks=(ShardedBlock("mlp", 4), ShardedBlock("mlp", 4)), width=4)
    pair = (("blocks.0.up", "colwise"), ("blocks.0.down", "rowwise"))
    half = dataclasses.replace(MLP, model=two, tensor_parallel=TensorParallel(pair))
    reason = uniform_plan(half)
    assert reason is not None and "(blocks.*.up)" in reason and "blocks.1.up left alone" in reason
    both = (*pair, ("blocks.1.up", "colwise"), ("blocks.1.down", "rowwise"))
    assert uniform_plan(dataclasses.replace(half, tensor_parallel=TensorParallel(both))) is None


def test_the_layout_transformers_rowwise_fails_on_is_declined_naming_the_script():
    heads = ShardedSpec(blocks=(ShardedBlock("attention", 4),), width=4, head_dim=1)
    plan = (*((f"blocks.0.{n}", "colwise") for n in "qkv"), ("blocks.0.out", "rowwise"))
    scenario = dataclasses.replace(MLP, model=heads, tensor_parallel=TensorParallel(plan))
    assert "bench/hf_tp_noncontiguous.py" in (noncontiguous_rowwise(scenario, 2) or "")
    assert noncontiguous_rowwise(scenario, 4) is None  # one head per rank: a contiguous view
    wide = dataclasses.replace(scenario, model=dataclasses.replace(heads, head_dim=2))
    assert noncontiguous_rowwise(wide, 2) is None  # reshape copies: contiguous


def test_clipping_another_norm_than_the_trainers_is_declined():
    assert HF_TP.supports(dataclasses.replace(MLP, max_grad_norm=1.0)) is None
    infinity = dataclasses.replace(MLP, max_grad_norm=1.0, grad_norm_type=float("inf"))
    assert "2-norm" in (HF_TP.supports(infinity) or "")


@pytest.mark.slow  # a W=4 world importing transformers in each rank
@pytest.mark.thorough  # varies test_transformers_styles_match_the_reference_and_a_dropped_...
def test_transformers_tp_composed_with_its_own_fsdp2_over_dp_matches_the_reference():
    _needs_transformers()
    mesh = TensorParallel(MLP.tensor_parallel.plan, tp=2)
    scenario = dataclasses.replace(MLP, tensor_parallel=mesh, accumulation=2, max_grad_norm=0.5)
    for fsdp_plan in ("blocks", "blocks-head-kept"):
        target = HfTPTarget(fsdp_plan=fsdp_plan, spelling="split")
        assert ddpcheck.check_example(target, scenario, 4) == ()


def test_dp_composes_through_fsdp2_which_declines_what_it_cannot_judge():
    mesh = TensorParallel(MLP.tensor_parallel.plan, tp=2)
    scenario = dataclasses.replace(MLP, tensor_parallel=mesh)
    assert HF_TP.supports_at(scenario, 4) is None  # dp=2 x tp=2: transformers' FSDP2 over dp
    assert fsdp_problem(scenario, 2) is None  # tp=2 = W: no dp, no FSDP2


def test_the_option_space_writes_transformers_other_names_and_fsdp_plans():
    split = dataclasses.replace(HF_TP, plan=MLP.tensor_parallel.plan, spelling="split")
    assert split.transformers_plan()["inp"] == "rowwise_split_input"
    assert split.transformers_plan()["head"] == "colwise_gather_output"
    assert set(FSDP_PLANS) >= {"blocks", "root"} and HF_TP.config_space() is not None


#: attention split over its 2 kv heads (4 q heads) with q/k norms over heads of 2 features, the
#: norms under transformers' replicated_with_grad_allreduce (Qwen3's plan for q_norm, k_norm)
QK_NORMS = Scenario(
    ShardedSpec(blocks=(ShardedBlock("attention", 4, kv_heads=2, qk_norm=True),), head_dim=2),
    data=sequence_data,
    global_batch=4,
    seed=3,
    tensor_parallel=TensorParallel(
        (
            *((f"blocks.0.{n}", "colwise") for n in "qkv"),
            *((f"blocks.0.{n}_norm", "heads-norm") for n in "qk"),
            ("blocks.0.out", "rowwise"),
        )
    ),
)


@pytest.mark.slow  # a W=2 world importing transformers in each rank
def test_transformers_q_k_norm_style_is_right_alone_and_wrong_under_accumulation():
    # bench/hf_replicated_grad_allreduce.py shows it without ddpcheck (transformers 5.25.0): the
    # style all-reduces .grad after every backward, so accumulated micro-batches count tp times
    _needs_transformers()
    from ddpcheck.targets.known_bugs import known_bug_line

    assert ddpcheck.check_example(HF_TP, dataclasses.replace(QK_NORMS, steps=2), 2) == ()
    accumulated = dataclasses.replace(QK_NORMS, accumulation=2)
    with pytest.raises(EquivalenceError) as caught:
        ddpcheck.check_example(HF_TP, accumulated, 2)
    wrong = {(d.kind, d.name) for d in caught.value.divergences}
    assert ("reference differs (gradient)", "blocks.0.q_norm.weight") in wrong, wrong
    assert "replicated_with_grad_allreduce" in known_bug_line(HF_TP, {"accumulation"}, accumulated)
