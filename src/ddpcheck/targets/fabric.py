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

from ddpcheck._language.scenario import Scenario
from ddpcheck._language.training import OptimizerLike, Params, SchedulerLike
from ddpcheck.targets import ddp_options, lightning_strategy
from ddpcheck.targets.configuration import (
    Config,
    construct,
    described,
    load_config,
)
from ddpcheck.targets.environment import join_existing_group
from ddpcheck.targets.option_space import options
from ddpcheck.targets.reasons import NO_PARAM_DTYPE, OWN_CHECKPOINTS, TORCH_DDP_ORDER

if TYPE_CHECKING:
    from ddpcheck.targets.protocol import ConfigSpace

__all__ = ["HARNESS_KEYS", "SCENARIO_KEYS", "FabricTarget"]

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
class FabricTarget(ddp_options.TorchDDPFramework):
    """Lightning Fabric over torch DDP (see the module docstring)."""

    requires = (("lightning", "2.0.9"),)  # the oldest release tried (docs/frameworks.md)

    config: Config = None  # Fabric(**config): the module docstring

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
        return ddp_options.cannot_run(
            scenario, **self.torch_ddp(), where=" (the config's strategy)"
        )

    def config_space(self) -> ConfigSpace:
        """``Fabric``'s ``strategy`` as a ``config=`` key: torch DDP's ``static_graph``,
        ``gradient_as_bucket_view``, ``find_unused_parameters=False``
        (``lightning_strategy.space``; ``ddpcheck.targets.option_space``)."""
        return options(config={"strategy": lightning_strategy.space()})

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
