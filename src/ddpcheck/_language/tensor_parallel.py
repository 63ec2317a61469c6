"""A scenario trained with tensor parallelism: a device mesh of ``dp x tp`` ranks and a plan.

Data parallelism replicates the model and splits the batch; tensor parallelism splits the model's
layers over the ``tp`` ranks of a group, which must therefore all see the *same* samples. A
scenario with ``tensor_parallel=TensorParallel(plan, tp)`` runs in a world of W ranks laid out as
torch's ``init_device_mesh`` lays out a ``(dp, tp)`` mesh (row-major: rank ``r`` sits at
``dp = r // tp``, ``tp = r % tp``), with ``dp = W / tp``.

Invariant (the data follows the mesh, docs/tensor-parallel.md): the global batch is split among the
``dp`` coordinates exactly as the batch rule splits it among W data-parallel ranks, and every rank
of one tensor-parallel group gets its group's share -- the harness decides, not the target: a
target's ``shard_batch`` hook is told the rank's ``dp`` coordinate and ``dp`` as the rank and the
world size (``ddpcheck._language.batches.global_indices``). The plan's weights are then checked as
every plan is: averaged over the W ranks, each sample ``tp`` times with the scale ``dp / T``,
which is ``1 / T``. The one-process reference trains the unparallelized model on the whole batch,
as it does for data parallelism.

A plan is plain data, so that it is drawn, shrunk and printed in replay lines like everything else
in a scenario: ``(module name, style)`` pairs, the styles named by :data:`STYLES` (the ready-made
``torch_tp`` and ``torch_2d`` targets turn them into torch's ``ParallelStyle`` objects,
``ddpcheck.targets.tensor_parallel``). A target with its own plan (its ``parallelize`` hook)
reads only the mesh.
"""

from __future__ import annotations

import dataclasses

from ddpcheck._base.errors import InvalidArgument
from ddpcheck._base.options import named_fields

__all__ = [
    "AXES",
    "STYLES",
    "TensorParallel",
    "data_coordinate",
    "mesh_shape",
    "mesh_problem",
]

#: The mesh's axes, outermost first: data parallelism across groups, tensor parallelism within.
AXES = ("dp", "tp")

#: The styles a plan may name, with what each does to an ``nn.Linear`` (torch's names).
STYLES: dict[str, str] = {
    "colwise": "ColwiseParallel(): output features sharded over tp, the output left sharded "
    "for the row-wise layer that consumes it",
    "colwise-dtensor": "ColwiseParallel(use_local_output=False): as colwise, the output kept a "
    "DTensor (what uneven shards need: from_local infers a global shape from even ones)",
    "rowwise": "RowwiseParallel(): input features sharded over tp (the column-wise layer's "
    "sharded output), partial outputs all-reduced",
    "colwise-replicate": "ColwiseParallel(output_layouts=Replicate()): output features sharded, "
    "the output all-gathered",
    "rowwise-replicate": "RowwiseParallel(input_layouts=Replicate()): input features sharded, "
    "the replicated input sliced, partial outputs all-reduced",
    "sequence": "SequenceParallel(): a norm on its rank's share of the sequence (dim 1), its "
    "weights replicated, their gradients all-reduced over tp",
    "sequence-in": "PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1), "
    "use_local_output=False): a norm block's replicated input cut along the sequence",
    "sequence-out": "PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts="
    "Replicate()): a norm block's sequence shards all-gathered",
    "sequence-in-out": "PrepareModuleInputOutput(...): both of the above, on one norm block",
    "rowwise-sequence": "RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), "
    "use_local_output=False): partial outputs reduce-scattered along the sequence",
    "colwise-sequence": "ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()): the "
    "sequence shards all-gathered in, the output features gathered out",
    "vocab": "RowwiseParallel(input_layouts=Replicate()) on an nn.Embedding: its rows (the "
    "vocabulary) sharded, each rank's lookups of other ranks' ids masked, partial sums "
    "all-reduced",
    "vocab-sequence": "RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), "
    "use_local_output=False) on an nn.Embedding: as vocab, the partial sums reduce-scattered "
    "along the sequence into a sequence-parallel region",
    "colwise-loss": "ColwiseParallel(use_local_output=False): logits sharded over the "
    "vocabulary (Shard(-1)), the cross-entropy under loss_parallel()",
    "colwise-sequence-loss": "ColwiseParallel(input_layouts=Shard(1), use_local_output=False): "
    "as colwise-loss, its input the sequence shards all-gathered",
    "heads-norm": "SequenceParallel(sequence_dim=1, use_local_output=True) on a q/k norm of "
    "attention split over its heads: its input (batch, heads, length, head_dim) sharded over the "
    "heads, its replicated weight's gradient summed over tp",
}


@named_fields
@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """A ``(dp, tp)`` mesh and the plan the ready-made targets apply over its ``tp`` axis.

    ``plan``: ``(module name, style)`` pairs, a style one of :data:`STYLES`; empty: nothing
    sharded (every layer replicated along ``tp``). ``tp``: the tensor-parallel degree; None:
    the whole world (``dp = 1``)."""

    plan: tuple[tuple[str, str], ...] = ()
    tp: int | None = None

    def __post_init__(self) -> None:
        if self.tp is not None and (
            isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1
        ):
            raise InvalidArgument(f"TensorParallel(tp={self.tp!r}) must be None or an integer >= 1")
        try:
            plan = tuple((str(name), str(style)) for name, style in self.plan)
        except (TypeError, ValueError):
            raise InvalidArgument(
                f"TensorParallel(plan={self.plan!r}) must be (module name, style) pairs"
            ) from None
        for name, style in plan:
            if style not in STYLES:
                raise InvalidArgument(
                    f"TensorParallel(plan=...) gives module {name!r} the style {style!r}; "
                    f"the styles are {', '.join(STYLES)}"
                )
        names = [name for name, _ in plan]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise InvalidArgument(
                f"TensorParallel(plan=...) names module {repeated[0]!r} twice; one style each"
            )
        object.__setattr__(self, "plan", plan)

    def degree(self, world_size: int) -> int:
        """The tensor-parallel degree in a world of ``world_size`` ranks."""
        return world_size if self.tp is None else self.tp


def mesh_problem(tensor_parallel: TensorParallel | None, world_size: int) -> str | None:
    """Why a world of ``world_size`` ranks cannot hold the mesh (None: it can)."""
    if tensor_parallel is None:
        return None
    tp = tensor_parallel.degree(world_size)
    if world_size % tp:
        return f"tp={tp} does not divide the world of {world_size} ranks into dp groups"
    return None


def mesh_shape(tensor_parallel: TensorParallel | None, world_size: int) -> tuple[int, int]:
    """``(dp, tp)``: a scenario without tensor parallelism is ``(W, 1)``."""
    if tensor_parallel is None:
        return world_size, 1
    problem = mesh_problem(tensor_parallel, world_size)
    if problem is not None:
        raise InvalidArgument(problem)
    tp = tensor_parallel.degree(world_size)
    return world_size // tp, tp


def data_coordinate(
    tensor_parallel: TensorParallel | None, rank: int, world_size: int
) -> tuple[int, int]:
    """``(rank, world size)`` as the batch rule sees them: the rank's ``dp`` coordinate and ``dp``
    (the data follows the mesh: every rank of a tensor-parallel group gets the same samples)."""
    dp, tp = mesh_shape(tensor_parallel, world_size)
    return rank // tp, dp
