"""Standalone: DeepSpeed's bf16 mode starts its float32 master weights from the bfloat16 cast of
the model, not from the model's float32 weights. No ddpcheck involved: plain torch and DeepSpeed,
one process (a world of 1 over gloo, on DeepSpeed's CPU accelerator).

    python bench/deepspeed_bf16_masters.py        # in a venv with DeepSpeed

Why it matters to ddpcheck: its ``param_dtype`` policy (float32 masters, forward and backward on
bfloat16 copies) does not say which start the masters take, and FSDP2's ``MixedPrecisionPolicy``
keeps the float32 weights. Where a weight lies near a bfloat16 rounding boundary the two starts
give the forward copies an ulp of difference after a step, and an ill-conditioned model turns that
into a different gradient: the option-space map's one failing cell (docs/frameworks.md) was a
width-2 LayerNorm, whose input gradient is zero in exact arithmetic, flipping the sign of every
gradient behind it at step 1, while DeepSpeed was bitwise the reference started from rounded
masters. So the reference's noise includes that start (``PARAM_DTYPE_VARIANTS``, docs/oracle.md).

In DeepSpeed's source (0.19.8): ``DeepSpeedEngine._configure_distributed_model`` casts the
module's parameters to bfloat16 ("Replaces blanket module.half()/bfloat16()"); then ZeRO-2's
optimizer builds each float32 partition as ``parallel_partitioned_bit16_groups[i][partition_id]
.detach().clone().to(dtype=master_weights_and_grads_dtype)`` (``zero/stage_1_and_2.py``) and
ZeRO-1 with float32 gradient accumulation, which runs ``BF16_Optimizer``, as
``bf16_dp_partitions[partition_id].clone().float()`` (``bf16_optimizer.py``): copies of the cast
parameters. Measured here for stages 1 and 2: every master equals the bfloat16
rounding of the float32 weight it was built from; the float32 weights themselves are not kept.
Exits 1 when the masters are the bfloat16 rounding (what 0.19.8 does), 0 when they are the
float32 weights.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def masters_after_initialize(stage: int) -> tuple[int, int, int]:
    """(tensors, equal to the float32 weights, equal to their bfloat16 rounding)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": True},
        "communication_data_type": "fp32",
        "data_types": {"grad_accum_dtype": "fp32"},
        "steps_per_print": 2**31,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config, dist_init_required=False
    )
    exact = rounded = 0
    for name, p in engine.module.named_parameters():
        master = safe_get_full_fp32_param(p)
        exact += torch.equal(master, weights[name])
        rounded += torch.equal(master, weights[name].to(torch.bfloat16).float())
    return len(weights), exact, rounded


def main() -> int:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        DS_ACCELERATOR="cpu",
    )
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    import deepspeed

    found = 0
    try:
        for stage in (1, 2):
            tensors, exact, rounded = masters_after_initialize(stage)
            print(
                f"deepspeed {deepspeed.__version__}, torch {torch.__version__}, ZeRO-{stage}, "
                f"bf16: of {tensors} float32 masters, {exact} equal the model's float32 weights, "
                f"{rounded} equal their bfloat16 rounding"
            )
            found += rounded == tensors and exact < tensors
    finally:
        dist.destroy_process_group()
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
