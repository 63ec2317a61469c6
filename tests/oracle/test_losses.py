"""The step's loss judged against the reference's (``ddpcheck._oracle.losses``), on hand-built
records: the ranks' objective (their micro-batch losses summed over W), each loss a rank
reports, and the losses of a tensor-parallel group bit for bit."""

from __future__ import annotations

import math

import torch

from ddpcheck import zoo
from ddpcheck._language.records import RankRecord, StepRecord
from ddpcheck._oracle.compare import CHECKS, NON_FINITE, compare
from ddpcheck._oracle.losses import LOSS_DIFFERS, LOSS_REPLICAS, ranks_loss
from ddpcheck._oracle.reference import Reference
from ddpcheck.scenario import Scenario
from ddpcheck.tensor_parallel import TensorParallel


def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _step(losses=None, reported=None) -> StepRecord:
    return StepRecord(
        grads={"w": _t(0.5)},
        params={"w": _t(1.0)},
        buffers={},
        state={},
        losses=losses,
        reported_loss=reported,
    )


def _reference(*objectives: float) -> Reference:
    return Reference(
        initial={"w": _t(1.0)},
        steps=[_step((value,), value) for value in objectives],
        gradient_bytes=8,
        gradient_numel=1,
        n_dtypes=1,
        compute_dtype=torch.float64,
    )


def _ranks(*per_rank: list[StepRecord]) -> list[RankRecord]:
    return [RankRecord(r, {"w": _t(1.0)}, steps, 0.0) for r, steps in enumerate(per_rank)]


def _compare(records, reference, scenario=None, checks=CHECKS):
    return compare(records, reference, scenario or Scenario(zoo.MLP), None, checks)


def test_the_ranks_objective_is_their_losses_summed_over_w():
    # at W=2 each micro-batch loss carries W/T: (1.5 + 0.5) + (2.0 + 0.0), over 2, is 2.0
    records = _ranks([_step((1.5, 0.5))], [_step((2.0, 0.0))])
    assert ranks_loss(records, 0) == 2.0
    assert _compare(records, _reference(2.0)) == []


def test_a_wrong_objective_is_loss_differs_with_both_curves():
    records = _ranks(
        [_step((1.0,)), _step((0.8,))],
        [_step((1.0,)), _step((1.2,))],
    )
    rows = _compare(records, _reference(1.0, 0.5))
    assert [(r.step, r.rank, r.name, r.kind) for r in rows] == [(1, None, "loss", LOSS_DIFFERS)]
    detail = rows[0].detail
    assert "the reference's 0.5" in detail and "1" in detail
    assert "step   reference   target" in detail
    lines = detail.splitlines()
    assert any(line.split()[:3] == ["0", "1", "1"] for line in lines)  # step 0: both 1
    assert any("<- differs" in line and line.split()[:3] == ["1", "0.5", "1"] for line in lines)


def test_a_reported_loss_is_judged_per_rank():
    records = _ranks([_step((1.0,), reported=1.0)], [_step((1.0,), reported=2.0)])
    rows = _compare(records, _reference(1.0))
    assert [(r.rank, r.name, r.kind) for r in rows] == [(1, "loss rank 1 reports", LOSS_DIFFERS)]
    assert "the loss rank 1 reports: 2" in rows[0].detail
    assert rows[0].max_rel == 1.0


def test_ranks_that_report_nothing_are_not_judged_on_it():
    records = _ranks([_step((1.0,), reported=1.0)], [_step((1.0,), reported=None)])
    assert _compare(records, _reference(1.0)) == []


def test_losses_within_the_tolerance_pass():
    tiny = 1e-13  # float64: rtol 1e-9
    records = _ranks([_step((1.0 + tiny,), reported=1.0 - tiny)], [_step((1.0,))])
    assert _compare(records, _reference(1.0)) == []


def test_a_nan_loss_where_the_reference_is_finite_is_the_targets_fault():
    records = _ranks([_step((1.0,), reported=math.nan)], [_step((1.0,))])
    rows = _compare(records, _reference(1.0))
    assert [(r.rank, r.kind, r.target_fault) for r in rows] == [(0, NON_FINITE, True)]


def test_missing_losses_are_not_reconstructed():
    # a framework computing its own losses out of sight: no objective to judge
    records = _ranks([_step(None)], [_step((5.0,))])
    assert _compare(records, _reference(1.0)) == []


def test_the_loss_check_belongs_to_the_reference_check():
    records = _ranks([_step((1.0,), reported=9.0)], [_step((1.0,))])
    assert _compare(records, _reference(1.0), checks={"replicas"}) == []
    assert [r.kind for r in _compare(records, _reference(1.0), checks={"reference"})] == [
        LOSS_DIFFERS
    ]


def _mesh_scenario(tp: int) -> Scenario:
    return Scenario(zoo.MLP, tensor_parallel=TensorParallel((), tp))


def test_a_tp_groups_losses_must_be_bitwise_equal():
    # dp=2 x tp=2: ranks 0,1 one group, ranks 2,3 the other; each group's pair must agree
    near = 0.5 + 2**-40
    records = _ranks([_step((0.5,))], [_step((0.5,))], [_step((1.5,))], [_step((1.5 + 2**-40,))])
    rows = _compare(records, _reference(1.0), _mesh_scenario(2), checks={"replicas"})
    assert [(r.rank, r.kind) for r in rows] == [(3, LOSS_REPLICAS)]
    assert "rank 3 and rank 2" in rows[0].detail
    records[1] = _ranks([_step((near,))])[0]
    records[1].rank = 1
    rows = _compare(records, _reference(1.0), _mesh_scenario(2), checks={"replicas"})
    assert [(r.rank, r.kind) for r in rows] == [(1, LOSS_REPLICAS), (3, LOSS_REPLICAS)]


def test_different_dp_groups_may_compute_different_losses():
    records = _ranks([_step((0.5,))], [_step((0.5,))], [_step((1.5,))], [_step((1.5,))])
    assert _compare(records, _reference(1.0), _mesh_scenario(2)) == []


def test_a_loss_reported_in_float32_is_judged_at_float32s_tolerance():
    # a framework's float32 running loss over a float64 model: 1e-8 off is its rounding
    off = 1.0 + 1e-8
    records = _ranks([_step((1.0,), reported=off)], [_step((1.0,))])
    assert [r.kind for r in _compare(records, _reference(1.0))] == [LOSS_DIFFERS]
    records[0].steps[0].reported_dtype = "float32"
    assert _compare(records, _reference(1.0)) == []
    records[0].steps[0].reported_loss = 1.01  # a bug, in any dtype
    assert [r.kind for r in _compare(records, _reference(1.0))] == [LOSS_DIFFERS]


def test_a_resumed_runs_loss_rows_name_the_step_of_the_whole_run():
    from ddpcheck._oracle.compare import compare_resumed

    scenario = Scenario(zoo.MLP, steps=3, checkpoint_after=0)
    before = _ranks([_step((1.0,), 1.0)], [_step((1.0,), 1.0)])
    after = _ranks(
        [_step((0.8,), 0.8), _step((0.6,), 0.9)], [_step((0.8,), 0.8), _step((0.6,), 0.6)]
    )
    rows = compare_resumed((before, after), _reference(1.0, 0.8, 0.6), scenario, None)
    assert [(r.step, r.rank, r.kind) for r in rows] == [(2, 0, LOSS_DIFFERS)]
    assert "at step 2, W=2" in rows[0].detail
    assert any(line.split()[:3] == ["2", "0.6", "0.9"] for line in rows[0].detail.splitlines())


def test_a_reference_loss_of_zero_prints_no_ratio():
    records = _ranks([_step((0.0,), reported=0.5)], [_step((0.0,))])
    (row,) = _compare(records, _reference(0.0))
    assert "x)" not in row.detail.splitlines()[0], row.detail
