"""Scenarios with epochs: the steps they derive, each step's samples and window, how they print
and replay, how the strategies draw them, and the oracle's rows for what a data path consumed."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, Phase, given, settings

import ddpcheck
from ddpcheck import features, strategies
from ddpcheck._language.epochs import ends_epoch, step_samples, window
from ddpcheck._language.messages import scenario_line
from ddpcheck._oracle.consumed import FOREIGN, check_consumed
from ddpcheck._oracle.sample_weights import DROPPED, DUPLICATED
from ddpcheck.scenario import batch_size_of, global_batch, local_micro_batches, micro_batches_of

#: 10 samples in steps of 4 (two micro-batches of 2), twice: 4, 4, 2 per epoch.
TEN = ddpcheck.Scenario(
    global_batch=4, accumulation=2, epochs=ddpcheck.Epochs(samples=10, epochs=2)
)


def test_steps_are_derived_from_the_epochs():
    assert TEN.steps == 6
    assert [batch_size_of(TEN, s) for s in range(6)] == [4, 4, 2, 4, 4, 2]
    assert [micro_batches_of(TEN, s) for s in range(6)] == [2, 2, 1, 2, 2, 1]  # short window
    assert [step_samples(TEN.epochs, 4, s) for s in (0, 2, 3)] == [range(4), range(8, 10), range(4)]
    assert window(ddpcheck.Epochs(samples=7), 6, 3, 1) == 1


def test_a_step_trains_the_datasets_samples_and_each_epoch_the_same_ones():
    x, _ = ddpcheck.scenario.dataset(TEN)
    assert len(x) == 10
    first, again = global_batch(TEN, 2), global_batch(TEN, 5)
    assert first[0].equal(x[8:10]) and again[0].equal(first[0])
    # W=3: 2 samples of the short last step split as tensor_split does, one micro-batch each
    assert [len(xs) for xs, _ in local_micro_batches(TEN, 2, 0, 3)] == [1]
    assert [len(xs) for xs, _ in local_micro_batches(TEN, 2, 2, 3)] == [0]


def test_a_scenario_with_epochs_prints_as_code_that_replays_it():
    assert eval(repr(TEN), {"ddpcheck": ddpcheck}) == TEN
    assert "epochs=ddpcheck.Epochs(samples=10, epochs=2)" in repr(TEN)
    assert "B=4 steps=6 N=10 epochs=2 acc=2" in scenario_line(TEN)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"global_batch": 5, "accumulation": 2}, "must be a multiple of accumulation=2"),
        ({"global_batch": 4, "steps": 5}, r"steps=5 disagrees with the epochs: .* are 3 step"),
        ({"epochs": (10, 2)}, "must be None or a ddpcheck.scenario.Epochs"),
    ],
)
def test_bad_epochs_are_refused_naming_the_argument(kwargs, message):
    with pytest.raises(ddpcheck.InvalidArgument) as refused:
        kwargs.setdefault("epochs", ddpcheck.Epochs(samples=10))
        ddpcheck.Scenario(**kwargs)
    assert refused.match(message)


def test_bad_epoch_counts_are_refused():
    with pytest.raises(ddpcheck.InvalidArgument, match=r"Epochs\(epochs=0\) must be an integer"):
        ddpcheck.Epochs(samples=10, epochs=0)


def test_the_feature_and_an_uneven_last_step():
    assert "epochs" in features.of(TEN)
    assert "uneven-batches" not in features.of(TEN, 2)  # 4, 4, 2: every step divides by 2
    assert "uneven-batches" in features.of(TEN, 3)


@settings(max_examples=60, database=None, suppress_health_check=list(HealthCheck), deadline=None)
@given(strategies.exercising("epochs", world_size=2))
def test_exercising_epochs_draws_a_dataset_the_steps_pass_over(scenario):
    assert scenario.epochs is not None and scenario.checkpoint_after is None
    assert scenario.global_batch % scenario.accumulation == 0
    per_epoch = -(-scenario.epochs.samples // scenario.global_batch)
    assert scenario.steps == per_epoch * scenario.epochs.epochs


@settings(max_examples=60, database=None, suppress_health_check=list(HealthCheck), deadline=None)
@given(strategies.scenarios(without={"epochs"}))
def test_a_target_without_epochs_never_gets_them(scenario):
    assert scenario.epochs is None


@settings(max_examples=40, database=None, suppress_health_check=list(HealthCheck), deadline=None)
@given(strategies.exercising("accumulation", world_size=2))
def test_features_made_by_changing_the_batch_drop_the_epochs(scenario):
    assert scenario.epochs is None and scenario.accumulation > 1


def test_a_step_fed_by_a_data_path_is_judged_by_what_it_consumed():
    step = range(4, 8)
    right = [((4, 5),), ((6, 7),)]
    assert check_consumed(1, 2, right, step) == []
    # a batch not split across the ranks: rank 1 took the next step's samples
    (foreign,) = check_consumed(1, 2, [((4, 5, 6, 7),), ((8, 9, 10, 11),)], step)
    assert foreign.kind == FOREIGN and foreign.rank == 1 and "8, 9, 10, 11" in foreign.detail
    assert "the ranks together took 8 sample(s)" in foreign.detail
    # padding: sample 4 twice, sample 7 never
    rows = check_consumed(1, 2, [((4, 5),), ((6, 4),)], step)
    assert [(r.kind, r.name) for r in rows] == [(DUPLICATED, "sample 4"), (DROPPED, "sample 7")]
    assert "rank 0 micro-batch 0, rank 1 micro-batch 0" in rows[0].detail


def test_a_replaced_field_keeps_the_epochs_consistent():
    with pytest.raises(ddpcheck.InvalidArgument, match="disagrees with the epochs"):
        dataclasses.replace(TEN, global_batch=2)  # steps=6 given, 10 samples / 2 make 10
    assert dataclasses.replace(TEN, global_batch=2, steps=2).steps == 10  # the default: derived


#: TEN with an evaluation set of 7 samples in per-device batches of 2.
EVALUATED = dataclasses.replace(
    TEN, epochs=ddpcheck.Epochs(samples=10, epochs=2, evaluation=7, evaluation_batch=2)
)


def test_an_evaluation_set_is_drawn_apart_and_evaluated_after_each_epoch():
    x, _ = ddpcheck.scenario.evaluation_set(EVALUATED)
    assert len(x) == 7 and not x[:7].equal(ddpcheck.scenario.dataset(EVALUATED)[0][:7])
    assert ddpcheck.scenario.evaluation_set(TEN) is None
    assert [ends_epoch(EVALUATED.epochs, 4, s) for s in range(6)] == [False, False, True] * 2
    assert eval(repr(EVALUATED), {"ddpcheck": ddpcheck}) == EVALUATED
    assert "N=10 epochs=2 eval=7 eval_batch=2" in scenario_line(EVALUATED)
    # its per-device batch: its own, or the training micro-batch's per device
    assert EVALUATED.epochs.evaluation_batch_at(4, 2, 2) == 2
    assert ddpcheck.Epochs(samples=10, evaluation=3).evaluation_batch_at(12, 2, 3) == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"evaluation": 0}, r"Epochs\(evaluation=0\) must be None or an integer >= 1"),
        ({"evaluation": 3, "evaluation_batch": 0}, r"evaluation_batch=0\) must be None or"),
        ({"evaluation_batch": 2}, r"evaluation_batch=2\) needs an evaluation set"),
    ],
)
def test_bad_evaluation_sets_are_refused(kwargs, message):
    with pytest.raises(ddpcheck.InvalidArgument, match=message):
        ddpcheck.Epochs(samples=10, **kwargs)


def test_the_strategies_draw_evaluation_sets_with_an_uneven_last_batch():
    def uneven(scenario):  # at W=2: no multiple of the per-device batch x 2
        epochs = scenario.epochs
        if epochs is None or epochs.evaluation is None:
            return False
        batch = epochs.evaluation_batch_at(scenario.global_batch, scenario.accumulation, 2)
        return batch > 1 and epochs.evaluation % (2 * batch) != 0

    drawn = []

    @settings(
        max_examples=100,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        deadline=None,
    )
    @given(strategies.exercising("epochs", world_size=2))
    def draw(scenario):
        drawn.append(scenario)

    draw()
    assert sum(s.epochs.evaluation is None for s in drawn) >= 5  # shrinking towards none
    assert sum(map(uneven, drawn)) >= 5, [s.epochs for s in drawn]
