"""FSDP2 resharding after forward under a zero-bubble pipeline schedule, without ddpcheck: torch
2.13's split backward loses weight gradients, silently.

Why (torch/distributed/pipelining/stage.py, ``backward_maybe_with_nosync``): the input half of a
split backward (``stage_backward_input``) finds the weights it must keep intermediates for from
``self.submod.parameters()``, read when that half runs. FSDP2 registers on the module the
parameters of its current state: after a forward with ``reshard_after_forward=True`` those are the
*sharded* DTensors, not the unsharded tensors the autograd graph used, so the weights' gradient
accumulators are not found in the graph, no parameter group holds them, and the weight half
(``stage_backward_weight``) computes nothing for them. Only the first stage escapes (its weight
half is a full backward). A stage whose parameters happen to be unsharded again when its input
half runs (another micro-batch's backward left them so) keeps that micro-batch's gradients: the
result is a partial sum, or ``None``.

Each case: dp=2 x pp=2 (W=4, ``init_device_mesh``), a model of stages each ``Linear(4, 4) ->
tanh -> Linear(4, 4)``, float64, 2 stages (GPipe, 1F1B: one per rank) or 4 (two per rank, looped
or V-shaped as torch places them), each stage ``fully_shard``-ed over ``mesh["dp"]``, 8 rows per
dp rank in 4 micro-batches, a mean squared loss, ``scale_grads=True``, one ``schedule.step``;
every stage's gradients (full tensors) against one process's on the whole batch of 16 rows.
Kinds of sharding:

- ``root, keep``: ``fully_shard(stage, reshard_after_forward=False)`` (torchtitan's default
  with a pipeline: ``reshard_after_forward_policy="default"`` is ``not pp_enabled``);
- ``root, reshard``: ``fully_shard(stage, reshard_after_forward=True)`` (torchtitan's
  ``"always"``);
- ``per linear``: each linear ``fully_shard``-ed with torch's default (``None``: True below the
  root), then the stage with ``reshard_after_forward=False``.

Expected on a torch that carries the bug: ``root, keep`` matches under every schedule; ``root,
reshard`` and ``per linear`` match under GPipe, 1F1B and Interleaved1F1B and differ (some
gradients ``None``) under InterleavedZeroBubble, ZBVZeroBubble and DualPipeV. The ``found``
column says how many of the stage-weights the input halves found in the graph, over all of this
world's input halves (``stage_backward_input`` wrapped to count them; "-" where no input half
ran): every weight, every time, where the numbers are right.

    python bench/pp_fsdp_reshard_split.py

Exit 1: exactly that (torch's bug shows, and keeping the parameters unsharded avoids it); 0:
every case matches (the bug fixed); 2: anything else. Every wait ends after ``DEADLINE`` seconds
(the gloo timeout); a world still alive ``DEADLINE + 30`` seconds after it started is killed. The
ranks are forked, each world on a FileStore of its own (no port chosen). Measured on torch
2.13.0+cpu: as expected, exit 1 -- the matches within 4.8e-16; ``root, reshard`` and ``per
linear`` 8 of 32 gradients None under InterleavedZeroBubble and ZBVZeroBubble (0.83 and 1.1
relative off elsewhere), 0.29 off under DualPipeV; found 32/96, 24/96, 16/24 against 96/96,
96/96, 24/24 kept unsharded; 18 cases in 440 s at load ~24 (docs/pipeline-parallel.md).
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

DEADLINE = 60
ROWS, WIDTH, PIECES, DP = 16, 4, 4, 2
SCHEDULES = (
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
)
SINGLE = {"ScheduleGPipe", "Schedule1F1B"}
V_SHAPED = {"ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
SPLITTING = {"ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
KINDS = ("root, keep", "root, reshard", "per linear")
WRONG = {"root, reshard", "per linear"}  # under a splitting schedule, on torch 2.13
METHOD = "fork" if "fork" in mp.get_all_start_methods() else "spawn"


class Piece(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def model(stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Piece() for _ in range(stages))).double()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (
        torch.randn(ROWS, WIDTH, generator=g, dtype=torch.float64),
        torch.randn(ROWS, WIDTH, generator=g, dtype=torch.float64),
    )


def placement(schedule: str) -> tuple[int, dict[int, int]]:
    """(stages, stage -> pp rank) as torch places them for ``schedule`` at pp=2."""
    if schedule in SINGLE:
        return 2, {0: 0, 1: 1}
    if schedule in V_SHAPED:
        return 4, {0: 0, 1: 1, 2: 1, 3: 0}
    return 4, {s: s % 2 for s in range(4)}


def count_found(found: list[int]) -> None:
    """Wrap torch's ``stage_backward_input`` (as the stage calls it) to count, per call, the
    weights it was given and those its parameter groups hold (found[0] of found[1])."""
    from torch.distributed.pipelining import stage as stage_module

    original = stage_module.stage_backward_input

    def counting(outputs, output_grads, inputs, weights):
        weights = list(weights)
        dinputs, groups = original(outputs, output_grads, inputs, iter(weights))
        found[0] += sum(len(g["params"]) for g in groups)
        found[1] += len(weights)
        return dinputs, groups

    stage_module.stage_backward_input = counting


def run_rank(kind: str, schedule_name: str, found: list[int]) -> dict[str, torch.Tensor]:
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (DP, 2), mesh_dim_names=("dp", "pp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    stages, owner = placement(schedule_name)
    full = model(stages)
    mine = [s for s in range(stages) if owner[s] == pp_rank]
    rows = ROWS // DP // PIECES
    count_found(found)
    built = []
    for s in mine:
        if kind == "per linear":
            fully_shard(full[s].up, mesh=mesh["dp"])
            fully_shard(full[s].down, mesh=mesh["dp"])
        fully_shard(full[s], mesh=mesh["dp"], reshard_after_forward=kind == "root, reshard")
        hint = torch.zeros(rows, WIDTH, dtype=torch.float64)
        built.append(
            pipelining.PipelineStage(
                full[s],
                s,
                stages,
                torch.device("cpu"),
                input_args=hint.clone().requires_grad_(s > 0),
                output_args=hint.clone().requires_grad_(True),
                group=mesh.get_group("pp"),
            )
        )
    schedule = getattr(pipelining, schedule_name)(
        built[0] if schedule_name in SINGLE else built,
        n_microbatches=PIECES,
        loss_fn=lambda out, target: ((out - target) ** 2).mean(),
    )
    x, y = (t.tensor_split(DP)[dp_rank] for t in data())
    schedule.step(*([x] if 0 in mine else []), target=y if stages - 1 in mine else None)
    return {
        f"{s}.{n}": None if p.grad is None else p.grad.full_tensor()
        for s in mine
        for n, p in full[s].named_parameters()
    }


def worker(rank: int, world: int, folder: str, kind: str, schedule: str) -> None:
    torch.set_num_threads(1)
    logging.getLogger("torch.distributed.pipelining").setLevel(logging.CRITICAL)
    record: dict[str, object] = {}
    found = [0, 0]
    try:
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(os.path.join(folder, "store"), world),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=DEADLINE),
        )
        record["grads"] = run_rank(kind, schedule, found)
    except Exception as exc:  # its world ends: the peers see the socket close
        while exc.__cause__ is not None:
            exc = exc.__cause__
        record["error"] = " ".join(f"{type(exc).__name__}: {exc}".split())[:120]
    record["found"] = found
    torch.save(record, os.path.join(folder, f"rank{rank}.pt"))
    sys.stdout.flush()
    os._exit(0)  # skip gloo's teardown


def run_world(kind: str, schedule: str) -> list[dict]:
    world = DP * 2
    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(
            worker,
            args=(world, folder, kind, schedule),
            nprocs=world,
            join=False,
            start_method=METHOD,
        )
        deadline = time.monotonic() + DEADLINE + 30
        for process in context.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        records = []
        for r in range(world):
            path = os.path.join(folder, f"rank{r}.pt")
            records.append(torch.load(path) if os.path.exists(path) else {"error": "hung"})
        return records


def reference(stages: int) -> dict[str, torch.Tensor]:
    net = model(stages)
    x, y = data()
    ((net(x) - y) ** 2).mean().backward()
    return {f"{s}.{n}": p.grad for s in range(stages) for n, p in net[s].named_parameters()}


def verdict(kind: str, schedule: str, records: list[dict]) -> tuple[str, str, bool]:
    """(found, what happened, whether torch's bug predicts it)."""
    found, given = (sum(r["found"][i] for r in records) for i in (0, 1))
    shown = f"{found}/{given}" if given else "-"
    errors = [r["error"] for r in records if "error" in r]
    if errors:
        return shown, f"raises: {errors[0]}", False
    want = reference(placement(schedule)[0])
    grads = [(name, g) for r in records for name, g in r["grads"].items()]
    missing = sum(g is None for _, g in grads)
    worst = max(
        float((g - want[name]).abs().max() / want[name].abs().max())
        for name, g in grads
        if g is not None
    )
    right = worst <= 1e-9 and not missing
    wrong_expected = kind in WRONG and schedule in SPLITTING
    text = "match" if right else "DIFFERS"
    text += f" ({worst:.1e}{f', {missing} of {len(grads)} gradients None' if missing else ''})"
    return shown, text, right != wrong_expected


def main() -> int:
    print(f"torch {torch.__version__}, gloo, start method {METHOD}, dp={DP} x pp=2")
    print(f"{'sharding':14} {'schedule':30} {'found':>7}  outcome")
    predicted, fixed, start = True, True, time.monotonic()
    for kind in KINDS:
        for schedule in SCHEDULES:
            shown, text, as_predicted = verdict(kind, schedule, run_world(kind, schedule))
            predicted &= as_predicted
            fixed &= text.startswith("match")
            print(f"{kind:14} {schedule:30} {shown:>7}  {text}")
    print(f"{len(KINDS) * len(SCHEDULES)} cases in {time.monotonic() - start:.0f} s")
    if fixed:
        print("every case matches one process: the bug is not in this torch (exit 0)")
        return 0
    if predicted:
        print(
            "FSDP2 resharding after forward loses weight gradients under every zero-bubble "
            "schedule, silently; reshard_after_forward=False trains right (exit 1)"
        )
        return 1
    print("not as predicted (exit 2)")
    return 2


if __name__ == "__main__":
    sys.exit(main())
