"""torch's pipeline parallelism (``torch_pp``): ``torch.distributed.pipelining`` over ``pp``,
FSDP2 over ``dp``.

The scenario says where the model is cut and how (``Scenario.pipeline``,
``ddpcheck._language.pipeline_parallel``); this target does what a user of
``torch.distributed.pipelining`` writes, as torchtitan composes it: rank 0's weights broadcast,
each of this rank's stages made of the modules it holds (a module of its own sharing the full
model's submodules, so its parameters keep the full model's names), ``fully_shard`` over
``mesh["dp"]`` when ``dp > 1``, a ``PipelineStage`` per stage on ``mesh["pp"]``, the schedule
built once, and per optimizer step one ``schedule.step`` per micro-batch of the step.

How the loss is weighed, and why not torch's default: ``scale_grads=True`` divides each stage's
whole ``.grad`` by ``n_microbatches`` after a ``step``, so two ``step`` calls accumulated into one
optimizer step give ``g1 / n + g2`` (torchtitan#1733; ``bench/pipeline_cpu.py`` measures it);
torchtitan's fix is what this target does: ``scale_grads=False`` and a ``loss_fn`` returning each
piece's summed terms times its micro-batch's scale (the harness's batch plan), so any
accumulation, and any split of the batch over ``dp``, weighs every sample as the one-process
loop does. Clipping computes the norm of the whole model: each stage's norm (over ``dp`` for
FSDP2's DTensors) combined over ``pp``, as torchtitan's ``clip_grad_norm_`` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from ddpcheck._base.errors import InvalidArgument
from ddpcheck._language.objective import summed
from ddpcheck._language.pipeline_parallel import (
    SCHEDULES,
    module_order,
    pipeline_problem,
    pipeline_shape,
    stage_modules,
    stages_of_rank,
)
from ddpcheck._language.scenario import Scenario, batch_size_of, micro_batches_of, stage_tp
from ddpcheck._language.training import FitRun
from ddpcheck.targets.fsdp import CPU_FLOOR, CUDA_FLOOR, broadcast_from, fsdp2
from ddpcheck.targets.option_space import options
from ddpcheck.targets.protocol import Target

if TYPE_CHECKING:  # torch.distributed.device_mesh loads when a pipeline target runs
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import PipelineStage

    from ddpcheck.targets.protocol import ConfigSpace

__all__ = ["PP_FLOOR", "Stage", "TorchPPTarget", "uneven_pieces"]

#: The oldest torch the pipeline target was run on: the only one so far (every schedule it draws
#: exists in 2.8; a floor is where the glue was seen to work). Older is refused, never misjudged.
PP_FLOOR = "2.13"


class Stage(nn.Module):
    """The modules of one stage, in the model's order, the full model's own submodules (shared,
    not copied: their parameters keep the full model's names -- ``inp``, ``blocks.<i>``,
    ``head`` -- and the harness records them where they live)."""

    def __init__(self, model: nn.Module, names: list[str]):
        super().__init__()
        self.order = list(names)
        blocks = {n.split(".", 1)[1]: model.get_submodule(n) for n in names if "." in n}
        if "inp" in names:
            self.inp = model.get_submodule("inp")
        if blocks:
            self.blocks = nn.ModuleDict(blocks)
        if "head" in names:
            self.head = model.get_submodule("head")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.order:
            x = self.get_submodule(name)(x)
        return x


def uneven_pieces(scenario: Scenario, world_size: int) -> str | None:
    """Why some rank's micro-batch cannot be cut into ``microbatches`` equal pieces (None: every
    one can): torch sizes its receive buffers by the first piece and refuses unequal ones
    (pytorch#126600, "we do not support this"; ``bench/pipeline_cpu.py``)."""
    assert scenario.pipeline is not None
    dp, _ = pipeline_shape(scenario.pipeline, world_size, stage_tp(scenario))
    pieces = scenario.pipeline.microbatches
    sizes = set()
    for step in range(scenario.steps):
        size, micro = batch_size_of(scenario, step), micro_batches_of(scenario, step)
        for share in torch.tensor_split(torch.arange(size), dp):
            for part in torch.tensor_split(share, micro):
                if len(part) == 0 or len(part) % pieces:
                    return (
                        f"step {step}: a micro-batch of {len(part)} sample(s) is no "
                        f"{pieces} equal pieces, and torch's pipelining supports only equal "
                        "ones (pytorch#126600)"
                    )
                sizes.add(len(part))
    if len(sizes) > 1:
        return (
            f"micro-batches of {sorted(sizes)} samples: a schedule's shapes are fixed when it is "
            "built (torch's pipelining), and this target builds one per run"
        )
    return None


#: What may make a pipeline's stages data-parallel over dp (``TorchPPTarget.dp_wrapper``).
DP_WRAPPERS = ("fsdp2", "ddp")

_DECLINED: dict[str, str] = {
    "uneven-batches": "a micro-batch the schedule cannot cut into equal pieces is refused by "
    "torch (pytorch#126600); the draws keep every piece equal",
    "rank-orders": "the initial broadcast pairs parameters by registration order, which must "
    "be the same on every rank",
    "checkpoint": "a pipeline's stages resume through torch.distributed.checkpoint, not the "
    "default hooks' rank-0 state_dict",
    "param-groups": "the optimizer is built over this rank's stages: param groups of the whole "
    "model are not split per stage yet",
    "tokens": "a token loss on torch_pp's pipelines is not measured yet; torch_nd checks the "
    "ones loss_parallel() computes (each piece weighed by its micro-batch's dp / T)",
    "epochs": "the harness's steps are fed to the schedule; a DataLoader's epochs are not",
    "autocast": "a low-precision forward on a pipeline has no calibrated tolerance yet: "
    "declined, never misjudged",
}


@dataclasses.dataclass(frozen=True)
class TorchPPTarget(Target):
    """``torch.distributed.pipelining`` with the scenario's schedule and stages over ``pp``,
    FSDP2 over ``dp`` (see the module docstring)."""

    #: what makes each stage data-parallel over ``dp``: ``"fsdp2"`` (``fully_shard``, as
    #: torchtitan composes it) or ``"ddp"`` (torch's DistributedDataParallel per stage; the
    #: stages get shape hints, which torch DDP needs: ``bench/pipeline_cpu.py``)
    dp_wrapper: str = "fsdp2"

    pipelines = True
    declined_features: ClassVar[Mapping[str, str]] = _DECLINED

    def __post_init__(self) -> None:
        if self.dp_wrapper not in DP_WRAPPERS:
            raise InvalidArgument(
                f"TorchPPTarget(dp_wrapper={self.dp_wrapper!r}) must be one of "
                f"{', '.join(map(repr, DP_WRAPPERS))}"
            )

    def config_space(self) -> ConfigSpace:
        """``dp_wrapper``: FSDP2 (the default) or torch DDP over each stage."""
        return options(fields={"dp_wrapper": ("ddp",)})

    #: the schedule computes each piece's loss on the last stage, out of the harness's sight:
    #: the loss checked is the one the last stage reports (the pieces' losses, averaged over dp)
    step_losses_seen = False

    #: torch's default is True; why this target passes False: the module docstring
    scale_grads: ClassVar[bool] = False

    @property
    def reports_loss(self) -> bool:
        return True  # run.reported on the ranks holding the last stage

    def piece_loss(
        self, run: FitRun, output: torch.Tensor, target: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """The loss of one piece of a micro-batch: its summed terms times the micro-batch's
        scale (the schedule's ``loss_fn``)."""
        return summed(run.scenario, output, target) * scale

    def shard_stage(self, part: Stage, index: int, stages: int, mesh: DeviceMesh) -> nn.Module:
        """Stage ``index`` of ``stages`` made data-parallel over ``mesh["dp"]``, as the schedule
        runs it: sharded in place by FSDP2, or wrapped in torch DDP (``dp_wrapper``); ``part``
        itself at dp = 1."""
        if mesh.size(0) == 1:
            return part
        if self.dp_wrapper == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(part, process_group=mesh.get_group("dp"))
        fsdp2().fully_shard(part, mesh=mesh["dp"])
        return part

    def pipeline_stage(
        self,
        runnable: nn.Module,
        index: int,
        stages: int,
        device: torch.device,
        inputs: torch.Tensor,
        outputs: torch.Tensor,
        group: dist.ProcessGroup,
    ) -> PipelineStage:
        """torch's ``PipelineStage`` of stage ``index`` over ``runnable``, its shapes given by
        example ``inputs`` and ``outputs``, its sends and receives over ``group``."""
        from torch.distributed.pipelining import PipelineStage

        return PipelineStage(
            runnable,
            index,
            stages,
            device,
            input_args=inputs,
            output_args=outputs,
            group=group,
        )

    def step_context(self) -> contextlib.AbstractContextManager[object]:
        """What each ``schedule.step`` runs under (the loss is computed inside it, on the last
        stage): nothing here."""
        return contextlib.nullcontext()

    def micro_batches(self, batches: list) -> list:
        """The step's micro-batches ``(x, y, scale)``, each one ``schedule.step``."""
        return batches

    def clip(
        self, params: Sequence[torch.Tensor], max_norm: float, norm_type: float, mesh: DeviceMesh
    ) -> None:
        """Clip the gradients by the whole model's norm (:func:`clip_pipeline`)."""
        clip_pipeline(params, max_norm, norm_type, mesh)

    def reported_loss_of(
        self, run: FitRun, losses: list[torch.Tensor], mesh: DeviceMesh
    ) -> torch.Tensor:
        """The step's loss the last stage reports, from its pieces' ``losses``."""
        return reported_loss(losses, mesh)

    requires = (("torch", PP_FLOOR),)

    def supports(self, scenario: Scenario) -> str | None:
        if scenario.pipeline is None:
            return f"{type(self).__name__} checks pipeline scenarios (stages and a schedule)"
        return None

    def supports_at(self, scenario: Scenario, world_size: int) -> str | None:
        assert scenario.pipeline is not None
        pipeline = scenario.pipeline
        problem = pipeline_problem(pipeline, world_size, len(module_order(scenario.model)))
        return problem or uneven_pieces(scenario, world_size)

    def requirements(self, device: str) -> tuple[tuple[str, str], ...]:
        """The release tried, or FSDP2's on ``device`` where that is later."""
        fsdp = CUDA_FLOOR if device.startswith("cuda") else CPU_FLOOR
        return (("torch", max(PP_FLOOR, fsdp, key=lambda r: tuple(map(int, r.split("."))))),)

    def fit(self, module: nn.Module, run: FitRun) -> None:
        from torch.distributed import pipelining

        pipeline, mesh = run.scenario.pipeline, run.mesh
        assert pipeline is not None and mesh is not None
        pp = mesh.size(1)
        broadcast_from(module, 0)
        coordinate = mesh.get_local_rank("pp")
        per_stage = stage_modules(pipeline, module_order(run.scenario.model))
        mine = stages_of_rank(pipeline, coordinate, pp)
        device = next(module.parameters()).device
        rows = _piece_rows(run)
        stages, parts = [], []
        for index in mine:
            part = Stage(module, per_stage[index])
            # shapes given, not inferred: inference runs a real forward and backward per stage
            # (torch's docs), whose gradients FSDP2 reduces into the first step's
            inputs, outputs = _shapes(part, rows, run.scenario, device)
            runnable = self.shard_stage(part, index, pipeline.stages, mesh)
            parts.append(part)
            stages.append(
                self.pipeline_stage(
                    runnable,
                    index,
                    pipeline.stages,
                    device,
                    inputs.requires_grad_(index > 0),
                    outputs.requires_grad_(True),
                    mesh.get_group("pp"),
                )
            )
        params = [p for part in parts for p in part.parameters()]
        optimizer = run.optimizer(params, **run.optimizer_kwargs)
        scheduler = (
            None
            if run.gamma is None
            else torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=run.gamma)
        )
        scale = [1.0]  # the scale of the micro-batch being stepped (its batch plan's)

        def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return self.piece_loss(run, output, target, scale[0])

        schedule_class = getattr(pipelining, f"Schedule{pipeline.schedule}")
        schedule = schedule_class(
            stages[0] if SCHEDULES[pipeline.schedule] == "single" else stages,
            n_microbatches=pipeline.microbatches,
            loss_fn=loss_fn,
            scale_grads=self.scale_grads,
        )
        first, last = 0 in mine, pipeline.stages - 1 in mine
        run.started(module, optimizer)
        for batches in run.batches:
            losses: list[torch.Tensor] = []
            for x, y, micro_scale in self.micro_batches(batches):
                scale[0] = micro_scale
                found: list[torch.Tensor] = []
                with self.step_context():
                    schedule.step(*([x] if first else []), target=y if last else None, losses=found)
                losses += found
            if run.max_grad_norm is not None:
                self.clip(params, run.max_grad_norm, run.grad_norm_type, mesh)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            run.record(module, optimizer, scheduler)
            if last:
                run.reported(self.reported_loss_of(run, losses, mesh))
            optimizer.zero_grad(set_to_none=run.set_to_none)


def _piece_rows(run: FitRun) -> int:
    """The samples of every piece the schedule runs: one size for the whole run
    (:func:`uneven_pieces` declines the others)."""
    assert run.scenario.pipeline is not None
    x = run.batches[0][0][0]
    return len(x) // run.scenario.pipeline.microbatches


def _shapes(
    part: Stage, rows: int, scenario: Scenario, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Example input and output of ``part`` for a piece of ``rows`` samples (empty tensors of
    the right shapes: what ``PipelineStage`` takes instead of inferring them; the head's are
    logits of the vocabulary for a model trained on tokens)."""
    from ddpcheck._language.sharded_models import IN_FEATURES, OUT_FEATURES, SEQUENCE, VOCABULARY

    dtype = scenario.torch_dtype

    first = part.get_submodule(part.order[0])
    width = IN_FEATURES if part.order[0] == "inp" else _width(first)
    last = part.get_submodule(part.order[-1])
    if part.order[-1] == "head":
        out = VOCABULARY if getattr(scenario.model, "tokens", False) else OUT_FEATURES
    else:  # the input projection's output, or a block's (residual: the model's width)
        out = last.out_features if isinstance(last, nn.Linear) else _width(last)
    return (
        torch.empty(rows, SEQUENCE, width, dtype=dtype, device=device),
        torch.empty(rows, SEQUENCE, out, dtype=dtype, device=device),
    )


def _width(block: nn.Module) -> int:
    """The model width a block reads and writes (its first linear's input features, or its
    norm's)."""
    for m in block.modules():
        if isinstance(m, nn.Linear):
            return m.in_features
        if isinstance(m, nn.LayerNorm):
            return int(m.normalized_shape[0])
    raise TypeError(f"no width found in {block}")


def reported_loss(losses: list[torch.Tensor], mesh: DeviceMesh) -> torch.Tensor:
    """The step's loss as a pipeline's last stage reports it: the pieces' losses summed (each is
    already weighed by its micro-batch's scale), averaged over ``dp`` (gloo has no AVG)."""
    total = torch.stack([loss.detach().reshape(()) for loss in losses]).sum()
    dist.all_reduce(total, group=mesh.get_group("dp"))
    return total / mesh.size(0)


def clip_pipeline(
    params: Sequence[torch.Tensor], max_norm: float, norm_type: float, mesh: DeviceMesh
) -> None:
    """Clip by the norm of every stage's gradients together: this rank's stages' norm (a DTensor
    norm made whole over ``dp``), combined over ``pp`` -- the largest for the infinity norm,
    else the p-th root of the sum of p-th powers -- then ``clip_grads_with_norm_``."""
    grads = [p.grad for p in params if p.grad is not None]
    local = torch.nn.utils.get_total_norm(grads, norm_type) if grads else torch.zeros(())
    full = getattr(local, "full_tensor", None)
    norm = (full() if callable(full) else local).detach().reshape(1)
    group = mesh.get_group("pp")
    if math.isinf(norm_type):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
    else:
        norm = norm**norm_type
        dist.all_reduce(norm, group=group)
        norm = norm ** (1.0 / norm_type)
    total = norm.reshape(())
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
