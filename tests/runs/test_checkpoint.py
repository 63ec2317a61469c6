"""Checkpoint round trips: save after step k at world size W, resume at W' (catalogue E7, E8).

The resumed run must continue exactly like the uninterrupted full-batch reference -- parameters,
optimizer state and the LR schedule's step count -- and each seeded checkpoint bug must be named
by the rows it fails with. Worlds are W <= 3 and the models tiny.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import ddpcheck
from ddpcheck import features
from ddpcheck import strategies as dst
from ddpcheck._runs.replay import from_repr
from ddpcheck.battery import BATTERY
from ddpcheck.errors import EquivalenceError, InvalidArgument, NothingChecked
from ddpcheck.mutation import catalogue
from ddpcheck.targets import PARALLEL, TORCH_DDP, TORCH_ZERO, ParallelTarget

RESUME = dict(BATTERY)["checkpoint-resume"]  # Adam, two param groups, ExponentialLR, 3 steps


def _resumed(after: int = 0, at: int | None = 3, **changes) -> ddpcheck.Scenario:
    return dataclasses.replace(RESUME, checkpoint_after=after, resume_world_size=at, **changes)


# ---------------------------------------------------------------------------------------------
# The scenario fields


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"checkpoint_after": -1}, "checkpoint_after=-1 must be an integer >= 0"),
        ({"checkpoint_after": True}, "checkpoint_after=True must be an integer >= 0"),
        ({"checkpoint_after": 1, "steps": 2}, "checkpoint_after=1 must be below steps - 1 = 1"),
        ({"checkpoint_after": 0, "steps": 1}, "the resumed run must train at least one step"),
        (
            {"checkpoint_after": 0, "steps": 2, "resume_world_size": 0},
            "resume_world_size=0 must be an integer >= 1",
        ),
        ({"resume_world_size": 2}, "resume_world_size=2 needs checkpoint_after"),
    ],
)
def test_bad_checkpoint_fields_are_refused_naming_the_field(fields, message):
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(")):
        ddpcheck.Scenario(**fields)


def test_a_rank_asked_for_half_of_a_run_that_saves_nothing_says_so():
    from ddpcheck._rank.runner import _saved_at

    assert _saved_at(_resumed(after=1), "resumed") == 1
    with pytest.raises(ValueError, match=r"part='until checkpoint' needs a scenario that saves"):
        _saved_at(ddpcheck.Scenario(), "until checkpoint")


def test_the_replay_line_carries_the_checkpoint_fields_only_when_set():
    assert "checkpoint" not in repr(ddpcheck.Scenario()) and "resume" not in repr(
        ddpcheck.Scenario()
    )
    scenario = _resumed(after=1, at=3)
    assert "checkpoint_after=1, resume_world_size=3" in repr(scenario)
    assert from_repr(repr(scenario)) == scenario


def test_the_checkpoint_feature_includes_what_the_resumed_world_exercises():
    assert "checkpoint" in features.of(RESUME, 2)
    assert "checkpoint" not in features.of(ddpcheck.Scenario(steps=2), 2)
    # 6 samples split evenly at W=2, not at W'=4: the resumed run gets uneven batches
    assert "uneven-batches" in features.of(_resumed(at=4), 2)
    assert "uneven-batches" not in features.of(_resumed(at=None), 2)


# ---------------------------------------------------------------------------------------------
# The built-in targets resume, at the same and at another world size


@pytest.mark.parametrize(
    "target, world_size, resumed_at",
    [(PARALLEL, 2, 3), (PARALLEL, 3, 2), (PARALLEL, 2, None), (TORCH_DDP, 2, 1)],
    ids=["parallel-2-to-3", "parallel-3-to-2", "parallel-2-to-2", "torch_ddp-2-to-1"],
)
def test_builtin_targets_resume_like_the_uninterrupted_run(target, world_size, resumed_at):
    ddpcheck.check_example(target, _resumed(at=resumed_at), world_size)


def test_a_sharded_optimizer_resharded_onto_three_ranks_gives_each_its_own_state():
    # the sharding check runs per part: W=2 before the checkpoint, W'=3 after it; a longer run
    # with momentum (SGD) resumed after step 1 of 3
    scenario = _resumed(
        after=1,
        at=3,
        optimizer=torch.optim.SGD,
        optimizer_kwargs={"lr": 0.1, "momentum": 0.9},
        steps=3,
    )
    ddpcheck.check_example(PARALLEL, scenario, 2)


@pytest.mark.skipif(
    importlib.util.find_spec("numpy") is not None,
    reason="numpy installed: ZeroRedundancyOptimizer can consolidate",
)
def test_torch_zero_declines_checkpoints_without_numpy_saying_why():
    with pytest.raises(
        NothingChecked, match="consolidate_state_dict decodes every rank's shard through numpy"
    ):
        ddpcheck.check_example(TORCH_ZERO, RESUME, 2)


# ---------------------------------------------------------------------------------------------
# Each seeded checkpoint bug is named by its rows


def _rows(mutant: str, world_size: int = 2, scenario: ddpcheck.Scenario = RESUME) -> list:
    with pytest.raises(EquivalenceError) as caught:
        ddpcheck.check_example(catalogue.by_name(mutant).target, scenario, world_size)
    assert "checkpoint_after=0" in caught.value.replay  # the replay line resumes too
    return caught.value.divergences


def test_a_checkpoint_of_one_shard_loses_the_others_optimizer_state():
    rows = _rows("ConsolidatesOwnShard")
    assert {row.step for row in rows} == {1}  # the first resumed step
    assert any(row.kind == "optimizer state differs" and row.rank == 1 for row in rows), rows


def test_the_wrappers_keys_loaded_with_strict_false_load_nothing():
    rows = _rows("SavesWrappedModel", world_size=3, scenario=_resumed(at=2))
    assert rows[0].step == "resume" and rows[0].world_size == 2
    assert rows[0].kind == "reference differs (initial state)"
    assert "after load_checkpoint (the state saved after step 0)" in rows[0].detail


def test_a_scheduler_left_out_of_the_checkpoint_restarts_its_count():
    rows = _rows("ForgetsScheduler")
    assert [(row.step, row.name, row.kind) for row in rows] == [
        (1, "step count (last_epoch)", "LR schedule differs")
    ] * 2
    assert "1 on rank 0, 2 in the reference" in rows[0].detail
    assert "closed-form schedule" in rows[0].detail


class LoadFailsOnRank1(ParallelTarget):
    """``load_checkpoint`` raises on rank 1 of the resumed world only."""

    def load_checkpoint(self, checkpoint, module, model, optimizer, scheduler):
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise RuntimeError("rank 1 cannot read the checkpoint")
        super().load_checkpoint(checkpoint, module, model, optimizer, scheduler)


def test_a_failure_while_resuming_is_a_row_of_the_resumed_world():
    with pytest.raises(EquivalenceError) as caught:
        ddpcheck.check_example(LoadFailsOnRank1(), _resumed(at=3), 2)
    rows = caught.value.divergences
    assert [(row.world_size, row.rank, row.kind) for row in rows] == [(3, 1, "rank failed")]
    assert "rank 1 cannot read the checkpoint" in rows[0].detail


# ---------------------------------------------------------------------------------------------
# The strategies draw it


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
@given(dst.scenarios(resume_world_sizes=(2, 3)))
def test_drawn_checkpoints_are_valid_and_resume_at_an_allowed_world_size(scenario):
    if scenario.checkpoint_after is not None:
        assert 0 <= scenario.checkpoint_after < scenario.steps - 1
        assert scenario.resume_world_size in (None, 2, 3)


def test_without_checkpoint_never_draws_one_and_bad_resume_sizes_are_refused():
    from hypothesis import find
    from hypothesis.errors import NoSuchExample

    with pytest.raises(NoSuchExample):
        find(
            dst.scenarios(without=["checkpoint"]),
            lambda s: s.checkpoint_after is not None,
            settings=settings(max_examples=200, database=None),
        )
    assert (
        find(
            dst.scenarios(),
            lambda s: s.checkpoint_after is not None,
            settings=settings(max_examples=500, database=None),
        ).steps
        == 2
    )
    with pytest.raises(InvalidArgument, match="resume_world_sizes=\\(0,\\) must be"):
        dst.scenarios(resume_world_sizes=(0,))


def test_kept_gradients_do_not_survive_a_checkpoint_in_the_reference_either():
    # set_to_none=False keeps a zero gradient for a layer that step 1 does not use; a resumed
    # run has none (checkpoints carry no gradients), and SGD steps a zero gradient but skips a
    # missing one -- the reference drops them after the checkpoint's step too (found by the
    # survey: this scenario failed before)
    from ddpcheck.models import Layer, ModelSpec, SpecData

    scenario = ddpcheck.Scenario(
        model=ModelSpec(layers=(Layer(use="sample"),), width=2),
        data=SpecData(width=2),
        global_batch=1,
        reduction="sum",
        seed=3637,
        set_to_none=False,
        checkpoint_after=0,
        resume_world_size=2,
    )
    ddpcheck.check_example(PARALLEL, scenario, 1)


def test_optimizer_state_is_loaded_by_name_when_ranks_register_in_other_orders():
    # A plain optimizer's state_dict pairs state with parameters by position; with per-rank
    # registration orders the default load_checkpoint must pair it by name (Adam moments of
    # same-shaped and other-shaped tensors would land on the wrong parameters otherwise).
    from ddpcheck import targets
    from ddpcheck.models import Layer, ModelSpec, SpecData

    scenario = ddpcheck.Scenario(
        ModelSpec(layers=(Layer(), Layer(kind="buffer"), Layer())),
        data=SpecData(4),
        optimizer=torch.optim.Adam,
        optimizer_kwargs={"lr": 0.01},
        global_batch=6,
        steps=3,
        seed=9,
        rank_orders=True,
        checkpoint_after=0,
        resume_world_size=3,
    )
    ddpcheck.check_example(targets.PARALLEL_DDP, scenario, 2)
