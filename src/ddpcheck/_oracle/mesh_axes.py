"""Replicas along a mesh axis: which axis two differing ranks share, and what was placed on it.

Data-parallel replicas must be bitwise copies; under tensor parallelism so must every tensor
placed ``Replicate`` along an axis -- a norm's weight, a row-wise layer's bias, every layer the
plan leaves alone, replicated across the ``tp`` ranks of a group; everything, across the ``dp``
groups. The oracle compares each rank's full tensors with rank 0's bitwise (``compare``); for a
scenario on a mesh, :func:`along_axes` says which axis a differing rank shares with rank 0 and
how the tensor was placed there (the ranks' ``RankRecord.placements``): ``replicas differ along
tp (parameter)``, ``Replicate()`` along tp. A sharded tensor's full value is gathered the same way
on every rank of a group, so a difference there names the axis too.
"""

from __future__ import annotations

import dataclasses

from ddpcheck._base.errors import Divergence
from ddpcheck._language.pipeline_parallel import ND_AXES, pipeline_shape
from ddpcheck._language.records import RankRecord
from ddpcheck._language.scenario import Scenario, stage_tp
from ddpcheck._language.tensor_parallel import AXES, mesh_shape

__all__ = ["along_axes", "differing_axes", "shared_axis"]

_REPLICAS = "replicas differ"


def shared_axis(rank: int, other: int, tp: int) -> str:
    """The mesh axis along which ``rank`` and ``other`` differ (row-major ``(dp, tp)``): ``"tp"``
    when they share a ``dp`` coordinate (one tensor-parallel group), ``"dp"`` when they share a
    ``tp`` coordinate, else ``"dp and tp"``."""
    if rank // tp == other // tp:
        return "tp"
    if rank % tp == other % tp:
        return "dp"
    return "dp and tp"


def differing_axes(rank: int, other: int, shape: tuple[int, ...], axes: tuple[str, ...]) -> str:
    """The axes of a row-major mesh of ``shape`` along which ``rank`` and ``other`` sit apart,
    joined by "and" (a pipeline of tensor-parallel stages': ``dp``, ``pp``, ``tp``)."""
    apart = []
    for axis, size in reversed(list(zip(axes, shape))):
        if rank % size != other % size:
            apart.append(axis)
        rank, other = rank // size, other // size
    return " and ".join(reversed(apart))


def along_axes(
    found: list[Divergence], records: list[RankRecord], scenario: Scenario
) -> list[Divergence]:
    """``found`` with each replica row of a scenario on a mesh naming its axis and placement."""
    if scenario.tensor_parallel is None or not any(d.kind.startswith(_REPLICAS) for d in found):
        return found
    if scenario.pipeline is not None:  # (dp, pp, tp): a pipeline of tensor-parallel stages
        tp = stage_tp(scenario)
        shape: tuple[int, ...] = (*pipeline_shape(scenario.pipeline, len(records), tp), tp)
        axes: tuple[str, ...] = ND_AXES
    else:
        shape, axes = mesh_shape(scenario.tensor_parallel, len(records)), AXES
    placements = records[0].placements if records else {}
    return [_named(d, shape, axes, placements) for d in found]


def _named(
    d: Divergence,
    shape: tuple[int, ...],
    axes: tuple[str, ...],
    placements: dict[str, dict[str, str]],
) -> Divergence:
    if not d.kind.startswith(_REPLICAS) or d.rank is None or " along " in d.kind:
        return d  # (a row that names its axis itself: the loss of a tp group)
    axis = differing_axes(0, d.rank, shape, axes)
    placed = placements.get(d.name.split(" ")[0], {})
    where = " and ".join(f"{placed[a]} along {a}" for a in axis.split(" and ") if a in placed)
    detail = f"placed {where}; " if where else ""
    return dataclasses.replace(
        d,
        kind=d.kind.replace(_REPLICAS, f"{_REPLICAS} along {axis}", 1),
        detail=f"{detail}rank {d.rank} and rank 0 are replicas along {axis}: {d.detail}",
    )
