"""A verdict on a release known to carry an upstream bug ends with one line naming it and the
release that fixed it (torch's pytorch#69031 on torch < 2.4): after the counterexample, never
instead of it, and only where the bug can explain it. The release is simulated here;
bench/ddp_no_sync_unused.py and bench/torch_matrix.py measure the real ones."""

from __future__ import annotations

import importlib.metadata

import pytest

from ddpcheck import targets
from ddpcheck._base.errors import Divergence, EquivalenceError
from ddpcheck._runs.smaller import with_features
from ddpcheck.models import Layer, ModelSpec
from ddpcheck.scenario import Scenario
from ddpcheck.targets import known_bugs

NEEDS = {"accumulation", "unused-on-some-ranks", "float32"}


@pytest.fixture
def torch_release(monkeypatch):
    real = importlib.metadata.version

    def release(version):
        monkeypatch.setattr(
            known_bugs.importlib.metadata,
            "version",
            lambda name: version if name == "torch" else real(name),
        )

    return release


def test_a_release_carrying_the_bug_names_it_and_its_fix(torch_release):
    torch_release("2.3.1")
    line = known_bugs.known_bug_line(targets.TORCH_DDP, NEEDS)
    assert line is not None
    assert "torch 2.3.1 carries pytorch#69031" in line and "fixed in torch 2.4.0" in line
    assert "\n" not in line
    assert known_bugs.known_bug_line(targets.TORCH_ZERO, NEEDS) == line  # DDP underneath


def test_the_line_is_only_where_the_bug_can_explain_the_verdict(torch_release):
    torch_release("2.3.1")
    assert known_bugs.known_bug_line(targets.PARALLEL, NEEDS) is None  # not torch's DDP
    assert known_bugs.known_bug_line(targets.TORCH_DDP, {"accumulation"}) is None
    for fixed in ("2.4.0", "2.13.0", "2.15.0+cpu"):
        torch_release(fixed)
        assert known_bugs.known_bug_line(targets.TORCH_DDP, NEEDS) is None


def test_the_verdict_keeps_its_counterexample_and_gains_one_line(torch_release, monkeypatch):
    torch_release("2.1.2")
    scenario = Scenario(
        ModelSpec(layers=(Layer("linear"), Layer("linear", use="sample"))),
        dtype="float32",
        global_batch=2,
        accumulation=2,
    )
    monkeypatch.setattr(
        "ddpcheck._runs.smaller.features.of", lambda scenario, world_size: frozenset(NEEDS)
    )
    error = EquivalenceError(
        [Divergence(0, 2, 1, "b.weight", "replicas differ (gradient)")],
        scenario=scenario,
        world_size=2,
        target=targets.TORCH_DDP,
        replay="python -m ddpcheck replay torch_ddp ...",
    )
    before = str(error)
    text = str(with_features(error, "the shrunk counterexample", "ddpcheck survey torch_ddp"))
    assert text.startswith(before)
    added = text[len(before) :].strip().splitlines()
    assert [line for line in added if "pytorch#69031" in line] == [added[-1]]


def test_fsdp2s_gloo_average_is_named_with_the_first_release_measured_right(torch_release):
    torch_release("2.8.0")
    line = known_bugs.known_bug_line(targets.TORCH_FSDP, {"float32"})
    assert line is not None and "pytorch#162338" in line
    assert "right again by torch 2.13.0 (the first release measured)" in line
    assert known_bugs.known_bug_line(targets.TORCH_DDP, {"float32"}) is None
    torch_release("2.13.0")
    assert known_bugs.known_bug_line(targets.TORCH_FSDP, {"float32"}) is None


def test_deepspeeds_cpu_reduction_is_named_only_behind_its_option(monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(
        known_bugs.importlib.metadata,
        "version",
        lambda name: "0.19.7" if name == "deepspeed" else real(name),
    )
    off = targets.DeepSpeedTarget(config={"zero_optimization": {"contiguous_gradients": False}})
    line = known_bugs.known_bug_line(off, {"float32"})
    assert line is not None and "DeepSpeed PR #8382" in line and "fixed in deepspeed 0.19.8" in line
    assert known_bugs.known_bug_line(targets.DEEPSPEED_ZERO1, {"float32"}) is None


def test_transformers_accumulation_bugs_are_named_below_4_46_3(monkeypatch):
    real = importlib.metadata.version
    for release, named in (("4.45.2", True), ("4.46.2", True), ("4.46.3", False)):
        monkeypatch.setattr(
            known_bugs.importlib.metadata,
            "version",
            lambda name, release=release: release if name == "transformers" else real(name),
        )
        line = known_bugs.known_bug_line(targets.HfTrainerTarget(), {"float32", "accumulation"})
        assert (line is not None and "#34191" in line and "4.46.3" in line) == named, release


def test_an_unfixed_bug_behind_two_options_is_named_only_under_both():
    # accelerate#4122 through the Trainer (bench/hf_split_uneven_batches.py): every release
    from ddpcheck.targets.hf_trainer import HfTrainerTarget

    both = {"split_batches": True, "even_batches": False}
    line = known_bugs.known_bug_line(
        HfTrainerTarget(config={"accelerator_config": both}), {"epochs"}
    )
    assert line is not None and "huggingface/accelerate#4122" in line, line
    assert "not fixed upstream" in line and "bench/hf_split_uneven_batches.py" in line
    for config in ({"split_batches": True}, {"even_batches": False}):
        target = HfTrainerTarget(config={"accelerator_config": config})
        assert known_bugs.known_bug_line(target, {"epochs"}) is None
    target = HfTrainerTarget(config={"accelerator_config": both})
    assert known_bugs.known_bug_line(target, {"accumulation"}) is None  # no epochs: not it


def test_ddp_under_a_split_backward_schedule_is_named_only_for_those_schedules():
    # pytorch#144530 (bench/pipeline_cpu.py): open, so every release; only under torch_pp's DDP
    # option and a schedule that splits the backward -- GPipe under DDP is right
    from ddpcheck.scenario import PipelineParallel
    from ddpcheck.sharded_models import ShardedSpec, sequence_data
    from ddpcheck.targets.pipeline import TorchPPTarget

    def scenario(schedule, per_rank):
        pipeline = PipelineParallel(schedule, (1, 2, 3)[: 2 * per_rank - 1], 2, 2, per_rank)
        return Scenario(ShardedSpec(), data=sequence_data, pipeline=pipeline)

    zbv, gpipe = scenario("ZBVZeroBubble", 2), scenario("GPipe", 1)
    ddp, features = TorchPPTarget(dp_wrapper="ddp"), {"pipeline-parallel"}
    line = known_bugs.known_bug_line(ddp, features, zbv)
    assert line is not None and "pytorch#144530" in line and "not fixed upstream" in line, line
    assert known_bugs.known_bug_line(ddp, features, gpipe) is None
    assert known_bugs.known_bug_line(TorchPPTarget(), features, zbv) is None  # FSDP2: not it
    assert known_bugs.known_bug_line(ddp, features) is None  # no scenario: cannot tell


def test_fsdp2_resharding_under_a_split_backward_is_named_only_where_it_reshards():
    # bench/pp_fsdp_reshard_split.py: torch 2.13 loses the weight gradients of stages FSDP2
    # reshards after forward under a zero-bubble schedule; keeping them unsharded is right
    from ddpcheck.scenario import PipelineParallel
    from ddpcheck.sharded_models import ShardedSpec, sequence_data
    from ddpcheck.targets.pipeline_nd import TorchNDTarget

    def scenario(schedule, per_rank):
        pipeline = PipelineParallel(schedule, (1, 2, 3)[: 2 * per_rank - 1], 2, 2, per_rank)
        return Scenario(ShardedSpec(), data=sequence_data, pipeline=pipeline)

    zbv, gpipe, features = scenario("ZBVZeroBubble", 2), scenario("GPipe", 1), {"pipeline-parallel"}
    for resharding in (TorchNDTarget(reshard_after_forward=True), TorchNDTarget(shard_blocks=True)):
        line = known_bugs.known_bug_line(resharding, features, zbv)
        assert line is not None and "bench/pp_fsdp_reshard_split.py" in line, line
        assert known_bugs.known_bug_line(resharding, features, gpipe) is None
    kept = TorchNDTarget(shard_blocks=True, reshard_after_forward=False)
    assert known_bugs.known_bug_line(kept, features, zbv) is None
    assert known_bugs.known_bug_line(TorchNDTarget(), features, zbv) is None
