"""torch's tensor parallelism, alone (``torch_tp``) and under FSDP2 over ``dp`` (``torch_2d``).

A scenario's plan (``Scenario.tensor_parallel``, ``ddpcheck._language.tensor_parallel``) names a
style per module; :func:`torch_plan` turns it into the dict of ``ParallelStyle`` objects that
``torch.distributed.tensor.parallel.parallelize_module`` takes -- exactly what a user writes. Each
target broadcasts rank 0's initial weights first (the scenarios initialise ranks differently on
purpose, and the layers a plan leaves alone stay plain tensors, replicated by nobody else), then
applies the plan over ``mesh["tp"]``; ``torch_2d`` then shards every layer with FSDP2 over
``mesh["dp"]`` (``fully_shard(mesh=...)``), as torchtitan composes them.

What was found by trying (torch 2.13, gloo, CPU): ``ColwiseParallel()``'s default local output
feeding ``RowwiseParallel()`` crashes when ``tp`` does not divide the hidden width
(``DTensor.from_local`` infers the global shape from even shards); the plans ddpcheck draws use
``ColwiseParallel(use_local_output=False)`` there (``"colwise-dtensor"``), which trains right.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from ddpcheck._language.objective import LOSS_PARALLEL
from ddpcheck._language.scenario import Scenario, batch_size_of, micro_batches_of
from ddpcheck._language.sharded_models import (
    LOSS_STYLES,
    REGION_STYLES,
    SEQUENCE,
    SEQUENCE_STYLES,
    VOCABULARY_STYLES,
    holders,
)
from ddpcheck._language.tensor_parallel import mesh_problem, mesh_shape
from ddpcheck._language.training import OptimizerLike
from ddpcheck.targets.fsdp import (
    CPU_FLOOR,
    CUDA_FLOOR,
    broadcast_from,
    gradient_sync_off,
    shard_leaves,
)
from ddpcheck.targets.protocol import Target

if TYPE_CHECKING:  # torch.distributed.tensor loads when a tensor-parallel target runs
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = [
    "AUTOCAST_ON_A_MESH",
    "TP_FLOOR",
    "EmptyShard",
    "PlanTarget",
    "Torch2DTarget",
    "TorchTPTarget",
    "empty_micro_batch",
    "empty_sequence",
    "empty_shard",
    "first_empty_shard",
    "no_loss_parallel",
    "replicate_rest",
    "retie",
    "tied_parameters",
    "torch_plan",
]


def torch_plan(
    plan: tuple[tuple[str, str], ...], sequence: type[ParallelStyle] | None = None
) -> dict[str, ParallelStyle]:
    """``{module name: ParallelStyle}`` for ``parallelize_module``, from a scenario's plan
    (``sequence``: the class of its ``"sequence"`` style; default torch's ``SequenceParallel``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    seq, rep = Shard(1), Replicate()  # the sequence dim of (batch, sequence, features)
    styles: dict[str, Callable[[], ParallelStyle]] = {
        "colwise": ColwiseParallel,
        "colwise-dtensor": lambda: ColwiseParallel(use_local_output=False),
        "rowwise": RowwiseParallel,
        "colwise-replicate": lambda: ColwiseParallel(output_layouts=rep),
        "rowwise-replicate": lambda: RowwiseParallel(input_layouts=rep),
        "sequence": sequence or SequenceParallel,
        "sequence-in": lambda: PrepareModuleInput(
            input_layouts=(rep,), desired_input_layouts=(seq,), use_local_output=False
        ),
        "sequence-out": lambda: PrepareModuleOutput(
            output_layouts=(seq,), desired_output_layouts=(rep,)
        ),
        "sequence-in-out": lambda: PrepareModuleInputOutput(
            input_layouts=(rep,),
            desired_input_layouts=(seq,),
            use_local_input=False,
            output_layouts=(seq,),
            desired_output_layouts=(rep,),
        ),
        "rowwise-sequence": lambda: RowwiseParallel(
            input_layouts=rep, output_layouts=seq, use_local_output=False
        ),
        "colwise-sequence": lambda: ColwiseParallel(input_layouts=seq, output_layouts=rep),
        "vocab": lambda: RowwiseParallel(input_layouts=rep),  # on an nn.Embedding
        "vocab-sequence": lambda: RowwiseParallel(
            input_layouts=rep, output_layouts=seq, use_local_output=False
        ),
        "colwise-loss": lambda: ColwiseParallel(use_local_output=False),
        "colwise-sequence-loss": lambda: ColwiseParallel(input_layouts=seq, use_local_output=False),
        # a q/k norm over head_dim: its input (batch, heads, length, head_dim) sharded on heads
        "heads-norm": lambda: SequenceParallel(sequence_dim=1, use_local_output=True),
    }
    return {name: styles[style]() for name, style in plan}


def tied_parameters(module: nn.Module) -> list[list[tuple[str, str]]]:
    """Each parameter ``module`` holds under several names (a tied weight), as its
    ``(module name, parameter name)`` places, the first the one ``named_parameters`` keeps."""
    places: dict[int, list[tuple[str, str]]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        owner, _, attr = name.rpartition(".")
        places.setdefault(id(param), []).append((owner, attr))
    return [found for found in places.values() if len(found) > 1]


def retie(module: nn.Module, ties: list[list[tuple[str, str]]]) -> None:
    """Restore the ties ``parallelize_module`` (and ``distribute_module``) break: each module's
    parameters are distributed separately, so a tied weight comes out as two DTensors. Every
    place gets the first place's parameter; the two must have one placement (a plan that shards
    the two uses differently cannot be tied: refused, as a set-up error)."""
    for (owner, attr), *others in ties:
        kept = getattr(module.get_submodule(owner), attr)
        for other, name in others:
            given = getattr(module.get_submodule(other), name)
            if getattr(given, "placements", None) != getattr(kept, "placements", None):
                raise ValueError(
                    f"{owner}.{attr} is tied to {other}.{name}, but the plan places them "
                    f"differently ({getattr(kept, 'placements', None)} and "
                    f"{getattr(given, 'placements', None)}): a tied weight has one placement"
                )
            setattr(module.get_submodule(other), name, kept)


def replicate_rest(module: nn.Module, mesh: DeviceMesh) -> None:
    """Every module the plan left alone, replicated over ``mesh`` as a DTensor module (its
    inputs taken as ``Replicate``, its outputs handed on as local tensors), so that every
    parameter is a DTensor on the ``tp`` axis: what ``clip_grad_norm_`` needs (it refuses plain
    tensors mixed with DTensors) and what FSDP2 composes with (one mesh for every parameter).
    torchtitan does the same with its own styles."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def inputs(_: nn.Module, args: tuple, _mesh: DeviceMesh) -> tuple:
        return tuple(
            DTensor.from_local(a, _mesh, [Replicate()], run_check=False)
            if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
            else a
            for a in args
        )

    def outputs(_: nn.Module, out: object, _mesh: DeviceMesh) -> object:
        return out.to_local() if isinstance(out, DTensor) else out

    for child in list(module.modules()):
        own = list(child.parameters(recurse=False))
        if own and not any(isinstance(p, DTensor) for p in own):
            # torch annotates both functions as returning None; their results are used
            distribute_module(child, mesh, input_fn=inputs, output_fn=outputs)  # type: ignore[arg-type]


def empty_micro_batch(scenario: Scenario, world_size: int) -> str | None:
    """Why a rank would run a forward on an empty micro-batch (None: none would): torch 2.13's
    DTensor never returns from reshaping some empty tensors (bench/dtensor_empty_reshape.py
    confirms it without ddpcheck), so such a scenario hangs instead of being judged."""
    if scenario.tensor_parallel is None:
        return None
    dp, _ = mesh_shape(scenario.tensor_parallel, world_size)
    for step in range(scenario.steps):
        size, micro = batch_size_of(scenario, step), micro_batches_of(scenario, step)
        if size < dp * micro:
            return (
                f"step {step}: {size} sample(s) over dp={dp} x {micro} micro-batch(es) leave a "
                "micro-batch empty, and torch's DTensor hangs reshaping some empty tensors "
                "(bench/dtensor_empty_reshape.py)"
            )
    return None


@dataclasses.dataclass(frozen=True)
class EmptyShard:
    """A module of a scenario's plan that leaves some ``tp`` rank none of its sharded features
    (``torch.chunk``'s split: 6 over 4 is 2, 2, 2, nothing), or that is no ``nn.Linear``
    (``features`` None)."""

    name: str
    style: str
    features: int | None
    tp: int

    @property
    def dimension(self) -> str:
        """``input`` for a row-wise style, ``output`` for a column-wise one, ``vocabulary`` for
        an embedding's rows."""
        if self.style in VOCABULARY_STYLES:
            return "vocabulary"
        return "input" if self.style.startswith("rowwise") else "output"

    @property
    def empty(self) -> int:
        """The ranks left none."""
        return 0 if self.features is None else self.tp - holders(self.features, self.tp)


def first_empty_shard(
    scenario: Scenario, world_size: int, rowwise_only: bool = False
) -> EmptyShard | None:
    """The first module of ``scenario``'s plan (its row-wise ones alone with ``rowwise_only``)
    that some ``tp`` rank would hold none of -- its output features for a column-wise style, its
    input features for a row-wise one -- or that is no ``nn.Linear``; None when there is none,
    at ``tp=1``, or when the model or the plan does not build (the example itself reports that).
    The model is built on the meta device: no memory, no random numbers drawn."""
    tensor_parallel = scenario.tensor_parallel
    if tensor_parallel is None or mesh_problem(tensor_parallel, world_size) is not None:
        return None
    _, tp = mesh_shape(tensor_parallel, world_size)
    plan = [
        (n, s)
        for n, s in tensor_parallel.plan
        if (s.startswith("rowwise") or s in VOCABULARY_STYLES or not rowwise_only)
        and s not in REGION_STYLES
    ]
    if tp == 1 or not plan:
        return None
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = scenario.model()
        layers = [(name, style, model.get_submodule(name)) for name, style in plan]
    except Exception:  # the example itself reports a model or a plan that does not build
        return None
    for name, style, layer in layers:
        if isinstance(layer, nn.Embedding) and style in VOCABULARY_STYLES:
            if holders(layer.num_embeddings, tp) < tp:  # its rows: the vocabulary
                return EmptyShard(name, style, layer.num_embeddings, tp)
            continue
        if not isinstance(layer, nn.Linear):
            return EmptyShard(name, style, None, tp)
        found = EmptyShard(name, style, 0, tp)
        features = layer.in_features if found.dimension == "input" else layer.out_features
        if holders(features, tp) < tp:
            return dataclasses.replace(found, features=features)
    return None


def empty_shard(scenario: Scenario, world_size: int) -> str | None:
    """Why FSDP2 over ``dp`` would hang gathering a row-wise layer (None: it would not): a
    row-wise style leaving some ``tp`` rank none of the layer's input features gives that rank a
    ``(out, 0)`` weight shard, which torch 2.13's ``fully_shard`` turns into ``(0, 0)``; its
    ``full_tensor()`` then all-gathers nothing and returns while the other ranks wait for it
    (bench/fsdp2_empty_tp_shard.py confirms it without ddpcheck). ``torch_tp`` trains such
    plans right (:func:`first_empty_shard` finds the layer)."""
    found = first_empty_shard(scenario, world_size, rowwise_only=True)
    if found is None or found.features is None:  # a module no linear: torch's to refuse
        return None
    return (
        f"{found.name}: row-wise over tp={found.tp} leaves {found.empty} rank(s) "
        f"none of its {found.features} input feature(s), and torch's FSDP2 loses such an "
        "empty shard's shape, so gathering it hangs (bench/fsdp2_empty_tp_shard.py)"
    )


def empty_sequence(scenario: Scenario, world_size: int) -> str | None:
    """Why a sequence-parallel plan would leave a ``tp`` rank no token (None: it would not): an
    empty shard of the sequence, which no plan anybody writes holds, and where torch 2.13's
    DTensor may never return (bench/dtensor_empty_reshape.py). The drawn plans never do."""
    tensor_parallel = scenario.tensor_parallel
    if tensor_parallel is None or mesh_problem(tensor_parallel, world_size) is not None:
        return None
    _, tp = mesh_shape(tensor_parallel, world_size)
    if holders(SEQUENCE, tp) < tp and any(s in SEQUENCE_STYLES for _, s in tensor_parallel.plan):
        return (
            f"a sequence of {SEQUENCE} tokens over tp={tp} leaves a rank none, and torch's "
            "DTensor may hang on an empty shard (bench/dtensor_empty_reshape.py)"
        )
    return None


#: The oldest torch the tensor-parallel targets were run on: the only one so far (their public
#: ``torch.distributed.tensor`` API is 2.5's, but a floor is where the glue was seen to work;
#: bench/torch_matrix.py has no tensor-parallel row yet). Older is refused, never misjudged.
TP_FLOOR = "2.13"

#: Why a tensor-parallel target declines ``autocast`` (every one of them, until it is calibrated).
AUTOCAST_ON_A_MESH = (
    "a low-precision forward on a mesh has no calibrated tolerance yet (the sharded matmuls "
    "round where the one-process reference does not): declined, never misjudged"
)

_DECLINED: Mapping[str, str] = {
    "checkpoint": "tensor-parallel parameters are DTensor shards: they resume through "
    "torch.distributed.checkpoint, not the default hooks' rank-0 state_dict",
    "rank-orders": "the initial broadcast pairs parameters by registration order, which must "
    "be the same on every rank",
    "autocast": AUTOCAST_ON_A_MESH,
}


@dataclasses.dataclass(frozen=True)
class PlanTarget(Target):
    """A target that applies the scenario's plan (``Scenario.tensor_parallel``): it opts in to
    tensor-parallel scenarios, checks those only, and reads the plan in :meth:`configure`."""

    parallelizes = True
    #: the scenario's plan, set by :meth:`configure` (empty: nothing sharded)
    plan: tuple[tuple[str, str], ...] = ()
    requires = (("torch", TP_FLOOR),)  # the only release tried so far

    def configure(self, scenario: Scenario) -> Target:
        tensor_parallel = scenario.tensor_parallel
        if tensor_parallel is None or tensor_parallel.plan == self.plan:
            return self
        return dataclasses.replace(self, plan=tensor_parallel.plan)

    def supports(self, scenario: Scenario) -> str | None:
        if scenario.tensor_parallel is None:
            return f"{type(self).__name__} checks tensor-parallel scenarios (a plan and a mesh)"
        return no_loss_parallel(scenario)

    def micro_batch(
        self, model: nn.Module, optimizer: OptimizerLike, index: int, count: int
    ) -> AbstractContextManager[object]:
        """:meth:`Target.micro_batch`'s context, inside :meth:`loss_context` when the plan leaves
        the logits sharded over the vocabulary: forward, loss and backward all run in it."""
        outer = super().micro_batch(model, optimizer, index, count)
        if not any(style in LOSS_STYLES for _, style in self.plan):
            return outer
        stack = contextlib.ExitStack()
        stack.enter_context(outer)
        stack.enter_context(self.loss_context())
        return stack

    def loss_context(self) -> AbstractContextManager[object]:
        """Where the cross-entropy of vocabulary-sharded logits is computed and back-propagated:
        torch's ``loss_parallel()`` (``Shard(-1)`` logits, ``reduction`` sum here)."""
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()


def no_loss_parallel(scenario: Scenario) -> str | None:
    """Why torch's ``loss_parallel()`` cannot compute the scenario's loss on the logits its plan
    leaves sharded over the vocabulary (None: it can, or no head leaves them sharded)."""
    plan = scenario.tensor_parallel.plan if scenario.tensor_parallel is not None else ()
    if scenario.loss in LOSS_PARALLEL or not any(style in LOSS_STYLES for _, style in plan):
        return None
    if scenario.loss == "label_smoothing":
        return (
            "loss='label_smoothing' on logits sharded over the vocabulary: torch's "
            'loss_parallel() says of label_smoothing "Currently not supported"'
        )
    return (
        f"loss={scenario.loss!r} on logits sharded over the vocabulary: torch's loss_parallel() "
        "supports the cross-entropy only, and its log_softmax backward is nll_loss's alone (an "
        "entropy or KL term gets a wrong gradient: bench/loss_parallel_entropy.py)"
    )


@dataclasses.dataclass(frozen=True)
class TorchTPTarget(PlanTarget):
    """torch's tensor parallelism (``parallelize_module`` with the scenario's plan) over every
    rank of the world: a ``tp``-way mesh, ``dp = 1`` (data parallelism over ``dp`` is
    ``torch_2d``'s). Gradients of the layers the plan shards are DTensor shards, those of the
    layers it leaves alone whole on every rank; nothing is reduced after backward, since every
    rank of a tensor-parallel group sees the same samples."""

    declined_features: ClassVar[Mapping[str, str]] = _DECLINED

    def supports_at(self, scenario: Scenario, world_size: int) -> str | None:
        problem = mesh_problem(scenario.tensor_parallel, world_size)
        if problem is not None:
            return problem
        dp, _ = mesh_shape(scenario.tensor_parallel, world_size)
        if dp > 1:  # first: the reason that holds whatever the batch (a closing line's tally)
            return (
                f"dp={dp}: {type(self).__name__} shards over tp only (torch_2d adds FSDP2 over dp)"
            )
        return empty_micro_batch(scenario, world_size) or empty_sequence(scenario, world_size)

    def parallelize(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor.parallel import parallelize_module

        broadcast_from(module, 0)
        ties = tied_parameters(module)
        parallelize_module(module, mesh["tp"], self.plan_styles())
        replicate_rest(module, mesh["tp"])
        self.retie(module, ties)
        return module

    def plan_styles(self) -> dict[str, ParallelStyle]:
        """The plan as torch's ``ParallelStyle`` objects (:func:`torch_plan`)."""
        return torch_plan(self.plan)

    def retie(self, module: nn.Module, ties: list[list[tuple[str, str]]]) -> None:
        """The model's tied weights tied again after the plan (:func:`retie`)."""
        retie(module, ties)


@dataclasses.dataclass(frozen=True)
class Torch2DTarget(TorchTPTarget):
    """FSDP2 over ``dp`` x torch's tensor parallelism over ``tp``: the plan applied first, then
    ``fully_shard(module, mesh=mesh["dp"])`` per layer and at the root, as torchtitan composes
    them; accumulation under ``set_requires_gradient_sync(False)``."""

    declined_features: ClassVar[Mapping[str, str]] = {
        **_DECLINED,
        "unused-on-some-ranks": "FSDP2 all-gathers a layer in its forward: a layer some ranks "
        "skip leaves the collectives unpaired",
    }

    def supports_at(self, scenario: Scenario, world_size: int) -> str | None:
        return (
            mesh_problem(scenario.tensor_parallel, world_size)
            or empty_micro_batch(scenario, world_size)
            or empty_sequence(scenario, world_size)
            or empty_shard(scenario, world_size)
        )

    def requirements(self, device: str) -> tuple[tuple[str, str], ...]:
        """The public DTensor API's release, or FSDP2's on ``device`` where that is later (the
        CPU's: ``ddpcheck.targets.fsdp.CPU_FLOOR``)."""
        fsdp = CUDA_FLOOR if device.startswith("cuda") else CPU_FLOOR
        return (("torch", max(TP_FLOOR, fsdp, key=lambda r: tuple(map(int, r.split("."))))),)

    def parallelize(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        module = super().parallelize(module, mesh)
        object.__setattr__(self, "_dp_mesh", mesh["dp"])  # the configured copy's, for wrap
        return module

    def wrap(self, module: nn.Module) -> nn.Module:
        return shard_leaves(module, True, mesh=vars(self)["_dp_mesh"])

    def no_sync(self, model: nn.Module) -> AbstractContextManager[object]:
        return gradient_sync_off(model)
