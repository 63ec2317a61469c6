"""Verdicts on real code: exit 1 only for a data-parallel bug, never for how a framework lives in
its process (process groups built per model, FSDP2's meshes), and never for a feature beyond
torch DDP's contract that the target did not declare."""

from __future__ import annotations

import pytest
import torch

import ddpcheck
from ddpcheck import cli, targets
from ddpcheck.errors import ExitCode
from ddpcheck.features import BEYOND_TORCH, DEFAULT_FEATURES, FEATURES, supported_by
from ddpcheck.scenario import Scenario
from tests.targets.course_ddp import (
    BroadcastsWhenAttached,
    CourseTarget,
    ManagedTarget,
    RecipientRankTarget,
    UnknownConsolidateTarget,
)

SCENARIO = Scenario(ddpcheck.zoo.MLP, global_batch=7, steps=2)


def test_a_target_that_declares_nothing_is_checked_within_torch_ddps_contract():
    assert (
        supported_by(CourseTarget())
        == DEFAULT_FEATURES
        == (
            frozenset(FEATURES)
            - BEYOND_TORCH
            - {"param-dtype", "tensor-parallel", "pipeline-parallel"}
        )
    )
    assert "rank-orders" in BEYOND_TORCH
    assert supported_by(targets.PARALLEL) == frozenset(FEATURES) - {  # all it can
        "param-dtype",
        "tensor-parallel",
        "pipeline-parallel",
    }
    ordered = Scenario(ddpcheck.zoo.MLP, rank_orders=True)
    why = ddpcheck.features.declines(CourseTarget(), ordered, 2)
    assert why == (
        "needs rank-orders (not in CourseTarget.supported_features: beyond torch DDP's "
        "contract, checked only when declared)"
    ), why


def test_a_target_that_owns_its_batch_plan_declares_tokens_to_be_checked_on_them():
    """A plan written for per-sample losses (before token losses existed) is not judged on a
    token loss unless the target declares it weighs tokens; one that declares them is."""
    own_plan = ddpcheck.Target.from_wrappers(shard_batch=ddpcheck.batches.strided)
    assert own_plan.owns_batch_plan and not ddpcheck.Target.from_wrappers().owns_batch_plan
    assert "tokens" not in supported_by(own_plan)
    assert "tokens" in supported_by(CourseTarget())  # the harness weighs its tokens
    tokens = Scenario(
        ddpcheck.zoo.TinyGPT,
        data=ddpcheck.zoo.token_data,
        loss="token_cross_entropy",
        global_batch=4,
    )
    why = ddpcheck.features.declines(own_plan, tokens, 2)
    assert why == (
        "needs tokens (not in WrapperTarget.supported_features: its own shard_batch "
        "may weigh samples only; declare 'tokens' with it once it weighs tokens)"
    ), why

    # declared by inheritance from a ready-made target whose plan was the batch rule: not enough
    class OwnPlanDDP(targets.TorchDDPTarget):
        def shard_batch(self, batch):
            return ddpcheck.batches.strided(batch)

    assert "tokens" not in supported_by(OwnPlanDDP())
    assert "tokens" in supported_by(targets.TORCH_DDP)

    class DuckTyped:  # no Target base: its shard_batch is its own plan all the same
        supported_features = None

        def shard_batch(self, batch):
            return ddpcheck.batches.strided(batch)

    assert "tokens" not in supported_by(DuckTyped())
    declared = ddpcheck.Target.from_wrappers(
        shard_batch=ddpcheck.batches.strided, supports=FEATURES.keys() - {"rank-orders"}
    )
    assert ddpcheck.features.declines(declared, tokens, 2) is None


@pytest.mark.slow
def test_a_ddp_with_torchs_contract_passes_check_with_the_default_settings(capsys):
    # Written against the previous release's API (supports(), no supported_features): upgrading
    # ddpcheck must not turn it red.
    status = cli.main(
        [
            "check",
            "tests.targets.course_ddp:CourseTarget()",
            "--world-sizes",
            "2,3",
            "--examples",
            "40",
        ]
    )
    out = capsys.readouterr().out
    assert status == ExitCode.OK, out
    assert "rank-orders-adam (W=2,3): needs rank-orders" in out, out


def test_a_process_group_manager_gets_its_numeric_verdict_and_its_groups_destroyed():
    # dp over the world, tp and pp of one rank each: 3 groups a rank is a member of
    notes = ddpcheck.check_example(ManagedTarget(), SCENARIO, 2)
    assert any(
        "created 3 process group(s) and left them (destroyed after the example)" in n for n in notes
    ), notes
    with pytest.raises(ddpcheck.EquivalenceError) as info:
        ddpcheck.check_example(ManagedTarget(weights_bug=True), SCENARIO, 2)
    kinds = info.value.kinds
    assert kinds[0].startswith(("replicas differ", "reference differs")), str(info.value)
    assert "rank left unfit" not in kinds, str(info.value)


def test_fsdp2_with_an_int_reshard_after_forward_passes_in_one_persistent_world():
    # fully_shard(reshard_after_forward=2) builds a DeviceMesh, and process groups, per call.
    target = targets.TorchFSDPTarget(reshard_after_forward=2)
    report = ddpcheck.assert_equivalent(target, SCENARIO, world_sizes=(4,))
    assert report.count == 1
    pids = ddpcheck.get_world(4).pids
    notes = ddpcheck.check_example(target, Scenario(ddpcheck.zoo.Tied, steps=2, seed=1), 4)
    assert any(
        "process group(s) and left them (destroyed after the example)" in n for n in notes
    ), notes
    assert ddpcheck.get_world(4).pids == pids, notes  # put right, not replaced


CHECKPOINT = Scenario(
    ddpcheck.zoo.MLP,
    optimizer=torch.optim.Adam,
    optimizer_kwargs={"lr": 0.01},
    global_batch=6,
    steps=3,
    checkpoint_after=0,
)


def test_the_default_checkpoint_asks_the_optimizer_by_the_keyword_it_takes():
    ddpcheck.check_example(RecipientRankTarget(), CHECKPOINT, 2)  # fairscale's recipient_rank


def test_an_optimizer_the_default_checkpoint_cannot_ask_declines_instead_of_failing():
    with pytest.raises(ddpcheck.NothingChecked) as info:
        ddpcheck.check_example(UnknownConsolidateTarget(), CHECKPOINT, 2)
    assert "consolidate_state_dict" in str(info.value) and "override" in str(info.value)
    ddpcheck.check_example(targets.PARALLEL, CHECKPOINT, 2)  # the world serves the next example


def test_the_initial_state_is_recorded_once_the_optimizer_is_built():
    # Horovod's shape: the broadcast happens when the optimizer is attached
    ddpcheck.check_example(BroadcastsWhenAttached(), SCENARIO, 2)
