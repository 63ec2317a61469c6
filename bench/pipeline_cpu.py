"""Does ``torch.distributed.pipelining`` train like one process on the whole batch, on the CPU
over gloo? Standalone (no ddpcheck): an MLP of one block per stage, split by hand into
``PipelineStage``s (each stage a copy of the whole model with the other blocks replaced by
``nn.Identity``, so its parameters keep the full model's names), trained for two SGD steps with
every schedule torch ships, compared with the same model trained in one process on the whole batch.

    python bench/pipeline_cpu.py    # exit 0: every case that should match does; 1: one does not

Each row is one case: its schedule, ``ranks`` (pipeline ranks, or dp x pp on a 2-D mesh), the
number of stages, of micro-batches, the largest relative difference (max |a - b| / max |b| per
tensor) over every stage's gradients and parameters after each step, the loss the schedule
returns (the mean of its per-micro-batch losses, or their sum for a summed loss) and the output
``step`` returns, then the time of the first step (which runs torch's shape inference) and of
the second, and the verdict. Three kinds of rows:

- ``match``: torch's documented semantics say the numbers equal the reference's (float64: 1e-9;
  float32: 1e-4). Every schedule at 2, 3 and 4 pipeline ranks (``n_microbatches`` = 2 x ranks;
  the multi-stage schedules with 2 or 3 stages per rank, the V-shaped ones mapping stages
  0..n-1 down the ranks and n..2n-1 back up, so rank 0 holds the last stage), shape hints
  (``input_args``/``output_args``: no shape inference), a new schedule or new stages every step,
  ``scale_grads=False`` with a summed loss, and dp=2 x pp=2 on a ``DeviceMesh`` with a manual
  all-reduce over the dp group, FSDP2 (``fully_shard(mesh=mesh["dp"])``) or DDP with shape hints.
  Any of them failing makes the exit status 1.
- ``known``: the numbers differ from the reference in the way torch's documentation or a public
  issue says; the verdict says whether they differ exactly as predicted. ``scale_grads`` not
  matching the loss's reduction (the docstring of ``PipelineScheduleSingle``: scale_grads=True
  for a mean loss, False for a sum) scales every gradient by n_microbatches or its inverse;
  accumulating over two ``step`` calls without ``zero_grad`` gives g1/n_microbatches + g2, not
  g1 + g2, because the final division by n_microbatches applies to the whole ``.grad``
  (torchtitan#1733, fixed there by ``scale_grads=False`` and a scaled loss); DDP with a
  zero-bubble schedule leaves the stages whose backward is split into input and weight parts with
  their dp-local gradients, silently (pytorch#144530, open; torch's own test_pp_ddp skips it);
  shape inference runs one extra training-mode forward per stage, so a BatchNorm counts one batch
  more than the reference (num_batches_tracked, running_var) unless shape hints are given.
- ``refused``: torch raises (each in a world of its own, whose ranks exit on the first error so
  their peers stop waiting): a batch that micro-batches do not divide evenly (receive buffers are
  sized by the first micro-batch; pytorch#126600: "we do not support this"), fewer rows than
  micro-batches, shape hints without ``requires_grad``, 1F1B/Interleaved constraints, and DDP
  without shape hints, whose first step is right and whose second fails in DDP's reducer (an
  internal assert: shape inference runs the DDP module's forward outside ``no_sync``).

Measured with torch 2.13.0+cpu on 2 shared, loaded cores: every ``match`` row within 2e-15
(float64) or 3e-7 (float32), the loss and output included; every ``known`` row exactly as
predicted (to 1e-15); every ``refused`` row raises, the DDP one after a right first step. The
``losses=`` list gets one 0-d tensor per micro-batch on the rank holding the last stage only (rank
0 for the V-shaped schedules); GPipe, 1F1B, Interleaved1F1B, LoopedBFS and DualPipeV hand back the
loss tensors themselves (requires_grad, graph freed), the zero-bubble ones detached copies.

The ranks are forked (no rank re-imports torch; "spawn" where fork is missing, ~2.5 minutes),
from one FileStore per world (no TCP port is chosen here); every collective and point-to-point wait
ends after ``DEADLINE`` seconds (the gloo timeout) and the main process kills any rank still alive
``DEADLINE + 30`` seconds after its world started. 61 cases in 11-13 s, ~35 s with the start-up
of Python and torch.
"""

from __future__ import annotations

import copy
import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

DEADLINE = 60  # seconds: the gloo timeout of every wait
WIDTH, OUT, BATCH, LR, STEPS = 8, 3, 24, 0.1, 2
SCHEDULES = (
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleLoopedBFS",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
)
SINGLE = {"ScheduleGPipe", "Schedule1F1B"}  # one stage per rank; the others take a list
V_SHAPED = {"ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
LOSSES = {
    "mean": lambda out, target: ((out - target) ** 2).mean(),
    "sum": lambda out, target: ((out - target) ** 2).sum(),
}
METHOD = "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def case(label, schedule, pp=2, per_rank=None, n_mb=None, **options):
    c = dict(
        label=label,
        schedule=schedule,
        pp=pp,
        dp=1,
        n_mb=n_mb or 2 * pp,
        per_rank=per_rank or (1 if schedule in SINGLE else 2),
        expect="match",
        wrap=None,
        hints=False,
        scale_grads=True,
        reduction="mean",
        zero=True,
        lr=LR,
        steps=STEPS,
        dtype="float64",
        batch=BATCH,
        renew=None,
        bn=False,
        predict=1.0,
    )
    c.update(options)
    return c


def cases():
    """(main world: ran in one 4-rank world, none should raise), (one world each: should raise)."""
    main = [case("", s, pp) for pp in (2, 3, 4) for s in SCHEDULES]
    main += [
        case("1 micro-batch", "ScheduleGPipe", n_mb=1),
        case("3 micro-batches", "Schedule1F1B", n_mb=3),
        case("3 micro-batches", "ScheduleInterleaved1F1B", n_mb=3),
        case("3 stages per rank", "ScheduleLoopedBFS", per_rank=3),
        case("3 stages per rank", "ScheduleInterleavedZeroBubble", per_rank=3),
        case("float32", "ScheduleZBVZeroBubble", dtype="float32"),
        case("shape hints", "Schedule1F1B", hints=True),
        case("shape hints", "ScheduleInterleaved1F1B", hints=True),
        case("new schedule each step", "ScheduleGPipe", renew="schedule"),
        case("new stages+schedule each step", "Schedule1F1B", renew="stages"),
        case("scale_grads=False, sum loss", "ScheduleGPipe", scale_grads=False, reduction="sum"),
        case(
            "scale_grads=False, sum loss",
            "ScheduleInterleavedZeroBubble",
            scale_grads=False,
            reduction="sum",
        ),
        case("BatchNorm, shape hints", "ScheduleGPipe", bn=True, hints=True),
    ]
    main += [case("dp2 all_reduce", s, dp=2, wrap="allreduce") for s in SCHEDULES[::5]]
    main += [case("dp2 FSDP2", s, dp=2, wrap="fsdp") for s in SCHEDULES]
    main += [case("dp2 DDP, shape hints", s, dp=2, wrap="ddp", hints=True) for s in SCHEDULES[:4]]
    main += [
        case(
            "scale_grads=False, mean loss",
            "ScheduleGPipe",
            expect="scaled",
            scale_grads=False,
            predict=4.0,
        ),
        case(
            "scale_grads=True, sum loss",
            "Schedule1F1B",
            expect="scaled",
            reduction="sum",
            predict=0.25,
        ),
        case("2 steps, no zero_grad", "ScheduleGPipe", expect="accumulate", zero=False),
        case(
            "2 steps, no zero_grad",
            "ScheduleInterleavedZeroBubble",
            expect="accumulate",
            zero=False,
        ),
        case("BatchNorm, shape inference", "ScheduleGPipe", expect="bn", bn=True),
    ]
    main += [
        case("dp2 DDP, shape hints", s, dp=2, wrap="ddp", hints=True, expect="unreduced", steps=1)
        for s in SCHEDULES[4:]
    ]
    refused = [
        case("10 rows, 4 micro-batches", "ScheduleGPipe", batch=10, n_mb=4, expect="refused"),
        case("3 rows, 4 micro-batches", "ScheduleGPipe", batch=3, n_mb=4, expect="refused"),
        case("shape hints, no requires_grad", "ScheduleGPipe", hints="no_grad", expect="refused"),
        case("2 micro-batches < 3 stages", "Schedule1F1B", pp=3, n_mb=2, expect="refused"),
        case("5 micro-batches, 2 rounds", "ScheduleInterleaved1F1B", n_mb=5, expect="refused"),
        case("dp2 DDP, shape inference", "ScheduleGPipe", dp=2, wrap="ddp", expect="refused"),
    ]
    return main, refused


def full_model(stages, dtype, bn=False):
    torch.manual_seed(0)
    blocks = []
    for i in range(stages):
        last = i == stages - 1
        layers = [nn.BatchNorm1d(WIDTH)] if bn and last else []
        layers += [nn.Linear(WIDTH, OUT)] if last else [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
        blocks.append(nn.Sequential(*layers))
    return nn.Sequential(*blocks).to(dtype)


def stage_module(full, stage):
    """The whole model with every other block an ``nn.Identity``: the full model's names."""
    module = copy.deepcopy(full)
    for i in range(len(module)):
        if i != stage:
            module[i] = nn.Identity()
    return module


def stage_owners(c):
    stages = c["pp"] * c["per_rank"]
    if c["schedule"] in V_SHAPED:  # 0..pp-1 down the ranks, pp..2pp-1 back up
        order = list(range(c["pp"])) + list(reversed(range(c["pp"])))
        return {s: order[s] for s in range(stages)}
    return {s: s % c["pp"] for s in range(stages)}  # looped: stage s on rank s mod pp


def batches(c):
    g = torch.Generator().manual_seed(1)
    dtype = getattr(torch, c["dtype"])
    return [
        (
            torch.randn(c["batch"], WIDTH, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(c["batch"], OUT, generator=g, dtype=torch.float64).to(dtype),
        )
        for _ in range(c["steps"])
    ]


def shape_hints(c, stage, stages, dtype):
    if not c["hints"]:
        return {}
    rows, grad = c["batch"] // c["dp"] // c["n_mb"], c["hints"] != "no_grad"
    width = OUT if stage == stages - 1 else WIDTH
    return dict(
        input_args=torch.zeros(rows, WIDTH, dtype=dtype, requires_grad=grad and stage > 0),
        output_args=torch.zeros(rows, width, dtype=dtype, requires_grad=grad),
    )


def whole(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def run_case(rank, groups, mesh, c, record):
    from torch.distributed import pipelining

    if c["dp"] == 1:
        if rank >= c["pp"]:
            record["idle"] = True
            return
        group, dp_group, dp_rank = groups[c["pp"]], None, 0
        pp_rank = dist.get_rank(group)
    else:
        group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
        pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    dtype, stages = getattr(torch, c["dtype"]), c["pp"] * c["per_rank"]
    owners = stage_owners(c)
    mine = [s for s in range(stages) if owners[s] == pp_rank]
    full = full_model(stages, dtype, c["bn"])
    modules = {s: stage_module(full, s) for s in mine}
    runnable = dict(modules)
    for s in mine:
        if c["wrap"] == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            runnable[s] = DistributedDataParallel(modules[s], process_group=dp_group)
        elif c["wrap"] == "fsdp":
            from torch.distributed.fsdp import fully_shard

            fully_shard(modules[s], mesh=mesh["dp"])

    def build_stages():
        return [
            pipelining.PipelineStage(
                runnable[s],
                s,
                stages,
                torch.device("cpu"),
                group=group,
                **shape_hints(c, s, stages, dtype),
            )
            for s in mine
        ]

    def build_schedule(built):
        return getattr(pipelining, c["schedule"])(
            built[0] if c["schedule"] in SINGLE else built,
            n_microbatches=c["n_mb"],
            loss_fn=LOSSES[c["reduction"]],
            scale_grads=c["scale_grads"],
        )

    built = build_stages()
    schedule = build_schedule(built)
    params = [p for s in mine for p in modules[s].parameters()]
    optimizer = torch.optim.SGD(params, lr=c["lr"])
    record.update(stages=mine, dp_rank=dp_rank, pp_rank=pp_rank)
    for k, (x, y) in enumerate(batches(c)):
        if k and c["renew"] == "stages":
            built = build_stages()
        if k and c["renew"]:
            schedule = build_schedule(built)
        if c["dp"] > 1:
            x, y = x.tensor_split(c["dp"])[dp_rank], y.tensor_split(c["dp"])[dp_rank]
        losses = []
        args = (x,) if 0 in mine else ()
        kwargs = dict(target=y) if stages - 1 in mine else {}
        start = time.perf_counter()
        output = schedule.step(*args, losses=losses, **kwargs)
        if c["wrap"] == "allreduce":
            for p in params:
                dist.all_reduce(p.grad, group=dp_group)
                p.grad.div_(c["dp"])
        seconds = time.perf_counter() - start
        grads = {n: whole(p.grad) for s in mine for n, p in modules[s].named_parameters()}
        optimizer.step()
        if c["zero"]:
            optimizer.zero_grad()
        record["steps"].append(
            dict(
                grads=grads,
                params={n: whole(p) for s in mine for n, p in modules[s].named_parameters()},
                buffers={n: b.clone() for s in mine for n, b in modules[s].named_buffers()},
                losses=[float(v.detach()) for v in losses] if stages - 1 in mine else None,
                stray_losses=0 if stages - 1 in mine else len(losses),
                loss_requires_grad=any(v.requires_grad for v in losses),
                output=None if output is None else output.detach().clone(),
                seconds=seconds,
            )
        )


def error_line(exc):
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__
    if cause is not None:
        text = f"{type(cause).__name__}: {cause}"
    return " ".join(text.split())[:150]


def worker(rank, world, folder, todo):
    torch.set_num_threads(1)
    done = []
    try:
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(os.path.join(folder, "store"), world),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=DEADLINE),
        )
        groups = {world: dist.group.WORLD}
        for n in range(2, world):
            groups[n] = dist.new_group(list(range(n)))
        mesh = None
        if world == 4:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        for c in todo:
            done.append({"steps": []})
            run_case(rank, groups, mesh, c, done[-1])
            dist.barrier()
    except Exception as exc:  # one rank's error ends its world: its peers see the socket close
        if not done:
            done.append({"steps": []})
        done[-1]["error"] = error_line(exc)
    torch.save(done, os.path.join(folder, f"rank{rank}.pt"))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip gloo's teardown


def run_world(world, todo):
    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(
            worker, args=(world, folder, todo), nprocs=world, join=False, start_method=METHOD
        )
        deadline = time.monotonic() + DEADLINE + 30
        for process in context.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        ranks = []
        for r in range(world):
            path = os.path.join(folder, f"rank{r}.pt")
            ranks.append(torch.load(path) if os.path.exists(path) else [{"error": "hung"}])
    # per case: the records of the ranks that took part
    return [
        [rs[i] if i < len(rs) else {"error": "not run"} for rs in ranks] for i in range(len(todo))
    ]


def reference(c, predict=1.0, carry=1.0, shard=None):
    """One process: the whole batch (or a dp shard), its mean loss (times ``predict``); before
    each backward after the first, the kept gradients divided by ``carry``."""
    dtype = getattr(torch, c["dtype"])
    net = full_model(c["pp"] * c["per_rank"], dtype, c["bn"])
    optimizer = torch.optim.SGD(net.parameters(), lr=c["lr"])
    loss_fn, steps = LOSSES[c["reduction"]], []
    for k, (x, y) in enumerate(batches(c)):
        if shard is not None:
            x, y = x.tensor_split(c["dp"])[shard], y.tensor_split(c["dp"])[shard]
        if k and carry != 1:
            for p in net.parameters():
                p.grad.div_(carry)
        if c["bn"]:  # BatchNorm normalises each micro-batch with its own statistics
            parts = list(zip(x.tensor_split(c["n_mb"]), y.tensor_split(c["n_mb"])))
            outs = [net(a) for a, _ in parts]
            loss = sum(loss_fn(o, b) for o, (_, b) in zip(outs, parts)) / len(parts)
            output = torch.cat(outs)
        else:
            output = net(x)
            loss = loss_fn(output, y)
        (loss * predict).backward()
        step = dict(grads={n: p.grad.clone() for n, p in net.named_parameters()})
        optimizer.step()
        if c["zero"]:
            optimizer.zero_grad()
        step.update(
            params={n: p.detach().clone() for n, p in net.named_parameters()},
            buffers={n: b.clone() for n, b in net.named_buffers()},
            loss=loss.detach(),
            output=output.detach(),
        )
        steps.append(step)
    return steps


def rel(got, want):
    got, want = got.double(), want.double()
    scale = want.abs().max()
    return float((got - want).abs().max() / scale) if scale > 0 else float(got.abs().max())


def differences(c, records, ref):
    """max rel diff of (gradients, parameters, loss, output) and of buffers."""
    worst = buffers = 0.0
    for k, want in enumerate(ref[: min(len(r["steps"]) for r in records)]):
        for r in records:
            got = r["steps"][k]
            for kind in ("grads", "params"):
                for name, t in got[kind].items():
                    worst = max(worst, rel(t, want[kind][name]))
            for name, t in got["buffers"].items():
                buffers = max(buffers, rel(t, want["buffers"][name]))
        last = sorted(
            (r for r in records if r["steps"][k]["losses"] is not None), key=lambda r: r["dp_rank"]
        )
        combine = (lambda v: sum(v) / len(v)) if c["reduction"] == "mean" else sum
        loss = sum(combine(r["steps"][k]["losses"]) for r in last) / len(last)
        worst = max(worst, rel(torch.tensor(loss, dtype=torch.float64), want["loss"]))
        worst = max(worst, rel(torch.cat([r["steps"][k]["output"] for r in last]), want["output"]))
    return worst, buffers


def judge(c, records):
    """(max rel diff shown, verdict, fails the run)."""
    tol = 1e-9 if c["dtype"] == "float64" else 1e-4
    errors = [r["error"] for r in records if r.get("error")]
    if c["expect"] == "refused":
        cause = [e for e in errors if "Connection closed" not in e and "Timed out" not in e]
        if errors:
            steps = min(len(r["steps"]) for r in records)
            first = f"step 1 ok ({differences(c, records, reference(c))[0]:.1e}), " if steps else ""
            return None, f"refused: {first}{(cause or errors)[0]}", False
        return differences(c, records, reference(c))[0], "ran (not refused)", False
    if errors:
        return None, f"ERROR: {errors[0]}", True
    records = [r for r in records if not r.get("idle")]
    if any(s["stray_losses"] or s["losses"] == [] for r in records for s in r["steps"]):
        return None, "losses on a rank without the last stage, or none on its rank", True
    diff, buffers = differences(c, records, reference(c))
    if c["expect"] == "match":
        diff = max(diff, buffers)
        return diff, "match" if diff <= tol else "DIFFERS", diff > tol
    if c["expect"] == "scaled":
        pred = differences(c, records, reference(c, predict=c["predict"]))[0]
        ok = pred <= tol
        text = f"known: = reference x {c['predict']:g} ({pred:.0e})" if ok else "known?"
        return diff, text, False
    if c["expect"] == "accumulate":
        pred = differences(c, records, reference(c, carry=c["n_mb"]))[0]
        ok = pred <= tol
        text = f"known: = g1/{c['n_mb']} + g2 ({pred:.0e})" if ok else "known? not g1/n + g2"
        return diff, text, False
    if c["expect"] == "bn":
        ref = reference(c)
        extra = {
            float(r["steps"][k]["buffers"][n] - ref[k]["buffers"][n])
            for r in records
            for k in range(len(ref))
            for n in r["steps"][k]["buffers"]
            if n.endswith("num_batches_tracked")
        }
        ok = diff <= tol and extra == {1.0}
        text = f"known: grads ok, buffers {buffers:.1e} off, num_batches_tracked +1"
        return max(diff, buffers), text if ok else "known? " + str(extra), False
    if c["expect"] == "unreduced":  # each stage: the global gradient, or its dp shard's own
        ref, local = reference(c), {d: reference(c, shard=d) for d in range(c["dp"])}
        unreduced, unexplained = set(), False
        for r in records:
            for name, g in r["steps"][0]["grads"].items():
                if rel(g, ref[0]["grads"][name]) > tol:
                    unreduced.add(name.split(".")[0])
                    unexplained |= rel(g, local[r["dp_rank"]][0]["grads"][name]) > tol
        verdict = f"known: stages {','.join(sorted(unreduced))} keep dp-local grads"
        return diff, verdict if unreduced and not unexplained else "known? " + str(unreduced), False
    raise ValueError(c["expect"])


def main():
    from torch.distributed import pipelining

    missing = [s for s in SCHEDULES if not hasattr(pipelining, s)]
    print(f"torch {torch.__version__}, gloo, start method {METHOD}; missing schedules: {missing}")
    main_cases, refused = cases()
    main_cases = [c for c in main_cases if c["schedule"] not in missing]
    start = time.monotonic()
    outcome = list(zip(main_cases, run_world(4, main_cases)))
    for c in refused:
        outcome += list(zip([c], run_world(c["dp"] * c["pp"], [c])))
    wall = time.monotonic() - start
    head = f"{'schedule':30} {'variant':31} {'ranks':>5} {'stages':>6} {'mb':>3} {'max rel':>8}"
    print(f"{head} {'ms 1st/2nd':>11}  verdict")
    failed, live = 0, {}
    for c, records in outcome:
        for r in records:
            for step in r.get("steps", []):
                if step["losses"] is not None:
                    live.setdefault(c["schedule"], set()).add(step["loss_requires_grad"])
        diff, verdict, fails = judge(c, records)
        failed += fails
        steps = [r["steps"] for r in records if r.get("steps")]
        ms = "/".join(
            f"{1000 * max(s[k]['seconds'] for s in steps if len(s) > k):.0f}"
            for k in range(min((len(s) for s in steps), default=0))
        )
        ranks = f"{c['dp']}x{c['pp']}" if c["dp"] > 1 else str(c["pp"])
        shown = "-" if diff is None else f"{diff:.1e}"
        print(
            f"{c['schedule']:30} {c['label'][:31]:31} {ranks:>5} {c['pp'] * c['per_rank']:>6} "
            f"{c['n_mb']:>3} {shown:>8} {ms:>11}  {verdict}"
        )
    print(
        f"{len(outcome)} cases in {wall:.0f} s. losses=: one 0-d tensor per micro-batch, only on "
        "the rank holding the last stage (rank 0 for the V-shaped schedules); still requiring "
        f"grad (graph freed) with {sorted(s for s, v in live.items() if True in v)}, detached with "
        f"{sorted(s for s, v in live.items() if v == {False})}"
    )
    if failed:
        print(f"{failed} case(s) that should match the one-process reference do not")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
