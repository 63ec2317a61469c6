"""A zero-bubble pipeline schedule over a stage whose output is a view, without ddpcheck: torch
2.13's ``stage_backward_input`` (the input half of a split backward) ends with
``t.detach_()`` on every stage output, and ``detach_`` refuses a view ("Can't detach views
in-place"). The full backward's last-stage path checks ``t._is_view()`` first (pytorch#142237,
for pytorch#142229, open); the split one does not. A tensor-parallel stage's output is always a
view: DTensor's ``to_local()`` returns ``local_tensor.view_as(local_tensor)``, so a module left
to hand on its local tensor (``use_local_output=True``, torch's default for the column- and
row-wise styles, or a replicated module's output hook) raises under ``InterleavedZeroBubble``,
``ZBVZeroBubble`` and ``DualPipeV`` even with nothing sharded.

Each case: a model of stages, each ``Linear(4, 4) -> tanh -> Linear(4, 4)``, float64, cut into 2
stages (GPipe, 1F1B: one per rank) or 4 (the zero-bubble schedules: two per rank, looped or
V-shaped as torch places them), over pp=2 (W=2) or pp=2 x tp=2 (W=4, ``init_device_mesh``), 8
rows in 4 micro-batches, a mean squared loss, ``scale_grads=True``, one ``schedule.step``; every
stage's gradients (full tensors) against one process's on the whole batch. Kinds:

- ``plain``: each stage hands on its last linear's output (no view): every schedule matches;
- ``view``: no DTensor, the stage hands on ``h.view(len(h), -1)`` (pytorch#142229's own case);
- ``tp replicate``: every linear replicated over tp (``distribute_module``: inputs taken as
  ``Replicate``, outputs handed on with ``to_local()``), nothing sharded;
- ``tp col/row``: the first linear ``ColwiseParallel``, the second ``RowwiseParallel`` (torch's
  defaults, ``use_local_output=True``);
- ``tp col/row, clone``: the same, the stage handing on ``h.clone()`` when ``h`` is a view (the
  workaround: a fresh tensor, the numbers unchanged).

Expected on a torch that carries the bug: ``view``, ``tp replicate`` and ``tp col/row`` match
under GPipe and 1F1B and raise "Can't detach views in-place" under the three zero-bubble
schedules; ``plain`` and ``tp col/row, clone`` match under all five.

    python bench/pp_split_backward_view.py

Exit 1: exactly that (torch's bug shows, and the clone avoids it); 0: every case matches (the
bug fixed); 2: anything else. Every wait ends after ``DEADLINE`` seconds (the gloo timeout); a
world still alive ``DEADLINE + 30`` seconds after it started is killed. The ranks are forked,
each world on a FileStore of its own (no port chosen); a rank that raises records its error and
exits at once, so its peers see the socket close instead of waiting. Measured on torch 2.13.0+cpu:
as expected, exit 1 -- the matches within 5.4e-16, every raise "Can't detach views in-place";
25 cases in 553 s on 2 cores at load ~25 (docs/pipeline-parallel.md).
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
ROWS, WIDTH, PIECES = 8, 4, 4
SCHEDULES = (
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
)
SINGLE = {"ScheduleGPipe", "Schedule1F1B"}
V_SHAPED = {"ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
KINDS = ("plain", "view", "tp replicate", "tp col/row", "tp col/row, clone")
RAISING = {"view", "tp replicate", "tp col/row"}  # under a zero-bubble schedule, on torch 2.13
METHOD = "fork" if "fork" in mp.get_all_start_methods() else "spawn"


class Piece(nn.Module):
    """One stage: two linears around a tanh; ``kind`` says what it hands on."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.up, self.down = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.tanh(self.up(x)))
        if self.kind == "view":
            return h.view(len(h), -1)
        if self.kind.endswith("clone") and h._is_view():
            return h.clone()
        return h


def model(kind: str, stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Piece(kind) for _ in range(stages))).double()


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
    if schedule in V_SHAPED:  # down the ranks and back up
        return 4, {0: 0, 1: 1, 2: 1, 3: 0}
    return 4, {s: s % 2 for s in range(4)}  # looped


def tensor_parallel(piece: Piece, kind: str, mesh) -> None:
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if kind == "tp replicate":
        for linear in (piece.up, piece.down):
            distribute_module(
                linear,
                mesh,
                input_fn=lambda _m, args, m: tuple(
                    DTensor.from_local(a, m, [Replicate()], run_check=False) for a in args
                ),
                output_fn=lambda _m, out, _mesh: out.to_local(),
            )
    else:
        parallelize_module(piece, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def run_rank(rank: int, world: int, kind: str, schedule_name: str) -> dict[str, torch.Tensor]:
    from torch.distributed import pipelining

    tp_mesh = None
    if world == 4:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        group, pp_rank, tp_mesh = mesh.get_group("pp"), mesh.get_local_rank("pp"), mesh["tp"]
    else:
        group, pp_rank = dist.group.WORLD, rank
    stages, owner = placement(schedule_name)
    full = model(kind, stages)
    mine = [s for s in range(stages) if owner[s] == pp_rank]
    rows = ROWS // PIECES
    built = []
    for s in mine:
        if tp_mesh is not None:
            tensor_parallel(full[s], kind, tp_mesh)
        hint = torch.zeros(rows, WIDTH, dtype=torch.float64)
        built.append(
            pipelining.PipelineStage(
                full[s],
                s,
                stages,
                torch.device("cpu"),
                input_args=hint.clone().requires_grad_(s > 0),
                output_args=hint.clone().requires_grad_(True),
                group=group,
            )
        )
    schedule = getattr(pipelining, schedule_name)(
        built[0] if schedule_name in SINGLE else built,
        n_microbatches=PIECES,
        loss_fn=lambda out, target: ((out - target) ** 2).mean(),
    )
    x, y = data()
    schedule.step(*([x] if 0 in mine else []), target=y if stages - 1 in mine else None)
    return {f"{s}.{n}": whole(p.grad) for s in mine for n, p in full[s].named_parameters()}


def error_line(exc: BaseException) -> str:
    """The innermost cause's message (torch wraps the autograd error twice)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:120]


def worker(rank: int, world: int, folder: str, kind: str, schedule: str) -> None:
    torch.set_num_threads(1)
    # torch logs the whole schedule of a failed action on every rank: the table says enough
    logging.getLogger("torch.distributed.pipelining").setLevel(logging.CRITICAL)
    record: dict[str, object] = {}
    try:
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(os.path.join(folder, "store"), world),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=DEADLINE),
        )
        record["grads"] = run_rank(rank, world, kind, schedule)
    except Exception as exc:  # its world ends: the peers see the socket close
        record["error"] = error_line(exc)
    torch.save(record, os.path.join(folder, f"rank{rank}.pt"))
    sys.stdout.flush()
    os._exit(0)  # skip gloo's teardown


def run_world(world: int, kind: str, schedule: str) -> list[dict]:
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
    net = model("plain", stages)
    x, y = data()
    ((net(x) - y) ** 2).mean().backward()
    return {f"{s}.{n}": p.grad for s in range(stages) for n, p in net[s].named_parameters()}


def verdict(kind: str, schedule: str, records: list[dict]) -> tuple[str, bool]:
    """(what happened, whether torch's bug predicts it)."""
    expect_raise = kind in RAISING and schedule not in SINGLE
    errors = [r["error"] for r in records if "error" in r]
    if errors:
        own = [e for e in errors if "detach views" in e]
        shown = (own or errors)[0]
        return f"raises: {shown}", expect_raise and bool(own)
    want = reference(placement(schedule)[0])
    worst = max(
        float((g - want[name]).abs().max() / want[name].abs().max())
        for r in records
        for name, g in r["grads"].items()
    )
    return f"{'match' if worst <= 1e-9 else 'DIFFERS'} ({worst:.1e})", (
        worst <= 1e-9 and not expect_raise
    )


def main() -> int:
    print(f"torch {torch.__version__}, gloo, start method {METHOD}")
    print(f"{'kind':18} {'schedule':30} {'W':>2}  outcome")
    predicted, fixed, start = True, True, time.monotonic()
    for kind in KINDS:
        world = 4 if kind.startswith("tp") else 2
        for schedule in SCHEDULES:
            text, as_predicted = verdict(kind, schedule, run_world(world, kind, schedule))
            predicted &= as_predicted
            fixed &= text.startswith("match")
            print(f"{kind:18} {schedule:30} {world:>2}  {text}")
    print(f"{len(KINDS) * len(SCHEDULES)} cases in {time.monotonic() - start:.0f} s")
    if fixed:
        print("every case matches one process: the bug is not in this torch (exit 0)")
        return 0
    if predicted:
        print(
            "a stage handing on a view raises under every zero-bubble schedule (a DTensor "
            "module's local output is one), and a clone avoids it (exit 1)"
        )
        return 1
    print("not as predicted (exit 2)")
    return 2


if __name__ == "__main__":
    sys.exit(main())
