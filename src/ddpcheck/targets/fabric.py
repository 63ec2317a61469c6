"""The ``fabric`` target: Lightning Fabric's DDP strategy driven as its docs show.

Per example and rank: a ``Fabric(accelerator="cpu", devices=W, strategy=DDPStrategy(
find_unused_parameters=True))`` finds the launcher's environment (``environment``: ``LOCAL_RANK``
says the processes exist) and the initialised process group, so ``launch()`` starts nothing;
``fabric.setup(model, optimizer)`` wraps the model in torch DDP and the optimizer in Fabric's;
every micro-batch but the last runs inside ``fabric.no_backward_sync(model)`` (the last with
``enabled=False``), back-propagates through ``fabric.backward(loss, model=model)``; clipping is
``fabric.clip_gradients(model, optimizer, max_norm=..., norm_type=...)``. The LR schedule is a
plain ``ExponentialLR`` on the optimizer Fabric wrapped (Fabric does not wrap schedulers). Fabric
keeps no per-process singleton; the process groups its strategy creates are destroyed after the
example by ddpcheck's hygiene check, and noted.

**Your own configuration** (``config``: the keyword arguments of ``Fabric(**config)``, a dict or
the path of a JSON file holding one; the rule: ``ddpcheck.targets.configuration``). ``precision``
is the scenario's (refused); ``accelerator``, ``devices``, ``num_nodes`` and ``plugins`` the
harness's (:data:`HARNESS_KEYS`); everything else reaches ``Fabric`` -- above all ``strategy``, a
``lightning.fabric.strategies.DDPStrategy``, a name or its JSON form (``lightning_strategy``),
which replaces the target's ``DDPStrategy(find_unused_parameters=True)``; what torch's DDP cannot
train under its options is declined (``ddp_options``)::

    FabricTarget(config={"strategy": {"name": "ddp", "find_unused_parameters": True,
                                      "gradient_as_bucket_view": True}})
    # ddpcheck check fabric --config fabric.json  (the same, as a JSON file)

**Epochs** (``fit_epochs``: a scenario with a dataset, ``docs/scenarios.md``): Fabric's own
data path, as its docs show -- ``DataLoader(dataset, batch_size=per-device, shuffle=...,
drop_last=...)`` through ``fabric.setup_dataloaders(loader,
use_distributed_sampler=...)``, which with ``True`` (its default) replaces the loader's sampler
by a ``DistributedSampler`` (``shuffle`` where the loader shuffled, ``seed`` 0 or
``PL_GLOBAL_SEED``, torch's ``drop_last=False``) and calls its ``set_epoch`` every epoch; with
``False`` the loader carries the user's own ``DistributedSampler``. Then the epoch loop of
``data_path.SamplerDataPath`` (windows, ``no_backward_sync``, ``fabric.backward``, each loss
normalised over the window's samples on every rank, as Fabric leaves it to the user). The three
are the fields ``use_distributed_sampler``, ``drop_last`` and ``shuffle``. Declined, quoting the
documentation: a dataset W does not divide (the sampler pads: :data:`FABRIC_PADS`), a last batch
``drop_last`` drops (:data:`DROPS_LAST_BATCH`), and ``shuffle=True`` (:data:`SHUFFLES`: a limit
of ddpcheck, whose reference walks the dataset in index order).

Imports Lightning only inside the hooks (and, given a config, to check it where it is built):
listing or pickling the target needs no Lightning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from ddpcheck._language.scenario import Scenario
from ddpcheck._language.training import EpochRun, OptimizerLike, Params, SchedulerLike
from ddpcheck.targets import ddp_options, lightning_strategy
from ddpcheck.targets.configuration import (
    Config,
    construct,
    described,
    load_config,
)
from ddpcheck.targets.data_path import SAMPLER_PADS, SamplerDataPath, sampler_cannot_run
from ddpcheck.targets.environment import join_existing_group
from ddpcheck.targets.option_space import options
from ddpcheck.targets.reasons import NO_PARAM_DTYPE, OWN_CHECKPOINTS, TORCH_DDP_ORDER

if TYPE_CHECKING:
    from ddpcheck.targets.protocol import ConfigSpace

__all__ = [
    "DROPS_LAST_BATCH",
    "FABRIC_PADS",
    "HARNESS_KEYS",
    "SCENARIO_KEYS",
    "SHUFFLES",
    "FabricTarget",
]

#: Fabric's documentation of ``setup_dataloaders(use_distributed_sampler=True)``, and torch's of
#: the sampler it puts in (``Fabric._get_distributed_sampler``: torch's ``drop_last=False``).
FABRIC_PADS = (
    'fabric.setup_dataloaders(use_distributed_sampler=True), its default, "automatically wraps '
    "or replaces the sampler on the dataloader(s) for distributed training\" with torch's "
    f"{SAMPLER_PADS}"
)
#: torch's documentation of ``DataLoader(drop_last=True)``, the user's loader Fabric keeps.
DROPS_LAST_BATCH = (
    "the DataLoader's drop_last=True, which Fabric keeps: \"set to True to drop the last "
    'incomplete batch, if the dataset size is not divisible by the batch size" (its samples are '
    "never trained, where the reference trains every sample every epoch)"
)
#: Why ``shuffle=True`` is declined: Fabric's sampler permutes, ddpcheck's reference does not.
SHUFFLES = (
    "the DataLoader's shuffle=True: Fabric's DistributedSampler then shuffles with seed 0 "
    "(PL_GLOBAL_SEED where set) and a new order every epoch, where ddpcheck's reference walks "
    "the dataset in index order (a limit of ddpcheck)"
)

#: ``Fabric`` keys the scenario sets, example by example: key -> what sets it (refused).
SCENARIO_KEYS: dict[str, str] = {
    "precision": "autocast (and dtype)",
    **lightning_strategy.SCENARIO_KEYS,
}
_WORLD = "ddpcheck's world: the process group exists, on the world's device"
#: ``Fabric`` keys ddpcheck's harness fixes: key -> (the values accepted, why).
HARNESS_KEYS: dict[str, tuple[tuple[object, ...], str]] = {
    "accelerator": ((), _WORLD),
    "devices": ((), _WORLD),
    "num_nodes": ((1,), _WORLD),
    "plugins": (
        (None, []),
        "precision plugins are the scenario's, the cluster environment the world's",
    ),
    **lightning_strategy.HARNESS_KEYS,
}


@dataclasses.dataclass(frozen=True)
class FabricTarget(ddp_options.TorchDDPFramework, SamplerDataPath):
    """Lightning Fabric over torch DDP (see the module docstring)."""

    requires = (("lightning", "2.0.9"),)  # the oldest release tried (docs/frameworks.md)

    config: Config = None  # Fabric(**config): the module docstring
    #: over epochs: ``fabric.setup_dataloaders(loader, use_distributed_sampler=...)``
    use_distributed_sampler: bool = True
    #: over epochs: the training ``DataLoader``'s ``drop_last``
    drop_last: bool = False
    #: over epochs: the training ``DataLoader``'s ``shuffle`` (declined: :data:`SHUFFLES`)
    shuffle: bool = False

    declined_features: ClassVar[Mapping[str, str]] = {
        "rank-orders": TORCH_DDP_ORDER,
        "checkpoint": f"{OWN_CHECKPOINTS} (fabric.save/fabric.load)",
        "param-dtype": NO_PARAM_DTYPE,
    }

    def __post_init__(self) -> None:
        where = described("FabricTarget", self.config)
        given = load_config(self.config, target=where)
        ddp = (_check(given, where) if given else None) or {
            "find_unused_parameters": True,
            "static_graph": False,
        }
        object.__setattr__(self, "_given", given)
        object.__setattr__(self, "_ddp", ddp)

    def supports(self, scenario: Scenario) -> str | None:
        if scenario.epochs is not None and self.shuffle:
            return SHUFFLES
        return ddp_options.cannot_run(
            scenario, **self.torch_ddp(), where=" (the config's strategy)"
        )

    def sampler_cannot_run(self, micro: int, samples: int, world_size: int) -> str | None:
        """The sampler's padding, as Fabric puts it in or as the user's own does, and a last
        batch the loader's ``drop_last`` drops (``samples`` a multiple of W: each rank's last
        batch is short where ``micro`` does not divide them)."""
        why = sampler_cannot_run(micro, samples, world_size)
        if why is not None and micro % world_size == 0 and self.use_distributed_sampler:
            return f"{samples} samples over {world_size} ranks: {FABRIC_PADS}"
        if why is None and self.drop_last and samples % micro:
            return f"{samples} samples in micro-batches of {micro}: {DROPS_LAST_BATCH}"
        return why

    def config_space(self) -> ConfigSpace:
        """``Fabric``'s ``strategy`` as a ``config=`` key: torch DDP's ``static_graph``,
        ``gradient_as_bucket_view``, ``find_unused_parameters=False``
        (``lightning_strategy.space``; ``ddpcheck.targets.option_space``); and the data path's
        fields, for scenarios with epochs: ``use_distributed_sampler=False``, the loader's
        ``drop_last=True`` and ``shuffle=True``."""
        return options(
            fields={
                "use_distributed_sampler": (False,),
                "drop_last": (True,),
                "shuffle": (True,),
            },
            config={"strategy": lightning_strategy.space()},
        )

    def warm_up(self) -> None:
        import lightning.fabric  # noqa: F401  (seconds in a rank: once per process, here)

    def setup(
        self,
        module: nn.Module,
        params: Params,
        optimizer_cls: type[torch.optim.Optimizer],
        **kwargs: Any,  # the scenario's options, for its optimizer class
    ) -> tuple[nn.Module, OptimizerLike]:
        from lightning.fabric import Fabric
        from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        join_existing_group()
        given = vars(self)["_given"]
        strategy = (
            DDPStrategy(find_unused_parameters=True)
            if "strategy" not in given
            else lightning_strategy.make(
                given["strategy"],
                registry=STRATEGY_REGISTRY,
                ddp_cls=DDPStrategy,
                where=described("FabricTarget", self.config),
            )
        )
        options = {
            **given,
            "accelerator": "cpu" if next(module.parameters()).device.type == "cpu" else "cuda",
            "devices": dist.get_world_size(),
            "num_nodes": 1,
            "strategy": strategy,
        }
        fabric = (
            Fabric(**options)
            if not given
            else construct(
                Fabric,
                options,
                target=described("FabricTarget", self.config),
                errors=(TypeError, ValueError, MisconfigurationException),
            )
        )
        fabric.launch()  # the processes and the group exist: sets up the strategy only
        model, optimizer = fabric.setup(module, optimizer_cls(params, **kwargs))
        setattr(model, _FABRIC, fabric)
        return model, optimizer

    def fit_epochs(self, module: nn.Module, run: EpochRun) -> None:
        """Fabric's own data path over the scenario's dataset (the module docstring): the loader
        through ``fabric.setup_dataloaders``, then ``SamplerDataPath``'s epoch loop."""
        self.check_epochs(run, run.world_size)
        model, optimizer = self.setup(module, run.params, run.optimizer, **run.optimizer_kwargs)
        loader = _part(model, _FABRIC).setup_dataloaders(
            self.train_loader(run), use_distributed_sampler=self.use_distributed_sampler
        )
        scheduler = None if run.gamma is None else self.make_scheduler(optimizer, run.gamma)
        run.started(model, optimizer)
        for _ in range(run.epochs):  # Fabric's loader calls its sampler's set_epoch
            for window in self.windows(iter(loader), run.accumulation):
                self.train_window(model, optimizer, run, window)
                self.step(model, optimizer, scheduler, run)
            self.evaluate(model, run)

    def train_loader(self, run: EpochRun) -> DataLoader[_Sample]:
        """The ``DataLoader`` the user hands ``setup_dataloaders``: the per-device batch, the
        loader's ``shuffle`` and ``drop_last``; under ``use_distributed_sampler=False`` the
        user's own ``DistributedSampler`` ("if you have a custom sampler defined, set this
        argument to False"), else none: Fabric puts its own in."""
        batch = self.per_device_batch(run, run.world_size)
        if self.use_distributed_sampler:
            return DataLoader(
                run.dataset, batch_size=batch, shuffle=self.shuffle, drop_last=self.drop_last
            )
        own: DistributedSampler[_Sample] = DistributedSampler(run.dataset, shuffle=self.shuffle)
        return DataLoader(run.dataset, batch_size=batch, sampler=own, drop_last=self.drop_last)

    def no_sync(self, model: nn.Module) -> AbstractContextManager[object]:
        """An accumulating micro-batch of the data path's windows."""
        return _part(model, _FABRIC).no_backward_sync(model, enabled=True)

    def evaluation_model(self, model: nn.Module) -> nn.Module:
        """The module Fabric's wrapper holds (``_FabricModule.module``), not DDP's forward."""
        inner: nn.Module = _part(model, "module")
        return inner

    def make_scheduler(self, optimizer: OptimizerLike, gamma: float) -> SchedulerLike:
        return torch.optim.lr_scheduler.ExponentialLR(_part(optimizer, "optimizer"), gamma)

    def micro_batch(
        self, model: nn.Module, optimizer: OptimizerLike, index: int, count: int
    ) -> AbstractContextManager[object]:
        return _part(model, _FABRIC).no_backward_sync(model, enabled=index < count - 1)

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        _part(model, _FABRIC).backward(loss, model=model)

    def clip_grad_norm(
        self, model: nn.Module, optimizer: OptimizerLike, max_norm: float, norm_type: float
    ) -> object:
        return _part(model, _FABRIC).clip_gradients(
            model, optimizer, max_norm=max_norm, norm_type=norm_type
        )


#: One sample of a scenario's dataset: ``(x, y, index)``.
_Sample = tuple[torch.Tensor, torch.Tensor, int]

#: The attribute of the model setup returned that holds the example's ``Fabric``.
_FABRIC = "ddpcheck_fabric"


def _part(wrapped: object, name: str) -> Any:
    """What ``wrapped`` holds as ``name``: the example's ``Fabric`` (hung on the model by
    setup), or the optimizer Fabric's wrapper holds. Untyped: Lightning types Fabric's methods
    with its private wrapper classes (``_FabricModule``), which ddpcheck does not import."""
    return getattr(wrapped, name)


def _check(given: dict[str, object], where: str) -> dict[str, bool] | None:
    """``lightning_strategy.checked`` for this target's keyword arguments; skipped without
    Lightning (``Target.requires`` refuses the target before it runs)."""
    try:
        from lightning.fabric import Fabric
        from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
    except ImportError:
        return None
    return lightning_strategy.checked(
        given,
        where,
        owner=Fabric,
        registry=STRATEGY_REGISTRY,
        ddp_cls=DDPStrategy,
        keys=(SCENARIO_KEYS, HARNESS_KEYS),
    )
