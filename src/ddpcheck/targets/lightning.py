"""The ``lightning`` target: Lightning's ``Trainer.fit`` owns the loop (``Target.fit``).

ddpcheck hands the target this rank's micro-batches (``ddpcheck.targets.FitRun``); the
target wraps the scenario's model in a ``LightningModule`` whose ``training_step`` returns the
micro-batch loss and whose ``configure_optimizers`` builds the scenario's optimizer and
``ExponentialLR`` (``interval="step"``), and runs ``Trainer(accelerator="cpu", devices=W,
strategy=DDPStrategy(find_unused_parameters=True, static_graph=...),
accumulate_grad_batches=A, gradient_clip_val=...)`` over a loader of those micro-batches
(``use_distributed_sampler=False``: they are already this rank's). A callback reports to
ddpcheck: ``on_train_start`` (model and optimizer built, DDP's broadcast done) and
``on_train_batch_end`` of each window's last micro-batch -- after the optimizer step and the LR
scheduler, before the next window's ``zero_grad`` -- where ddpcheck records the step. The
Trainer finds the launcher's environment and the initialised group (``environment``), so it
spawns and initialises nothing.

``manual=True`` runs manual optimization instead (``automatic_optimization = False``:
``manual_backward``, and every A-th micro-batch ``clip_gradients``, ``step``, the scheduler and
``zero_grad``), as Lightning's docs show for accumulation. ``static_graph=True`` declines
accumulation (torch's DDP trips an internal assert under ``no_sync()`` with a static graph:
``bench/ddp_static_graph_no_sync.py``) and data-dependent parameter usage (documented). Documented
behaviours the target meets as a user must: automatic optimization divides each micro-batch's loss
by ``accumulate_grad_batches`` (ddpcheck's are already scaled, so ``training_step`` multiplies them
back), and ``gradient_clip_val`` clips the 2-norm only (infinity-norm clipping is declined in
automatic optimization; manual optimization clips through ``torch.nn.utils.clip_grad_norm_``).

Imports Lightning only inside :meth:`LightningTarget.fit`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ddpcheck._base.errors import NothingChecked
from ddpcheck._language import features
from ddpcheck._language.models import ModelSpec
from ddpcheck.targets.environment import join_existing_group
from ddpcheck.targets.framework import FrameworkTarget
from ddpcheck.targets.reasons import NO_PARAM_DTYPE, OWN_CHECKPOINTS, TORCH_DDP_ORDER

__all__ = ["LightningTarget"]


@dataclasses.dataclass(frozen=True)
class LightningTarget(FrameworkTarget):
    """Lightning's ``Trainer.fit`` with ``DDPStrategy`` (see the module docstring)."""

    requires = (("lightning", "2.0.9"),)  # the oldest release tried (docs/frameworks.md)

    manual: bool = False  # manual optimization instead of automatic
    static_graph: bool = False  # DDPStrategy(static_graph=True)

    declined_features: ClassVar[Mapping[str, str]] = {
        "rank-orders": TORCH_DDP_ORDER,
        "checkpoint": f"{OWN_CHECKPOINTS} (the Trainer's .ckpt files, which this loop does not "
                      "drive)",
        "param-dtype": NO_PARAM_DTYPE}

    def warm_up(self) -> None:
        import lightning.pytorch  # noqa: F401  (seconds in a rank: once per process, here)

    def supports(self, scenario: Any) -> str | None:
        if self.static_graph and scenario.accumulation > 1:
            return ("accumulation with static_graph: torch 2.13's DDP(static_graph=True) raises "
                    "'expect_autograd_hooks_ INTERNAL ASSERT FAILED' under no_sync(), which "
                    "Lightning uses to accumulate (bench/ddp_static_graph_no_sync.py)")
        if self.static_graph and _usage_varies(scenario):
            return ("parameter usage that depends on the data, with static_graph: torch's DDP "
                    "docs require that \"the set of used and unused parameters will not change "
                    "during the whole training loop\"")
        if (not self.manual and scenario.max_grad_norm is not None
                and math.isinf(scenario.grad_norm_type)):
            return ("clipping: Trainer(gradient_clip_val=...) clips the 2-norm only "
                    "(gradient_clip_algorithm 'norm' or 'value'); infinity-norm clipping needs "
                    "manual optimization (LightningTarget(manual=True))")
        return None

    def fit(self, module: Any, run: Any) -> None:
        import lightning.pytorch as pl
        from lightning.pytorch.strategies import DDPStrategy

        join_existing_group()
        accumulation = max(len(step) for step in run.batches)
        if any(len(step) != accumulation for step in run.batches):
            raise NothingChecked("LightningTarget needs the same number of micro-batches every "
                                 "step (Trainer(accumulate_grad_batches=...) is one number)")
        net = _module(pl, module, run, accumulation, self.manual)
        automatic = not self.manual and run.max_grad_norm is not None
        trainer = pl.Trainer(
            accelerator="cpu" if next(module.parameters()).device.type == "cpu" else "cuda",
            devices=dist.get_world_size(), num_nodes=1,
            strategy=DDPStrategy(find_unused_parameters=True, static_graph=self.static_graph),
            max_steps=run.steps, max_epochs=1,
            accumulate_grad_batches=1 if self.manual else accumulation,
            gradient_clip_val=run.max_grad_norm if automatic else None,
            gradient_clip_algorithm="norm" if automatic else None,
            use_distributed_sampler=False, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            callbacks=[_recorder(pl, run, accumulation)])
        # a list is a map-style dataset (len and getitem); torch's annotation asks for Dataset
        loader: torch.utils.data.DataLoader[Any] = torch.utils.data.DataLoader(
            [micro for step in run.batches for micro in step],  # type: ignore[arg-type]
            batch_size=None, shuffle=False)
        trainer.fit(net, train_dataloaders=loader)


def _usage_varies(scenario: Any) -> bool:
    """Whether which parameters get gradients depends on the samples (a layer some samples
    skip): some rank or step then uses another set."""
    if isinstance(scenario.model, ModelSpec) and any(layer.use == "sample"
                                                     for layer in scenario.model.layers):
        return True  # (a zoo model's `layers` may be a count: GPTConfig's)
    return any("unused-on-some-ranks" in features.of(scenario, world_size)
               for world_size in (2, 3, 4))


def _module(pl: Any, net: Any, run: Any, accumulation: int, manual: bool) -> Any:
    """The ``LightningModule`` around the scenario's model (classes made here: Lightning is
    imported only when the target runs)."""

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net
            self.automatic_optimization = not manual

        def forward(self, x: torch.Tensor) -> Any:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y, scale = batch
            loss = run.loss(self.net, x, y, scale)
            if not manual:  # Lightning divides by accumulate_grad_batches; ours is scaled
                return loss * accumulation
            self.manual_backward(loss)
            if (batch_idx + 1) % accumulation == 0:
                optimizer = self.optimizers()
                if run.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(self.parameters(), run.max_grad_norm,
                                                   run.grad_norm_type)
                optimizer.step()
                scheduler = self.lr_schedulers()
                if scheduler is not None:
                    scheduler.step()
            return None

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if manual and batch_idx % accumulation == 0:
                self.optimizers().zero_grad(set_to_none=run.set_to_none)

        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            optimizer.zero_grad(set_to_none=run.set_to_none)

        def configure_optimizers(self) -> Any:
            optimizer = run.optimizer(run.params, **run.optimizer_kwargs)
            if run.gamma is None:
                return optimizer
            schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, run.gamma)
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    return Module()


def _recorder(pl: Any, run: Any, accumulation: int) -> Any:
    """The callback through which ddpcheck records the Trainer's run."""

    class Recorder(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            run.started(trainer.strategy.model, trainer.optimizers[0])

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if (batch_idx + 1) % accumulation:
                return  # inside the accumulation window: no optimizer step yet
            configs = trainer.lr_scheduler_configs
            run.record(trainer.strategy.model, trainer.optimizers[0],
                       configs[0].scheduler if configs else None)

    return Recorder()
