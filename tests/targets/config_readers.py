"""Targets that read back, inside each rank, what the framework made of a target's ``config=``:
each writes ``rank<r>.json`` into its ``report`` folder once the model and optimizer are built,
so a test sees the setting *reached* the framework, not just that the target accepted it.

Module-level dataclasses: ranks rebuild them from their fields (the replay line too)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch.distributed as dist

from ddpcheck.targets import DeepSpeedTarget, TorchFSDPTarget, TorchZeroTarget


def _write(folder: str, readings: dict[str, Any]) -> None:
    with open(os.path.join(folder, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(readings, f)


def read_back(folder: str) -> list[dict[str, Any]]:
    """Every rank's readings, by rank."""
    names = sorted(n for n in os.listdir(folder) if n.startswith("rank"))
    out = []
    for name in names:
        with open(os.path.join(folder, name)) as f:
            out.append(json.load(f))
    return out


@dataclasses.dataclass(frozen=True)
class ReadingDeepSpeed(DeepSpeedTarget):
    """The engine's own answers: its ZeRO stage, dtypes, buckets, the optimizer it wraps."""

    report: str = ""

    def setup(
        self, module: Any, params: Any, optimizer_cls: type, **kwargs: Any
    ) -> tuple[Any, Any]:
        engine, optimizer = super().setup(module, params, optimizer_cls, **kwargs)
        model_dtype, accumulation_dtype = engine.get_data_types()
        _write(
            self.report,
            {
                "stage": int(engine.zero_optimization_stage()),
                "bf16": bool(engine.bfloat16_enabled()),
                "param_dtype": str(next(module.parameters()).dtype),
                "model_dtype": str(model_dtype),
                "grad_accum_dtype": str(accumulation_dtype),
                "communication_data_type": str(engine.communication_data_type),
                "reduce_bucket_size": int(engine.zero_reduce_bucket_size()),
                "gradient_clipping": float(engine.gradient_clipping()),
                "optimizer": type(engine.optimizer).__name__,
            },
        )
        return engine, optimizer


@dataclasses.dataclass(frozen=True)
class ReadingFSDP(TorchFSDPTarget):
    """FSDP2's own state: the root's mixed-precision policy, and whether its layers keep the
    gathered parameters after forward (``reshard_after_forward=False``)."""

    report: str = ""

    def wrap(self, module: Any) -> Any:
        model = super().wrap(module)
        groups = [
            m._get_fsdp_state()._fsdp_param_group
            for m in model.modules()
            if hasattr(m, "_get_fsdp_state")
        ]
        groups = [g for g in groups if g is not None]
        policy = model._get_fsdp_state()._mp_policy
        _write(
            self.report,
            {
                "output_dtype": str(policy.output_dtype),
                "param_dtype": str(policy.param_dtype),
                "reduce_dtype": str(policy.reduce_dtype),
                "keeps_gathered": [g.post_forward_mesh_info is None for g in groups],
            },
        )
        return model


@dataclasses.dataclass(frozen=True)
class ReadingZero(TorchZeroTarget):
    """``ZeroRedundancyOptimizer``'s own flag."""

    report: str = ""

    def make_optimizer(self, params: Any, optimizer_cls: type, **kwargs: Any) -> Any:
        optimizer = super().make_optimizer(params, optimizer_cls, **kwargs)
        _write(self.report, {"parameters_as_bucket_view": optimizer.parameters_as_bucket_view})
        return optimizer
