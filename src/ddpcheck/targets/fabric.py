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

Imports Lightning only inside the hooks: listing or pickling the target needs no Lightning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ddpcheck.targets.environment import join_existing_group
from ddpcheck.targets.framework import FrameworkTarget
from ddpcheck.targets.reasons import NO_PARAM_DTYPE, OWN_CHECKPOINTS, TORCH_DDP_ORDER

__all__ = ["FabricTarget"]


@dataclasses.dataclass(frozen=True)
class FabricTarget(FrameworkTarget):
    """Lightning Fabric over torch DDP (see the module docstring)."""

    requires = (("lightning", "2.0.9"),)  # the oldest release tried (docs/frameworks.md)

    declined_features: ClassVar[Mapping[str, str]] = {
        "rank-orders": TORCH_DDP_ORDER,
        "checkpoint": f"{OWN_CHECKPOINTS} (fabric.save/fabric.load)",
        "param-dtype": NO_PARAM_DTYPE}

    def warm_up(self) -> None:
        import lightning.fabric  # noqa: F401  (seconds in a rank: once per process, here)

    def setup(self, module: Any, params: Any, optimizer_cls: type,
              **kwargs: Any) -> tuple[Any, Any]:
        from lightning.fabric import Fabric
        from lightning.fabric.strategies import DDPStrategy

        join_existing_group()
        fabric = Fabric(accelerator="cpu" if next(module.parameters()).device.type == "cpu"
                        else "cuda", devices=dist.get_world_size(), num_nodes=1,
                        strategy=DDPStrategy(find_unused_parameters=True))
        fabric.launch()  # the processes and the group exist: sets up the strategy only
        model, optimizer = fabric.setup(module, optimizer_cls(params, **kwargs))
        model.ddpcheck_fabric = fabric
        return model, optimizer

    def make_scheduler(self, optimizer: Any, gamma: float) -> Any:
        return torch.optim.lr_scheduler.ExponentialLR(optimizer.optimizer, gamma)

    def micro_batch(self, model: Any, optimizer: Any, index: int,
                    count: int) -> AbstractContextManager[Any]:
        return model.ddpcheck_fabric.no_backward_sync(model, enabled=index < count - 1)

    def backward(self, model: Any, loss: Any) -> None:
        model.ddpcheck_fabric.backward(loss, model=model)

    def clip_grad_norm(self, model: Any, optimizer: Any, max_norm: float,
                       norm_type: float) -> Any:
        return model.ddpcheck_fabric.clip_gradients(model, optimizer, max_norm=max_norm,
                                                    norm_type=norm_type)
