"""The loop hooks' checks on hand-built records: parameters must not move inside an accumulation
window, and the communication budget counts every reduction -- reduce-scatters with the padding a
dim-0 sharding adds, all-gathers -- so a gradient reduced twice is caught whatever its shape."""

from __future__ import annotations

import torch

from ddpcheck import targets, zoo
from ddpcheck._language.records import Collective, RankRecord, StepRecord
from ddpcheck._oracle.budget import check_budget
from ddpcheck._oracle.compare import bitwise_equal, compare
from ddpcheck._oracle.reference import Reference
from ddpcheck._oracle.window import STEPPED_INSIDE_WINDOW, check_window
from ddpcheck.scenario import Scenario


def _t(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _record(rank, params_after, window) -> RankRecord:
    step = StepRecord(
        grads={"w": _t(0.5, 0.5)}, params={"w": params_after}, buffers={}, state={}, window=window
    )
    return RankRecord(rank, {"w": _t(1.0, 2.0)}, [step], 0.0)


def test_parameters_that_stay_put_inside_the_window_pass():
    records = [
        _record(r, _t(0.9, 1.9), [(0, {"w": _t(1.0, 2.0)}), (1, {"w": _t(1.0, 2.0)})])
        for r in range(2)
    ]
    assert check_window(0, 2, records, bitwise_equal) == []


def test_a_step_inside_the_window_is_named_with_its_micro_batch():
    moved = [(0, {"w": _t(1.0, 2.0)}), (1, {"w": _t(0.95, 2.0)})]
    records = [_record(0, _t(0.9, 1.9), moved), _record(1, _t(0.9, 1.9), moved)]
    rows = check_window(0, 2, records, bitwise_equal)
    assert [(d.rank, d.kind, d.name) for d in rows] == [
        (0, STEPPED_INSIDE_WINDOW, "w"),
        (1, STEPPED_INSIDE_WINDOW, "w"),
    ]
    assert "after micro-batch 1" in rows[0].detail and "0.05" in rows[0].detail
    # in compare, it explains every number after it: the window's rows come first and alone
    reference = Reference(
        initial={"w": _t(1.0, 2.0)},
        steps=[StepRecord({"w": _t(0.5, 0.5)}, {"w": _t(0.8, 1.8)}, {}, {})],
        gradient_bytes=16,
        gradient_numel=2,
        n_dtypes=1,
        compute_dtype=torch.float64,
    )
    found = compare(records, reference, Scenario(zoo.MLP), targets.TORCH_DDP)
    assert {d.kind for d in found} == {STEPPED_INSIDE_WINDOW}, found


def _collective(op, numel, itemsize=8) -> Collective:
    return Collective(
        op=op,
        nbytes=numel * itemsize,
        dtypes=("float64",),
        shapes=((numel,),),
        root=None,
        group=None,
        reduce_op="SUM" if "reduce" in op else None,
        async_op=False,
        launched=0.0,
    )


def _budget(collectives, shards=None, world_size=3) -> list:
    # one trainable (5, 2) weight: 80 bytes; at W=3 a dim-0 sharding pads it to 6 rows (96)
    reference = Reference(
        initial={},
        steps=[],
        gradient_bytes=80,
        gradient_numel=10,
        n_dtypes=1,
        compute_dtype=torch.float64,
        trainable_shapes={"w": ((5, 2), 8)},
        parameter_bytes=80,
    )
    records = [
        RankRecord(r, {}, [StepRecord({}, {}, {}, {}, collectives, shards=dict(shards or {}))], 0.0)
        for r in range(world_size)
    ]
    return check_budget(0, world_size, records, reference, False)


def test_a_reduce_scatter_counts_with_its_dim_0_padding_and_twice_is_over_budget():
    shard = {"w": (0, torch.zeros(2, 2))}
    assert _budget([_collective("reduce_scatter_single", 12)], shard) == []  # padded: 12 elems
    # the same padded elements from a target that shards nothing along dim 0: more than the
    # gradient has
    assert (
        _budget([_collective("reduce_scatter_single", 12)])[0].kind == "communication over budget"
    )
    twice = _budget(
        [_collective("reduce_scatter_single", 12), _collective("all_reduce", 10)], shard
    )
    assert [d.kind for d in twice] == ["communication over budget"] * 3
    assert "all_reduce/reduce_scatter_single" in twice[0].detail


def test_a_reduce_to_an_owner_counts_like_an_all_reduce():
    assert _budget([_collective("reduce", 10)]) == []
    assert (
        _budget([_collective("reduce", 10), _collective("reduce", 10)])[0].kind
        == "communication over budget"
    )


def test_all_gathers_beyond_one_regather_of_the_parameters_are_over_budget():
    assert _budget([_collective("all_gather_into_tensor", 4)]) == []  # this rank's share
    rows = _budget(
        [_collective("all_gather_into_tensor", 4), _collective("all_gather_into_tensor", 10)]
    )  # a gradient gathered whole
    assert [(d.kind, d.name) for d in rows] == [
        ("communication over budget", "(all parameters)")
    ] * 3
    # FSDP2 all-gathers every layer in every forward and backward: not budgeted
    assert _budget([_collective("all_gather_into_tensor", 40)], {"w": (0, torch.zeros(2, 2))}) == []
