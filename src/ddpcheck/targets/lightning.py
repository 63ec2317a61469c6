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
scheduler, before the next window's ``zero_grad`` -- where ddpcheck records the step; the step's
loss the module logs (``self.log(..., sync_dist=True)``: its window's losses, averaged over the
ranks) is read from ``trainer.callback_metrics`` when the next window starts, and at the end
(Lightning fills it after ``on_train_batch_end``), for ``run.reported``. The
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

**Epochs** (``fit_epochs``: a scenario with a dataset, ``docs/scenarios.md``): Lightning's own
epoch loop -- ``Trainer.fit`` with ``max_epochs`` over a ``DataLoader`` of the per-device batch
with ``DistributedSampler(shuffle=False)`` (``use_distributed_sampler=False``: Lightning's own
sampler "will add ``shuffle=True`` for the train sampler", where the reference walks the dataset
in index order), ``training_step`` returning each batch's mean loss; the Trainer decides when it
steps, and every step it takes is recorded. Declined, quoting Lightning: an epoch's short last
window under accumulation (:data:`SCALED_BY_ACCUMULATION`; ``bench/lightning_short_window.py``),
and the sampler's padding (``data_path.sampler_cannot_run``). With an evaluation set,
``validation_step`` logs each batch's mean of the objective's terms for the epoch with
``sync_dist=True`` over a validation loader with a ``DistributedSampler``, and the callback hands
the logged value to ``run.evaluated`` after every validation run; a set W does not divide is
declined (:data:`REPLICATES_SAMPLES`, Lightning's own warning).

**Your own configuration** (``config``: the keyword arguments of ``Trainer(**config)``, a dict or
the path of a JSON file holding one; the rule: ``ddpcheck.targets.configuration``). The
scenario's keys (:data:`SCENARIO_KEYS`: steps and epochs, ``accumulate_grad_batches``,
``gradient_clip_val``/``_algorithm``, ``precision``) are refused; the harness's
(:data:`HARNESS_KEYS`: the world, the loader, no logger, no checkpoints) are accepted only with
ddpcheck's value; everything else reaches the ``Trainer`` -- above all ``strategy``, an object, a
name or its JSON form (``lightning_strategy``), which replaces the target's
``DDPStrategy(find_unused_parameters=True)``; what torch's DDP cannot train under its options is
declined (``ddp_options``). Manual optimization stays the ``manual`` field (it is the module's,
not the Trainer's)::

    LightningTarget(config={"strategy": {"name": "ddp", "static_graph": True,
                                         "gradient_as_bucket_view": True}})
    # ddpcheck check lightning --config lightning.json  (the same, as a JSON file)

Imports Lightning only inside :meth:`LightningTarget.fit` (and, given a config, to check it where
it is built).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler

from ddpcheck._base.errors import InvalidArgument, NothingChecked
from ddpcheck._language.scenario import Scenario
from ddpcheck._language.training import EpochRun, FitRun
from ddpcheck.targets import ddp_options, lightning_strategy
from ddpcheck.targets.configuration import (
    Config,
    construct,
    described,
    load_config,
)
from ddpcheck.targets.data_path import sampler_cannot_run
from ddpcheck.targets.environment import join_existing_group
from ddpcheck.targets.option_space import options
from ddpcheck.targets.reasons import (
    NO_PARAM_DTYPE,
    OWN_CHECKPOINTS,
    TORCH_DDP_ORDER,
)

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.strategies import DDPStrategy

    from ddpcheck.targets.protocol import ConfigSpace

#: One micro-batch as the loop feeds it: ``(x, y, scale)``.
MicroBatch = tuple[torch.Tensor, torch.Tensor, float]
#: One sample of a scenario's dataset or evaluation set: ``(x, y, index)``.
Sample = tuple[torch.Tensor, torch.Tensor, int]

__all__ = ["HARNESS_KEYS", "SCALED_BY_ACCUMULATION", "SCENARIO_KEYS", "LightningTarget"]

_STEPS = "steps: the target sets max_steps, one epoch over this rank's micro-batches"
#: ``Trainer`` keys the scenario sets, example by example: key -> what sets it (refused).
SCENARIO_KEYS: dict[str, str] = {
    **dict.fromkeys(
        (
            "max_steps",
            "min_steps",
            "max_epochs",
            "min_epochs",
            "max_time",
            "fast_dev_run",
            "limit_train_batches",
            "overfit_batches",
        ),
        _STEPS,
    ),
    **dict.fromkeys(
        ("check_val_every_n_epoch", "val_check_interval", "limit_val_batches"),
        "epochs: the evaluation set is evaluated after every epoch",
    ),
    "accumulate_grad_batches": "accumulation",
    "gradient_clip_val": "max_grad_norm",
    "gradient_clip_algorithm": "max_grad_norm and grad_norm_type",
    "precision": "autocast (and dtype)",
    **lightning_strategy.SCENARIO_KEYS,
}
_WORLD = "ddpcheck's world: the process group exists, on the world's device"
#: ``Trainer`` keys ddpcheck's harness fixes: key -> (the values accepted, why).
HARNESS_KEYS: dict[str, tuple[tuple[object, ...], str]] = {
    "accelerator": ((), _WORLD),
    "devices": ((), _WORLD),
    "num_nodes": ((1,), _WORLD),
    "plugins": (
        (None, []),
        "precision plugins are the scenario's, the cluster environment the world's",
    ),
    "use_distributed_sampler": (
        (False,),
        "ddpcheck feeds each rank its own micro-batches, or, over a scenario's dataset with "
        "epochs, a DataLoader with its own DistributedSampler(shuffle=False) (Lightning's would "
        "shuffle the training set)",
    ),
    "enable_checkpointing": (
        (False,),
        "checkpoints are declined: the target sets enable_checkpointing=False",
    ),
    "logger": ((False,), "a logger writes files: the target sets logger=False"),
    "deterministic": (
        (None, False),
        "torch.use_deterministic_algorithms(True) would outlive the "
        "example in ddpcheck's persistent ranks",
    ),
    "sync_batchnorm": (
        (False,),
        "not tried with this target (it replaces the model's BatchNorm layers)",
    ),
    **lightning_strategy.HARNESS_KEYS,
}


@dataclasses.dataclass(frozen=True)
class LightningTarget(ddp_options.TorchDDPFramework):
    """Lightning's ``Trainer.fit`` with ``DDPStrategy`` (see the module docstring)."""

    requires = (("lightning", "2.0.9"),)  # the oldest release tried (docs/frameworks.md)

    manual: bool = False  # manual optimization instead of automatic
    static_graph: bool = False  # DDPStrategy(static_graph=True)
    config: Config = None  # Trainer(**config): the module docstring
    #: how ``self.log(..., sync_dist=True)`` reduces each step's loss over the ranks (a seam)
    log_reduce_fx: ClassVar[str] = "mean"
    #: whether ``validation_step`` logs the evaluation metric with ``sync_dist=True`` (a seam)
    metric_sync_dist: ClassVar[bool] = True
    #: over epochs, it logs the evaluation metric in ``validation_step`` (``self.log``)
    reports_metric = True

    declined_features: ClassVar[Mapping[str, str]] = {
        "rank-orders": TORCH_DDP_ORDER,
        "checkpoint": f"{OWN_CHECKPOINTS} (the Trainer's .ckpt files, which this loop does not "
        "drive)",
        "param-dtype": NO_PARAM_DTYPE,
    }

    def __post_init__(self) -> None:
        where = described("LightningTarget", self.config)
        given = load_config(self.config, target=where)
        ddp = {"find_unused_parameters": True, "static_graph": self.static_graph}
        if "strategy" in given and self.static_graph:
            raise InvalidArgument(
                f"{where}: static_graph=True and a 'strategy' both set the "
                "strategy; give static_graph in the strategy "
                '({"name": "ddp", "static_graph": true})'
            )
        if given:  # checked here, before any process starts
            ddp = _check(given, where) or ddp
        object.__setattr__(self, "_given", given)
        object.__setattr__(self, "_ddp", ddp)

    def config_space(self) -> ConfigSpace:
        """Manual optimization and a static graph (the fields), or manual optimization and the
        ``Trainer``'s ``strategy`` as a ``config=`` key: torch DDP's ``static_graph``,
        ``gradient_as_bucket_view``, ``find_unused_parameters=False``
        (``lightning_strategy.space``; ``ddpcheck.targets.option_space``). One or the other:
        the ``static_graph`` field and a strategy together are refused. Shrinks towards the
        fields; with the field set, or a strategy in the config, the strategy is not drawn."""
        from hypothesis import strategies as st

        fields = options(fields={"manual": (True,), "static_graph": (True,)})
        if self.static_graph or "strategy" in vars(self)["_given"]:
            return fields
        strategy = options(
            fields={"manual": (True,)}, config={"strategy": lightning_strategy.space()}
        )
        return st.one_of(fields, strategy)

    def warm_up(self) -> None:
        import lightning.pytorch  # noqa: F401  (seconds in a rank: once per process, here)

    def supports(self, scenario: Scenario) -> str | None:
        ddp = self.torch_ddp()
        cannot = ddp_options.cannot_run(
            scenario,
            **ddp,
            where="" if "strategy" not in vars(self)["_given"] else " (the config's strategy)",
        )
        if cannot is not None:
            return cannot
        if (
            not self.manual
            and scenario.max_grad_norm is not None
            and math.isinf(scenario.grad_norm_type)
        ):
            return (
                "clipping: Trainer(gradient_clip_val=...) clips the 2-norm only "
                "(gradient_clip_algorithm 'norm' or 'value'); infinity-norm clipping needs "
                "manual optimization (LightningTarget(manual=True))"
            )
        return _epochs_cannot_run(scenario, self.manual)

    def supports_at(self, scenario: Scenario, world_size: int) -> str | None:
        """A scenario with epochs that Lightning's ``DistributedSampler`` cannot load at
        ``world_size`` as the reference weighs it (``data_path.sampler_cannot_run``: no
        per-device batch size, or the sampler's padding), or whose evaluation set it pads
        (:func:`_pads_evaluation`)."""
        epochs = scenario.epochs
        if epochs is None:
            return None
        micro = scenario.global_batch // scenario.accumulation
        return sampler_cannot_run(micro, epochs.samples, world_size) or _pads_evaluation(
            epochs.evaluation, world_size
        )

    def fit(self, module: nn.Module, run: FitRun) -> None:
        import lightning.pytorch as pl

        join_existing_group()
        accumulation = max(len(step) for step in run.batches)
        if any(len(step) != accumulation for step in run.batches):
            raise NothingChecked(
                "LightningTarget needs the same number of micro-batches every "
                "step (Trainer(accumulate_grad_batches=...) is one number)"
            )
        net = _module(pl, module, run, accumulation, self.manual, self.log_reduce_fx)
        trainer = self._trainer(
            pl,
            module,
            run,
            _recorder(pl, run, accumulation),
            max_steps=run.steps,
            max_epochs=1,
            accumulate_grad_batches=1 if self.manual else accumulation,
            use_distributed_sampler=False,
        )
        # a list is a map-style dataset (len and getitem); torch's annotation asks for Dataset
        loader: torch.utils.data.DataLoader[MicroBatch] = torch.utils.data.DataLoader(
            [micro for step in run.batches for micro in step],  # type: ignore[arg-type]
            batch_size=None,
            shuffle=False,
        )
        trainer.fit(net, train_dataloaders=loader)

    def fit_epochs(self, module: nn.Module, run: EpochRun) -> None:
        """Lightning's own epoch loop over the scenario's dataset: ``Trainer.fit`` with
        ``max_epochs`` the scenario's over a ``DataLoader`` of the per-device batch (the global
        micro-batch over W) whose sampler is a ``DistributedSampler(shuffle=False)`` -- what
        Lightning's docs say to add with ``use_distributed_sampler=False`` where its own sampler,
        which adds ``shuffle=True`` for training, must not shuffle (the reference walks the
        dataset in index order) -- and a ``LightningModule`` whose ``training_step`` returns each
        batch's mean loss as a user's does. Lightning decides when the optimizer steps (a
        window's end, and an epoch's last batch), how it scales the losses, and calls the
        sampler's ``set_epoch``; the callback records every step it took."""
        import lightning.pytorch as pl

        join_existing_group()
        micro = run.global_batch // run.accumulation
        why = (
            sampler_cannot_run(micro, len(run.dataset), run.world_size)
            or _epochs_cannot_run(run.scenario, self.manual)
            or _pads_evaluation(
                None if run.evaluation is None else len(run.evaluation), run.world_size
            )
        )
        if why is not None:  # asked to run what supports and supports_at decline
            raise NothingChecked(f"LightningTarget declines this example: {why}")
        net = _epoch_module(pl, module, run, self.manual, self.metric_sync_dist)
        trainer = self._trainer(
            pl,
            module,
            run,
            _step_recorder(pl, run),
            max_steps=-1,
            max_epochs=run.epochs,
            accumulate_grad_batches=1 if self.manual else run.accumulation,
            use_distributed_sampler=False,
        )
        trainer.fit(
            net,
            train_dataloaders=self.train_loader(run),
            val_dataloaders=None if run.evaluation is None else self.evaluation_loader(run),
        )

    def train_loader(self, run: EpochRun) -> torch.utils.data.DataLoader[Any]:
        """The ``DataLoader`` ``Trainer.fit`` trains on: the per-device batch (the global
        micro-batch over W) and the sampler Lightning's docs say to add where its own must not
        shuffle (``use_distributed_sampler=False``)."""
        sampler: DistributedSampler[Any] = DistributedSampler(run.dataset, shuffle=False)
        per_device = run.global_batch // run.accumulation // run.world_size
        return torch.utils.data.DataLoader(run.dataset, batch_size=per_device, sampler=sampler)

    def evaluation_loader(self, run: EpochRun) -> torch.utils.data.DataLoader[Sample]:
        """The validation ``DataLoader``: the evaluation's per-device batch and a
        ``DistributedSampler`` without shuffling, what Lightning's own for validation is."""
        assert run.evaluation is not None
        sampler: DistributedSampler[Sample] = DistributedSampler(run.evaluation, shuffle=False)
        return torch.utils.data.DataLoader(
            run.evaluation, batch_size=run.evaluation_batch, sampler=sampler
        )

    def _trainer(
        self,
        pl: Any,  # lightning.pytorch, imported by fit
        module: nn.Module,
        run: FitRun,
        recorder: object,
        **scenario: object,  # what the scenario and the data path set: steps, epochs, ...
    ) -> Trainer:
        """The ``Trainer``: the user's configuration, the scenario's clipping and ``scenario``,
        the harness's world, and ddpcheck's callback beside the user's."""
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        automatic = not self.manual and run.max_grad_norm is not None
        given = vars(self)["_given"]
        callbacks = given.get("callbacks") or []
        kwargs = {
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "num_sanity_val_steps": 0,
            **given,
            # the scenario's
            **scenario,
            "gradient_clip_val": run.max_grad_norm if automatic else None,
            "gradient_clip_algorithm": "norm" if automatic else None,
            # the harness's
            "accelerator": "cpu" if next(module.parameters()).device.type == "cpu" else "cuda",
            "devices": dist.get_world_size(),
            "num_nodes": 1,
            "strategy": self._strategy(),
            "logger": False,
            "enable_checkpointing": False,
            "callbacks": [*(callbacks if isinstance(callbacks, list) else [callbacks]), recorder],
        }
        if not given:
            trainer: Trainer = pl.Trainer(**kwargs)
            return trainer
        return construct(
            pl.Trainer,
            kwargs,
            target=described("LightningTarget", self.config),
            errors=(TypeError, ValueError, MisconfigurationException),
        )

    @property
    def reports_loss(self) -> bool:
        return True  # each step's loss, self.log(..., sync_dist=True) (run.reported)

    def _strategy(self) -> DDPStrategy:
        """This run's strategy: the config's, built afresh, or the target's own."""
        from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

        given = vars(self)["_given"]
        if "strategy" not in given:
            return DDPStrategy(find_unused_parameters=True, static_graph=self.static_graph)
        return lightning_strategy.make(
            given["strategy"],
            registry=StrategyRegistry,
            ddp_cls=DDPStrategy,
            where=described("LightningTarget", self.config),
        )


def _check(given: dict[str, object], where: str) -> dict[str, bool] | None:
    """``lightning_strategy.checked`` for this target's keyword arguments; skipped without
    Lightning (``Target.requires`` refuses the target before it runs)."""
    try:
        import lightning.pytorch as pl
        from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    except ImportError:
        return None
    return lightning_strategy.checked(
        given,
        where,
        owner=pl.Trainer,
        registry=StrategyRegistry,
        ddp_cls=DDPStrategy,
        keys=(SCENARIO_KEYS, HARNESS_KEYS),
    )


def _module(
    pl: Any,  # lightning.pytorch, imported by fit: its classes are subclassed here
    net: nn.Module,
    run: FitRun,
    accumulation: int,
    manual: bool,
    reduce_fx: str,
) -> LightningModule:
    """The ``LightningModule`` around the scenario's model (classes made here: Lightning is
    imported only when the target runs)."""

    class Module(_user_module(pl, net, run, accumulation, manual)):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.window_loss = torch.zeros(())  # the window's losses so far

        def training_step(self, batch: MicroBatch, batch_idx: int) -> torch.Tensor | None:
            x, y, scale = batch
            loss = run.loss(self.net, x, y, scale)
            # the step's loss as a LightningModule logs it: its window's losses (each scaled by
            # the plan: summed, they are this rank's part), averaged over the ranks by sync_dist
            first = batch_idx % accumulation == 0
            self.window_loss = loss.detach() + (0.0 if first else self.window_loss)
            if (batch_idx + 1) % accumulation == 0:
                self.log(
                    LOGGED_LOSS,
                    self.window_loss,
                    on_step=True,
                    sync_dist=True,
                    reduce_fx=reduce_fx,
                    batch_size=1,
                )
            if not manual:  # Lightning divides by accumulate_grad_batches; ours is scaled
                return loss * accumulation
            self.manual_backward(loss)
            if (batch_idx + 1) % accumulation == 0:
                _manual_step(self, run)
            return None

    return Module()


def _user_module(
    pl: Any, net: nn.Module, run: FitRun, accumulation: int, manual: bool
) -> type[LightningModule]:
    """What both modules share -- the scenario's model, the optimization mode, manual
    accumulation's ``zero_grad`` at a window's start, the scenario's ``zero_grad`` and
    optimizers -- each adding its own ``training_step`` (pl: as :func:`_module`'s)."""

    class UserModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net
            self.automatic_optimization = not manual

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.net(x)
            return out

        def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
            if manual and batch_idx % accumulation == 0:
                self.optimizers().zero_grad(set_to_none=run.set_to_none)

        def optimizer_zero_grad(
            self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer
        ) -> None:
            optimizer.zero_grad(set_to_none=run.set_to_none)

        def configure_optimizers(self) -> torch.optim.Optimizer | dict[str, object]:
            return _optimizers(run)

    return cast("type[LightningModule]", UserModule)


def _manual_step(module: LightningModule, run: FitRun) -> None:
    """The step that ends an accumulation window under manual optimization: clip, step the
    optimizer, then the schedule (one of each: configure_optimizers returns them)."""
    optimizer = module.optimizers()
    if isinstance(optimizer, list):
        raise TypeError("LightningTarget's module configures one optimizer, not a list")
    if run.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(module.parameters(), run.max_grad_norm, run.grad_norm_type)
    optimizer.step()
    scheduler = module.lr_schedulers()
    if isinstance(scheduler, list):
        raise TypeError("LightningTarget's module configures one LR schedule, not a list")
    if scheduler is not None:
        scheduler.step()


def _recorder(pl: Any, run: FitRun, accumulation: int) -> object:  # pl: as _module's
    """The callback through which ddpcheck records the Trainer's run."""

    class Recorder(pl.Callback):
        def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
            run.started(_model(trainer), trainer.optimizers[0])

        # the step is recorded in on_train_batch_end, inside the batch that logged its loss: the
        # loss of the step recorded last is read once Lightning has finished that batch -- when
        # the next window starts, and at the end
        def on_train_batch_start(
            self, trainer: Trainer, pl_module: LightningModule, batch: MicroBatch, batch_idx: int
        ) -> None:
            if batch_idx and batch_idx % accumulation == 0:
                _report(trainer, run)

        def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
            _report(trainer, run)

        def on_train_batch_end(
            self,
            trainer: Trainer,
            pl_module: LightningModule,
            outputs: object,
            batch: MicroBatch,
            batch_idx: int,
        ) -> None:
            if (batch_idx + 1) % accumulation:
                return  # inside the accumulation window: no optimizer step yet
            configs = trainer.lr_scheduler_configs
            run.record(
                _model(trainer),
                trainer.optimizers[0],
                configs[0].scheduler if configs else None,
            )

    return Recorder()


#: The name under which the module logs each step's loss (``self.log(..., sync_dist=True)``).
LOGGED_LOSS = "ddpcheck_step_loss"
#: The name under which the module logs the evaluation metric (``validation_step``).
LOGGED_METRIC = "ddpcheck_evaluation_metric"


def _report(trainer: Trainer, run: FitRun) -> None:
    """The loss Lightning holds for the step recorded last, as every rank reads it."""
    logged = trainer.callback_metrics.get(LOGGED_LOSS)
    if logged is not None:
        run.reported(logged)


def _model(trainer: Trainer) -> nn.Module:
    """The model the Trainer's strategy trains (wrapped by it: torch DDP)."""
    model = trainer.strategy.model
    if model is None:
        raise RuntimeError("Lightning's strategy holds no model inside Trainer.fit")
    return model


#: Lightning's documentation of automatic optimization's loss scaling, quoted by the decline of
#: an epoch's short last window (bench/lightning_short_window.py; Lightning-AI/pytorch-lightning
#: issue 19987, open, reports the same weighting as a bug)
SCALED_BY_ACCUMULATION = (
    'LightningModule.training_step: "When accumulate_grad_batches > 1, the loss returned here '
    'will be automatically normalized by accumulate_grad_batches internally", also in an '
    "epoch's last window, where Lightning steps on the final batch whatever the window holds: "
    "its samples weigh less than in the reference (Lightning-AI/pytorch-lightning#19987)"
)


#: Lightning's warning where evaluation runs over several devices, quoted by the decline of an
#: evaluation set W does not divide (data_connector.py)
REPLICATES_SAMPLES = (
    'Lightning: "multi-device settings use `DistributedSampler` that replicates some samples to '
    'make sure all devices have same batch size in case of uneven inputs" (it recommends '
    "Trainer(devices=1) for each sample to be evaluated exactly once)"
)


def _pads_evaluation(evaluation: int | None, world_size: int) -> str | None:
    """Why the validation loop's ``DistributedSampler`` does not evaluate each sample of an
    evaluation set of ``evaluation`` samples once at ``world_size``; None when it does."""
    if evaluation is None or evaluation % world_size == 0:
        return None
    return (
        f"an evaluation set of {evaluation} samples over {world_size} ranks: {REPLICATES_SAMPLES}"
    )


def _epochs_cannot_run(scenario: Scenario, manual: bool) -> str | None:
    """Why Lightning's own data path, with the ``training_step`` a user writes (the mean loss of
    each batch), does not train ``scenario``'s epochs as the reference does, by a documented
    convention; None when it must."""
    if scenario.epochs is None:
        return None
    if scenario.reduction != "mean" or scenario.loss != "squared_error":
        return (
            "epochs with a summed or token objective: a LightningModule's training_step returns "
            "the mean loss of each batch"
        )
    if scenario.accumulation > 1 and scenario.epochs.samples % scenario.global_batch:
        short = (
            f"an epoch of {scenario.epochs.samples} samples in steps of {scenario.global_batch}: "
            f"its last window holds fewer samples than accumulation={scenario.accumulation} "
            "full micro-batches, and "
        )
        if manual:
            return short + (
                "under manual optimization accumulation is the module's (\"the users are left "
                "with optimizer.zero_grad(), gradient accumulation, ...\"); this target's "
                "module steps every accumulation batches, as Lightning's example does"
            )
        return short + SCALED_BY_ACCUMULATION
    return None


def _epoch_module(
    pl: Any, net: nn.Module, run: EpochRun, manual: bool, sync_dist: bool
) -> LightningModule:
    """The ``LightningModule`` a user writes for the scenario's epochs: ``training_step``
    returns each batch's mean loss (automatic optimization), or, under manual optimization,
    back-propagates it over the accumulation and steps every ``accumulation`` batches, as
    Lightning's docs show; with an evaluation set, ``validation_step`` logs each batch's mean
    of the objective's terms for the epoch, weighted by its terms and synchronised over the
    ranks (``self.log(..., on_epoch=True, sync_dist=sync_dist, batch_size=...)``) (pl: as
    :func:`_module`'s)."""
    accumulation = run.accumulation

    class EpochModule(_user_module(pl, net, run, accumulation, manual)):  # type: ignore[misc]
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
            loss = run.loss_of(self.net, batch)
            if not manual:
                return loss  # Lightning scales it (accumulate_grad_batches) and steps
            self.manual_backward(loss / accumulation)
            if (batch_idx + 1) % accumulation == 0:
                _manual_step(self, run)
            return None

    if run.evaluation is None:
        return EpochModule()

    class EvaluatingModule(EpochModule):
        def validation_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> None:
            terms = run.evaluation_terms(self.net, batch)
            self.log(
                LOGGED_METRIC,
                run.metric_of(terms),
                on_step=False,
                on_epoch=True,
                sync_dist=sync_dist,
                batch_size=int(terms[:, 1].sum()),
            )

    return EvaluatingModule()


def _optimizers(run: FitRun) -> torch.optim.Optimizer | dict[str, object]:
    """``configure_optimizers``: the scenario's optimizer, and its ``ExponentialLR`` stepped
    every optimizer step (``interval="step"``)."""
    optimizer = run.optimizer(run.params, **run.optimizer_kwargs)
    if run.gamma is None:
        return optimizer
    schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, run.gamma)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _step_recorder(pl: Any, run: EpochRun) -> object:  # pl: as _module's
    """The callback that records every optimizer step the ``Trainer`` took: after a batch whose
    optimizer step (and LR schedule) ran -- Lightning counts them in ``global_step`` -- and
    before the next window's ``zero_grad``; and the evaluation metric the module logged, after
    each validation run."""

    class StepRecorder(pl.Callback):
        recorded = 0

        def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
            run.started(_model(trainer), trainer.optimizers[0])

        def on_train_batch_end(
            self,
            trainer: Trainer,
            pl_module: LightningModule,
            outputs: object,
            batch: object,
            batch_idx: int,
        ) -> None:
            while self.recorded < trainer.global_step:  # once per step: Lightning takes one
                self.recorded += 1
                configs = trainer.lr_scheduler_configs
                run.record(
                    _model(trainer),
                    trainer.optimizers[0],
                    configs[0].scheduler if configs else None,
                )

        # the validation loop runs after the epoch's last batch (and its step, recorded above);
        # Lightning fills callback_metrics with the epoch's logged metric before this hook
        def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
            logged = trainer.callback_metrics.get(LOGGED_METRIC)
            if not trainer.sanity_checking and logged is not None:
                run.evaluated(logged)

    return StepRecorder()
