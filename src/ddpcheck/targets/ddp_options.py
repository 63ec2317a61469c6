"""What torch DDP's own options, set in a user's framework configuration, let a target check.

accelerate (``DistributedDataParallelKwargs``), Lightning and Fabric (``DDPStrategy(**kwargs)``)
pass these options to torch's ``DistributedDataParallel``. ddpcheck's ready-made targets set
``find_unused_parameters=True``, since unused parameters are part of every battery; a user's
configuration may say otherwise, and is honoured: the scenarios torch documents it cannot train
are declined, never run into its errors and reported as the framework's bug.

* ``find_unused_parameters=False``: torch raises "Expected to have finished reduction in the
  prior iteration" once a parameter gets no gradient -- a parameter unused everywhere, or on
  some ranks, or from step to step (:data:`UNUSED`, :func:`usage_varies`).
* ``static_graph=True``: torch's DDP docs require that "the set of used and unused parameters
  will not change during the whole training loop"; and torch 2.13 trips an internal assert
  under ``no_sync()`` (``bench/ddp_static_graph_no_sync.py``), so accumulation through
  ``no_sync`` is declined too.
"""

from __future__ import annotations

from ddpcheck._language import features
from ddpcheck._language.models import ModelSpec
from ddpcheck._language.scenario import Scenario
from ddpcheck.targets.framework import FrameworkTarget
from ddpcheck.targets.protocol import supported_but

__all__ = ["UNUSED", "TorchDDPFramework", "cannot_run", "declined", "usage_varies"]

#: The features a DDP without ``find_unused_parameters`` cannot train.
UNUSED = frozenset({"unused-everywhere", "unused-on-some-ranks"})


def declined(options: dict[str, bool]) -> frozenset[str]:
    """The features DDP with ``options`` (``find_unused_parameters``, ``static_graph``) cannot
    train whatever the scenario: unused parameters, unless it looks for them or the graph is
    static (the module docstring)."""
    if options["find_unused_parameters"] or options["static_graph"]:
        return frozenset()
    return UNUSED


class TorchDDPFramework(FrameworkTarget):
    """A framework target that trains through torch DDP with options its user may set: the
    features those options cannot train are declined, each with torch's reason, beside its
    class's ``declined_features``. A subclass's ``__post_init__`` stores the options as ``_ddp``
    (``find_unused_parameters``, ``static_graph``), read from its user's configuration, or it
    overrides :meth:`torch_ddp`."""

    def torch_ddp(self) -> dict[str, bool]:
        """The options the framework will pass to torch's ``DistributedDataParallel``."""
        options: dict[str, bool] = vars(self)["_ddp"]
        return options

    @property
    def supported_features(self) -> frozenset[str]:  # type: ignore[override]
        return supported_but(self.declined_features) - declined(self.torch_ddp())

    def declined_reason(self, feature: str) -> str | None:
        if feature in declined(self.torch_ddp()):
            return (
                "your configuration sets torch DDP's find_unused_parameters=False, and DDP raises "
                "'Expected to have finished reduction in the prior iteration' once a parameter "
                "gets no gradient"
            )
        return super().declined_reason(feature)


def usage_varies(scenario: Scenario) -> bool:
    """Whether which parameters get gradients depends on the samples (a layer some samples
    skip): some rank or step then uses another set."""
    if isinstance(scenario.model, ModelSpec) and any(
        layer.use == "sample" for layer in scenario.model.layers
    ):
        return True  # (a zoo model's `layers` may be a count: GPTConfig's)
    return any(
        "unused-on-some-ranks" in features.of(scenario, world_size) for world_size in (2, 3, 4)
    )


def cannot_run(
    scenario: Scenario,
    *,
    find_unused_parameters: bool,
    static_graph: bool,
    no_sync_accumulation: bool = True,
    where: str = "",
) -> str | None:
    """Why torch DDP with these options cannot train ``scenario`` (the module docstring), or None.
    ``no_sync_accumulation``: the framework accumulates under ``no_sync()``; ``where``: how the
    user set the options, for the reason."""
    if static_graph and no_sync_accumulation and scenario.accumulation > 1:
        return (
            f"accumulation with static_graph{where}: torch 2.13's DDP(static_graph=True) "
            "raises 'expect_autograd_hooks_ INTERNAL ASSERT FAILED' under no_sync(), which "
            "the framework accumulates under (bench/ddp_static_graph_no_sync.py)"
        )
    if static_graph and usage_varies(scenario):
        return (
            f"parameter usage that depends on the data, with static_graph{where}: torch's "
            'DDP docs require that "the set of used and unused parameters will not change '
            'during the whole training loop"'
        )
    if not find_unused_parameters and usage_varies(scenario):
        return (
            f"parameter usage that depends on the data, with find_unused_parameters=False"
            f"{where}: torch's DDP raises 'Expected to have finished reduction in the prior "
            "iteration' once a parameter gets no gradient"
        )
    return None
