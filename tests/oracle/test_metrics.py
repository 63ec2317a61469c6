"""The evaluation metric judged against the reference's (``ddpcheck._oracle.metrics``), on
hand-built records, and the reference's own metric after every epoch."""

from __future__ import annotations

import torch

from ddpcheck import Epochs, Scenario, zoo
from ddpcheck._language.records import RankRecord, StepRecord
from ddpcheck._language.training import evaluation_metric
from ddpcheck._oracle.compare import CHECKS, compare
from ddpcheck._oracle.metrics import METRIC_DIFFERS
from ddpcheck._oracle.reference import Reference, reference_run
from ddpcheck.scenario import build_model, evaluation_set


def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _step(metric=None, dtype=None) -> StepRecord:
    return StepRecord(
        grads={"w": _t(0.5)},
        params={"w": _t(1.0)},
        buffers={},
        state={},
        metric=metric,
        metric_dtype=dtype,
    )


def _reference(*metrics) -> Reference:
    return Reference(
        initial={"w": _t(1.0)},
        steps=[_step(m) for m in metrics],
        gradient_bytes=8,
        gradient_numel=1,
        n_dtypes=1,
        compute_dtype=torch.float64,
    )


def _ranks(*per_rank: list[StepRecord]) -> list[RankRecord]:
    return [RankRecord(r, {"w": _t(1.0)}, steps, 0.0) for r, steps in enumerate(per_rank)]


def _compare(records, reference, checks=CHECKS):
    return compare(records, reference, Scenario(zoo.MLP), None, checks)


def test_the_metric_after_each_epoch_is_the_references():
    # two epochs of two steps: the metric after steps 1 and 3
    right = [_step(), _step(2.0), _step(), _step(1.5)]
    assert _compare(_ranks(right, right), _reference(None, 2.0, None, 1.5)) == []


def test_a_wrong_metric_is_metric_differs_with_both_curves():
    wrong = [_step(), _step(2.0), _step(), _step(1.6)]
    rows = _compare(_ranks(wrong, wrong), _reference(None, 2.0, None, 1.5))
    assert [(r.step, r.rank, r.kind) for r in rows] == [
        (3, 0, METRIC_DIFFERS),
        (3, 1, METRIC_DIFFERS),
    ]
    assert rows[0].name == "metric rank 0 reports"
    detail = rows[0].detail
    assert "the evaluation metric rank 0 reports: 1.6, the reference's 1.5" in detail
    lines = detail.splitlines()
    assert any(line.split()[:3] == ["1", "2", "2"] for line in lines)  # epoch 1: both 2
    assert any("<- differs" in line and line.split()[:3] == ["3", "1.5", "1.6"] for line in lines)


def test_ranks_that_report_no_metric_are_not_judged_on_it():
    silent = [_step(), _step()]
    assert _compare(_ranks(silent, silent), _reference(None, 2.0)) == []


def test_a_metric_at_the_wrong_point_or_missing_after_an_epoch_is_metric_differs():
    early = [_step(2.0), _step()]  # read before the epoch's last step
    rows = _compare(_ranks(early, [_step(), _step(2.0)]), _reference(None, 2.0))
    assert [(r.step, r.rank, r.kind) for r in rows] == [(0, 0, METRIC_DIFFERS)]
    assert "after step 0, where no epoch ends" in rows[0].detail
    once = [_step(), _step(2.0), _step(), _step()]  # the second epoch's never reported
    rows = _compare(_ranks(once, once), _reference(None, 2.0, None, 1.5))
    assert [(r.step, r.kind) for r in rows] == [(3, METRIC_DIFFERS), (3, METRIC_DIFFERS)]
    assert "reports no evaluation metric after step 3, the last of an epoch" in rows[0].detail


def test_a_metric_logged_in_float32_is_judged_at_float32s_tolerance():
    off = 2.0 * (1 + 1e-8)
    records = _ranks([_step(off)], [_step(2.0)])
    assert [r.kind for r in _compare(records, _reference(2.0))] == [METRIC_DIFFERS]
    records[0].steps[0].metric_dtype = "float32"
    assert _compare(records, _reference(2.0)) == []


def test_the_metric_check_belongs_to_the_reference_check():
    records = _ranks([_step(9.0)], [_step(2.0)])
    assert _compare(records, _reference(2.0), checks={"replicas"}) == []


def test_the_reference_evaluates_its_own_model_after_every_epochs_last_step():
    scenario = Scenario(
        zoo.MLP, global_batch=4, epochs=Epochs(samples=6, epochs=2, evaluation=5), seed=3
    )
    reference = reference_run(scenario)
    metrics = [s.metric for s in reference.steps]
    assert [m is not None for m in metrics] == [False, True, False, True]
    # the metric of the model it holds after step 3: the mean of the terms over all 5 samples
    model = build_model(scenario, scenario.seed)
    model.load_state_dict(reference.steps[-1].params)
    x, y = evaluation_set(scenario)
    assert len(x) == 5
    with torch.no_grad():
        expected = float(((model(x) - y) ** 2).flatten(1).sum(1).mean())
    assert abs(metrics[3] - expected) < 1e-12
    assert evaluation_metric(scenario, model) == metrics[3]
    assert all(s.metric is None for s in reference_run(Scenario(zoo.MLP)).steps)
