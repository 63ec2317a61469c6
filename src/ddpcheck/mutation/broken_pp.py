"""Pipeline mutants: ``torch_pp`` (``ddpcheck.targets.pipeline.TorchPPTarget``) with one seeded
bug each (family M of ``docs/bug-catalogue.md``): the classic silent bugs of pipeline code, about
how the pieces' and micro-batches' losses are scaled, which group a stage's gradients are reduced
over, and which norm a pipeline clips by.

Each mutant overrides one method of the target (``scale_grads``, ``piece_loss``,
``micro_batches``, ``shard_stage``, ``clip``, ``reported_loss_of``); its docstring names it and
says the bug. The unmutated ``torch_pp`` is their control.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from ddpcheck._language.objective import summed
from ddpcheck._language.training import FitRun
from ddpcheck.targets.pipeline import Stage, TorchPPTarget

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import PipelineStage

__all__ = [
    "ENTRIES",
    "AccumulatedThenScaledPP",
    "ClipsByStageNormPP",
    "LastMicroBatchSkippedPP",
    "LastStageNotReducedPP",
    "LossNotScaledPP",
    "PiecesDividedTwicePP",
    "PieceMeanNotDividedPP",
    "ReportedFromOnePipelinePP",
    "WeightPassDividedPP",
]


def _piece_mean(run: FitRun, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean of a piece's terms: what a user's ``loss_fn`` returns."""
    return summed(run.scenario, output, target) / len(output)


@dataclasses.dataclass(frozen=True)
class _MeanLossPP(TorchPPTarget):
    """torch_pp whose pieces' losses are means divided by the accumulation, as a user's loop
    writes them: it logs their mean (right whatever the gradients are, so that only the
    gradients tell the bug)."""

    def reported_loss_of(
        self, run: FitRun, losses: list[torch.Tensor], mesh: DeviceMesh
    ) -> torch.Tensor:
        assert run.scenario.pipeline is not None
        return super().reported_loss_of(run, losses, mesh) / run.scenario.pipeline.microbatches


@dataclasses.dataclass(frozen=True)
class PieceMeanNotDividedPP(_MeanLossPP):
    """``piece_loss``: each piece's mean loss with ``scale_grads=False`` -- the division by the
    number of pieces missing: every gradient ``microbatches`` times the truth."""

    def piece_loss(
        self, run: FitRun, output: torch.Tensor, target: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return _piece_mean(run, output, target) / run.scenario.accumulation  # BUG: no 1 / pieces


@dataclasses.dataclass(frozen=True)
class PiecesDividedTwicePP(TorchPPTarget):
    """``piece_loss`` and ``scale_grads``: the pieces' loss divided by their number, and the
    schedule's default scaling dividing the gradients by it again: ``1 / microbatches**2``."""

    scale_grads: ClassVar[bool] = True

    def piece_loss(
        self, run: FitRun, output: torch.Tensor, target: torch.Tensor, scale: float
    ) -> torch.Tensor:
        assert run.scenario.pipeline is not None
        loss = _piece_mean(run, output, target) / run.scenario.accumulation
        return loss / run.scenario.pipeline.microbatches  # BUG: the schedule divides too

    def reported_loss_of(
        self, run: FitRun, losses: list[torch.Tensor], mesh: DeviceMesh
    ) -> torch.Tensor:  # the pieces' losses already divided by their number: their sum
        return super().reported_loss_of(run, losses, mesh)


@dataclasses.dataclass(frozen=True)
class LossNotScaledPP(TorchPPTarget):
    """``piece_loss``: the pieces' summed terms back-propagated without the micro-batch's scale
    (the loss that is logged is normalised; the one back-propagated is not)."""

    def piece_loss(
        self, run: FitRun, output: torch.Tensor, target: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return summed(run.scenario, output, target)  # BUG: no scale

    def reported_loss_of(
        self, run: FitRun, losses: list[torch.Tensor], mesh: DeviceMesh
    ) -> torch.Tensor:  # the logged loss divided as it should be: only the gradients are wrong
        total = super().reported_loss_of(run, losses, mesh)
        return total * run.batches[0][0][2]


@dataclasses.dataclass(frozen=True)
class AccumulatedThenScaledPP(_MeanLossPP):
    """``scale_grads`` and ``piece_loss``: torch's default (each piece's mean, divided by the
    accumulation, ``scale_grads=True``) under accumulation: the schedule divides the whole
    accumulated ``.grad`` by the pieces after every ``step`` -- a moving average
    (torchtitan#1733)."""

    scale_grads: ClassVar[bool] = True

    def piece_loss(
        self, run: FitRun, output: torch.Tensor, target: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return _piece_mean(run, output, target) / run.scenario.accumulation


@dataclasses.dataclass(frozen=True)
class LastMicroBatchSkippedPP(TorchPPTarget):
    """``micro_batches``: the step's last micro-batch never stepped when there are several (an
    off-by-one in the accumulation loop)."""

    def micro_batches(self, batches: list) -> list:
        return batches[:-1] if len(batches) > 1 else batches  # BUG: the last one dropped


@dataclasses.dataclass(frozen=True)
class LastStageNotReducedPP(TorchPPTarget):
    """``shard_stage``: the last stage left out of FSDP2 over ``dp``: its gradients stay each
    pipeline's own, its replicas drift apart."""

    def shard_stage(self, part: Stage, index: int, stages: int, mesh: DeviceMesh) -> nn.Module:
        if index != stages - 1:  # BUG: the last stage never reduced over dp
            return super().shard_stage(part, index, stages, mesh)
        return part


@dataclasses.dataclass(frozen=True)
class ClipsByStageNormPP(TorchPPTarget):
    """``clip``: ``clip_grad_norm_`` over this rank's stages only: each stage clipped by its own
    norm, not the whole model's."""

    def clip(
        self, params: Sequence[torch.Tensor], max_norm: float, norm_type: float, mesh: DeviceMesh
    ) -> None:
        torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)  # BUG: this stage's norm


@dataclasses.dataclass(frozen=True)
class ReportedFromOnePipelinePP(TorchPPTarget):
    """``reported_loss_of``: the last stage's own pieces' loss reported, never averaged over
    ``dp``: each pipeline logs its share."""

    def reported_loss_of(
        self, run: FitRun, losses: list[torch.Tensor], mesh: DeviceMesh
    ) -> torch.Tensor:
        return torch.stack([loss.detach().reshape(()) for loss in losses]).sum()  # BUG


@dataclasses.dataclass(frozen=True)
class WeightPassDividedPP(TorchPPTarget):
    """``pipeline_stage``: a split backward (the zero-bubble schedules run each stage's backward
    as an input pass, then a weight pass) whose weight pass divides the gradients it computes by
    the number of pieces again, its input pass not: each stage's weights get ``1 / pieces`` of
    their gradient while the gradients handed upstream stay right. Schedules that do not split
    the backward never enter the weight pass: on them this is torch_pp."""

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
        stage = super().pipeline_stage(runnable, index, stages, device, inputs, outputs, group)
        in_weight_pass = [False]

        def divide(grad: torch.Tensor) -> torch.Tensor:  # the schedule sets stage.chunks
            return grad / (stage.chunks or 1) if in_weight_pass[0] else grad  # BUG

        for param in runnable.parameters():  # at dp > 1 FSDP2's unsharded grads bypass these
            param.register_hook(divide)
        weight_pass = stage.backward_weight_one_chunk

        def divided(*args: object, **kwargs: object) -> None:
            in_weight_pass[0] = True
            try:
                weight_pass(*args, **kwargs)  # type: ignore[arg-type]
            finally:
                in_weight_pass[0] = False

        stage.backward_weight_one_chunk = divided  # type: ignore[method-assign]
        return stage


#: The catalogue's rows of this family: ``(mutant class name, bug class, one line)``.
ENTRIES: list[tuple[str, str, str]] = [
    ("PieceMeanNotDividedPP", "M1", "each piece's mean loss with scale_grads=False: x pieces"),
    (
        "PiecesDividedTwicePP",
        "M1",
        "the pieces' loss divided by their number and scale_grads dividing again",
    ),
    (
        "LossNotScaledPP",
        "M2",
        "the summed loss back-propagated unscaled, only the logged loss normalised",
    ),
    (
        "AccumulatedThenScaledPP",
        "M3",
        "scale_grads=True under accumulation: the accumulated gradients divided every step",
    ),
    ("LastMicroBatchSkippedPP", "M4", "the step's last micro-batch never run by the schedule"),
    ("LastStageNotReducedPP", "M5", "the last stage's gradients never reduced over dp"),
    ("ClipsByStageNormPP", "M6", "each stage clipped by its own norm, not the whole model's"),
    ("ReportedFromOnePipelinePP", "M7", "the loss reported by each pipeline, not averaged over dp"),
    (
        "WeightPassDividedPP",
        "M9",
        "a split backward's weight pass dividing by the pieces again, its input pass not",
    ),
]
