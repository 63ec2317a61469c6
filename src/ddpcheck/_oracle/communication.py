"""The communication of a step, as a failure shows it: each rank's collectives by mesh axis.

Why: a wrong number says *that* a rank diverged; what crossed the wire at that step often says
*why* -- an all-reduce missing on ``tp``, a reduce-scatter where a gather belongs, a rank that
issued one more. So a failure's report ends with the step's collectives, per rank, grouped by
the mesh axis of their process group (``dp``, ``tp``, ``pp``: named from the scenario's mesh,
never a group's id), the operation and the bytes: ``rank 1: tp all_reduce x3 (96 B), dp
all_gather x2 (64 B)``; ranks that issued the same say so once. The ranks of one group are
compared too: the first rank whose collectives on a group differ from its group's first rank's
(operation, reduction, dtype, in order) is named with the first one that differs.

What is there: every collective a rank issued through ``torch.distributed``'s Python API or
torch's functional collectives (DTensor's), out of the harness's own gathers; not those issued
from C++ (torch DDP's buckets) nor point-to-point sends (a pipeline's stages). Pure: records and
the scenario in, text out.
"""

from __future__ import annotations

from collections.abc import Sequence

from ddpcheck._language.pipeline_parallel import PIPELINE_AXES, pipeline_shape
from ddpcheck._language.records import Collective, RankRecord
from ddpcheck._language.scenario import Scenario
from ddpcheck._language.tensor_parallel import AXES, mesh_shape

__all__ = ["axis_of", "mesh_of", "step_report"]

#: op name suffixes that say how torch spells a call, not what crosses the wire
_SUFFIXES = ("_into_tensor", "_coalesced", "_single", "_tensor", "_object_list", "_object")

Mesh = tuple[tuple[str, str], tuple[int, int]]


def mesh_of(scenario: Scenario, world_size: int) -> Mesh | None:
    """The scenario's ``((axis names), (sizes))``, row-major as ``init_device_mesh`` lays it
    out; None for a scenario on no mesh."""
    if scenario.tensor_parallel is not None:
        return AXES, mesh_shape(scenario.tensor_parallel, world_size)
    if scenario.pipeline is not None:
        return PIPELINE_AXES, pipeline_shape(scenario.pipeline, world_size)
    return None


def axis_of(group: tuple[int, ...] | None, rank: int, world_size: int, mesh: Mesh | None) -> str:
    """The name of ``group`` as ``rank`` sees it: the mesh axis whose group it is (``"tp"``),
    ``"world"`` for the default group where no axis spans it, else its ranks."""
    if group == ():
        return "another group"
    members = tuple(range(world_size)) if group is None else tuple(sorted(group))
    if mesh is not None:
        (outer, inner), (n_outer, n_inner) = mesh
        coordinate_outer, coordinate_inner = divmod(rank, n_inner)
        along_inner = tuple(coordinate_outer * n_inner + i for i in range(n_inner))
        along_outer = tuple(j * n_inner + coordinate_inner for j in range(n_outer))
        if members == along_inner and n_inner > 1:
            return inner
        if members == along_outer and n_outer > 1:
            return outer
    if members == tuple(range(world_size)):
        return "world"
    return f"group {list(members)}"


def _op(c: Collective) -> str:
    name = c.op
    for suffix in _SUFFIXES:
        name = name.removesuffix(suffix)
    return name


def _bytes(n: int) -> str:
    if n < 10_000:
        return f"{n} B"
    if n < 10_000_000:
        return f"{n / 1024:.1f} KiB"
    return f"{n / 1024**2:.1f} MiB"


def _summary(calls: Sequence[Collective], rank: int, world_size: int, mesh: Mesh | None) -> str:
    """``tp all_reduce x3 (96 B), dp all_gather x2 (64 B)``, in order of first appearance."""
    counts: dict[tuple[str, str], list[int]] = {}
    for c in calls:
        key = (axis_of(c.group, rank, world_size, mesh), _op(c))
        count = counts.setdefault(key, [0, 0])
        count[0] += 1
        count[1] += c.nbytes
    if not counts:
        return "none"
    return ", ".join(
        f"{axis} {op}{f' x{n}' if n > 1 else ''} ({_bytes(size)})"
        for (axis, op), (n, size) in counts.items()
    )


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _differs(
    records: Sequence[RankRecord], step: int, world_size: int, mesh: Mesh | None
) -> list[str]:
    """One line per group whose ranks issued different collectives on it at ``step``: the first
    rank that differs from the group's first, and where."""
    by_group: dict[tuple[int, ...] | None, dict[int, list[Collective]]] = {}
    for record in records:
        for c in record.steps[step].collectives:
            if c.group != ():
                by_group.setdefault(c.group, {}).setdefault(record.rank, []).append(c)
    lines = []
    for group, per_rank in by_group.items():
        members = range(world_size) if group is None else group
        seqs = {r: per_rank.get(r, []) for r in members if 0 <= r < len(records)}
        if len(seqs) < 2:
            continue
        first, *others = sorted(seqs)
        keys = {r: [(_op(c), c.reduce_op, c.dtypes) for c in s] for r, s in seqs.items()}
        for other in others:
            if keys[other] == keys[first]:
                continue
            index = next(
                (i for i, (a, b) in enumerate(zip(keys[first], keys[other])) if a != b),
                min(len(keys[first]), len(keys[other])),
            )
            axis = axis_of(group, first, world_size, mesh)
            said = [
                f"rank {r} {seqs[r][index].brief()}" if index < len(seqs[r]) else f"rank {r} none"
                for r in (first, other)
            ]
            lines.append(
                f"  ranks of one {axis} group issued different collectives on it: rank "
                f"{other} ({len(seqs[other])}) vs rank {first} ({len(seqs[first])}), the first "
                f"difference at its collective {index}: {'; '.join(said)}"
            )
            break
    return lines


def step_report(records: Sequence[RankRecord], scenario: Scenario, step: object) -> str:
    """The communication block of a failure's report at ``step`` (an int; anything else, or a
    step no rank recorded: the last step recorded, else ``""``)."""
    steps = min((len(r.steps) for r in records), default=0)
    if not steps:
        return ""
    at = step if isinstance(step, int) and 0 <= step < steps else steps - 1
    world_size = len(records)
    mesh = mesh_of(scenario, world_size)
    lines = [
        f"communication at step {at} (each rank's collectives by mesh axis, op and bytes; the "
        "harness's own gathers left out):"
    ]
    said: dict[str, list[int]] = {}
    for record in records:
        said.setdefault(
            _summary(record.steps[at].collectives, record.rank, world_size, mesh), []
        ).append(record.rank)
    for text, ranks in said.items():
        lines.append(f"  {_ranks(ranks)}: {text}")
    return "\n".join(lines + _differs(records, at, world_size, mesh))
