"""A failure's communication block (``ddpcheck._oracle.communication``) and the global gradient
norm on a mesh (``ddpcheck._oracle.losses.check_grad_norm``), on hand-built records: the
collectives of a step named by mesh axis, op and bytes, the ranks of one group compared, and the
norm a rank's clipping returned judged against the reference's."""

from __future__ import annotations

import torch

from ddpcheck import zoo
from ddpcheck._language.records import Collective, RankRecord, StepRecord
from ddpcheck._oracle.communication import axis_of, mesh_of, step_report
from ddpcheck._oracle.compare import CHECKS, compare
from ddpcheck._oracle.losses import GRAD_NORM_DIFFERS
from ddpcheck._oracle.reference import Reference
from ddpcheck.scenario import Scenario
from ddpcheck.tensor_parallel import TensorParallel

MESH_2X2 = Scenario(zoo.MLP, tensor_parallel=TensorParallel((), 2))


def _c(op: str, group: tuple[int, ...] | None, nbytes: int = 32, functional=True) -> Collective:
    return Collective(
        op, nbytes, ("float32",), ((8,),), None, group, "SUM", False, 0.0, functional=functional
    )


def _step(collectives=(), grad_norm=None) -> StepRecord:
    t = torch.tensor([0.5], dtype=torch.float64)
    return StepRecord(
        {"w": t}, {"w": t + 0.5}, {}, {}, list(collectives), losses=None, grad_norm=grad_norm
    )


def _ranks(*per_rank: list[StepRecord]) -> list[RankRecord]:
    one = torch.tensor([1.0], dtype=torch.float64)
    return [RankRecord(r, {"w": one}, steps, 0.0) for r, steps in enumerate(per_rank)]


def test_groups_are_named_by_the_mesh_axis_they_run_along():
    mesh = mesh_of(MESH_2X2, 4)  # dp=2 x tp=2: rank r at dp = r // 2, tp = r % 2
    assert mesh == (("dp", "tp"), (2, 2))
    assert axis_of((2, 3), 3, 4, mesh) == "tp"
    assert axis_of((1, 3), 3, 4, mesh) == "dp"
    assert axis_of(None, 3, 4, mesh) == "world"
    assert axis_of((0, 3), 0, 4, mesh) == "group [0, 3]"
    # tp = W: the tp group is the world's (torch reuses the default group for it)
    assert axis_of(None, 1, 2, mesh_of(MESH_2X2, 2)) == "tp"
    assert mesh_of(Scenario(zoo.MLP), 2) is None
    assert axis_of(None, 0, 2, None) == "world"


def test_a_step_is_shown_per_rank_by_axis_op_and_bytes_and_alike_ranks_once():
    tp0, tp1, dp0, dp1 = (0, 1), (2, 3), (0, 2), (1, 3)
    per_rank = [
        [_step([_c("all_reduce", g), _c("all_reduce", g), _c("all_gather_single", d, 16)])]
        for g, d in ((tp0, dp0), (tp0, dp1), (tp1, dp0), (tp1, dp1))
    ]
    text = step_report(_ranks(*per_rank), MESH_2X2, 0)
    assert text.splitlines()[1:] == [
        "  ranks 0, 1, 2, 3: tp all_reduce x2 (64 B), dp all_gather (16 B)"
    ], text


def test_a_rank_that_issued_another_sequence_on_its_group_is_named():
    tp0 = (0, 1)
    records = _ranks(
        [_step([_c("all_reduce", tp0), _c("all_reduce", tp0)])],
        [_step([_c("all_reduce", tp0), _c("reduce_scatter_single", tp0)])],
    )
    text = step_report(records, MESH_2X2, "-")  # no step of its own: the last one recorded
    assert "rank 0: tp all_reduce x2 (64 B)" in text
    assert "rank 1: tp all_reduce (32 B), tp reduce_scatter (32 B)" in text
    said = "ranks of one tp group issued different collectives on it: rank 1 (2) vs rank 0 (2)"
    assert said in text, text
    assert "the first difference at its collective 1" in text, text


def _reference(norm: float) -> Reference:
    return Reference(
        initial={"w": torch.tensor([1.0], dtype=torch.float64)},
        steps=[_step(grad_norm=norm)],
        gradient_bytes=8,
        gradient_numel=1,
        n_dtypes=1,
        compute_dtype=torch.float64,
    )


def test_the_norm_clipping_returned_on_a_mesh_is_the_references():
    mesh = Scenario(zoo.MLP, tensor_parallel=TensorParallel((), 2))
    right = _ranks([_step(grad_norm=17.5717768)], [_step(grad_norm=17.5717768)])
    assert compare(right, _reference(17.5717768), mesh, None, CHECKS) == []
    # the tp replicas counted twice: 1.408x
    wrong = _ranks([_step(grad_norm=24.7479712)], [_step(grad_norm=24.7479712)])
    rows = compare(wrong, _reference(17.5717768), mesh, None, CHECKS)
    assert [(d.kind, d.rank, d.name) for d in rows] == [
        (GRAD_NORM_DIFFERS, 0, "grad norm"),
        (GRAD_NORM_DIFFERS, 1, "grad norm"),
    ], rows
    assert "1.408x" in rows[0].detail, rows[0].detail
    # a rank returning no number, or data parallelism (what clipping returns was never promised
    # there): not judged
    assert compare(_ranks([_step()], [_step()]), _reference(17.57), mesh, None, CHECKS) == []
    assert compare(wrong, _reference(17.5717768), Scenario(zoo.MLP), None, CHECKS) == []
