"""Targets the configuration tests run, which look inside the rank at what the user's own
configuration did to the framework: the plugin the ``Accelerator`` holds, the options of the DDP
model a Lightning or Fabric strategy built. Each fails its rank, naming what it saw, when the
configuration did not reach the framework. Imports accelerate and Lightning: imported only where
they are installed (the ranks import it by this module's name when they unpickle a target)."""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning.pytorch as pl

from ddpcheck.targets import AccelerateTarget, FabricTarget, LightningTarget

#: accelerate: gradients synchronised every micro-batch (no ``no_sync``), DDP's gradients views of
#: its buckets, still looking for unused parameters
ACCELERATE = {
    "gradient_accumulation_plugin": {"sync_each_batch": True},
    "kwargs_handlers": [
        {
            "class": "DistributedDataParallelKwargs",
            "find_unused_parameters": True,
            "gradient_as_bucket_view": True,
        }
    ],
}
#: Lightning: a static graph, gradients as bucket views (the JSON form of DDPStrategy)
LIGHTNING_STRATEGY = {"name": "ddp", "static_graph": True, "gradient_as_bucket_view": True}
#: Fabric: DDP without find_unused_parameters, gradients as bucket views
FABRIC = {"strategy": {"name": "ddp", "gradient_as_bucket_view": True}}


def _ddp_options(model: Any) -> dict[str, Any]:
    return {
        name: getattr(model, name, None)
        for name in ("static_graph", "gradient_as_bucket_view", "find_unused_parameters")
    }


@dataclasses.dataclass(frozen=True)
class ObservingAccelerate(AccelerateTarget):
    """Fails the rank unless the ``Accelerator`` holds :data:`ACCELERATE`'s plugin and the DDP
    model it prepared has its options."""

    def setup(
        self, module: Any, params: Any, optimizer_cls: type, **kwargs: Any
    ) -> tuple[Any, Any]:
        model, optimizer = super().setup(module, params, optimizer_cls, **kwargs)
        plugin = model.ddpcheck_accelerator.gradient_state.plugin_kwargs
        seen = {"sync_each_batch": plugin.get("sync_each_batch"), **_ddp_options(model)}
        assert seen["sync_each_batch"] is True and seen["gradient_as_bucket_view"] is True, (
            f"the Accelerator holds {seen}, not the configuration given"
        )
        return model, optimizer


class ObserveDDP(pl.Callback):
    """Fails the rank unless the DDP model Lightning's strategy built is static and views its
    buckets (:data:`LIGHTNING_STRATEGY`)."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        seen = _ddp_options(trainer.strategy.model)
        assert seen["static_graph"] is True and seen["gradient_as_bucket_view"] is True, (
            f"Lightning's DDP model has {seen}, not the strategy given"
        )


#: Lightning's Trainer with a user callback and :data:`LIGHTNING_STRATEGY` (a module-level name:
#: a callback object is no code, so this is how a replay line names the target)
OBSERVED_LIGHTNING = LightningTarget(
    config={"strategy": LIGHTNING_STRATEGY, "callbacks": [ObserveDDP()]}
)
#: the control: the same observer, the target's own strategy
UNCONFIGURED_LIGHTNING = LightningTarget(config={"callbacks": [ObserveDDP()]})


@dataclasses.dataclass(frozen=True)
class ObservingFabric(FabricTarget):
    """Fails the rank unless the DDP model Fabric set up has :data:`FABRIC`'s options."""

    def setup(
        self, module: Any, params: Any, optimizer_cls: type, **kwargs: Any
    ) -> tuple[Any, Any]:
        model, optimizer = super().setup(module, params, optimizer_cls, **kwargs)
        seen = _ddp_options(model._forward_module)
        assert (
            seen["gradient_as_bucket_view"] is True and seen["find_unused_parameters"] is False
        ), f"Fabric's DDP model has {seen}, not the strategy given"
        return model, optimizer
