"""The ``accelerate`` target: Hugging Face accelerate's ``Accelerator`` driven as its docs show.

Per example and rank: an ``Accelerator(cpu=..., gradient_accumulation_steps=A)`` joins the
existing process group (``environment``), ``prepare(model, optimizer)`` wraps the model in torch
DDP (``find_unused_parameters=True``, through ``DistributedDataParallelKwargs``) and the
optimizer in its gated ``AcceleratedOptimizer``, ``prepare_scheduler`` the ``ExponentialLR``; every
micro-batch runs inside ``accelerator.accumulate(model)``, back-propagates through
``accelerator.backward`` and is followed by ``optimizer.step()``, ``scheduler.step()`` and
``optimizer.zero_grad()`` -- accelerate's loop idiom, in which accelerate decides which of those
act (``Target.steps_every_micro_batch``); clipping is ``accelerator.clip_grad_norm_``.
``teardown`` resets accelerate's singletons (``AcceleratorState``, ``PartialState``,
``GradientState``) so the next example builds its own.

Two documented behaviours the target meets the way a user must:

* ``accelerator.backward`` divides the loss by ``gradient_accumulation_steps`` ("Scales the
  gradients in accordance to the GradientAccumulationPlugin"), for losses averaged per
  micro-batch; ddpcheck's micro-batch losses are already scaled to the whole step's objective, so
  the target multiplies them back first.
* ``AcceleratedScheduler`` steps the scheduler ``num_processes`` times per optimizer step unless
  batches are split ("the training dataloader batch size was multiplied by num_processes, so we
  need to do num_processes steps per training step"); ddpcheck's batch is the global batch split
  across ranks, so the target sets ``split_batches=True`` (``split_batches=False`` is kept as an
  option, which declines scenarios with an LR schedule: the schedule differs by design).

**Your own configuration** (``config``: the keyword arguments of ``Accelerator(**config)``, a
dict or the path of a JSON file holding one; the rule: ``ddpcheck.targets.configuration``). The
scenario's keys (:data:`SCENARIO_KEYS`: the accumulation, the precision) are refused; the
harness's (:data:`HARNESS_KEYS`: the world, the batch split, DDP as the backend) are accepted only
with ddpcheck's value; everything else reaches the ``Accelerator`` -- a
``GradientAccumulationPlugin`` (its ``num_steps`` the scenario's), ``kwargs_handlers`` (a
``DistributedDataParallelKwargs`` replaces the target's ``find_unused_parameters=True``, and what
torch's DDP cannot train under its options is declined: ``ddp_options``), ``dataloader_config``,
``rng_types``. In JSON an object is the dict of its keyword arguments, a handler one with its
class's name under ``"class"``::

    AccelerateTarget(config={
        "gradient_accumulation_plugin": {"sync_each_batch": True},  # num_steps: the scenario's
        "kwargs_handlers": [{"class": "DistributedDataParallelKwargs",
                             "find_unused_parameters": True, "gradient_as_bucket_view": True}]})
    # ddpcheck check accelerate --config accelerate.json  (the same, as a JSON file)

Over a scenario's epochs the target runs accelerate's own data path
(:meth:`AccelerateTarget.fit_epochs`) and, with an evaluation set, evaluates it after every
epoch, gathering each sample's terms with ``gather_for_metrics``
(:meth:`AccelerateTarget.evaluate`).

Imports accelerate only inside the hooks (and, given a config, to check it where it is built).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ddpcheck._base.errors import InvalidArgument, NothingChecked
from ddpcheck._language.scenario import Scenario
from ddpcheck._language.training import (
    EpochRun,
    MicroBatchLoss,
    OptimizerLike,
    Params,
    SchedulerLike,
)
from ddpcheck.targets import ddp_options
from ddpcheck.targets.configuration import (
    Config,
    build,
    construct,
    described,
    has,
    keywords_of,
    load_config,
    reconcile,
)
from ddpcheck.targets.environment import join_existing_group
from ddpcheck.targets.option_space import nested, options
from ddpcheck.targets.protocol import Target
from ddpcheck.targets.reasons import NO_PARAM_DTYPE, OWN_CHECKPOINTS, TORCH_DDP_ORDER

if TYPE_CHECKING:  # accelerate ships no type information: mypy reads these names untyped
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import KwargsHandler

    from ddpcheck.targets.protocol import ConfigSpace

__all__ = ["HARNESS_KEYS", "SCENARIO_KEYS", "AccelerateTarget"]

_PRECISION = "autocast (and dtype): ddpcheck's loop runs the scenario's autocast"
#: ``Accelerator`` keys the scenario sets, example by example: key -> what sets it (refused).
#: A handler in ``kwargs_handlers`` is named by its class.
SCENARIO_KEYS: dict[str, str] = {
    "gradient_accumulation_steps": "accumulation",
    "gradient_accumulation_plugin.num_steps": "accumulation",
    "mixed_precision": _PRECISION,
    "kwargs_handlers.AutocastKwargs": _PRECISION,
    "kwargs_handlers.GradScalerKwargs": "autocast (a float16 scaler skips steps the reference "
    "takes)",
    **{
        f"kwargs_handlers.{recipe}": _PRECISION
        for recipe in ("FP8RecipeKwargs", "AORecipeKwargs", "TERecipeKwargs", "MSAMPRecipeKwargs")
    },
}
_WORLD = "ddpcheck's world: the process group exists, on the world's device"
_DDP = "this target checks accelerate over torch DDP (DeepSpeed has targets of its own)"
#: ``Accelerator`` keys ddpcheck's harness fixes: key -> (the values accepted, why).
HARNESS_KEYS: dict[str, tuple[tuple[object, ...], str]] = {
    "cpu": ((), _WORLD),
    "kwargs_handlers.InitProcessGroupKwargs": ((), _WORLD),
    "step_scheduler_with_optimizer": (
        (True,),
        "the scheduler steps with the optimizer, once per step, as the scenario's schedule",
    ),
    "deepspeed_plugin": ((None,), _DDP),
    "deepspeed_plugins": ((None,), _DDP),
    "fsdp_plugin": ((None,), _DDP),
    "torch_tp_plugin": ((None,), _DDP),
    "megatron_lm_plugin": ((None,), _DDP),
    "parallelism_config": ((None,), _DDP),
    "dynamo_backend": ((None, "no", "NO"), "torch.compile is not tried with this target"),
    "dynamo_plugin": ((None,), "torch.compile is not tried with this target"),
    "log_with": ((None, []), "the target starts no tracker (it never calls init_trackers)"),
}


class AcceleratorLoop:
    """accelerate's loop idiom over a prepared model and optimizer that carry their example's
    ``Accelerator`` (:meth:`hold`): ``accumulate``, ``backward``, ``clip_grad_norm_``, ``reduce``
    of the loss, the prepared scheduler -- one copy for ``accelerate`` and ``accelerate_nd``."""

    @staticmethod
    def hold(accelerator: Accelerator, model: nn.Module, optimizer: OptimizerLike) -> None:
        """The hooks get the model or the optimizer: both carry this example's Accelerator."""
        setattr(model, _ACCELERATOR, accelerator)
        setattr(optimizer, _ACCELERATOR, accelerator)

    def make_scheduler(self, optimizer: OptimizerLike, gamma: float) -> SchedulerLike:
        prepared: AcceleratedOptimizer = optimizer  # what setup's prepare returned
        inner = torch.optim.lr_scheduler.ExponentialLR(prepared.optimizer, gamma)
        return _accelerator(prepared).prepare_scheduler(inner)

    def micro_batch(
        self, model: nn.Module, optimizer: OptimizerLike, index: int, count: int
    ) -> AbstractContextManager[object]:
        return _accelerator(model).accumulate(model)

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        accelerator = _accelerator(model)
        # accelerate divides by gradient_accumulation_steps; ddpcheck's loss is already scaled
        accelerator.backward(loss * accelerator.gradient_accumulation_steps)

    def reported_loss(
        self, model: nn.Module, optimizer: OptimizerLike, losses: Sequence[MicroBatchLoss]
    ) -> torch.Tensor:
        # what accelerate's examples log: the step's loss through accelerator.reduce(..., "mean")
        # (on a mesh a tp group's ranks share one loss: the mean over every rank is over dp)
        return _accelerator(model).reduce(MicroBatchLoss.total(losses), reduction="mean")

    def clip_grad_norm(
        self, model: nn.Module, optimizer: OptimizerLike, max_norm: float, norm_type: float
    ) -> object:
        return _accelerator(model).clip_grad_norm_(model.parameters(), max_norm, norm_type)

    def teardown(self, model: nn.Module, optimizer: OptimizerLike) -> None:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@dataclasses.dataclass(frozen=True)
class AccelerateTarget(AcceleratorLoop, ddp_options.TorchDDPFramework):
    """accelerate's ``Accelerator`` over torch DDP (see the module docstring)."""

    requires = (("accelerate", "0.30.0"),)  # the oldest release tried (docs/frameworks.md)

    split_batches: bool = True
    accumulation: int = 1  # the scenario's micro-batches per step, set by configure()
    config: Config = None  # Accelerator(**config): the module docstring
    #: the evaluation ``DataLoader``'s ``drop_last`` (scenarios with an evaluation set)
    evaluation_drop_last: bool = False

    steps_every_micro_batch = True
    #: over epochs, it evaluates the scenario's evaluation set with ``gather_for_metrics``
    reports_metric = True

    declined_features: ClassVar[Mapping[str, str]] = {
        "rank-orders": TORCH_DDP_ORDER,
        "checkpoint": f"{OWN_CHECKPOINTS} (save_state/load_state, its own directory format)",
        "param-dtype": NO_PARAM_DTYPE,
    }

    def __post_init__(self) -> None:
        where = described("AccelerateTarget", self.config)
        given = load_config(self.config, target=where)
        if given:  # checked, and its objects built once, here: before any process starts
            _check(given, where)
        object.__setattr__(self, "_given", given)
        object.__setattr__(self, "_ddp", _torch_ddp(given))

    def supports(self, scenario: Scenario) -> str | None:
        if not self.splits_batches() and scenario.lr_decay is not None:
            return (
                "an LR schedule with split_batches=False: AcceleratedScheduler then steps "
                "the schedule num_processes times per optimizer step, by design (the "
                "batch is taken to be per process), where the reference steps it once"
            )
        given = vars(self)["_given"]
        if scenario.epochs is not None:
            why = _data_path_cannot_run(scenario, _even_batches(given))
            if why is not None:
                return why
        sync_each_batch = bool(
            _option(given.get("gradient_accumulation_plugin") or {}, "sync_each_batch")
        )
        return ddp_options.cannot_run(
            scenario,
            **self.torch_ddp(),
            no_sync_accumulation=not sync_each_batch,
            where=" (the config's DistributedDataParallelKwargs)",
        )

    def supports_at(self, scenario: Scenario, world_size: int) -> str | None:
        """A scenario with epochs whose micro-batch ``world_size`` does not divide: no per-device
        batch size gives it (and split_batches refuses it); or whose evaluation set an
        evaluation loader with ``drop_last`` would not evaluate whole."""
        if scenario.epochs is None:
            return None
        return _indivisible(
            scenario.global_batch // scenario.accumulation, world_size, self.splits_batches()
        ) or _drops_evaluation(scenario, world_size, self.evaluation_drop_last)

    def splits_batches(self) -> bool:
        """Whether the user's configuration means batches split across the ranks -- the
        ``split_batches`` keyword where given (accelerate has accepted and ignored it since
        1.0: what the user meant is what their loop is written for), else the
        ``DataLoaderConfiguration``'s, else this target's ``split_batches``."""
        given = vars(self)["_given"]
        if "split_batches" in given:
            return bool(given["split_batches"])
        if has(given, "dataloader_config.split_batches"):
            return bool(_option(given.get("dataloader_config") or {}, "split_batches"))
        return self.split_batches

    def config_space(self) -> ConfigSpace:
        """``split_batches=False`` (accelerate's default), the evaluation loader's
        ``drop_last=True`` (``evaluation_drop_last``), and ``Accelerator`` keyword arguments
        as ``config=`` keys (``ddpcheck.targets.option_space``): ``sync_each_batch`` (gradients
        reduced every micro-batch, not under ``no_sync``), the data path's ``dataloader_config``
        (``dispatch_batches``, ``even_batches``), and torch DDP's options through a
        ``DistributedDataParallelKwargs`` -- the target's ``find_unused_parameters=True`` unless
        ``False`` is drawn; what DDP cannot train under them is declined (``ddp_options``)."""
        ddp = nested(
            {
                "find_unused_parameters": (False,),
                "gradient_as_bucket_view": (True,),
                "static_graph": (True,),
            },
            base={"class": "DistributedDataParallelKwargs", "find_unused_parameters": True},
        )
        return options(
            fields={"split_batches": (False,), "evaluation_drop_last": (True,)},
            config={
                "gradient_accumulation_plugin": ({"sync_each_batch": True},),
                "kwargs_handlers": ddp.map(lambda handler: [handler] if handler else {}),
                # the data path's (scenarios with epochs): rank 0 loads and dispatches slices;
                # ranks' last batches left uneven. (Not the split_batches keyword, which
                # accelerate 1.x ignores: drawn, it would fail every run -- check it with
                # --config; bench/accelerate_split_batches.py.)
                "dataloader_config": (
                    {"dispatch_batches": True},
                    {"even_batches": False},
                    {"dispatch_batches": True, "even_batches": False},
                ),
            },
        )

    def warm_up(self) -> None:
        import accelerate  # noqa: F401  (seconds in a rank: once per process, here)

    def configure(self, scenario: Scenario) -> Target:
        # a copy, not dataclasses.replace: the config was read and checked when the target was
        # built, and is not read again in the rank (its file may be elsewhere)
        if scenario.accumulation == self.accumulation:
            return self
        configured = copy.copy(self)
        object.__setattr__(configured, "accumulation", scenario.accumulation)
        return configured

    def setup(
        self,
        module: nn.Module,
        params: Params,
        optimizer_cls: type[torch.optim.Optimizer],
        **kwargs: Any,  # the scenario's options, for its optimizer class
    ) -> tuple[nn.Module, OptimizerLike]:
        accelerator = self.accelerator(module)
        model, optimizer = accelerator.prepare(module, optimizer_cls(params, **kwargs))
        self.hold(accelerator, model, optimizer)
        return model, optimizer

    def accelerator(self, module: nn.Module) -> Accelerator:
        """This example's ``Accelerator``, in the existing process group, from the user's config
        (its objects built afresh) and what the scenario and the harness set."""
        from accelerate import Accelerator

        join_existing_group()
        options = self.accelerator_kwargs(next(module.parameters()).device)
        if not vars(self)["_given"]:
            return Accelerator(**options)
        return construct(Accelerator, options, target=described("AccelerateTarget", self.config))

    def accelerator_kwargs(self, device: torch.device) -> dict[str, object]:
        """``Accelerator``'s keyword arguments in a rank: the user's config, its objects built
        afresh, and what the scenario and the harness set."""
        from accelerate.utils import (
            DataLoaderConfiguration,
            DistributedDataParallelKwargs,
            GradientAccumulationPlugin,
        )

        given = vars(self)["_given"]
        where = described("AccelerateTarget", self.config)
        kwargs = dict(given, cpu=device.type == "cpu")
        plugin = given.get("gradient_accumulation_plugin")
        if plugin is None:
            kwargs["gradient_accumulation_steps"] = self.accumulation
        else:
            plugin = build(
                plugin, GradientAccumulationPlugin, target=where, key="gradient_accumulation_plugin"
            )
            kwargs["gradient_accumulation_plugin"] = dataclasses.replace(
                plugin, num_steps=self.accumulation
            )
        loader = build(
            given.get("dataloader_config") or {},
            DataLoaderConfiguration,
            target=where,
            key="dataloader_config",
        )
        if not has(given, "dataloader_config.split_batches") and "split_batches" not in given:
            # the target's option, where the user said nothing; their own keyword stays as
            # they wrote it, whatever accelerate makes of it
            loader = dataclasses.replace(loader, split_batches=self.split_batches)
        kwargs["dataloader_config"] = loader
        handlers = [_handler(h, where) for h in _listed(given.get("kwargs_handlers"))]
        if not any(isinstance(h, DistributedDataParallelKwargs) for h in handlers):
            handlers.append(DistributedDataParallelKwargs(find_unused_parameters=True))
        kwargs["kwargs_handlers"] = handlers
        return kwargs

    def fit_epochs(self, module: nn.Module, run: EpochRun) -> None:
        """accelerate's own data path over the scenario's dataset, as its guide shows: a
        ``DataLoader`` of the per-device batch (the global micro-batch where the configuration
        splits batches), ``prepare(model, optimizer, dataloader)``, then for every epoch and batch
        ``accumulate``, ``backward`` of the batch's mean loss, ``optimizer.step()``,
        ``scheduler.step()``, ``zero_grad()`` -- accelerate decides which act and when it syncs
        (at a window's end, and at the end of the loader)."""
        from torch.utils.data import DataLoader

        micro = run.global_batch // run.accumulation  # samples per micro-batch, all ranks
        why = _indivisible(micro, run.world_size, self.splits_batches())
        if why is not None:  # asked to run what supports_at declines
            raise NothingChecked(f"AccelerateTarget declines this example: {why}")
        accelerator = self.accelerator(module)
        per_device = micro if self.splits_batches() else micro // run.world_size
        loader = DataLoader(run.dataset, batch_size=per_device)
        evaluation = []
        if run.evaluation is not None:  # its batch split across the ranks, as the training's
            batch = run.evaluation_batch * (run.world_size if self.splits_batches() else 1)
            evaluation.append(
                DataLoader(run.evaluation, batch_size=batch, drop_last=self.evaluation_drop_last)
            )
        model, optimizer, loader, *evaluation = accelerator.prepare(
            module, run.optimizer(run.params, **run.optimizer_kwargs), loader, *evaluation
        )
        self.hold(accelerator, model, optimizer)
        scheduler = None if run.gamma is None else self.make_scheduler(optimizer, run.gamma)
        run.started(model, optimizer)
        for _ in range(run.epochs):
            for batch in loader:
                with accelerator.accumulate(model):
                    accelerator.backward(run.loss_of(model, batch))
                    if run.max_grad_norm is not None and accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(
                            model.parameters(), run.max_grad_norm, run.grad_norm_type
                        )
                    optimizer.step()
                    if scheduler is not None:
                        scheduler.step()
                    if accelerator.sync_gradients:  # the optimizer stepped
                        run.record(model, optimizer, scheduler)
                    optimizer.zero_grad(set_to_none=run.set_to_none)
            for evaluation_loader in evaluation:  # (none without an evaluation set)
                self.evaluate(accelerator, model, run, evaluation_loader)

    def evaluate(
        self,
        accelerator: Accelerator,
        model: nn.Module,
        run: EpochRun,
        loader: Iterable[Sequence[torch.Tensor]],
    ) -> None:
        """After an epoch: the prepared evaluation loader, each sample's terms and count
        gathered and their ratio reported. Where the loader evens out the ranks' batches --
        ``even_batches=True`` (accelerate's default), or a loader that dispatches
        (``dispatch_batches=True``: rank 0 loads each batch and slices it, "loop[ing] with
        indices from the beginning" to complete the last one, as ``prepare_data_loader``'s
        docstring says, whatever ``even_batches`` says) -- as accelerate's guide shows: every
        batch's through ``gather_for_metrics``, which drops the samples repeated to complete the
        last batch. Otherwise (``even_batches=False``) the ranks' last batches differ in size and
        their batch counts may differ, so no collective can run per batch: each rank's terms
        are gathered once after the loop, through ``gather_for_metrics(...,
        use_gather_object=True)`` ("useful for gathering tensors with different sizes"), and
        the module the DDP wrapper holds evaluates (its forward communicates nothing)."""
        from accelerate.data_loader import DataLoaderDispatcher

        even = bool(accelerator.even_batches) or isinstance(loader, DataLoaderDispatcher)
        net = model if even else accelerator.unwrap_model(model)
        net.eval()
        gathered, local = [], []
        for batch in loader:
            terms = run.evaluation_terms(net, batch)
            if even:
                gathered.append(accelerator.gather_for_metrics(terms))
            else:
                local.append(terms)
        net.train()
        if not even:
            mine = torch.cat(local) if local else torch.zeros(0, 2, dtype=torch.float64)
            rows = accelerator.gather_for_metrics(mine, use_gather_object=True)
            gathered = [torch.stack(list(rows)).reshape(-1, 2)]
        run.evaluated(run.metric_of(torch.cat(gathered)))


#: The attribute of the prepared model and optimizer that holds the example's ``Accelerator``.
_ACCELERATOR = "ddpcheck_accelerator"


def _accelerator(prepared: object) -> Accelerator:
    """The example's ``Accelerator``, which setup hung on the prepared model and optimizer."""
    return getattr(prepared, _ACCELERATOR)


_EVEN_BATCHES = (
    "accelerate's DataLoaderConfiguration(even_batches=True), its default: \"in cases where "
    "the total batch size across all processes does not exactly divide the dataset, samples "
    "at the start of the dataset will be duplicated so the batch can be divided equally among "
    'all workers"'
)
_SCALED_BY_ACCUMULATION = (
    'accelerator.backward divides every loss by gradient_accumulation_steps ("Scales the '
    "gradients in accordance to the GradientAccumulationPlugin\"), also in an epoch's last "
    "window when it holds fewer micro-batches"
)


def _data_path_cannot_run(scenario: Scenario, even_batches: bool) -> str | None:
    """Why accelerate's own data path, with the loop its guide writes (the mean loss of each
    batch), does not train ``scenario``'s epochs as the reference does, by a documented
    convention; None when it must."""
    epochs = scenario.epochs
    if epochs is None:
        return None
    if scenario.reduction != "mean" or scenario.loss != "squared_error":
        return (
            "epochs with a summed or token objective: the loop of accelerate's guide takes the "
            "mean loss of each batch"
        )
    if epochs.samples % scenario.global_batch:
        return (
            f"an epoch of {epochs.samples} samples in steps of {scenario.global_batch}: its last "
            "step is short, and "
            + (
                _EVEN_BATCHES
                if even_batches
                else "with even_batches=False the ranks' last batches differ in size while "
                "the loop averages per batch"
            )
            + f"; and {_SCALED_BY_ACCUMULATION}"
        )
    return None


def _drops_evaluation(scenario: Scenario, world_size: int, drop_last: bool) -> str | None:
    """Why an evaluation loader with ``drop_last`` does not evaluate all of ``scenario``'s
    evaluation set at ``world_size``, by torch's and accelerate's documented convention; None
    when it does."""
    epochs = scenario.epochs
    if not drop_last or epochs is None or epochs.evaluation is None:
        return None
    per_device = epochs.evaluation_batch_at(
        scenario.global_batch, scenario.accumulation, world_size
    )
    if epochs.evaluation % (per_device * world_size) == 0:
        return None
    return (
        f"an evaluation set of {epochs.evaluation} samples in batches of "
        f"{per_device * world_size} across the ranks "
        "with drop_last=True: torch's DataLoader drops \"the last incomplete batch, if the "
        "dataset size is not divisible by the batch size\", and accelerate's sharded loader "
        "every batch that leaves some process without one: the metric is over fewer samples "
        "than the evaluation set"
    )


def _indivisible(micro: int, world_size: int, split: bool) -> str | None:
    """Why a micro-batch of ``micro`` samples cannot be loaded at ``world_size``; None if it can."""
    if micro % world_size == 0:
        return None
    why = (
        "split_batches needs a batch size that is a round multiple of the number of processes"
        if split
        else "no per-device batch size gives it"
    )
    return f"a micro-batch of {micro} samples over {world_size} ranks ({why})"


def _even_batches(given: Mapping[str, object]) -> bool:
    """The configuration's ``even_batches`` (accelerate's default: True)."""
    if has(given, "dataloader_config.even_batches"):
        return bool(_option(given.get("dataloader_config") or {}, "even_batches"))
    return True


def _listed(value: object) -> Sequence[object]:
    """The config's ``kwargs_handlers``: a list (or tuple) of handlers, else none."""
    return value if isinstance(value, (list, tuple)) else ()


def _check(given: dict[str, object], where: str) -> None:
    """Refuse what the rule refuses (``configuration.reconcile``), and a JSON form that builds no
    object, naming the key; skipped without accelerate (``Target.requires`` refuses the target
    before it runs)."""
    try:
        from accelerate import Accelerator
        from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin
    except ImportError:
        return
    handlers = given.get("kwargs_handlers") or []
    if not isinstance(handlers, (list, tuple)):
        raise InvalidArgument(
            f"{where}: 'kwargs_handlers' must be a list of handlers (in "
            'JSON, objects naming their class: {"class": '
            '"DistributedDataParallelKwargs", ...})'
        )
    view = dict(given)
    view["kwargs_handlers"] = {type(h).__name__: h for h in (_handler(h, where) for h in handlers)}
    for key, factory in (
        ("gradient_accumulation_plugin", GradientAccumulationPlugin),
        ("dataloader_config", DataLoaderConfiguration),
    ):
        build(given.get(key) or {}, factory, target=where, key=key)  # its keywords checked
    reconcile(
        view,
        target=where,
        scenario_keys=SCENARIO_KEYS,
        harness_keys=HARNESS_KEYS,
        known=keywords_of(Accelerator),
        known_as="Accelerator keyword argument",
    )


def _handler(value: object, where: str) -> KwargsHandler:
    """One of ``kwargs_handlers``: the object, or built from its JSON form (``"class"``: the name
    of one of ``accelerate.utils``' handlers)."""
    import accelerate.utils
    from accelerate.utils import KwargsHandler

    if not isinstance(value, Mapping):
        return build(value, KwargsHandler, target=where, key="kwargs_handlers")

    name = value.get("class")
    cls = getattr(accelerate.utils, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, KwargsHandler)):
        names = sorted(n for n in dir(accelerate.utils) if n.endswith(("Kwargs", "KwargsHandler")))
        raise InvalidArgument(
            f"{where}: a handler of 'kwargs_handlers' given as a dict names "
            f'its class under "class" (one of {", ".join(names)}), not '
            f"{name!r}"
        )
    kwargs = {k: v for k, v in value.items() if k != "class"}
    return build(kwargs, cls, target=where, key=f"kwargs_handlers.{name}")


def _torch_ddp(given: Mapping[str, object]) -> dict[str, bool]:
    """The torch DDP options the ``Accelerator`` will pass (``ddp_options``)."""
    handler = _ddp_handler(given)
    if handler is None:
        return {"find_unused_parameters": True, "static_graph": False}
    return {
        name: bool(_option(handler, name)) for name in ("find_unused_parameters", "static_graph")
    }


def _ddp_handler(given: Mapping[str, object]) -> object:
    """The config's ``DistributedDataParallelKwargs`` (an object or its JSON form), or None."""
    for handler in _listed(given.get("kwargs_handlers")):
        name = handler.get("class") if isinstance(handler, Mapping) else type(handler).__name__
        if name == "DistributedDataParallelKwargs":
            return handler
    return None


def _option(obj: object, name: str) -> object:
    """A field of a handler or plugin, given as an object or as its JSON form (absent: False,
    the default of the flags read here)."""
    return obj.get(name, False) if isinstance(obj, Mapping) else getattr(obj, name, False)
