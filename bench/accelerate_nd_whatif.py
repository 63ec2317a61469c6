"""A what-if for ``accelerate_nd``'s glue on the CPU: accelerate told that a CPU world is
multi-device (``Accelerator.multi_device``, patched in every process that imports this file), so
that ``ParallelismConfig`` is accepted where accelerate 1.15 refuses it (MULTI_CPU,
bench/accelerate_nd_cpu.py). It checks ddpcheck's glue -- transformers distributing the model,
``prepare``, accelerate's loop, the reported loss -- not accelerate's CPU support, which it
does not have: never a verdict on accelerate.

    ddpcheck check bench/accelerate_nd_whatif.py:TARGET --mesh tp=2,dp=2xtp=2 --examples 20

Measured 2026-12-07 (load ~20): exit 0, 3 battery + 20 random examples, 104 s. Before the target
distributed over the harness's mesh (over a mesh accelerate built per example instead): exit 1,
"Could not resolve the process group registered under the name 6", intermittent -- torch's
value-keyed submesh cache handing a later example the groups the fitness check destroyed.
2026-12-08, accelerate 1.15.0 and 1.16.0 at ``dp=2 x tp=2``: exit 1 once an example leaves two
FSDP2 shards empty on a rank (a rank aborts, gloo "8 vs 4") -- accelerate's optimizer remap by
storage address, confirmed without ddpcheck by bench/accelerate_tp_empty_shard.py.
"""

import dataclasses

import accelerate.accelerator as _acc

_acc.Accelerator.multi_device = property(lambda self: self.use_distributed)

from ddpcheck._language.tensor_parallel import mesh_shape  # noqa: E402
from ddpcheck.targets.accelerate_nd import AccelerateNDTarget  # noqa: E402
from ddpcheck.targets.hf_tp import HfTPTarget  # noqa: E402


@dataclasses.dataclass(frozen=True)
class WhatIf(AccelerateNDTarget):
    """accelerate_nd without its CPU decline."""

    def supports(self, scenario):
        if scenario.epochs is not None:
            return "epochs"
        return HfTPTarget.supports(self, scenario)

    def accelerator(self, module):
        import torch.distributed as dist
        from accelerate import Accelerator, ParallelismConfig
        from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin

        from ddpcheck.targets.environment import join_existing_group

        join_existing_group()
        given = vars(self)["_given"]
        kwargs = dict(given, cpu=True)
        dp, tp = mesh_shape(vars(self)["_tensor_parallel"], dist.get_world_size())
        kwargs["parallelism_config"] = ParallelismConfig(dp_shard_size=dp, tp_size=tp)
        plugin = given.get("gradient_accumulation_plugin")
        if plugin is None:
            kwargs["gradient_accumulation_steps"] = self.accumulation
        else:
            kwargs["gradient_accumulation_plugin"] = GradientAccumulationPlugin(
                **{**plugin, "num_steps": self.accumulation}
            )
        kwargs["dataloader_config"] = DataLoaderConfiguration(split_batches=True)
        return Accelerator(**kwargs)


TARGET = WhatIf()
