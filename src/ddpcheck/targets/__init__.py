"""Targets: how an implementation under test is driven inside each rank (public).

``protocol`` says what a target is -- every hook the runner calls, and its default
(:class:`Target`, :class:`WrapperTarget`, :class:`FitRun` for a target that owns its loop,
:class:`MicroBatchLoss` for one that reports its loss);
``builtin`` holds ``parallel`` (ours), torch's DDP, ZeRO and FSDP2 and ``local``; ``accelerate``,
``fabric``, ``lightning``, ``deepspeed``, ``hf_trainer`` drive those frameworks (each imported
only when its target runs; ``environment`` joins them to the existing process group,
``configuration`` reconciles your own configuration with a scenario); ``catalogue`` lists the
ready-made ones (:data:`READY_MADE`, what ``ddpcheck targets`` prints, and :data:`BUILTIN`, the
short names the command line accepts). This package face hands those names on.
"""

from __future__ import annotations

from ddpcheck.targets.accelerate import AccelerateTarget
from ddpcheck.targets.accelerate_nd import AccelerateNDTarget
from ddpcheck.targets.builtin import (
    ZERO_HARNESS_KEYS,
    ZERO_SCENARIO_KEYS,
    LocalTarget,
    ParallelDDPTarget,
    ParallelTarget,
    TorchDDPTarget,
    TorchFSDPTarget,
    TorchZeroTarget,
)
from ddpcheck.targets.catalogue import (
    ACCELERATE,
    ACCELERATE_ND,
    BUILTIN,
    DEEPSPEED,
    DEEPSPEED_ZERO1,
    DEEPSPEED_ZERO2,
    FABRIC,
    HF_TP,
    HF_TRAINER,
    LIGHTNING,
    LOCAL,
    PARALLEL,
    PARALLEL_DDP,
    PARALLEL_TP,
    READY_MADE,
    TESTED,
    TORCH_2D,
    TORCH_DDP,
    TORCH_FSDP,
    TORCH_ND,
    TORCH_PP,
    TORCH_TP,
    TORCH_ZERO,
    TORCH_ZERO_BUCKET_VIEW,
    ReadyMade,
)
from ddpcheck.targets.deepspeed import DeepSpeedTarget
from ddpcheck.targets.fabric import FabricTarget
from ddpcheck.targets.hf_tp import HfTPTarget
from ddpcheck.targets.hf_trainer import HfTrainerTarget
from ddpcheck.targets.lightning import LightningTarget
from ddpcheck.targets.parallel_tp import ParallelTPTarget
from ddpcheck.targets.pipeline import TorchPPTarget
from ddpcheck.targets.pipeline_nd import TorchNDTarget
from ddpcheck.targets.protocol import (
    CONSTRUCTOR_CALL,
    FitRun,
    MicroBatchLoss,
    OwnsLoop,
    Target,
    WrapperTarget,
)
from ddpcheck.targets.tensor_parallel import Torch2DTarget, TorchTPTarget

__all__ = [
    "ACCELERATE",
    "ACCELERATE_ND",
    "AccelerateNDTarget",
    "AccelerateTarget",
    "BUILTIN",
    "CONSTRUCTOR_CALL",
    "DEEPSPEED",
    "DEEPSPEED_ZERO1",
    "DEEPSPEED_ZERO2",
    "DeepSpeedTarget",
    "FABRIC",
    "FabricTarget",
    "FitRun",
    "HF_TP",
    "HF_TRAINER",
    "HfTPTarget",
    "HfTrainerTarget",
    "LIGHTNING",
    "LOCAL",
    "LightningTarget",
    "LocalTarget",
    "MicroBatchLoss",
    "OwnsLoop",
    "PARALLEL",
    "PARALLEL_DDP",
    "PARALLEL_TP",
    "ParallelDDPTarget",
    "ParallelTPTarget",
    "ParallelTarget",
    "READY_MADE",
    "ReadyMade",
    "TESTED",
    "TORCH_2D",
    "TORCH_ND",
    "TORCH_PP",
    "TORCH_DDP",
    "TORCH_FSDP",
    "TORCH_TP",
    "TORCH_ZERO",
    "TORCH_ZERO_BUCKET_VIEW",
    "Target",
    "Torch2DTarget",
    "TorchNDTarget",
    "TorchPPTarget",
    "TorchDDPTarget",
    "TorchFSDPTarget",
    "TorchTPTarget",
    "TorchZeroTarget",
    "WrapperTarget",
    "ZERO_HARNESS_KEYS",
    "ZERO_SCENARIO_KEYS",
]
