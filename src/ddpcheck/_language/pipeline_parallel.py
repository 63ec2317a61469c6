"""A scenario trained with pipeline parallelism: a ``(dp, pp)`` mesh, a schedule, micro-batches.

Pipeline parallelism splits the model into *stages*, consecutive slices of its modules, held by
the ``pp`` ranks of a group, which pass activations forward and gradients back; the schedule
decides the order in which each rank runs the forward and backward of each micro-batch. Every rank
of one pipeline group must therefore see the *same* samples: as for tensor parallelism, the data
follows the mesh (rank ``r`` sits at ``dp = r // pp``, ``pp = r % pp``, as torch's
``init_device_mesh`` lays out a ``(dp, pp)`` mesh), and the plan rule weighs each sample ``pp``
times at ``dp / T``, which is ``1 / T``.

Which stage holds which module is the scenario's, not the target's: the model is one of the
transformer-shaped stacks tensor-parallel plans use (``ddpcheck._language.sharded_models``:
``inp``, ``blocks.<i>``, ``head``), cut into ``stages`` consecutive slices of that order
(``boundaries``); a stage keeps the full model's parameter names, so the one-process reference
judges each parameter on the ranks whose stage holds it. Where a rank holds several stages is
torch's rule for the schedule (:func:`stages_of_rank`): looped schedules put stage ``s`` on rank
``s % pp``, the V-shaped ones go down the ranks and back up.

What torch refuses, found by trying (``bench/pipeline_cpu.py``, torch 2.13, gloo): a batch that the
micro-batches do not divide evenly (pytorch#126600: receive buffers are sized by the first
micro-batch; "we do not support this"), so a scenario whose micro-batches a schedule cannot cut
evenly is no pipeline scenario (:func:`pipeline_problem`); each schedule's own constraints on
the number of micro-batches are checked here too, so that a replay line states a runnable case.
"""

from __future__ import annotations

import dataclasses

from ddpcheck._base.errors import InvalidArgument
from ddpcheck._base.options import named_fields

__all__ = [
    "ND_AXES",
    "PIPELINE_AXES",
    "SCHEDULES",
    "SCHEDULES_SPLITTING_BACKWARD",
    "PipelineParallel",
    "held_modules",
    "module_order",
    "pipeline_problem",
    "pipeline_shape",
    "stage_modules",
    "stages_of_rank",
]

#: The mesh's axes, outermost first: data parallelism across pipelines, stages within one.
PIPELINE_AXES = ("dp", "pp")
#: A pipeline of tensor-parallel stages (``torch_nd``): rank ``r`` sits at ``dp = r // (pp tp)``,
#: ``pp = (r // tp) % pp``, ``tp = r % tp``, as ``init_device_mesh`` lays out these names.
ND_AXES = ("dp", "pp", "tp")

#: The schedules a scenario may name (torch's class names without ``Schedule``), with how many
#: stages each puts on one rank: 1 (single-stage schedules), 2 (the V-shaped ones), or any
#: number of at least 1 (looped).
SCHEDULES: dict[str, str] = {
    "GPipe": "single",
    "1F1B": "single",
    "Interleaved1F1B": "looped",
    "LoopedBFS": "looped",
    "InterleavedZeroBubble": "looped",
    "ZBVZeroBubble": "v",
    "DualPipeV": "v",
}

#: The schedules that split each stage's backward into its input and weight parts (zero bubble).
SCHEDULES_SPLITTING_BACKWARD = frozenset({"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"})


@named_fields
@dataclasses.dataclass(frozen=True)
class PipelineParallel:
    """A ``(dp, pp)`` mesh, the stages the model is cut into and the schedule that runs them.

    ``schedule``: one of :data:`SCHEDULES`. ``pp``: the pipeline degree (None: the whole world,
    ``dp = 1``). ``microbatches``: how many pieces the schedule cuts each of a rank's
    micro-batches into (torch's ``n_microbatches``). ``boundaries``: where the model's modules --
    ``inp``, each block, ``head``, in that order -- are cut into stages: stage ``s`` holds the
    modules from ``boundaries[s - 1]`` (0 for the first) up to ``boundaries[s]`` (the end for the
    last); ``stages_per_rank * pp - 1`` increasing cuts."""

    schedule: str = "GPipe"
    boundaries: tuple[int, ...] = (1,)
    microbatches: int = 1
    pp: int | None = None
    stages_per_rank: int = 1

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise InvalidArgument(
                f"PipelineParallel(schedule={self.schedule!r}) must be one of "
                f"{', '.join(SCHEDULES)}"
            )
        for name, minimum in (("microbatches", 1), ("stages_per_rank", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise InvalidArgument(
                    f"PipelineParallel({name}={value!r}) must be an integer >= {minimum}"
                )
        if self.pp is not None and (
            isinstance(self.pp, bool) or not isinstance(self.pp, int) or self.pp < 1
        ):
            raise InvalidArgument(
                f"PipelineParallel(pp={self.pp!r}) must be None or an integer >= 1"
            )
        try:
            cuts = tuple(int(b) for b in self.boundaries)
        except (TypeError, ValueError):
            raise InvalidArgument(
                f"PipelineParallel(boundaries={self.boundaries!r}) must be module indices"
            ) from None
        if any(b < 1 for b in cuts) or list(cuts) != sorted(set(cuts)):
            raise InvalidArgument(
                f"PipelineParallel(boundaries={self.boundaries!r}) must be increasing module "
                "indices >= 1 (each stage holds at least one module)"
            )
        object.__setattr__(self, "boundaries", cuts)
        kind = SCHEDULES[self.schedule]
        if kind == "single" and self.stages_per_rank != 1:
            raise InvalidArgument(
                f"PipelineParallel(schedule={self.schedule!r}) runs one stage per rank, not "
                f"stages_per_rank={self.stages_per_rank}"
            )
        if kind == "v" and self.stages_per_rank != 2:
            raise InvalidArgument(
                f"PipelineParallel(schedule={self.schedule!r}) runs exactly two stages per rank "
                f"(a V), not stages_per_rank={self.stages_per_rank}"
            )

    @property
    def stages(self) -> int:
        return len(self.boundaries) + 1

    def degree(self, world_size: int) -> int:
        """The pipeline degree in a world of ``world_size`` ranks."""
        return world_size if self.pp is None else self.pp


def pipeline_problem(
    pipeline: PipelineParallel | None, world_size: int, modules: int | None = None, tp: int = 1
) -> str | None:
    """Why a world of ``world_size`` ranks cannot run the pipeline (None: it can); ``modules``:
    how many modules the model has to cut (None: not checked); ``tp``: the degree of each
    stage's tensor parallelism (``(dp, pp, tp)``: ``pp`` then divides ``W / tp``)."""
    if pipeline is None:
        return None
    if world_size % tp:
        return f"tp={tp} does not divide the world of {world_size} ranks"
    world_size //= tp
    pp = pipeline.degree(world_size)
    if world_size % pp:
        return f"pp={pp} does not divide the world of {world_size} ranks into dp groups"
    if pipeline.stages != pp * pipeline.stages_per_rank:
        return (
            f"{pipeline.stages} stage(s) (boundaries={pipeline.boundaries}) on pp={pp} rank(s) "
            f"at {pipeline.stages_per_rank} per rank: the stages must be pp x stages_per_rank"
        )
    if modules is not None and pipeline.boundaries and pipeline.boundaries[-1] >= modules:
        return (
            f"boundaries={pipeline.boundaries} cut past the model's {modules} modules "
            "(inp, the blocks, head): the last stage would hold none"
        )
    m, stages = pipeline.microbatches, pipeline.stages
    if pipeline.schedule == "1F1B" and m < stages:
        return f"1F1B needs microbatches >= stages ({m} < {stages}; torch refuses it)"
    if pipeline.schedule == "DualPipeV" and m < stages:
        return f"DualPipeV needs microbatches >= stages ({m} < {stages}; torch refuses it)"
    looped = SCHEDULES[pipeline.schedule] == "looped" and pipeline.schedule != "LoopedBFS"
    if looped and m % max(1, m // pp):
        return (
            f"{pipeline.schedule} needs microbatches divisible by max(1, microbatches // pp)"
            f" ({m} at pp={pp}; torch refuses it)"
        )
    return None


def pipeline_shape(
    pipeline: PipelineParallel | None, world_size: int, tp: int = 1
) -> tuple[int, int]:
    """``(dp, pp)``: a scenario without pipeline parallelism is ``(W, 1)``; with ``tp``-way
    tensor-parallel stages, ``dp = W / (pp tp)``."""
    if pipeline is None:
        return world_size, 1
    problem = pipeline_problem(pipeline, world_size, tp=tp)
    if problem is not None:
        raise InvalidArgument(problem)
    pp = pipeline.degree(world_size // tp)
    return world_size // (pp * tp), pp


def stage_modules(pipeline: PipelineParallel, names: list[str]) -> list[list[str]]:
    """The names of the modules each stage holds, from the model's ``names`` in order."""
    cuts = [0, *pipeline.boundaries, len(names)]
    return [names[cuts[s] : cuts[s + 1]] for s in range(pipeline.stages)]


def stages_of_rank(pipeline: PipelineParallel, coordinate: int, pp: int) -> list[int]:
    """The stages the rank at pipeline coordinate ``coordinate`` holds, in order: ``s`` with
    ``s % pp == coordinate`` for looped schedules; for V-shaped ones the stage on the way down and
    the one on the way back up (``coordinate`` and ``2 pp - 1 - coordinate``: torch's rule)."""
    if SCHEDULES[pipeline.schedule] == "v":
        return [coordinate, 2 * pp - 1 - coordinate]
    return list(range(coordinate, pipeline.stages, pp))


def module_order(model_spec: object) -> list[str]:
    """The modules a pipeline cuts, in order: ``inp``, ``blocks.<i>``, ``head`` -- the model of a
    ``ShardedSpec`` (the only models pipeline scenarios have)."""
    blocks = getattr(model_spec, "blocks", None)
    if blocks is None:
        raise InvalidArgument(
            f"a pipeline scenario's model must be a ddpcheck.sharded_models.ShardedSpec (inp, "
            f"blocks, head: the modules the stages hold), not {model_spec!r}"
        )
    return ["inp", *(f"blocks.{i}" for i in range(len(blocks))), "head"]


def held_modules(
    pipeline: PipelineParallel, model_spec: object, coordinate: int, pp: int
) -> list[str]:
    """The modules the rank at pipeline coordinate ``coordinate`` holds, over all its stages."""
    per_stage = stage_modules(pipeline, module_order(model_spec))
    return [m for s in stages_of_rank(pipeline, coordinate, pp) for m in per_stage[s]]
