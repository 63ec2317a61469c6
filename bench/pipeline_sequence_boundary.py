"""Can a sequence-parallel region cross a pipeline stage boundary? Standalone (no ddpcheck): a
stage whose last module is a norm under torch's ``SequenceParallel`` hands the next stage its
activations still sharded along the sequence (dim 1), and the next stage's first module, a norm
under ``SequenceParallel`` too, takes them as its ``Shard(1)`` input -- a region cut in two, as
torchtitan's blocks hand each other their sequence shards under PP x TP x SP.

A ``PipelineStage`` sends plain tensors, so the boundary carries each ``tp`` rank's *local*
shard (``SequenceParallel(use_local_output=True)`` on the first stage's norm; the shapes given
to ``PipelineStage`` are each rank's own); on the other side ``SequenceParallel`` reads a plain
tensor as "already sharded on the sequence" and rebuilds the DTensor with
``DTensor.from_local(..., run_check=False)`` -- no global shape given, so torch assumes the
sequence was split evenly. A second variant hands the DTensor itself
(``use_local_output=False``).

W=4 on a ``(pp, tp) = (2, 2)`` mesh, gloo, float64: stage 0 = ``inp`` (a linear, replicated)
then ``norm0`` (a LayerNorm; ``PrepareModuleInput`` cuts its replicated input along the sequence,
then ``SequenceParallel``); stage 1 = ``norm1`` (a LayerNorm under ``SequenceParallel``), then
``head``, column-wise with its input all-gathered from the sequence shards
(``ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())``); a squared loss,
summed, GPipe, 2 pieces of a batch of 4, ``scale_grads=False``. Compared with one process on the
unsharded model: every gradient gathered whole, and the loss. Sequence lengths 4 (even over
tp=2) and 3 (uneven: shards of 2 and 1, what ddpcheck's models have).

    python bench/pipeline_sequence_boundary.py   # exit 0: every local-shard case matches;
                                                 # 1: one differs or raises (printed)

Each row: the sequence length, what crosses the boundary, the largest |a - b| over every
gradient, the loss's, and the verdict (``match``, ``differs``, or ``raised: ...``). The ranks are
spawned from one FileStore (no TCP port); every wait ends after ``DEADLINE`` seconds (gloo's
timeout) and the main process ends a rank still alive after ``2 x DEADLINE``.
"""

from __future__ import annotations

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
IN, WIDTH, OUT = 3, 4, 3
BATCH, PIECES = 4, 2
#: (sequence length, what crosses the boundary), and whether the verdict is judged
CASES = [(4, "local", True), (3, "local", True), (4, "dtensor", False), (3, "dtensor", False)]


def _model() -> torch.nn.Module:
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("inp", nn.Linear(IN, WIDTH))
    model.add_module("norm0", nn.LayerNorm(WIDTH))
    model.add_module("norm1", nn.LayerNorm(WIDTH))
    model.add_module("head", nn.Linear(WIDTH, OUT))
    with torch.no_grad():  # norms that are not the identity at the start
        for norm in (model.norm0, model.norm1):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    return model.double()


def _data(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, seq, IN, generator=g, dtype=torch.float64)
    y = torch.randn(BATCH, seq, OUT, generator=g, dtype=torch.float64)
    return x, y


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum()


def _reference(seq: int) -> tuple[dict[str, torch.Tensor], float]:
    model = _model()
    x, y = _data(seq)
    loss = _loss(model(x), y)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, float(loss.detach())


def _rank(rank: int, path: str, seq: int, crossing: str, out: str) -> None:
    from torch import nn
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        SequenceParallel,
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
        stage = mesh.get_local_rank("pp")
        tp_rank = mesh.get_local_rank("tp")
        names = [["inp", "norm0"], ["norm1", "head"]][stage]
        part = nn.Sequential()
        for name in names:
            part.add_module(name, model.get_submodule(name))
        local = crossing == "local"
        if stage == 0:
            plan = {
                "norm0": PrepareModuleInput(
                    input_layouts=(Replicate(),),
                    desired_input_layouts=(Shard(1),),
                    use_local_output=False,
                ),
            }
            parallelize_module(part, mesh["tp"], plan)
            parallelize_module(part.norm0, mesh["tp"], SequenceParallel(use_local_output=local))
        else:
            plan = {
                "norm1": SequenceParallel(use_local_output=False),
                "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
            }
            parallelize_module(part, mesh["tp"], plan)
        # every rank's own shard of the sequence: torch.chunk's split, as DTensor's Shard(1)
        chunks = torch.arange(seq).chunk(TP)
        mine = len(chunks[tp_rank]) if tp_rank < len(chunks) else 0
        rows = BATCH // PIECES
        shapes = {
            0: ((rows, seq, IN), (rows, mine, WIDTH)),
            1: ((rows, mine, WIDTH), (rows, seq, OUT)),
        }[stage]
        pipeline_stage = pipelining.PipelineStage(
            part,
            stage,
            PP,
            torch.device("cpu"),
            input_args=torch.empty(shapes[0], dtype=torch.float64).requires_grad_(stage > 0),
            output_args=torch.empty(shapes[1], dtype=torch.float64).requires_grad_(True),
            group=mesh.get_group("pp"),
        )
        schedule = pipelining.ScheduleGPipe(
            pipeline_stage, n_microbatches=PIECES, loss_fn=_loss, scale_grads=False
        )
        x, y = _data(seq)
        losses: list[torch.Tensor] = []
        schedule.step(*([x] if stage == 0 else []), target=y if stage else None, losses=losses)
        grads = {}
        for name, p in model.named_parameters():
            if name.split(".")[0] in names:
                g = p.grad
                full = getattr(g, "full_tensor", None)
                grads[name] = (full() if callable(full) else g).detach().clone()
        total = float(torch.stack([loss.detach() for loss in losses]).sum()) if stage else None
        torch.save({"grads": grads, "loss": total}, f"{out}.{rank}")
    except Exception:
        traceback.print_exc()
        torch.save({"error": traceback.format_exc(limit=3)}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _case(seq: int, crossing: str) -> tuple[str, float | None, float | None]:
    ref, ref_loss = _reference(seq)
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "out")
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_rank, args=(r, os.path.join(folder, "store"), seq, crossing, out))
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
        return f"raised: {_why(errors[0])}", None, None
    worst = 0.0
    for result in results:
        for name, g in result["grads"].items():
            if g.shape != ref[name].shape:
                return f"differs: {name}'s gradient is {tuple(g.shape)}", None, None
            worst = max(worst, float((g - ref[name]).abs().max()))
    loss_off = max(abs(r["loss"] - ref_loss) for r in results if r["loss"] is not None)
    verdict = "match" if worst < 1e-9 and loss_off < 1e-9 else "differs"
    return verdict, worst, loss_off


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
    print(f"{'sequence':<9} {'crossing':<9} {'max |grad - ref|':>17} {'|loss - ref|':>13}  verdict")
    status = 0
    for seq, crossing, judged in CASES:
        verdict, worst, loss_off = _case(seq, crossing)
        shown = [f"{v:.2e}" if v is not None else "-" for v in (worst, loss_off)]
        note = "" if judged else "  (reported, not judged)"
        print(f"{seq:<9} {crossing:<9} {shown[0]:>17} {shown[1]:>13}  {verdict}{note}")
        if judged and verdict != "match":
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
