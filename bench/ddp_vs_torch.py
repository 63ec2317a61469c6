"""Step time of parallel.DDP against torch's DistributedDataParallel, and the overlap it gets.

Prints (not a test, no assertion):

1. the median step time (forward, backward, gradient sync, SGD step) of ``parallel.DDP`` and of
   torch's ``DistributedDataParallel`` -- default settings (25 MB buckets, static graph not
   declared), and with ``find_unused_parameters=True``, which is what parallel.DDP always offers
   -- on the same 16.8 M-parameter MLP stack, gloo, W=2, in the same world. Repetitions
   interleave the variants (rotating which goes first) and each repetition's time is the slower
   rank's; the figure is the median of per-repetition ratios (ours / torch's). Target: <= 1.0.
2. the overlap, from a ``ddpcheck._runs.trace`` recording of one parallel.DDP step: when
   each bucket's all-reduce was launched and completed, against the end of backward.

Run: ``python bench/ddp_vs_torch.py [repetitions]`` (about a minute on 2 cores);
``python bench/ddp_vs_torch.py --profile`` prints where rank 0's parallel.DDP step spends its time.
``python bench/ddp_vs_torch.py --device cuda [repetitions]``: the same on two GPUs over NCCL (each
step ends with ``torch.cuda.synchronize()``, so it is timed to completion, TF32 off as in every
ddpcheck rank); on a machine with fewer than two GPUs it says so and measures nothing (exit 0).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch import nn

WIDTH, DEPTH, BATCH = 1024, 16, 32  # 16 x (1024 x 1024 + 1024) = 16.8 M parameters, 67 MB


class BenchMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))  # (BATCH, WIDTH)
        return self.layers[-1](x)


def bench_data(seed: int, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, WIDTH, generator=g, dtype=dtype),
        torch.randn(batch, WIDTH, generator=g, dtype=dtype),
    )


def _variants():
    from torch.nn.parallel import DistributedDataParallel

    from ddpcheck._base.devices import to_rank_device
    from parallel import DDP

    def build(wrap):
        torch.manual_seed(0)
        model = wrap(to_rank_device(BenchMLP()))  # on this rank's GPU in a CUDA world
        return model, torch.optim.SGD(model.parameters(), lr=1e-3)

    return {
        "parallel.DDP": build(DDP),
        "torch DDP": build(DistributedDataParallel),
        "torch DDP (find_unused)": build(
            lambda m: DistributedDataParallel(m, find_unused_parameters=True)
        ),
    }


def _step(name: str, model, optimizer, x, y) -> None:
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    if name == "parallel.DDP":
        model.finish_gradient_sync()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if x.is_cuda:  # kernels run asynchronously: the step ends when they have
        torch.cuda.synchronize()


def _rank_time(repetitions: int, warmup: int = 3) -> dict[str, list[float]]:
    import torch.distributed as dist

    from ddpcheck._base.devices import to_rank_device

    variants = _variants()
    names = list(variants)
    x, y = to_rank_device([bench_data(dist.get_rank(), BATCH, torch.float32)])[0]
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(warmup + repetitions):
        order = names[rep % len(names) :] + names[: rep % len(names)]  # rotate who goes first
        for name in order:
            model, optimizer = variants[name]
            dist.barrier()  # start together: a rank's step time includes waiting for the other
            start = time.perf_counter()
            _step(name, model, optimizer, x, y)
            elapsed = time.perf_counter() - start
            if rep >= warmup:
                times[name].append(elapsed)
    return times


def _rank_profile(steps: int) -> str:
    import cProfile
    import io
    import pstats

    import torch.distributed as dist

    from ddpcheck._base.devices import to_rank_device

    model, optimizer = _variants()["parallel.DDP"]
    x, y = to_rank_device([bench_data(dist.get_rank(), BATCH, torch.float32)])[0]
    for _ in range(3):
        _step("parallel.DDP", model, optimizer, x, y)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        _step("parallel.DDP", model, optimizer, x, y)
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(18)
    return out.getvalue()


def step_time(repetitions: int, device: str = "cpu") -> None:
    from ddpcheck._world.registry import get_world

    world = get_world(2, device=device)
    per_rank = world.run(_rank_time, repetitions, deadline=600)
    # A repetition takes as long as its slower rank.
    times = {
        name: [max(r[name][i] for r in per_rank) for i in range(repetitions)]
        for name in per_rank[0]
    }
    ours = times["parallel.DDP"]
    params = sum(p.numel() for p in BenchMLP().parameters())
    print(
        f"Step time, MLP {DEPTH}x{WIDTH} ({params / 1e6:.1f} M parameters, "
        f"{params * 4 / 2**20:.0f} MiB of float32 gradients), batch {BATCH} per rank, SGD, "
        f"{world.backend} W=2 on {device}, default 25 MB buckets, {repetitions} interleaved "
        "repetitions:"
    )
    print(f"  {'parallel.DDP':26} median {statistics.median(ours) * 1e3:7.1f} ms")
    for name in ("torch DDP", "torch DDP (find_unused)"):
        ratio = statistics.median(o / t for o, t in zip(ours, times[name]))
        print(
            f"  {name:26} median {statistics.median(times[name]) * 1e3:7.1f} ms;"
            f" ours / it = {ratio:.3f} (median ratio)"
        )


def overlap(device: str = "cpu") -> None:
    from ddpcheck._runs.trace import record_step
    from ddpcheck._world.registry import get_world
    from ddpcheck.scenario import Scenario
    from ddpcheck.targets import PARALLEL_DDP

    scenario = Scenario(
        model=BenchMLP, data=bench_data, dtype="float32", global_batch=2 * BATCH, steps=1
    )
    traces = get_world(2, device=device).run(record_step, PARALLEL_DDP, scenario, 2, deadline=300)
    print("Overlap, one traced parallel.DDP step (ms from the start of backward):")
    for t in traces:
        backward = [p for p in t.phases if p[0] == "backward"][-1]
        t0 = backward[1]
        cells = []
        for c, carries in zip(t.collectives, t.carries):
            if carries.startswith("bucket"):
                label = carries.split(":")[0]
                cells.append(
                    f"{label} ({c.nbytes / 2**20:.1f} MiB) launched "
                    f"{(c.launched - t0) * 1e3:.1f}, done {(c.completed - t0) * 1e3:.1f}"
                )
        print(f"  rank {t.rank}: backward ends {(backward[2] - t0) * 1e3:.1f}; " + "; ".join(cells))
        first = min(c.launched for c, k in zip(t.collectives, t.carries) if k.startswith("bucket"))
        verdict = "before" if first < backward[2] else "AFTER"
        print(
            f"    first bucket's all-reduce launched {verdict} backward returned "
            f"({(backward[2] - first) * 1e3:.1f} ms earlier)"
        )


def _device(argv: list[str]) -> str:
    """``--device cpu|cuda`` out of ``argv`` (removed from it); "cpu" without one."""
    if "--device" not in argv:
        return "cpu"
    at = argv.index("--device")
    device = argv[at + 1] if at + 1 < len(argv) else ""
    del argv[at : at + 2]
    if device not in ("cpu", "cuda"):
        sys.exit(f"--device {device!r}: use cpu or cuda")
    return device


if __name__ == "__main__":
    args = sys.argv[1:]
    device = _device(args)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and gpus < 2:
        print(
            f"ddp_vs_torch --device cuda: skipped, nothing measured: it needs 2 CUDA devices "
            f"(NCCL, one rank per GPU) and this machine has {gpus}"
        )
        sys.exit(0)
    if "--profile" in args:
        from ddpcheck._world.registry import get_world

        print(get_world(2, device=device).run(_rank_profile, 20, deadline=600)[0])
    else:
        step_time(int(args[0]) if args else 30, device)
        overlap(device)
