"""What crosses the wire during one training step, and when: a per-rank timeline.

Invariant: :func:`record_step` runs on every rank of a world and returns, for the last of its
steps, every collective the rank issued through ``torch.distributed``'s Python API (op, bytes,
dtype, root, group, launch, completion and wait times, what it carries) and the phases of the
step (forward, backward, after-backward, optimizer step). :func:`chrome_trace` turns the ranks'
records into Chrome trace format (``chrome://tracing``, https://ui.perfetto.dev): one process per
rank; its thread 0 holds the phases, threads 1.. the collectives, each drawn from launch to
completion on the first lane free at its launch; a flow arrow runs from each asynchronous
collective to the point where the rank waited for it.

Times are ``time.perf_counter()``, which on Linux is ``CLOCK_MONOTONIC``: one clock for every
process on the machine, so ranks line up without correction.

What a collective carries: for a wrapper exposing ``bucket_layout`` (``parallel.DDP``), the bucket
whose gradient bytes match the next asynchronous floating-point all-reduce, in launch order. The
trace reads the layout from the wrapper after the step, so ``parallel/`` needs no hook into
ddpcheck. Collectives issued from C++ (torch DDP's Reducer) never pass through Python and do not
appear.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpcheck._base.devices import to_rank_device
from ddpcheck._language.scenario import Scenario, build_model, make_param_groups
from ddpcheck._language.training import train
from ddpcheck._rank import recorder
from ddpcheck._rank.runner import setup, target_loop
from ddpcheck.targets.protocol import Target

__all__ = ["TRACE_SCENARIO", "RankTrace", "Stack", "chrome_trace", "overlap", "record_step"]


class Stack(nn.Module):
    """Eight 256-wide linear layers (0.5 M parameters): with 1 MB buckets, three buckets."""

    def __init__(self, width: int = 256, depth: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))  # (b, width)
        return self.layers[-1](x)


def stack_data(seed: int, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, 256, generator=g, dtype=dtype),
        torch.randn(batch, 256, generator=g, dtype=dtype),
    )


#: The step ``ddpcheck trace`` records: several buckets, so overlap with backward is visible.
TRACE_SCENARIO = Scenario(
    model=Stack, data=stack_data, dtype="float32", global_batch=64, steps=1, bucket_size_mb=1.0
)


@dataclasses.dataclass
class RankTrace:
    rank: int
    phases: list[tuple[str, float, float]]  # (name, start, end), perf_counter seconds
    collectives: list[recorder.Collective]
    carries: list[str]  # per collective: what it carries ("" if unknown)


def record_step(target: Target, scenario: Scenario = TRACE_SCENARIO, warmup: int = 1) -> RankTrace:
    """Train ``warmup + 1`` steps on this rank and return the last one's timeline.

    The warm-up steps allocate what the first step allocates (optimizer state, gradients), so the
    recorded step is a steady-state one. Collective: run on every rank of the world.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    scenario = dataclasses.replace(scenario, steps=warmup + 1)
    target = target.configure(scenario)
    module = to_rank_device(build_model(scenario, scenario.seed))  # a CUDA world's rank: there
    model, optimizer = setup(target, module, make_param_groups(scenario, module), scenario)
    phases: list[tuple[str, float, float]] = []

    def start_step(step: int) -> None:
        # Line the ranks up so the recorded step starts together (the barrier is not recorded).
        dist.barrier()
        recorder.reset()
        phases.clear()

    train(
        scenario,
        model,
        optimizer,
        target_loop(
            target,
            model,
            optimizer,
            scenario,
            rank,
            world_size,
            before_step=start_step,
            phases=phases,
        ),
    )
    records = recorder.records()
    return RankTrace(rank, phases, records, _carries(model, module, records))


def _carries(model: Any, module: nn.Module, records: list[recorder.Collective]) -> list[str]:
    """Label each record with the DDP bucket it carries, "" if unknown (see module docstring)."""
    layout = getattr(model, "bucket_layout", None)
    params = dict(module.named_parameters())
    buckets = []
    for i, names in enumerate(layout or []):
        nbytes = sum(params[n].numel() * params[n].element_size() for n in names if n in params)
        buckets.append((nbytes, f"bucket {i}: " + ", ".join(names)))
    out, next_bucket = [], 0
    for c in records:
        label = ""
        if (
            not label
            and next_bucket < len(buckets)
            and c.op == "all_reduce"
            and c.async_op
            and c.dtypes
            and c.dtypes[0].startswith(("float", "bfloat"))
            and c.nbytes == buckets[next_bucket][0]
        ):
            label = buckets[next_bucket][1]
            next_bucket += 1
        out.append(label)
    return out


def overlap(trace: RankTrace) -> tuple[float, float] | None:
    """(launch of the first gradient all-reduce, end of backward), in seconds relative to the
    start of the last backward; None if the step launched no async all-reduce."""
    backward = [p for p in trace.phases if p[0] == "backward"][-1]
    launches = [c.launched for c in trace.collectives if c.op == "all_reduce" and c.async_op]
    if not launches:
        return None
    return min(launches) - backward[1], backward[2] - backward[1]


def chrome_trace(traces: list[RankTrace], title: str = "") -> dict[str, Any]:
    """The Chrome trace format (JSON object form) of one step on every rank; times in µs."""
    origin = min(
        [p[1] for t in traces for p in t.phases]
        + [c.launched for t in traces for c in t.collectives]
    )

    def us(seconds: float) -> float:
        return round((seconds - origin) * 1e6, 3)

    events: list[dict[str, Any]] = []
    flow_id = 0
    for t in traces:
        pid = t.rank
        events.append(
            {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"rank {t.rank}"}}
        )
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": t.rank}}
        )
        events.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "step"}}
        )
        for name, start, end in t.phases:
            events.append(
                {
                    "ph": "X",
                    "name": name,
                    "cat": "phase",
                    "pid": pid,
                    "tid": 0,
                    "ts": us(start),
                    "dur": max(us(end) - us(start), 0.001),
                }
            )
        lanes: list[float] = []  # per lane: when its last collective completed
        for c, carries in zip(t.collectives, t.carries):
            end = c.completed if c.completed is not None else c.launched
            lane = next((i for i, free in enumerate(lanes) if free <= c.launched), len(lanes))
            if lane == len(lanes):
                lanes.append(end)
                events.append(
                    {
                        "ph": "M",
                        "name": "thread_name",
                        "pid": pid,
                        "tid": lane + 1,
                        "args": {"name": f"collectives {lane}" if lane else "collectives"},
                    }
                )
            lanes[lane] = end
            args = {
                "bytes": c.nbytes,
                "dtype": "/".join(sorted(set(c.dtypes))),
                "shapes": [list(s) for s in c.shapes],
                "async": c.async_op,
                "carries": carries or "(unknown)",
            }
            for key, value in (
                ("reduce_op", c.reduce_op),
                ("root", c.root),
                ("group", list(c.group) if c.group is not None else None),
            ):
                if value is not None:
                    args[key] = value
            if c.waited is not None:
                args["wait_returned_after_us"] = round((c.waited - c.launched) * 1e6, 1)
            if c.completed is None:
                args["completed"] = "never waited for"
            name = c.op + (f" {carries.split(':')[0]}" if carries.startswith("bucket") else "")
            events.append(
                {
                    "ph": "X",
                    "name": name,
                    "cat": "collective",
                    "pid": pid,
                    "tid": lane + 1,
                    "ts": us(c.launched),
                    "dur": max(us(end) - us(c.launched), 0.001),
                    "args": args,
                }
            )
            if c.async_op and c.waited is not None:
                flow_id += 1
                events.append(
                    {
                        "ph": "s",
                        "name": "wait",
                        "cat": "flow",
                        "id": flow_id,
                        "pid": pid,
                        "tid": lane + 1,
                        "ts": us(c.launched),
                    }
                )
                events.append(
                    {
                        "ph": "f",
                        "bp": "e",
                        "name": "wait",
                        "cat": "flow",
                        "id": flow_id,
                        "pid": pid,
                        "tid": 0,
                        "ts": us(c.waited),
                    }
                )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"title": title, "clock": "perf_counter (CLOCK_MONOTONIC)"},
    }
