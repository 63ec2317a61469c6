"""The ready-made targets, as ``ddpcheck targets`` lists them and the command line names them: one
instance each, its framework and the releases tried (:data:`TESTED`), a summary, and what it
declines -- read from the target's own ``declined_features``, never written twice.
"""

from __future__ import annotations

import dataclasses

from ddpcheck._language.features import FEATURES
from ddpcheck.targets.accelerate import AccelerateTarget
from ddpcheck.targets.accelerate_nd import AccelerateNDTarget
from ddpcheck.targets.builtin import (
    LocalTarget,
    ParallelDDPTarget,
    ParallelTarget,
    TorchDDPTarget,
    TorchFSDPTarget,
    TorchZeroTarget,
)
from ddpcheck.targets.deepspeed import DeepSpeedTarget
from ddpcheck.targets.deepspeed_autotp import AUTOTP_FLOOR, DeepSpeedAutoTPTarget
from ddpcheck.targets.environment import installed_version
from ddpcheck.targets.fabric import FabricTarget
from ddpcheck.targets.framework import install_command, requirements
from ddpcheck.targets.hf_tp import HfTPTarget
from ddpcheck.targets.hf_trainer import HfTrainerTarget
from ddpcheck.targets.lightning import LightningTarget
from ddpcheck.targets.parallel_tp import ParallelTPTarget
from ddpcheck.targets.pipeline import TorchPPTarget
from ddpcheck.targets.pipeline_nd import TorchNDTarget
from ddpcheck.targets.protocol import Target
from ddpcheck.targets.support import supported_by, why_unsupported
from ddpcheck.targets.tensor_parallel import Torch2DTarget, TorchTPTarget
from ddpcheck.targets.torchtitan import TorchTitanTarget

__all__ = [
    "ACCELERATE",
    "BUILTIN",
    "DEEPSPEED",
    "DEEPSPEED_AUTOTP",
    "DEEPSPEED_ZERO1",
    "DEEPSPEED_ZERO2",
    "FABRIC",
    "ACCELERATE_ND",
    "HF_TP",
    "HF_TRAINER",
    "LIGHTNING",
    "LOCAL",
    "PARALLEL",
    "PARALLEL_DDP",
    "PARALLEL_TP",
    "READY_MADE",
    "TESTED",
    "TORCH_DDP",
    "TORCH_FSDP",
    "TORCH_TP",
    "TORCH_2D",
    "TORCH_ND",
    "TORCH_PP",
    "TORCH_ZERO",
    "TORCH_ZERO_BUCKET_VIEW",
    "TORCHTITAN",
    "ReadyMade",
]

PARALLEL = ParallelTarget()
PARALLEL_DDP = ParallelDDPTarget()
PARALLEL_TP = ParallelTPTarget()
TORCH_DDP = TorchDDPTarget()
TORCH_ZERO = TorchZeroTarget()
TORCH_ZERO_BUCKET_VIEW = TorchZeroTarget(parameters_as_bucket_view=True)
TORCH_FSDP = TorchFSDPTarget()
TORCH_TP = TorchTPTarget()
TORCH_2D = Torch2DTarget()
TORCH_PP = TorchPPTarget()
TORCH_ND = TorchNDTarget()
LOCAL = LocalTarget()
ACCELERATE = AccelerateTarget()
FABRIC = FabricTarget()
LIGHTNING = LightningTarget()
DEEPSPEED = DeepSpeedTarget()  # the stage of its config (DeepSpeedTarget(config=...)), else 2
DEEPSPEED_ZERO1 = DeepSpeedTarget(stage=1)
DEEPSPEED_ZERO2 = DeepSpeedTarget(stage=2)
DEEPSPEED_AUTOTP = DeepSpeedAutoTPTarget()
HF_TRAINER = HfTrainerTarget()
HF_TP = HfTPTarget()
ACCELERATE_ND = AccelerateNDTarget()
TORCHTITAN = TorchTitanTarget()


@dataclasses.dataclass(frozen=True)
class ReadyMade:
    """One ready-made target, as ``ddpcheck targets`` lists it."""

    name: str  # its command-line name
    target: Target
    framework: str  # the distribution that provides what it drives
    module: str  # the module it imports (installed when importable)
    summary: str
    #: what its ``supports()`` declines besides, scenario by scenario
    per_scenario: str = ""
    #: the releases this one target was run against, where fewer than its framework's
    #: (``TESTED``): a target newer than the matrix
    tried: tuple[str, ...] | None = None

    @property
    def declines(self) -> dict[str, str]:
        """feature -> why the target declines it: every feature it is not checked on, with the
        reason its class declares (``Target.declined_features``)."""
        reasons = self.target.declined_features
        return {
            feature: reasons.get(feature) or why_unsupported(self.target, feature)
            for feature in FEATURES
            if feature not in supported_by(self.target)
        }

    @property
    def version(self) -> str | None:
        """The framework's installed version; None when it is not installed."""
        return installed_version(self.framework, self.module)

    @property
    def minimum(self) -> str | None:
        """The oldest release of its framework it supports (``Target.requires``), if any."""
        return dict(getattr(self.target, "requires", ()) or ()).get(self.framework)

    @property
    def minimum_on_cuda(self) -> str | None:
        """Its framework's floor on CUDA where it differs from the CPU's (FSDP2's torch)."""
        on_cuda = dict(requirements(self.target, "cuda")).get(self.framework)
        return on_cuda if on_cuda != self.minimum else None

    @property
    def install(self) -> str:
        """The pip command that installs its framework at a supported release."""
        return install_command(self.framework, self.minimum)

    @property
    def tested(self) -> tuple[str, ...]:
        """The releases of its framework its targets were run against and passed."""
        return TESTED.get(self.framework, ()) if self.tried is None else self.tried


#: The releases of each framework the ready-made targets were run against
#: (``bench/framework_releases.py``; docs/frameworks.md, "Releases tried"; torch's by
#: ``bench/torch_matrix.py``, docs/torch-releases.md, where a release's own bugs are verdicts):
#: the oldest is the floor ``Target.requires`` states (FSDP2's on the CPU is later, measured by
#: ``bench/fsdp2_cpu.py``), the newest the pin of constraints.txt.
TESTED: dict[str, tuple[str, ...]] = {
    "torch": ("2.1.2", "2.4.1", "2.8.0", "2.13.0"),
    "accelerate": ("0.30.0", "0.30.1", "1.0.0", "1.15.0"),
    "lightning": ("2.0.9", "2.4.0", "2.6.6"),
    "transformers": (
        "4.45.2",
        "4.46.0",
        "4.46.2",
        "4.46.3",
        "4.48.3",
        "4.51.3",
        "4.57.6",
        "5.0.0",
        "5.25.0",
    ),
    "deepspeed": ("0.19.0", "0.19.8"),
}

#: Every ready-made target, in the order ``ddpcheck targets`` lists them.
READY_MADE: tuple[ReadyMade, ...] = (
    ReadyMade(
        "parallel",
        PARALLEL,
        "torch",
        "torch",
        "parallel.DDP + parallel.ShardedOptimizer (this repository)",
    ),
    ReadyMade("parallel_ddp", PARALLEL_DDP, "torch", "torch", "parallel.DDP + the plain optimizer"),
    ReadyMade(
        "parallel_tp",
        PARALLEL_TP,
        "torch",
        "torch",
        "parallel.tensor_parallel (this repository's column/row layers) with a plan drawn for "
        "each model over tp, parallel.DDP over dp",
        tried=("2.13.0",),  # bench/torch_matrix.py has no tensor-parallel row yet
    ),
    ReadyMade(
        "torch_ddp",
        TORCH_DDP,
        "torch",
        "torch",
        "torch DistributedDataParallel(find_unused_parameters=True)",
    ),
    ReadyMade(
        "torch_zero",
        TORCH_ZERO,
        "torch",
        "torch",
        "torch DDP + ZeroRedundancyOptimizer; TorchZeroTarget(config={its keyword "
        "arguments} or 'zero.json')",
        "checkpoints where numpy is missing (consolidate_state_dict decodes through it)",
    ),
    ReadyMade(
        "torch_zero_bucket_view",
        TORCH_ZERO_BUCKET_VIEW,
        "torch",
        "torch",
        "torch DDP + ZeroRedundancyOptimizer(parameters_as_bucket_view=True): fails on "
        "torch 2.13 (docs/stride-bug.md)",
    ),
    ReadyMade(
        "torch_fsdp",
        TORCH_FSDP,
        "torch",
        "torch",
        "torch FSDP2 (fully_shard per layer); TorchFSDPTarget(reshard_after_forward=int|"
        "False, cpu_offload=True) for its options (cpu_offload needs --device cuda), "
        "TorchFSDPTarget(config={fully_shard keyword arguments} or 'fsdp.json')",
        "a layer skipped by some ranks' micro-batches, a weight used outside its layer, "
        "infinity-norm clipping with an empty shard, a layer called twice per forward "
        "with accumulation (reduce-scattered twice: bench/fsdp_reused_module.py)",
    ),
    ReadyMade(
        "torch_tp",
        TORCH_TP,
        "torch",
        "torch",
        "torch tensor parallelism (parallelize_module) with a plan drawn for each model, over "
        "every rank (tp = W)",
        tried=("2.13.0",),  # bench/torch_matrix.py has no tensor-parallel row yet
    ),
    ReadyMade(
        "torch_2d",
        TORCH_2D,
        "torch",
        "torch",
        "FSDP2 over dp x torch tensor parallelism over tp, on a (dp, tp) mesh drawn per example",
        tried=("2.13.0",),  # bench/torch_matrix.py has no tensor-parallel row yet
    ),
    ReadyMade(
        "torch_pp",
        TORCH_PP,
        "torch",
        "torch",
        "torch pipeline parallelism (torch.distributed.pipelining, every schedule it ships) "
        "over pp x FSDP2 over dp, on a (dp, pp) mesh, stages and schedule drawn per example",
        "a micro-batch the schedule cannot cut into equal pieces (pytorch#126600)",
        tried=("2.13.0",),  # bench/torch_matrix.py has no pipeline row yet
    ),
    ReadyMade(
        "torch_nd",
        TORCH_ND,
        "torch",
        "torch",
        "a pipeline of tensor-parallel stages: torch.distributed.pipelining over pp x torch "
        "tensor parallelism over tp x FSDP2 over dp, on a (dp, pp, tp) mesh drawn per example",
        "a micro-batch the schedule cannot cut into equal pieces (pytorch#126600)",
        tried=("2.13.0",),
    ),
    ReadyMade("local", LOCAL, "torch", "torch", "no synchronisation at all: must fail for W > 1"),
    ReadyMade(
        "accelerate",
        ACCELERATE,
        "accelerate",
        "accelerate",
        "Accelerator: prepare, accumulate, backward, clip_grad_norm_, the prepared "
        "scheduler; AccelerateTarget(config={...} or 'accelerate.json'): your own "
        "Accelerator arguments",
    ),
    ReadyMade(
        "fabric",
        FABRIC,
        "lightning",
        "lightning",
        "Lightning Fabric DDP: setup, no_backward_sync, backward, clip_gradients; "
        "FabricTarget(config={...}): your own Fabric arguments and strategy",
    ),
    ReadyMade(
        "lightning",
        LIGHTNING,
        "lightning",
        "lightning",
        "Lightning Trainer.fit with DDPStrategy, automatic optimization (its own loop; "
        "LightningTarget(manual=True), LightningTarget(static_graph=True), "
        "LightningTarget(config={...}): your own Trainer arguments and strategy)",
        "infinity-norm clipping in automatic optimization (gradient_clip_val clips the 2-norm)",
    ),
    ReadyMade(
        "hf_trainer",
        HF_TRAINER,
        "transformers",
        "transformers",
        "transformers' Trainer.train over DDP, its own loop: the scenario's model as a "
        "causal LM taking num_items_in_batch; HfTrainerTarget(config={...} or "
        "'args.json', loss_kwargs=False)",
        "reduction='sum' (the Trainer normalises to a mean), clipping a norm other than "
        "the 2-norm, float16 autocast",
    ),
    ReadyMade(
        "hf_tp",
        HF_TP,
        "transformers",
        "transformers",
        "transformers' own tensor parallelism (apply_tensor_parallelism, its colwise/rowwise/"
        "colwise_rep/rowwise_rep styles) with a plan drawn for each model, written as a "
        "transformers plan (generic layer names), or on its own architectures (Llama, Qwen3, "
        "Gemma 3, Phi-3, ...) their own tp_plan (tp_plan='auto'), over tp; with dp > 1 "
        "transformers' own FSDP2 over dp (DistributedConfig(tp_size, fsdp_size)); a plain loop",
        "a plan giving layers of one generic name (blocks.*.up) different styles: no "
        "transformers plan says that",
        tried=("5.25.0",),  # its tensor parallelism moved to transformers.distributed
    ),
    ReadyMade(
        "accelerate_nd",
        ACCELERATE_ND,
        "accelerate",
        "accelerate",
        "accelerate's ParallelismConfig(dp_shard_size, tp_size) over a model transformers "
        "distributed (the drawn plan as a transformers plan, transformers' FSDP2 over "
        "dp_shard), accelerate's loop, as transformers' Trainer composes them; "
        "AccelerateNDTarget(config={...}): your own Accelerator arguments",
        "every example on the CPU (accelerate 1.10.0 to 1.16.0 refuse a ParallelismConfig in a "
        "MULTI_CPU world: hf_tp checks transformers' TP x FSDP2 there), tp=1 meshes, an "
        "fsdp_plugin",
        # 1.10.0-1.14.0 tried too, below the floor (bench/accelerate_nd_cpu.py, the what-if)
        tried=("1.15.0", "1.16.0"),
    ),
    ReadyMade(
        "torchtitan",
        TORCHTITAN,
        "torchtitan",
        "torchtitan",
        "torchtitan's own parallelize_llama (its TP/SP plan over tp, FSDP2 over dp_shard) on "
        "its own Llama 3 at a tiny size, a plain loop with torchtitan's loss normalisation; "
        "TorchTitanTarget(config={its ParallelismConfig fields} or 'parallelism.json'); needs "
        "triton installed to import",
        "a config naming pipeline, context, expert or replicate degrees, or another "
        "spmd_backend; heads tp does not divide; token losses other than the cross-entropy "
        "at tp > 1; reduction='sum'",
        tried=("0.3.0",),
    ),
    ReadyMade(
        "deepspeed",
        DEEPSPEED,
        "deepspeed",
        "deepspeed",
        "DeepSpeed's engine at the ZeRO stage of your config (default 2): "
        "DeepSpeedTarget(config={...} or 'ds_config.json')",
    ),
    ReadyMade(
        "deepspeed_zero1",
        DEEPSPEED_ZERO1,
        "deepspeed",
        "deepspeed",
        "DeepSpeed's engine, ZeRO stage 1, CPU accelerator over gloo (float32: "
        "ddpcheck check deepspeed_zero1 --dtypes float32)",
    ),
    ReadyMade(
        "deepspeed_zero2",
        DEEPSPEED_ZERO2,
        "deepspeed",
        "deepspeed",
        "DeepSpeed's engine, ZeRO stage 2: gradients partitioned, reduced every "
        "micro-batch (float32: --dtypes float32)",
    ),
    ReadyMade(
        "deepspeed_autotp",
        DEEPSPEED_AUTOTP,
        "deepspeed",
        "deepspeed",
        "DeepSpeed's AutoTP training (tensor_parallel.autotp_size = the mesh's tp), ZeRO stage 0 "
        "over dp, on tiny transformers causal LMs it shards by their own plan; "
        "DeepSpeedAutoTPTarget(config={...} or 'ds_config.json')",
        "models other than transformers causal LMs (HfCausalLM), a scenario's own plan, "
        "tp=1, empty shards, clipping in float64 (DeepSpeed's norm is float32)",
        tried=(AUTOTP_FLOOR,),
    ),
)

#: Built-in targets by the short names the command line accepts: a framework's only where it is
#: installed.
BUILTIN = {
    entry.name: entry.target
    for entry in READY_MADE
    if entry.framework == "torch" or entry.version is not None
}
