"""What one equivalence example trains, and the rules that make it comparable.

A :class:`Scenario` is plain, picklable data: a model factory, a data function, an optimizer with
its keyword arguments, optional parameter groups and learning-rate decay, the global batch size,
steps, accumulation, dtype, seed, optional gradient clipping, the loss and its precision policy
(``ddpcheck._language.objective`` computes the loss, the same for every party). Its ``repr`` is
Python code, so
a failing example prints as a line that ``ddpcheck._runs.replay.from_repr`` turns back into
the same scenario (replay lines use this).

The batch rule (documented in docs/scenarios.md): the global batch of B samples is split into W
contiguous shards with ``torch.tensor_split`` -- the first ``B % W`` ranks get one sample more, a
rank may get none when B < W -- and each shard into ``accumulation`` micro-batches the same way.
Every sample is used exactly once. A rank back-propagates ``sum of its samples' losses * W / B``
(``* W`` only for ``reduction="sum"``), so that the *average* over ranks that data-parallel code
computes weighs every sample exactly as the full-batch reference does, whatever the split. Under
``loss="token_cross_entropy"`` the terms are non-padding tokens, not samples: the scale is
``W / T``, T the non-padding tokens of the global batch.
This rule is the default batch plan (``ddpcheck.batches.contiguous``); a target may own the split
instead (``Target.shard_batch``), and the oracle then checks that its plan weighs samples so.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
from collections.abc import Callable

import torch
from torch import nn

from ddpcheck._base.errors import InvalidArgument
from ddpcheck._base.options import named_fields
from ddpcheck._base.scripts import MAIN_NAMES, public_module_name
from ddpcheck._language import zoo
from ddpcheck._language.epochs import Epochs, step_count, step_samples, window
from ddpcheck._language.objective import LOSSES, LOW_PRECISION, per_sample_loss
from ddpcheck._language.pipeline_parallel import (
    PipelineParallel,
    pipeline_problem,
    pipeline_shape,
)
from ddpcheck._language.tensor_parallel import (
    TensorParallel,
    data_coordinate,
    mesh_problem,
    mesh_shape,
)

__all__ = [
    "Epochs",
    "PipelineParallel",
    "Scenario",
    "TensorParallel",
    "batch_size_of",
    "build_model",
    "data_parallel_degree",
    "data_rank",
    "mesh_of",
    "dataset",
    "evaluation_set",
    "global_batch",
    "local_micro_batches",
    "micro_batches_of",
    "per_sample_loss",
    "stage_tp",
]

_DTYPES = {"float64": torch.float64, "float32": torch.float32}


@named_fields
@dataclasses.dataclass(frozen=True)
class Scenario:
    """One training run to compare: every rank and the reference build it identically."""

    model: Callable[[], nn.Module] = zoo.MLP
    data: Callable[[int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = zoo.regression_data
    optimizer: type = torch.optim.SGD
    optimizer_kwargs: dict = dataclasses.field(default_factory=lambda: {"lr": 0.1})
    param_groups: Callable[[nn.Module], list] | None = None
    lr_decay: float | None = None  # ExponentialLR gamma, stepped after every optimizer step
    global_batch: int = 8
    steps: int = 2
    accumulation: int = 1
    dtype: str = "float64"
    reduction: str = "mean"  # the global objective: mean or sum of the loss terms (see `loss`)
    seed: int = 0
    bucket_size_mb: float | None = None  # a hint for targets that bucket (None: their default)
    set_to_none: bool = True  # zero_grad(set_to_none=...)
    rank_seeds: bool = True  # initialise each rank differently: rank 0's weights must win
    # clip the synchronised gradients' global norm to this before every step (None: no clipping)
    max_grad_norm: float | None = None
    grad_norm_type: float = 2.0  # the norm clipped (math.inf: the largest |gradient|)
    # every rank registers parameters and buffers in its own order (same names, shapes, values)
    rank_orders: bool = False
    # save a checkpoint after this step (0-based) and resume from it in a fresh run: the target's
    # save_checkpoint/load_checkpoint hooks (None: train uninterrupted)
    checkpoint_after: int | None = None
    resume_world_size: int | None = None  # the resumed run's world size (None: the same W)
    # the terms of the objective (ddpcheck._language.objective.LOSSES): "squared_error" per
    # sample, or per non-padding token "token_cross_entropy" and the other token losses
    # (objective.TOKEN_LOSSES: model logits (B, L, V), data tokens)
    loss: str = "squared_error"
    # the forward under torch.autocast(device, dtype=autocast): torch.bfloat16 or torch.float16
    autocast: torch.dtype | None = None
    # float32 master weights, forward and backward on copies in param_dtype, gradients
    # accumulated and reduced in float32 (FSDP2's MixedPrecisionPolicy): the target casts
    param_dtype: torch.dtype | None = None
    # a dataset of N samples passed over in epochs (``ddpcheck._language.epochs``): steps of
    # ``global_batch`` samples, the last of an epoch short when it does not divide N; ``steps``
    # is then derived from it (None: a fresh full global batch every step)
    epochs: Epochs | None = None
    # trained on a (dp, tp) device mesh with a tensor-parallel plan
    # (``ddpcheck._language.tensor_parallel``; None: data parallelism over the whole world)
    tensor_parallel: TensorParallel | None = None
    # trained on a (dp, pp) device mesh, the model cut into pipeline stages
    # (``ddpcheck._language.pipeline_parallel``; None: no pipeline)
    pipeline: PipelineParallel | None = None

    def __post_init__(self) -> None:
        _check_int("global_batch", self.global_batch, 1)
        _check_int("steps", self.steps, 1)
        _check_int("accumulation", self.accumulation, 1)
        if self.epochs is not None:
            _derive_steps(self)
        _check_int("seed", self.seed, 0)
        if self.dtype not in _DTYPES:
            raise InvalidArgument(f"dtype={self.dtype!r} must be one of {sorted(_DTYPES)}")
        if self.reduction not in ("mean", "sum"):
            raise InvalidArgument(f"reduction={self.reduction!r} must be 'mean' or 'sum'")
        if self.loss not in LOSSES:
            raise InvalidArgument(f"loss={self.loss!r} must be one of {sorted(LOSSES)}")
        _check_precision(self.autocast, self.param_dtype, self.dtype)
        if not callable(self.model):
            raise InvalidArgument(
                f"model={self.model!r} must be a callable returning an "
                "nn.Module, such as a module class"
            )
        if not (
            isinstance(self.optimizer, type) and issubclass(self.optimizer, torch.optim.Optimizer)
        ):
            raise InvalidArgument(
                f"optimizer={self.optimizer!r} must be a torch.optim.Optimizer "
                "subclass, such as torch.optim.SGD"
            )
        if not isinstance(self.optimizer_kwargs, dict):
            raise InvalidArgument(f"optimizer_kwargs={self.optimizer_kwargs!r} must be a dict")
        if self.lr_decay is not None and not 0 < self.lr_decay <= 1:
            raise InvalidArgument(f"lr_decay={self.lr_decay!r} must be in (0, 1]")
        if self.bucket_size_mb is not None and not self.bucket_size_mb > 0:
            raise InvalidArgument(f"bucket_size_mb={self.bucket_size_mb!r} must be positive")
        _check_clipping(self.max_grad_norm, self.grad_norm_type)
        _check_checkpoint(self.checkpoint_after, self.resume_world_size, self.steps)
        _check_meshes(self.tensor_parallel, self.pipeline)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def __repr__(self) -> str:
        fields = [
            f"{f.name}={_code(getattr(self, f.name))}"
            for f in dataclasses.fields(self)
            if f.name == "model" or not _is_default(self, f)
        ]
        return f"ddpcheck.Scenario({', '.join(fields)})"


def _check_meshes(tensor_parallel: object, pipeline: object) -> None:
    if tensor_parallel is not None and not isinstance(tensor_parallel, TensorParallel):
        raise InvalidArgument(
            f"tensor_parallel={tensor_parallel!r} must be None or a "
            "ddpcheck.scenario.TensorParallel(plan, tp)"
        )
    if pipeline is not None and not isinstance(pipeline, PipelineParallel):
        raise InvalidArgument(
            f"pipeline={pipeline!r} must be None or a "
            "ddpcheck.scenario.PipelineParallel(schedule, boundaries, microbatches, pp)"
        )
    if pipeline is not None and tensor_parallel is not None and tensor_parallel.tp is None:
        raise InvalidArgument(
            "a pipeline of tensor-parallel stages names its degree: TensorParallel(plan, tp=N)"
        )


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgument(f"{name}={value!r} must be an integer >= {minimum}")


#: ``Scenario.steps``'s default: left as it is, a scenario with epochs derives its steps.
_DEFAULT_STEPS = 2


def _derive_steps(scenario: Scenario) -> None:
    """``steps`` from the epoch structure (``ddpcheck._language.epochs``), refusing a given
    count that disagrees and a global batch the accumulation does not divide."""
    epochs = scenario.epochs
    if not isinstance(epochs, Epochs):
        raise InvalidArgument(
            f"epochs={epochs!r} must be None or a ddpcheck.scenario.Epochs(samples, epochs)"
        )
    if scenario.global_batch % scenario.accumulation:
        raise InvalidArgument(
            f"global_batch={scenario.global_batch} must be a multiple of accumulation="
            f"{scenario.accumulation} in a scenario with epochs: a window holds accumulation "
            "micro-batches of global_batch / accumulation samples across the ranks"
        )
    steps = step_count(epochs, scenario.global_batch)
    if scenario.steps not in (steps, _DEFAULT_STEPS):
        raise InvalidArgument(
            f"steps={scenario.steps} disagrees with the epochs: {epochs.epochs} epoch(s) of "
            f"{epochs.samples} samples in steps of global_batch={scenario.global_batch} are "
            f"{steps} step(s); leave steps out"
        )
    object.__setattr__(scenario, "steps", steps)


def _check_clipping(max_norm: float | None, norm_type: float) -> None:
    def positive(value: object) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0

    if max_norm is not None and not (positive(max_norm) and math.isfinite(max_norm)):
        raise InvalidArgument(
            f"max_grad_norm={max_norm!r} must be None or a positive finite number"
        )
    if not positive(norm_type):
        raise InvalidArgument(
            f"grad_norm_type={norm_type!r} must be a positive number, such as 2.0 or math.inf"
        )
    if max_norm is None and norm_type != 2.0:  # a norm that is never clipped is a mistake
        raise InvalidArgument(
            f"grad_norm_type={norm_type!r} needs max_grad_norm (no clipping without it)"
        )


def _check_precision(
    autocast: torch.dtype | None, param_dtype: torch.dtype | None, dtype: str
) -> None:
    for name, value in (("autocast", autocast), ("param_dtype", param_dtype)):
        if value is None:
            continue
        if value not in LOW_PRECISION:
            raise InvalidArgument(f"{name}={value!r} must be None, torch.bfloat16 or torch.float16")
        if dtype != "float32":  # autocast leaves float64 alone; mixed precision keeps fp32 masters
            raise InvalidArgument(
                f"{name}={value} needs dtype='float32' (the master weights of "
                f"mixed precision), not dtype={dtype!r}"
            )


def _check_checkpoint(after: int | None, resume_world_size: int | None, steps: int) -> None:
    if after is not None:
        _check_int("checkpoint_after", after, 0)
        if after >= steps - 1:  # a checkpoint after the last step resumes nothing
            raise InvalidArgument(
                f"checkpoint_after={after!r} must be below steps - 1 = "
                f"{steps - 1}: the resumed run must train at least one step"
            )
    if resume_world_size is not None:
        _check_int("resume_world_size", resume_world_size, 1)
        if after is None:
            raise InvalidArgument(
                f"resume_world_size={resume_world_size!r} needs "
                "checkpoint_after (there is no resume without a checkpoint)"
            )


def _code(value: object) -> str:
    """Python source that evaluates to ``value`` (classes and functions by their import path)."""
    if isinstance(value, type) or (callable(value) and hasattr(value, "__qualname__")):
        return import_path(value)
    if dataclasses.is_dataclass(value):
        args = ", ".join(
            f"{f.name}={_code(getattr(value, f.name))}"
            for f in dataclasses.fields(value)
            if not _is_default(value, f)
        )
        return f"{import_path(type(value))}({args})"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_code(v) for v in value)
        if isinstance(value, list):
            return f"[{inner}]"
        return f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_code(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float) and math.isinf(value):  # repr() gives `inf`, which is not code
        return 'float("inf")' if value > 0 else '-float("inf")'  # needs no import to evaluate
    return repr(value)


def _is_default(obj: object, field: dataclasses.Field) -> bool:
    """Whether ``obj``'s value of ``field`` may be left out of its code: it equals the field's
    default in its class *and in every dataclass above it* -- a subclass that changes a
    default (``stage: int = 1`` under a framework's 2) still names the value, or a replay line
    would read as another configuration."""
    value = getattr(obj, field.name)
    for cls in type(obj).__mro__:
        declared = getattr(cls, "__dataclass_fields__", {}).get(field.name)
        if declared is None:
            continue
        if declared.default is not dataclasses.MISSING:
            default = declared.default
        elif declared.default_factory is not dataclasses.MISSING:
            default = declared.default_factory()
        else:
            return False
        if value != default:
            return False
    return True


def _public_name(module: str) -> str | None:
    """The public module that hands on a floor's module (``ddpcheck._language.zoo`` ->
    ``ddpcheck.zoo``), which replay lines name: the floors may move, the public names stay."""
    parts = module.split(".")
    if len(parts) != 3 or parts[0] != "ddpcheck" or not parts[1].startswith("_"):
        return None
    public = f"ddpcheck.{parts[2]}"
    return public if importlib.util.find_spec(public) is not None else None


def import_path(obj: type | Callable[..., object]) -> str:
    """The shortest ``package.name`` that reaches ``obj`` (torch.optim.Adam, not
    torch.optim.adam.Adam: submodules are not always attributes of their package); what the
    script being run defines is named by the script's module (``check_my_ddp.my_data``), which is
    what another process imports (``ddpcheck._base.scripts``)."""
    if obj.__module__ in MAIN_NAMES:  # the script being run, as other processes import it
        return f"{public_module_name(obj.__module__)}.{obj.__qualname__}"
    parts, qualname = obj.__module__.split("."), obj.__qualname__
    public = _public_name(obj.__module__)
    if public is not None and getattr(importlib.import_module(public), qualname, None) is obj:
        return f"{public}.{qualname}"
    for i in range(1, len(parts) + 1):
        module = importlib.import_module(".".join(parts[:i]))
        if getattr(module, qualname, None) is obj:
            return f"{module.__name__}.{qualname}"
    return f"{obj.__module__}.{qualname}"


# ---------------------------------------------------------------------------------------------
# Building: the same code runs in every rank and in the reference.


def build_model(scenario: Scenario, seed: int) -> nn.Module:
    """The scenario's model, initialised from ``seed``, in the scenario's dtype (a model with a
    ``restore_dtypes()`` method keeps the exceptions it makes after the cast)."""
    # The CPU generator only: torch.manual_seed also queues seeds for CUDA, XPU and MTIA, and
    # formats a stack trace for each (about 1 ms, in every rank of every example).
    torch.random.default_generator.manual_seed(seed)
    model = scenario.model()
    if not isinstance(model, nn.Module):
        raise InvalidArgument(
            f"model={_code(scenario.model)} returned {type(model).__name__}, not a torch.nn.Module"
        )
    model = model.to(scenario.torch_dtype)
    restore = getattr(model, "restore_dtypes", None)
    if callable(restore):  # a model that mixes dtypes on purpose sets its exceptions back
        restore()
    return model


def make_param_groups(scenario: Scenario, model: nn.Module) -> list:
    if scenario.param_groups is None:
        return list(model.parameters())
    return scenario.param_groups(model)


def global_batch(scenario: Scenario, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of one step: different data every step, or with epochs the samples of the
    dataset the step consumes (``ddpcheck._language.epochs``)."""
    if scenario.epochs is None:
        return scenario.data(
            scenario.seed * 1_000 + step, scenario.global_batch, scenario.torch_dtype
        )
    x, y = dataset(scenario)
    samples = step_samples(scenario.epochs, scenario.global_batch, step)
    return x[samples.start : samples.stop], y[samples.start : samples.stop]


def dataset(scenario: Scenario) -> tuple[torch.Tensor, torch.Tensor]:
    """The dataset of a scenario with epochs: ``samples`` samples drawn once from its data."""
    if scenario.epochs is None:
        raise ValueError("dataset() needs a scenario with epochs")
    return scenario.data(scenario.seed * 1_000, scenario.epochs.samples, scenario.torch_dtype)


#: The evaluation set's data seed, past the dataset's (``seed * 1000``): no step draws it.
_EVALUATION_SEED = 999


def evaluation_set(scenario: Scenario) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The evaluation set of a scenario with epochs that evaluates (``Epochs.evaluation``
    samples, drawn once from its data, apart from the dataset); None without one."""
    if scenario.epochs is None or scenario.epochs.evaluation is None:
        return None
    seed = scenario.seed * 1_000 + _EVALUATION_SEED
    return scenario.data(seed, scenario.epochs.evaluation, scenario.torch_dtype)


def batch_size_of(scenario: Scenario, step: int) -> int:
    """The samples of ``step``'s global batch: ``global_batch``, or fewer in an epoch's last."""
    if scenario.epochs is None:
        return scenario.global_batch
    return len(step_samples(scenario.epochs, scenario.global_batch, step))


def micro_batches_of(scenario: Scenario, step: int) -> int:
    """The micro-batches of ``step``: the accumulation, or fewer in an epoch's short last step."""
    if scenario.epochs is None:
        return scenario.accumulation
    return window(scenario.epochs, scenario.global_batch, scenario.accumulation, step)


def local_micro_batches(
    scenario: Scenario, step: int, rank: int, world_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of one step, each as ``(x, y)`` (possibly empty); under tensor
    parallelism, those of the rank's ``dp`` coordinate (the data follows the mesh)."""
    rank, world_size = data_rank(scenario, rank, world_size)
    x, y = global_batch(scenario, step)
    xs, ys = torch.tensor_split(x, world_size)[rank], torch.tensor_split(y, world_size)[rank]
    return list(
        zip(
            torch.tensor_split(xs, micro_batches_of(scenario, step)),
            torch.tensor_split(ys, micro_batches_of(scenario, step)),
        )
    )


def data_parallel_degree(scenario: Scenario, world_size: int) -> int:
    """The ranks the global batch is split among: W, or the mesh's ``dp`` under tensor or
    pipeline parallelism (raises ``InvalidArgument`` for a world that cannot hold the mesh)."""
    if scenario.pipeline is not None:
        return pipeline_shape(scenario.pipeline, world_size, stage_tp(scenario))[0]
    return mesh_shape(scenario.tensor_parallel, world_size)[0]


def data_rank(scenario: Scenario, rank: int, world_size: int) -> tuple[int, int]:
    """``(rank, world size)`` as the batch rule sees them: the rank's ``dp`` coordinate and
    ``dp`` (the data follows the mesh: every rank of a tensor-parallel group or of a pipeline
    gets the same samples)."""
    if scenario.pipeline is not None:
        tp = stage_tp(scenario)
        dp, pp = pipeline_shape(scenario.pipeline, world_size, tp)
        return rank // (pp * tp), dp
    return data_coordinate(scenario.tensor_parallel, rank, world_size)


def mesh_of(scenario: Scenario, world_size: int) -> tuple[int, int, int] | None:
    """The ``(dp, pp, tp)`` mesh ``scenario`` runs on at ``world_size`` (``--mesh`` names
    these), or None where that world cannot hold its mesh (the target declines it, saying why)."""
    if scenario.pipeline is not None:
        tp = stage_tp(scenario)
        if pipeline_problem(scenario.pipeline, world_size, tp=tp) is not None:
            return None
        dp, pp = pipeline_shape(scenario.pipeline, world_size, tp)
        return dp, pp, tp
    if mesh_problem(scenario.tensor_parallel, world_size) is not None:
        return None
    dp, tp = mesh_shape(scenario.tensor_parallel, world_size)
    return dp, 1, tp


def stage_tp(scenario: Scenario) -> int:
    """The tensor-parallel degree of a pipeline's stages (1: none; a pipeline's ``tp`` is named,
    ``_check_meshes``)."""
    parallel = scenario.tensor_parallel
    return 1 if parallel is None or parallel.tp is None else parallel.tp
