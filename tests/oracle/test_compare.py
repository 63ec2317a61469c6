"""Verdicts that mean what they say: the oracle's comparisons on hand-built records.

Everything here but the last test calls :func:`ddpcheck._oracle.compare.compare`
directly on ``RankRecord``/``StepRecord`` objects built by hand (no worlds, no processes). The
invariant under test (``ddpcheck._oracle.compare``'s docstring): replicas are compared by
their raw bits, NaN payloads included; NaN/inf on a rank where the reference is finite is the
target's fault; NaN/inf that the reference produces itself make the scenario unjudgeable, which is
never the target's fault; and every named check runs on every rank.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpcheck import targets, zoo
from ddpcheck._language.records import RankRecord, StepRecord
from ddpcheck._oracle.compare import (
    CHECKS,
    NON_FINITE,
    bitwise_equal,
    cannot_judge,
    compare,
    validate_checks,
)
from ddpcheck._oracle.reference import Reference
from ddpcheck._oracle.rows import non_finite
from ddpcheck._oracle.tolerances import all_close, close
from ddpcheck.errors import EquivalenceError, InvalidArgument
from ddpcheck.scenario import Scenario

NAN = float("nan")
INF = float("inf")


def _other_nan() -> torch.Tensor:
    """A quiet NaN whose payload differs from ``float('nan')``'s: equal as a number, not in bits."""
    bits = torch.tensor([NAN], dtype=torch.float64).view(torch.int64) | 1
    nan = bits.view(torch.float64)
    assert torch.isnan(nan).all() and not bitwise_equal(nan, torch.tensor([NAN]).double())
    return nan


def _t(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _step(w, grad=None, state=None, buffers=None) -> StepRecord:
    return StepRecord(
        grads={"w": _t(0.5, 0.5) if grad is None else grad},
        params={"w": w},
        buffers=buffers or {},
        state=state or {},
    )


def _reference(steps, initial=None) -> Reference:
    return Reference(
        initial={"w": _t(1.0, 2.0)} if initial is None else initial,
        steps=steps,
        gradient_bytes=16,
        gradient_numel=2,
        n_dtypes=1,
        compute_dtype=torch.float64,
    )


def _ranks(*per_rank, initial=None) -> list[RankRecord]:
    return [
        RankRecord(
            rank, {"w": _t(1.0, 2.0)} if initial is None else dict(initial), list(steps), 0.0
        )
        for rank, steps in enumerate(per_rank)
    ]


def _compare(records, reference, checks=CHECKS):
    return compare(records, reference, Scenario(zoo.MLP), None, checks)


# ---------------------------------------------------------------------------------------------
# Replicas: raw bits


def test_identical_nan_replicas_pass_the_replica_check():
    reference = _reference([_step(_t(1.0, 2.0))])
    records = _ranks([_step(_t(NAN, 2.0))], [_step(_t(NAN, 2.0))], [_step(_t(NAN, 2.0))])
    assert _compare(records, reference, {"replicas"}) == []


def test_a_nan_payload_difference_between_replicas_is_still_replicas_differ():
    reference = _reference([_step(_t(1.0, 2.0))])
    records = _ranks([_step(_t(NAN, 2.0))], [_step(torch.cat([_other_nan(), _t(2.0)]))])
    rows = _compare(records, reference, {"replicas"})
    assert [(r.kind, r.rank, r.name, r.target_fault) for r in rows] == [
        ("replicas differ (parameter)", 1, "w", True)
    ]
    assert "differ in their bits" in rows[0].detail


def test_signed_zeros_differ_bitwise():
    reference = _reference([_step(_t(1.0, 2.0))])
    records = _ranks(
        [_step(_t(1.0, 2.0), grad=_t(0.0, 0.5))], [_step(_t(1.0, 2.0), grad=_t(-0.0, 0.5))]
    )
    assert [r.kind for r in _compare(records, reference, {"replicas"})] == [
        "replicas differ (gradient)"
    ]


@pytest.mark.parametrize(
    "a, b, equal",
    [
        (torch.tensor([1, 2]), torch.tensor([1, 2]), True),
        (torch.tensor([True, False]), torch.tensor([True, True]), False),
        (torch.tensor([NAN], dtype=torch.float16), torch.tensor([NAN], dtype=torch.float16), True),
        (
            torch.tensor([NAN], dtype=torch.bfloat16),
            torch.tensor([NAN], dtype=torch.bfloat16),
            True,
        ),
        (torch.tensor([complex(NAN, 1)]), torch.tensor([complex(NAN, 1)]), True),
        (torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64), False),  # dtype
        (torch.tensor([1.0]), torch.tensor([[1.0]]), False),  # shape
        (torch.tensor([INF, -INF]), torch.tensor([INF, -INF]), True),
    ],
)
def test_bitwise_equal(a, b, equal):
    assert bitwise_equal(a, b) is equal


def test_replicas_with_names_only_on_another_rank_differ():
    reference = _reference([_step(_t(1.0, 2.0))])
    extra = _step(_t(1.0, 2.0))
    extra.params["v"] = _t(3.0)
    records = _ranks([_step(_t(1.0, 2.0))], [extra])
    rows = _compare(records, reference, {"replicas"})
    assert [(r.kind, r.rank, r.name, r.detail) for r in rows] == [
        ("replicas differ (parameter)", 1, "v", "present on rank 1 only")
    ]


# ---------------------------------------------------------------------------------------------
# Non-finite values


def test_reference_going_non_finite_cannot_be_judged_and_is_not_the_targets_fault():
    reference = _reference(
        [
            _step(_t(1.0, 2.0)),
            _step(_t(NAN, INF), grad=_t(INF, 0.5)),
            _step(_t(NAN, NAN), grad=_t(NAN, NAN)),
        ]
    )
    # The ranks agree with the reference at step 0, then do anything at all: not judged.
    records = _ranks(
        [_step(_t(1.0, 2.0)), _step(_t(5.0, 6.0)), _step(_t(NAN, 1.0))],
        [_step(_t(1.0, 2.0)), _step(_t(7.0, 8.0)), _step(_t(2.0, NAN))],
    )
    rows = _compare(records, reference)
    assert cannot_judge(rows)
    assert {r.kind for r in rows} == {NON_FINITE}
    assert not any(r.target_fault for r in rows)
    assert {(r.step, r.rank) for r in rows} == {(1, None)}
    assert {r.name for r in rows} == {"w", "w.grad"}  # where: every reference tensor at step 1
    assert "the reference itself produced NaN/inf at step 1" in rows[0].detail
    assert "lower the learning rate" in rows[0].detail
    # whichever checks were asked for
    for check in CHECKS:
        assert cannot_judge(_compare(records, reference, {check}))


def test_a_target_fault_before_the_reference_goes_non_finite_is_reported_alone():
    reference = _reference([_step(_t(1.0, 2.0)), _step(_t(NAN, NAN))])
    records = _ranks(
        [_step(_t(1.0, 2.5)), _step(_t(NAN, NAN))], [_step(_t(1.0, 2.5)), _step(_t(NAN, NAN))]
    )
    rows = _compare(records, reference)
    assert rows and all(r.target_fault for r in rows) and not cannot_judge(rows)
    assert {(r.step, r.kind) for r in rows} == {(0, "reference differs (parameter)")}


def test_non_finite_optimizer_state_in_the_reference_cannot_be_judged():
    reference = _reference([_step(_t(1.0, 2.0), state={"w": {"exp_avg_sq": _t(INF, 1.0)}})])
    state = {"w": {"exp_avg_sq": _t(INF, 1.0)}}
    records = _ranks([_step(_t(1.0, 2.0), state=state)], [_step(_t(1.0, 2.0), state=state)])
    rows = _compare(records, reference)
    assert cannot_judge(rows)
    assert [r.name for r in rows] == ["w['exp_avg_sq']"]


def test_rank_non_finite_where_the_reference_is_finite_is_the_targets_fault():
    reference = _reference([_step(_t(1.0, 2.0))])
    nan_step = _step(_t(1.0, 2.0), grad=_t(NAN, 0.5))
    records = _ranks([nan_step], [nan_step])  # bitwise identical replicas: rank 0 stands for all
    rows = _compare(records, reference)
    assert [(r.kind, r.rank, r.name, r.target_fault) for r in rows] == [
        (NON_FINITE, 0, "w.grad", True)
    ]
    assert rows[0].detail == (
        "rank 0 has NaN/inf in gradient w at step 0 where the reference is finite (1 of 2 elements)"
    )
    assert not cannot_judge(rows)


def test_rank_non_finite_optimizer_state_is_the_targets_fault():
    reference = _reference([_step(_t(1.0, 2.0), state={"w": {"exp_avg": _t(0.1, 0.2)}})])
    records = _ranks(
        [_step(_t(1.0, 2.0), state={"w": {"exp_avg": _t(0.1, 0.2)}})],
        [_step(_t(1.0, 2.0), state={"w": {"exp_avg": _t(0.1, -INF)}})],
    )
    rows = _compare(records, reference, {"state"})
    assert [(r.kind, r.rank, r.name, r.target_fault) for r in rows] == [
        (NON_FINITE, 1, "w['exp_avg']", True)
    ]


def test_non_finite_values_the_reference_starts_with_are_ordinary_values():
    mask = _t(0.0, -INF)  # an additive attention mask, say
    initial = {"w": _t(1.0, 2.0), "mask": mask}
    reference = _reference([_step(_t(1.0, 2.0), buffers={"mask": mask})], initial=initial)
    good = _ranks(
        [_step(_t(1.0, 2.0), buffers={"mask": mask})],
        [_step(_t(1.0, 2.0), buffers={"mask": mask.clone()})],
        initial=initial,
    )
    assert _compare(good, reference) == []
    lost = _ranks(
        [_step(_t(1.0, 2.0), buffers={"mask": _t(0.0, 0.0)})],
        [_step(_t(1.0, 2.0), buffers={"mask": _t(0.0, 0.0)})],
        initial=initial,
    )
    assert [r.kind for r in _compare(lost, reference)] == ["reference differs (buffer)"]


# ---------------------------------------------------------------------------------------------
# Checks: validated, and each one on every rank


@pytest.mark.parametrize(
    "checks, says",
    [
        ("replicas", "is a string"),
        ({"replica"}, "unknown check 'replica'"),
        (set(), "is empty"),
        (5, "must be a set of check names"),
        (["reference", "budgte"], "unknown check 'budgte'"),
    ],
)
def test_validate_checks_rejects(checks, says):
    with pytest.raises(InvalidArgument) as info:
        validate_checks(checks)
    message = str(info.value)
    assert says in message
    assert repr(checks) in message
    assert all(repr(name) in message for name in CHECKS)  # lists the valid ones


def test_validate_checks_accepts():
    assert validate_checks(None) == CHECKS
    assert validate_checks(["replicas", "budget"]) == frozenset({"replicas", "budget"})
    assert validate_checks(c for c in ("state",)) == frozenset({"state"})


def test_check_example_validates_checks_before_anything_runs():
    with pytest.raises(InvalidArgument, match="is a string"):
        from ddpcheck import check_example

        check_example(targets.TORCH_DDP, Scenario(zoo.MLP), 2, checks="replicas")


def test_reference_alone_compares_every_rank():
    reference = _reference([_step(_t(1.0, 2.0))])
    records = _ranks([_step(_t(1.0, 2.0))], [_step(_t(1.0, 2.5))], [_step(_t(1.0, 2.0))])
    rows = _compare(records, reference, {"reference"})
    assert [(r.kind, r.rank) for r in rows] == [("reference differs (parameter)", 1)]
    # ... and non-finite values on any rank, too
    records = _ranks([_step(_t(1.0, 2.0))], [_step(_t(1.0, 2.0))], [_step(_t(INF, 2.0))])
    rows = _compare(records, reference, {"reference"})
    assert [(r.kind, r.rank, r.target_fault) for r in rows] == [(NON_FINITE, 2, True)]


def test_replicas_alone_reports_no_reference_rows():
    reference = _reference([_step(_t(1.0, 2.0))])
    records = _ranks([_step(_t(1.0, 2.0))], [_step(_t(1.0, 2.5))])
    rows = _compare(records, reference, {"replicas"})
    assert [r.kind for r in rows] == ["replicas differ (parameter)"]


# ---------------------------------------------------------------------------------------------
# End to end: torch's own DDP on a scenario that overflows


def test_torch_ddp_on_an_overflowing_scenario_is_not_blamed():
    """lr=1e200 sends the reference itself to NaN at step 1: nobody's bug. The verdict is a
    ScenarioError naming the step (exit 2 on the command line), never an EquivalenceError."""
    import ddpcheck
    from ddpcheck import check_example

    scenario = Scenario(model=zoo.MLP, optimizer_kwargs={"lr": 1e200}, steps=3)
    with pytest.raises(ddpcheck.ScenarioError, match="step 1") as raised:
        check_example(targets.TORCH_DDP, scenario, 2)
    assert not isinstance(raised.value, EquivalenceError)
    assert "lower the learning rate" in str(raised.value)


def test_the_overflow_replay_line_exits_2_not_1(capsys):
    from ddpcheck import cli

    status = cli.main(
        [
            "replay",
            "torch_ddp",
            "--world-size",
            "2",
            "--scenario",
            'ddpcheck.Scenario(model=ddpcheck.zoo.MLP, optimizer_kwargs={"lr": 1e200}, steps=3)',
        ]
    )
    err = capsys.readouterr().err
    assert status == 2, err
    assert "cannot judge" in err and "Traceback" not in err


def test_gradients_sent_in_a_wider_dtype_are_not_called_a_double_reduction():
    """float32 gradients promoted by torch.cat into a float64 buffer: as many elements, twice
    the bytes -- its own kind, with the dtypes, not 'reduced more than once'."""
    from ddpcheck._language.records import Collective
    from ddpcheck._oracle.budget import check_budget

    def reduce(dtype: str, numel: int) -> Collective:
        return Collective(
            op="all_reduce",
            nbytes=numel * (8 if dtype == "float64" else 4),
            dtypes=(dtype,),
            shapes=((numel,),),
            root=None,
            group=None,
            reduce_op="SUM",
            async_op=True,
            launched=0.0,
        )

    reference = Reference(
        initial={},
        steps=[],
        gradient_bytes=8 * 4,
        gradient_numel=8,
        n_dtypes=1,
        compute_dtype=torch.float32,
    )

    def rows(collectives):
        records = [
            RankRecord(r, {}, [StepRecord({}, {}, {}, {}, collectives)], 0.0) for r in range(2)
        ]
        return check_budget(0, 2, records, reference, False)

    widened = rows([reduce("float64", 8)])
    assert [d.kind for d in widened] == ["communication in a wider dtype"] * 2
    assert "float64" in widened[0].detail and "wider dtype" in widened[0].detail
    twice = rows([reduce("float32", 8), reduce("float32", 8)])
    assert [d.kind for d in twice] == ["communication over budget"] * 2
    assert "reduced more than once" in twice[0].detail
    assert rows([reduce("float32", 8)]) == []


def test_control_scalars_are_not_a_double_reduction_but_a_second_gradient_is():
    """A course DDP sums float "has a gradient here" flags, one per trainable tensor: control
    traffic, within budget. The same gradients reduced twice are not."""
    from ddpcheck._language.records import Collective
    from ddpcheck._oracle.budget import check_budget

    def reduce(numel: int) -> Collective:
        return Collective(
            op="all_reduce",
            nbytes=numel * 8,
            dtypes=("float64",),
            shapes=((numel,),),
            root=None,
            group=None,
            reduce_op="SUM",
            async_op=False,
            launched=0.0,
        )

    # two trainable tensors of 4 and 3 elements
    reference = Reference(
        initial={},
        steps=[],
        gradient_bytes=7 * 8,
        gradient_numel=7,
        n_dtypes=1,
        compute_dtype=torch.float64,
        trainable_tensors=2,
    )

    def rows(collectives):
        records = [
            RankRecord(r, {}, [StepRecord({}, {}, {}, {}, collectives)], 0.0) for r in range(2)
        ]
        return check_budget(0, 2, records, reference, False)

    assert rows([reduce(2), reduce(4), reduce(3)]) == []  # flags, then each gradient once
    again = rows([reduce(2), reduce(4), reduce(3), reduce(3)])  # the bias reduced twice
    assert [d.kind for d in again] == ["communication over budget"] * 2, again


class ShiftedSoftmax(torch.nn.Module):
    """A bias every logit shares: softmax ignores it, so its gradient is zero in exact arithmetic
    and ~1e-17 of rounding noise in practice -- an attention key bias, in small. Adam's first
    step, lr * g / (|g| + eps), turns that noise into ~1e-9 parameter differences."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(5, 6, bias=False)
        self.shift = torch.nn.Parameter(torch.zeros(1))
        self.out = torch.nn.Linear(6, 3)
        with torch.no_grad():
            self.w.weight.mul_(40.0)

    def forward(self, x):
        return self.out(torch.softmax(self.w(x) + self.shift, dim=-1))


def _accumulated_in_three(scenario):
    """What a correct target records at W=1 with three micro-batches: the reference's own run,
    its gradients summed in another order."""
    from ddpcheck._oracle.reference import Variant, _train

    steps, _, initial = _train(scenario, Variant(3))
    return [RankRecord(0, initial, steps, 0.0)]


def test_rounding_noise_adam_amplifies_is_not_a_divergence():
    from ddpcheck._oracle.reference import reference_run

    for seed in range(3):
        scenario = Scenario(
            model=ShiftedSoftmax,
            optimizer=torch.optim.Adam,
            optimizer_kwargs={"lr": 0.1},
            global_batch=12,
            steps=3,
            accumulation=3,
            seed=seed,
        )
        reference = reference_run(scenario)
        records = _accumulated_in_three(scenario)
        # the fixed float64 tolerance alone calls the noise a divergence ...
        blind = dataclasses.replace(reference, scenario=None, noise_cache={})
        rows = compare(records, blind, scenario, targets.LOCAL)
        assert [(d.kind, d.name) for d in rows] == [("reference differs (parameter)", "shift")]
        # ... the reference's own spread over other summation orders does not
        assert compare(records, reference, scenario, targets.LOCAL) == []


def test_the_noise_floor_hides_no_bug_beside_the_noise():
    from ddpcheck._oracle.reference import reference_run

    scenario = Scenario(
        model=ShiftedSoftmax,
        optimizer=torch.optim.Adam,
        optimizer_kwargs={"lr": 0.1},
        global_batch=12,
        steps=3,
        accumulation=3,
    )
    reference = reference_run(scenario)
    records = _accumulated_in_three(scenario)
    records[0].steps[1].params["out.weight"] = records[0].steps[1].params["out.weight"] * (1 + 1e-6)
    rows = compare(records, reference, scenario, targets.LOCAL)
    assert [(d.step, d.kind, d.name) for d in rows] == [
        (1, "reference differs (parameter)", "out.weight")
    ], rows
    assert "the reference's own rounding over other summation orders" in rows[0].detail


def test_a_reduction_narrower_than_the_gradients_is_named_before_the_numbers():
    """float32 gradients reduce-scattered in bfloat16 (a param_dtype policy without
    reduce_dtype): its own kind, naming the dtype, first among the rows; parameters gathered in
    bfloat16 are the policy, not a reduction."""
    from ddpcheck._language.records import Collective
    from ddpcheck._oracle.budget import NARROWER, check_reduce_dtypes

    def call(op: str, dtype: str) -> Collective:
        return Collective(
            op=op,
            nbytes=16,
            dtypes=(dtype,),
            shapes=((8,),),
            root=None,
            group=None,
            reduce_op="SUM" if "reduce" in op else None,
            async_op=False,
            launched=0.0,
        )

    reference = Reference(
        initial={"w": _t(1.0, 2.0).float()},
        steps=[_step(_t(1.0, 2.0).float(), grad=_t(0.5, 0.5).float())],
        gradient_bytes=8,
        gradient_numel=2,
        n_dtypes=1,
        compute_dtype=torch.bfloat16,
        gradient_dtype=torch.float32,
    )

    def records(*collectives):
        return [
            RankRecord(
                r,
                {"w": _t(1.0, 2.0).float()},
                [
                    StepRecord(
                        {"w": _t(0.5, 0.5).float()},
                        {"w": _t(1.0, 2.0).float()},
                        {},
                        {},
                        list(collectives),
                    )
                ],
                0.0,
            )
            for r in range(2)
        ]

    narrow = records(
        call("all_gather_single", "bfloat16"), call("reduce_scatter_single", "bfloat16")
    )
    rows = check_reduce_dtypes(0, 2, narrow, reference)
    assert [(r.kind, r.rank) for r in rows] == [(NARROWER, 0), (NARROWER, 1)]
    assert "reduce_scatter_single SUM 8 bfloat16" in rows[0].detail
    assert "the gradients are float32" in rows[0].detail
    assert (
        check_reduce_dtypes(
            0,
            2,
            records(
                call("all_gather_single", "bfloat16"), call("reduce_scatter_single", "float32")
            ),
            reference,
        )
        == []
    )
    assert check_reduce_dtypes(0, 1, narrow, reference) == []  # W=1: nothing crossed a wire
    scenario = Scenario(zoo.MLP, dtype="float32", param_dtype=torch.bfloat16, steps=1)
    rows = compare(narrow, reference, scenario, None)
    assert rows[0].kind == NARROWER  # the cause, before any number
    assert NARROWER not in [
        r.kind for r in compare(narrow, reference, scenario, None, {"replicas", "reference"})
    ]


def test_control_scalars_may_be_narrower_but_a_gradient_shaped_reduction_may_not():
    """A float64 model: its norm and a flag per trainable tensor reduced in float32 are control
    traffic (DeepSpeed reduces its norm in a float32 tensor); one small gradient reduced in
    float32 is a narrowing, however few its elements."""
    from ddpcheck._language.records import Collective
    from ddpcheck._oracle.budget import NARROWER, check_reduce_dtypes

    def call(shape: tuple) -> Collective:
        return Collective(
            op="all_reduce",
            nbytes=4 * max(1, math.prod(shape)),
            dtypes=("float32",),
            shapes=(shape,),
            root=None,
            group=None,
            reduce_op="SUM",
            async_op=False,
            launched=0.0,
        )

    # weight (4, 3) and bias (4,): two trainable tensors of float64
    reference = Reference(
        initial={},
        steps=[],
        gradient_bytes=16 * 8,
        gradient_numel=16,
        n_dtypes=1,
        compute_dtype=torch.float64,
        gradient_dtype=torch.float64,
        trainable_tensors=2,
        norm_scalars=1,
        trainable_shapes={"w": ((4, 3), 8), "b": ((4,), 8)},
    )

    def rows(*collectives):
        records = [
            RankRecord(r, {}, [StepRecord({}, {}, {}, {}, list(collectives))], 0.0)
            for r in range(2)
        ]
        return check_reduce_dtypes(0, 2, records, reference)

    assert rows(call((1,)), call((2,))) == []  # the norm, the flags
    assert [r.kind for r in rows(call((4,)))] == [NARROWER] * 2  # the bias, 4 elements
    assert [r.kind for r in rows(call((5,)))] == [NARROWER] * 2  # more than the allowance


# ---------------------------------------------------------------------------------------------
# The one-pass comparison is never more lenient than the per-tensor one

_ELEMENT = st.one_of(st.floats(-1e3, 1e3, width=32), st.sampled_from([NAN, INF, -INF, 0.0, -0.0]))


@st.composite
def _pairs(draw):
    """(got, ref) pairs of a few tensors: equal, nudged by about the tolerance, or unrelated."""
    pairs = []
    for _ in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16]))
        ref = torch.tensor(draw(st.lists(_ELEMENT, min_size=1, max_size=6)), dtype=dtype)
        how = draw(st.sampled_from(["same", "nudged", "other"]))
        if how == "same":
            got = ref.clone()
        elif how == "nudged":
            scale = draw(st.sampled_from([1e-9, 1e-6, 1e-3, 1e-1]))
            got = (ref.double() * (1 + scale) + scale).to(dtype)
        else:
            got = torch.tensor(
                draw(st.lists(_ELEMENT, min_size=ref.numel(), max_size=ref.numel())), dtype=dtype
            )
        pairs.append((got, ref))
    return pairs


@given(
    pairs=_pairs(),
    rtol=st.sampled_from([0.0, 1e-7, 1e-4, 1e-2]),
    atol=st.sampled_from([0.0, 1e-9, 1e-5, 1e-2]),
)
@settings(deadline=None)
def test_all_close_passes_only_what_close_passes_one_by_one(pairs, rtol, atol):
    if all_close(pairs, rtol, atol):
        assert all(close(got, ref, rtol, atol) for got, ref in pairs)
        assert not any(
            non_finite(got) is not None and bool((non_finite(got) & torch.isfinite(ref)).any())
            for got, ref in pairs
        )


def test_all_close_declines_what_it_cannot_compare_in_one_pass():
    w = _t(1.0, 2.0)
    assert all_close([(w.clone(), w), (w.float(), w.float())], 1e-7, 0.0)
    assert not all_close([(w.float(), w)], 1e-7, 0.0)  # dtypes differ
    assert not all_close([(w[:1], w)], 1e-7, 0.0)  # shapes differ
    assert not all_close([(None, w)], 1e-7, 0.0)
    ints = torch.tensor([1, 2])
    assert not all_close([(ints + 1, ints)], 1.0, 1.0)  # integers compare exactly, one by one


def test_a_near_miss_among_many_tensors_is_still_found():
    """One parameter of many off by more than the tolerance: the one pass fails, and the
    per-tensor comparison names exactly that parameter."""
    names = [f"p{i}" for i in range(12)]
    params = {n: _t(1.0 + i, 2.0) for i, n in enumerate(names)}
    off = {**params, "p7": params["p7"] + 1e-3}
    reference = Reference(
        initial=params,
        steps=[StepRecord(grads={}, params=params, buffers={}, state={})],
        gradient_bytes=0,
        gradient_numel=0,
        n_dtypes=1,
        compute_dtype=torch.float64,
    )
    records = [
        RankRecord(
            rank, dict(params), [StepRecord(grads={}, params=dict(off), buffers={}, state={})], 0.0
        )
        for rank in range(2)
    ]
    rows = compare(records, reference, Scenario(), targets.PARALLEL, {"reference"})
    assert [(r.step, r.rank, r.name) for r in rows] == [(0, 0, "p7"), (0, 1, "p7")]
