"""Can ``torch.distributed.pipelining`` carry ``loss_parallel()``? Standalone (no ddpcheck): the
last stage's head column-wise with its logits left sharded over the vocabulary
(``ColwiseParallel(use_local_output=False)``: a ``Shard(-1)`` DTensor, torchtitan's head under
loss parallelism), the schedule's ``loss_fn`` a token cross-entropy (or a policy-gradient loss:
``log_softmax`` then ``nll_loss(reduction="none")``) computed on that DTensor, and
``schedule.step`` run inside ``with loss_parallel():`` -- as torchtitan's trainer runs its
pipeline step inside its train context. The loss is computed inside the schedule on the last
stage's output, and its backward runs inside the schedule too.

W=4 on a ``(pp, tp) = (2, 2)`` mesh, gloo, float64: ``inp`` (a linear), an MLP block (column /
row-wise), ``head`` (5-token vocabulary: uneven over tp=2), cut into two stages (GPipe, 1F1B) or
four (Interleaved1F1B, two per rank: the head alone on the last); a batch of 4 token sequences
of length 3 in 2 pieces (``n_microbatches=2``), ``scale_grads=False`` and a summed loss, then one
SGD step; every gradient gathered whole and compared with one process training the unsharded
model on the whole batch, and the loss the schedule hands back (summed over the pieces).

    python bench/pipeline_loss_parallel.py    # exit 0: every case matches; 1: one differs;
                                              # 2: torch raised (a case it cannot run)

Each row: schedule, loss, whether the step ran under ``loss_parallel()``, the largest |a - b|
over every gradient, the loss's, the placements ``loss_fn`` was handed (``Shard(dim=2)``: the
logits really sharded over the vocabulary; a row is a match only then), and the verdict. The
last row, a control, steps outside ``loss_parallel()``; it is reported, not judged.
The ranks are spawned from one FileStore (no TCP port); every wait ends after ``DEADLINE``
seconds (gloo's timeout) and the main process ends a rank still alive after ``2 x DEADLINE``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: seconds: a rank's start-up on a loaded machine included (60 s timed out at load ~24)
DEADLINE = 180
WORLD, PP, TP = 4, 2, 2
VOCAB, SEQ, IN, WIDTH, HIDDEN = 5, 3, 4, 6, 4
BATCH, PIECES = 4, 2
CASES = [
    ("GPipe", "cross_entropy", True),
    ("1F1B", "cross_entropy", True),
    ("Interleaved1F1B", "cross_entropy", True),
    ("GPipe", "policy_gradient", True),
    ("1F1B", "policy_gradient", True),
    ("GPipe", "cross_entropy", False),  # control: the step outside loss_parallel()
]


def _model() -> torch.nn.Module:
    from torch import nn

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("inp", nn.Linear(IN, WIDTH))
    model.add_module("block", Mlp())
    model.add_module("block2", Mlp())
    model.add_module("head", nn.Linear(WIDTH, VOCAB))
    return model.double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, IN, generator=g, dtype=torch.float64)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, y


def _advantage(y: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(SEQ).expand_as(y).reshape(-1)
    return 0.5 + 0.25 * ((y.reshape(-1) + positions) % 3).double()


def _loss(name: str, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    flat = logits.reshape(-1, VOCAB)
    if name == "cross_entropy":
        loss = F.cross_entropy(flat, y.reshape(-1), reduction="sum")
    else:
        nll = F.nll_loss(F.log_softmax(flat, dim=-1), y.reshape(-1), reduction="none")
        local = getattr(nll, "to_local", None)
        loss = ((nll if local is None else local()) * _advantage(y)).sum()
    local = getattr(loss, "to_local", None)  # Replicate: whole on each rank
    return loss if local is None else local()


def _reference(name: str) -> tuple[dict[str, torch.Tensor], float]:
    model = _model()
    x, y = _data()
    loss = _loss(name, model(x), y)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, float(loss.detach())


def _stages(schedule: str) -> list[list[str]]:
    if schedule == "Interleaved1F1B":
        return [["inp"], ["block"], ["block2"], ["head"]]
    return [["inp", "block"], ["block2", "head"]]


def _rank(rank: int, path: str, schedule: str, loss_name: str, context: bool, out: str) -> None:
    from torch import nn
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    dist.init_process_group(
        "gloo",
        init_method=f"file://{path}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=DEADLINE),
    )
    try:
        mesh = init_device_mesh("cpu", (PP, TP), mesh_dim_names=("pp", "tp"))
        model = _model()
        per_stage = _stages(schedule)
        pp = mesh.get_local_rank("pp")
        mine = list(range(pp, len(per_stage), PP))
        x, y = _data()
        rows = BATCH // PIECES
        stages, params = [], {}
        for index in mine:
            part = nn.Sequential()
            for name in per_stage[index]:
                part.add_module(name, model.get_submodule(name))
            plan: dict[str, object] = {}
            for name in per_stage[index]:
                if name.startswith("block"):
                    plan[f"{name}.up"] = ColwiseParallel()
                    plan[f"{name}.down"] = RowwiseParallel()
                if name == "head":
                    plan["head"] = ColwiseParallel(use_local_output=False)
            if plan:
                parallelize_module(part, mesh["tp"], plan)
            width = IN if per_stage[index][0] == "inp" else WIDTH
            last = "head" in per_stage[index]
            stages.append(
                pipelining.PipelineStage(
                    part,
                    index,
                    len(per_stage),
                    torch.device("cpu"),
                    input_args=torch.empty(rows, SEQ, width, dtype=torch.float64).requires_grad_(
                        index > 0
                    ),
                    output_args=torch.empty(
                        rows, SEQ, VOCAB if last else WIDTH, dtype=torch.float64
                    ).requires_grad_(True),
                    group=mesh.get_group("pp"),
                )
            )
            params.update(
                {
                    f"{n}": p
                    for n, p in model.named_parameters()
                    if n.split(".")[0] in per_stage[index]
                }
            )
        seen: list[str] = []  # what loss_fn was handed: a DTensor sharded over the vocabulary?

        def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            seen.append(str(getattr(output, "placements", type(output).__name__)))
            return _loss(loss_name, output, target)

        kind = getattr(pipelining, f"Schedule{schedule}")
        sched = kind(
            stages[0] if len(stages) == 1 else stages,
            n_microbatches=PIECES,
            loss_fn=loss_fn,
            scale_grads=False,
        )
        losses: list[torch.Tensor] = []
        first, last = 0 in mine, len(per_stage) - 1 in mine
        with loss_parallel() if context else contextlib.nullcontext():
            sched.step(*([x] if first else []), target=y if last else None, losses=losses)
        grads = {}
        for name, p in params.items():
            g = p.grad
            full = getattr(g, "full_tensor", None)
            grads[name] = (full() if callable(full) else g).detach().clone()
        total = float(torch.stack([loss.detach() for loss in losses]).sum()) if last else None
        torch.save({"grads": grads, "loss": total, "seen": seen}, f"{out}.{rank}")
    except Exception:
        traceback.print_exc()
        torch.save({"error": traceback.format_exc(limit=3)}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _case(
    schedule: str, loss_name: str, context: bool
) -> tuple[str, float | None, float | None, str]:
    ref, ref_loss = _reference(loss_name)
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "out")
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(
                target=_rank,
                args=(r, os.path.join(folder, "store"), schedule, loss_name, context, out),
            )
            for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(2 * DEADLINE)
            if p.is_alive():
                p.kill()
        results = [
            torch.load(f"{out}.{r}") if os.path.exists(f"{out}.{r}") else {"error": "no result"}
            for r in range(WORLD)
        ]
    # the root cause first: a rank that raised, before the peers it left waiting
    errors = sorted((r["error"] for r in results if "error" in r), key=_waiting)
    if errors:
        return f"raised: {_why(errors[0])}", None, None, "-"
    seen = sorted({p for r in results for p in r["seen"]})
    worst = 0.0
    for result in results:
        for name, g in result["grads"].items():
            worst = max(worst, float((g - ref[name]).abs().max()))
    reported = [r["loss"] for r in results if r["loss"] is not None]
    loss_off = max(abs(v - ref_loss) for v in reported)
    sharded = seen == ["(Shard(dim=2),)"]
    verdict = "match" if worst < 1e-9 and loss_off < 1e-9 and sharded else "differs"
    return verdict, worst, loss_off, ",".join(seen)


def _waiting(error: str) -> int:
    """0 for a rank's own error, 1 for a rank that died without a word, 2 for a rank that only
    saw a peer go (its connection closed or reset)."""
    if "Connection closed" in error or "Connection reset" in error:
        return 2
    return 1 if error == "no result" else 0


def _why(error: str) -> str:
    """The error's own line (``SomeError: ...``), not the last line of its traceback; a rank
    that died without a word (gloo aborts the process on a size mismatch: its message is on
    stderr) is said so."""
    lines = [line.strip() for line in error.strip().splitlines()]
    found = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): \S", line)]
    text = found[-1] if found else lines[-1]
    if text == "no result":
        return "a rank died without a result (its error is on stderr)"
    return text[:160]


def main() -> int:
    print(f"torch {torch.__version__}, W={WORLD} (pp={PP} x tp={TP}), gloo, float64")
    print(
        f"{'schedule':<16} {'loss':<16} {'context':<14} {'max |grad - ref|':>17} "
        f"{'|loss - ref|':>13}  {'loss_fn got':<16} verdict"
    )
    status = 0
    for schedule, loss_name, context in CASES:
        verdict, worst, loss_off, seen = _case(schedule, loss_name, context)
        shown = [f"{v:.2e}" if v is not None else "-" for v in (worst, loss_off)]
        where = "loss_parallel" if context else "none (control)"
        print(
            f"{schedule:<16} {loss_name:<16} {where:<14} {shown[0]:>17} {shown[1]:>13}  "
            f"{seen:<16} {verdict}"
        )
        if not context:  # the control is told, not judged
            continue
        if verdict.startswith("raised"):
            status = 2
        elif verdict != "match" and status == 0:
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
