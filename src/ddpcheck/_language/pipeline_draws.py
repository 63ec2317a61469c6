"""Hypothesis strategies for pipeline scenarios: a mesh, a schedule, stages, and a batch whose
every micro-batch the schedule can cut into equal pieces.

Drawn as tensor-parallel scenarios are, and shrinking the same way: towards two stages on two
ranks (``pp`` the smallest divisor of W), GPipe, one piece per micro-batch, the fewest and
plainest blocks, SGD, one step, float64. Every schedule torch ships is drawn with the stages per
rank it runs (one, a looped two, a V's two) and the pieces it accepts
(``ddpcheck._language.pipeline_parallel.pipeline_problem``); the batch is ``dp x accumulation x
pieces x c`` samples, so that no rank's micro-batch is cut unevenly -- which torch refuses
(pytorch#126600), so such a draw would test nothing.

For a target that also applies plans (``torch_nd``: ``tensor-parallel`` not in ``without``) the
mesh is ``(dp, pp, tp)``: ``tp`` drawn first (1, or a degree leaving a pipeline of at least two
ranks), then ``pp``, and the plan drawn for the whole model by ``plans.plans`` -- the same
fragments -- less those whose activations cross a module's boundary as a DTensor (a
sequence-parallel region's open ends): a stage hands plain tensors to the next, so a region a
cut could split is not drawn. Where the target serves ``tokens`` (``torch_nd``), half the
scenarios train the vocabulary head on a token loss ``loss_parallel()`` computes (cross-entropy,
a policy gradient: ``objective.LOSS_PARALLEL``), and its logits may stay sharded over the
vocabulary (``colwise-loss``): they never cross a stage, the loss is the last stage's.
"""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import strategies as st

from ddpcheck._base.errors import InvalidArgument
from ddpcheck._language.objective import LOSS_PARALLEL
from ddpcheck._language.pipeline_parallel import (
    SCHEDULES,
    PipelineParallel,
    pipeline_problem,
)
from ddpcheck._language.plans import clip_norm, divisors, optimizer_for
from ddpcheck._language.scenario import Scenario
from ddpcheck._language.sharded_models import (
    ShardedBlock,
    ShardedSpec,
    plan_choices,
    sequence_data,
    sequence_tokens,
)
from ddpcheck._language.tensor_parallel import TensorParallel

__all__ = ["CROSSING_STYLES", "PIPELINE_DRAWN", "pipeline_scenarios", "stage_plans"]

#: The features pipeline scenarios are drawn with.
PIPELINE_DRAWN = frozenset(
    {
        "float64",
        "float32",
        "accumulation",
        "lr-schedule",
        "clipping",
        "broadcast",
        "pipeline-parallel",
        "tokens",
    }
)

#: The largest number of pieces a micro-batch is cut into, and of samples per piece.
MAX_PIECES, MAX_PER_PIECE = 4, 2


def pipeline_scenarios(
    *,
    world_size: int,
    dtypes: Iterable[str] = ("float64", "float32"),
    without: Iterable[str] = (),
    degrees: Iterable[int] | None = None,
    max_steps: int = 3,
    max_accumulation: int = 2,
    layouts: Iterable[tuple[int, int]] | None = None,
) -> st.SearchStrategy[Scenario]:
    """Pipeline scenarios at ``world_size``: a degree ``pp`` (drawn among ``degrees``, default
    the divisors of W), a schedule with its stages per rank, a model of at least as many modules
    as stages, cut at drawn boundaries, pieces the schedule accepts, and what tensor-parallel
    scenarios draw besides -- optimizer, dtype, steps, accumulation, LR decay, clipping -- none
    of ``without``. ``layouts``: ``(pp, tp)`` pairs, each drawn as asked (``--mesh``: ``dp`` is
    what is left of W), instead of ``degrees`` and the drawn ``tp``."""
    dtypes, without = tuple(dtypes), frozenset(without)
    if not dtypes:
        raise InvalidArgument("dtypes must name at least one of float64, float32")
    if layouts is not None:
        if degrees is not None:
            raise InvalidArgument("give degrees= or layouts=, not both")
        pairs = tuple(sorted(set(layouts), key=lambda pair: (pair[1], pair[0])))
        bad = [(p, t) for p, t in pairs if p < 1 or t < 1 or world_size % (p * t)]
        if not pairs or bad:
            raise InvalidArgument(
                f"layouts={pairs!r} must be (pp, tp) pairs whose product divides "
                f"world_size={world_size}"
            )
        return _scenarios(world_size, dtypes, without, pairs, max_steps, max_accumulation)
    if degrees is None:
        degrees = divisors(world_size)
    degrees = tuple(sorted(set(degrees)))
    wrong = [d for d in degrees if d < 1 or world_size % d]
    if not degrees or wrong:
        raise InvalidArgument(
            f"degrees={degrees!r} must be pipeline degrees that divide world_size={world_size}"
        )
    return _scenarios(
        world_size,
        dtypes,
        without,
        _layouts(world_size, degrees, without),
        max_steps,
        max_accumulation,
    )


def _layouts(
    world_size: int, degrees: tuple[int, ...], without: frozenset[str]
) -> tuple[tuple[int, int], ...]:
    """The ``(pp, tp)`` layouts drawn without a mesh asked for: ``tp`` 1, or (for stages that
    take plans) a degree leaving a pipeline of at least two ranks; ``pp`` among ``degrees``
    dividing what is left."""
    tps = [1]
    if "tensor-parallel" not in without:
        tps = [t for t in (1, *divisors(world_size)) if _pipes(world_size, t)] or [1]
    return tuple(
        (p, t)
        for t in dict.fromkeys(tps)
        for p in degrees
        if p * t <= world_size and (world_size // t) % p == 0
    )


#: The styles whose output leaves their module as a DTensor another module takes in (or whose
#: input arrives so): never drawn for a pipeline's stages, which a cut may separate. Not
#: ``colwise-loss``: its logits leave the head, the model's last module, for the schedule's
#: ``loss_fn`` on the same stage, under ``loss_parallel()`` (``bench/pipeline_loss_parallel.py``:
#: every schedule tried matches one process to 7e-16).
CROSSING_STYLES = frozenset(
    {
        "sequence-in",
        "sequence-out",
        "rowwise-sequence",
        "colwise-sequence",
        "colwise-sequence-loss",
    }
)


@st.composite
def stage_plans(draw: st.DrawFn, spec: ShardedSpec, tp: int) -> tuple[tuple[str, str], ...]:
    """A plan for ``spec``'s model at degree ``tp`` whose every module hands on a plain tensor
    (no :data:`CROSSING_STYLES`), shrinking towards nothing sharded; for a model trained on
    tokens, the head's logits left sharded for ``loss_parallel()`` half the time (among every
    head fragment it is one in a dozen)."""
    if tp == 1:
        return ()
    groups = [
        [f for f in group if not any(style in CROSSING_STYLES for _, style in f)]
        for group in plan_choices(spec, tp)
    ]
    sharded_logits = [f for f in groups[-1] if ("head", "colwise-loss") in f]
    if sharded_logits:  # (one draw, not an `and`: mypy types its right side by its left)
        sharded: bool = draw(st.booleans())
        groups[-1] = sharded_logits if sharded else groups[-1]
    return tuple(pair for group in groups for pair in draw(st.sampled_from(group)))


#: The block kinds pipelines are drawn with (those they were measured with: no RMSNorm yet).
PIPELINE_KINDS = ("mlp", "attention", "norm")


@st.composite
def _scenarios(
    draw: st.DrawFn,
    world_size: int,
    dtypes: tuple[str, ...],
    without: frozenset[str],
    layouts: tuple[tuple[int, int], ...],
    max_steps: int,
    max_accumulation: int,
) -> Scenario:
    # a pipeline of tensor-parallel stages: tp first, then pp among what is left
    tp = draw(st.sampled_from(tuple(dict.fromkeys(t for _, t in layouts))))
    pp = draw(st.sampled_from(tuple(p for p, t in layouts if t == tp)))
    schedule = draw(st.sampled_from(tuple(SCHEDULES)))
    per_rank = 1 if SCHEDULES[schedule] == "single" else 2
    stages = pp * per_rank
    blocks = draw(
        st.lists(
            st.builds(
                ShardedBlock,
                kind=st.sampled_from(PIPELINE_KINDS),
                size=st.integers(1, 4),
                bias=st.booleans().map(lambda b: not b),
            ),
            min_size=max(1, stages - 2),
            max_size=max(1, stages - 2) + 2,
        ).map(tuple)
    )
    modules = len(blocks) + 2
    cuts = draw(
        st.lists(
            st.integers(1, modules - 1), min_size=stages - 1, max_size=stages - 1, unique=True
        ).map(lambda c: tuple(sorted(c)))
    )
    fits = [
        m
        for m in range(1, max(MAX_PIECES, stages) + 1)
        if pipeline_problem(PipelineParallel(schedule, cuts, m, pp, per_rank), pp, modules) is None
    ]
    pieces = draw(st.sampled_from(fits))
    dtype = draw(st.sampled_from(dtypes))
    optimizer, kwargs = optimizer_for(draw, dtype)
    accumulation = 1 if "accumulation" in without else draw(st.integers(1, max_accumulation))
    dp = world_size // (pp * tp)
    batch = dp * accumulation * pieces * draw(st.integers(1, MAX_PER_PIECE))
    max_grad_norm = clip_norm(draw, without)
    # a token loss torch's loss_parallel() computes (half the draws where tokens are served):
    # the head may then leave its logits sharded over the vocabulary for the last stage's loss_fn
    tokens = "tokens" not in without and draw(st.booleans())
    spec = ShardedSpec(
        blocks=blocks,
        width=draw(st.integers(2, 6)),
        head_dim=draw(st.integers(1, 3)),
        tokens=tokens,
    )
    nd = "tensor-parallel" not in without  # torch_nd: its scenarios name tp, 1 included
    return Scenario(
        model=spec,
        tensor_parallel=TensorParallel(draw(stage_plans(spec, tp)), tp) if nd else None,
        data=sequence_tokens if tokens else sequence_data,
        loss=draw(st.sampled_from(LOSS_PARALLEL)) if tokens else "squared_error",
        optimizer=optimizer,
        optimizer_kwargs=kwargs,
        lr_decay=None if "lr-schedule" in without else draw(st.sampled_from((None, 0.5))),
        global_batch=batch,
        steps=draw(st.integers(1, min(max_steps, 2) if dtype == "float32" else max_steps)),
        accumulation=accumulation,
        dtype=dtype,
        seed=draw(st.integers(0, 2**16)),
        rank_seeds="broadcast" not in without,
        max_grad_norm=max_grad_norm,
        pipeline=PipelineParallel(
            schedule, cuts, pieces, None if pp * tp == world_size else pp, per_rank
        ),
    )


def _pipes(world_size: int, tp: int) -> bool:
    """Whether ``tp``-way stages leave a pipeline of at least two ranks in ``world_size``."""
    return world_size % tp == 0 and world_size // tp >= 2
