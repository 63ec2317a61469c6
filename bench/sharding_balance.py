"""How evenly each sharding rule spreads optimizer state, and what a sharded step costs.

Prints (not a test, no assertion):

1. per-rank AdamW state bytes (exp_avg + exp_avg_sq + a float32 step per parameter), max / ideal,
   for each rule at W=4 on two GPT-like parameter lists (shapes only, on the meta device): GPT-2
   small, whose tied 50304x768 embedding alone exceeds a quarter of the model, so no rule can
   reach 1.0 -- the line shows the lower bound max(largest, ideal) / ideal -- and a character-level
   GPT (nanoGPT's shakespeare_char), where the largest tensor allows near-perfect balance;
2. ``ShardedOptimizer.step()`` time against torch's ``ZeroRedundancyOptimizer.step()`` on the same
   character-level GPT, AdamW, gloo, W=2, in the same world: repetitions interleave the two, and
   the figure is the median of per-repetition ratios (ours / torch's) on rank 0. Gradients are
   set identically on every rank and, for ours, marked as already averaged (what parallel.DDP
   does), so both steps do the same work: the local AdamW update plus parameter broadcasts.

Run: ``python bench/sharding_balance.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import statistics
import time

import torch

from parallel import ShardedOptimizer, sharding

RULES = {"modulo": sharding.modulo, "contiguous": sharding.contiguous, "greedy": sharding.greedy}


def gpt_shapes(vocab: int, block: int, layers: int, d: int) -> list[tuple[int, ...]]:
    """nanoGPT's parameters in ``model.parameters()`` order (lm_head tied to wte, bias=True)."""
    shapes = [(vocab, d), (block, d)]
    for _ in range(layers):
        shapes += [
            (d,),
            (d,),
            (3 * d, d),
            (3 * d,),
            (d, d),
            (d,),  # ln_1, attn
            (d,),
            (d,),
            (4 * d, d),
            (4 * d,),
            (d, 4 * d),
            (d,),
        ]  # ln_2, mlp
    return [*shapes, (d,), (d,)]  # ln_f


MODELS = {
    "gpt2-small (124M)": gpt_shapes(50304, 1024, 12, 768),
    "gpt-char (10.7M)": gpt_shapes(65, 256, 6, 384),
}


def state_bytes(p: torch.Tensor) -> int:
    return 2 * p.numel() * p.element_size() + 4  # AdamW: exp_avg, exp_avg_sq, step (float32)


def balance(world_size: int = 4) -> None:
    print(f"AdamW state bytes per rank at W={world_size}: max / ideal (ideal = total / W)")
    for name, shapes in MODELS.items():
        params = [torch.empty(s, device="meta") for s in shapes]
        total = sum(state_bytes(p) for p in params)
        ideal = total / world_size
        bound = max(max(state_bytes(p) for p in params), ideal) / ideal
        cells = []
        for rule_name, rule in RULES.items():
            loads = [0] * world_size
            for p, owner in zip(params, rule(params, world_size)):
                loads[owner] += state_bytes(p)
            cells.append(f"{rule_name} {max(loads) / ideal:.3f}")
        print(
            f"  {name:18} {len(params):3} tensors, {total / 2**20:7.1f} MiB: "
            + ", ".join(cells)
            + f"  (best possible >= {bound:.3f})"
        )


def _rank_time(shapes: list[tuple[int, ...]], repetitions: int) -> dict[str, list[float]]:
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from parallel.ddp import AveragedGrad

    def replica():
        g = torch.Generator().manual_seed(0)
        return [torch.randn(s, generator=g).requires_grad_() for s in shapes]

    ours_params, torch_params, bucket_params = replica(), replica(), replica()
    variants = {
        "ours": (
            ShardedOptimizer(
                ours_params, torch.optim.AdamW, sharding_rule=sharding.greedy, lr=1e-3
            ),
            ours_params,
        ),
        "torch": (
            ZeroRedundancyOptimizer(torch_params, optimizer_class=torch.optim.AdamW, lr=1e-3),
            torch_params,
        ),
        "torch bucket view": (
            ZeroRedundancyOptimizer(
                bucket_params,
                optimizer_class=torch.optim.AdamW,
                lr=1e-3,
                parameters_as_bucket_view=True,
            ),
            bucket_params,
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(repetitions + 2):  # the first two warm up (state allocation)
        for name, (opt, params) in variants.items():
            for p in params:
                p.grad = torch.full_like(p, 1e-3)
            if name == "ours":
                for p in params:  # as parallel.DDP.finish_gradient_sync() would have
                    p.ddp_averaged_grad = AveragedGrad(p.grad)
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            elapsed = time.perf_counter() - start
            if rep >= 2:
                times[name].append(elapsed)
    return times


def step_time(repetitions: int = 15) -> None:
    from ddpcheck._world.registry import get_world

    shapes = MODELS["gpt-char (10.7M)"]
    times = get_world(2).run(_rank_time, shapes, repetitions, deadline=600)[0]
    ours = times["ours"]
    print(f"AdamW step, gpt-char, gloo W=2, {repetitions} interleaved repetitions, rank 0:")
    print(f"  ShardedOptimizer (greedy)            median {statistics.median(ours) * 1e3:7.1f} ms")
    for name in ("torch", "torch bucket view"):
        ratio = statistics.median(o / t for o, t in zip(ours, times[name]))
        label = "ZeroRedundancyOptimizer" + (" (bucket view)" if "bucket" in name else "")
        print(
            f"  {label:36} median {statistics.median(times[name]) * 1e3:7.1f} ms;"
            f" ours / it = {ratio:.2f} (median ratio)"
        )


if __name__ == "__main__":
    balance()
    step_time()
