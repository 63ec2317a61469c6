"""Standalone: under ``zero_optimization.round_robin_gradients`` DeepSpeed's ZeRO-1 and ZeRO-2 train
right, but its public read-back API -- ``deepspeed.utils.safe_get_full_grad``,
``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state`` -- maps each parameter to the wrong
piece of the flat partitions: it raises a size mismatch, or silently returns another parameter's
gradient, weights and optimizer state. No ddpcheck involved: plain torch and DeepSpeed, two
processes over gloo on DeepSpeed's CPU accelerator.

    python bench/deepspeed_round_robin_gradients.py        # in a venv with DeepSpeed

Why (DeepSpeed 0.19.8's source): with ``round_robin_gradients`` the ZeRO optimizer
(``runtime/zero/stage_1_and_2.py``) lays each param group out in its flat buffer reordered
(``_round_robin_reorder``: parameters 0, 2, 4, ... then 1, 3, 5, ... at W=2), but
``_link_all_hp_params`` hands ``link_hp_params`` the group in its original order, with offsets only
where alignment padding exists (``parameter_alignment``, false by default): without padding
``_init_lp_to_hp_mapping`` (``utils/mixed_precision_linkage.py``) places every parameter at the
sum of the sizes of the parameters before it in the *original* order, and numbers it within the
partition in that order too (``_index_in_param_group``, the entry of the partition's gradient
list ``get_full_hp_grad`` reads). Every ``_hp_mapping`` is off: the parameter's fragment
address, its fp32 master and optimizer-state slices, and the gradient it reads.

Two models, each on two ranks with Adam (lr 0.01, 3 steps, ``gradient_clipping`` 0): ``mixed``
(Linear 4->8, Linear 8->8, Linear 8->1: 32, 8, 64, 8, 8, 1 elements) and ``square`` (four bias-free
Linear 4->4 of 16 elements each, so a misplaced read has the right size). Per stage, model and
``round_robin_gradients`` false then true, each rank compares with a single-process torch run on
the full batch (both ranks' micro-batches): after each backward, every parameter's gradient read
through ``safe_get_full_grad`` and read from the partitions by their real layout (the reordered
group, ``round_robin_bit16_groups``, each rank's ``averaged_gradients`` piece: what a checker can
do instead); after each step, ``safe_get_full_fp32_param`` and ``safe_get_full_optimizer_state``
(``exp_avg``) against the module's weights and the reference's Adam state; at the end the trained
weights, against the reference and, bitwise, against the run with the option false.

Measured (2026-12-04, deepspeed 0.19.8, torch 2.13.0+cpu, 47 s), ZeRO-1 and ZeRO-2 alike: with the
option false every read is right (18 of 18 for ``mixed``, 12 of 12 for ``square``). With it true,
``mixed``: ``safe_get_full_grad`` 3 of 18 right, 9 raise ("The size of tensor a (8) must match the
size of tensor b (30) at non-singleton dimension 0" for ``0.bias``, "list index out of range"
for ``2.weight``) and 6 return wrong values (``2.bias`` off by 0.234); ``safe_get_full_fp32_param``
and ``exp_avg`` 6 of 18 right, 9 wrong, 3 another parameter's (``2.bias`` reads ``0.bias``'s);
``square``: each of the three 6 of 12 right, the other 6 another parameter's (``2.weight`` reads
``4.weight``'s and back). The read by the real layout: 18 of 18 and 12 of 12 right. The trained
weights: within 1.49e-08 (``mixed``) and 2.98e-08 (``square``) of the reference, and **bitwise
equal** with the option true and false. So training is right; the read-back API is broken.

Every read is collective (an all-reduce per parameter); where one raises on one rank the script
issues the all-reduce it skipped, so the ranks stay paired. Exits 1 when a public read is wrong
or raises under the option (the bug), 0 otherwise; 2 if a rank fails outright.
"""

from __future__ import annotations

import copy
import datetime
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

DEADLINE = 120  # seconds: the gloo timeout of every collective
STEPS = 3
TOLERANCE = 1e-6  # float32, against the single-process reference


def mixed() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def square() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(4, 4, bias=False), nn.Tanh()]
    return nn.Sequential(*layers[:-1], nn.Flatten(0))


MODELS = {"mixed": mixed, "square": square}


def batch(step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(3, 4, generator=generator)


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


def verdict(got: torch.Tensor | None, want: torch.Tensor, others: dict[str, torch.Tensor]) -> str:
    """``ok``, or what is wrong with ``got``: another parameter's value, or the distance."""
    if got is None:
        return "None"
    got = got.reshape(want.shape) if got.numel() == want.numel() else got
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}"
    gap = float((got - want).abs().max())
    if gap <= TOLERANCE:
        return "ok"
    for name, value in others.items():
        if value.shape == want.shape and float((got - value).abs().max()) <= TOLERANCE:
            return f"is {name}'s"
    return f"off by {gap:.3g}"


def guarded(read, param) -> tuple[torch.Tensor | None, str | None]:
    """A collective public read; where it raises before its all-reduce, that all-reduce."""
    try:
        return read(param), None
    except Exception as exc:  # what DeepSpeed raises is the finding
        # the all-reduce get_full_hp_* did not reach, over the group it uses
        dist.all_reduce(torch.zeros(param.numel()), group=param._dp_group)
        return None, f"raises {type(exc).__name__}: {str(exc).splitlines()[0][:90]}"


def layout_pieces(zero) -> dict[int, list[tuple[int, torch.Tensor]]]:
    """This rank's pieces of every gradient, by the partitions' real layout: ``id(param)`` ->
    ``[(offset in the parameter, flat piece)]`` (no collective)."""
    pieces: dict[int, list] = {}
    for i, group in enumerate(zero.round_robin_bit16_groups):
        size = int(zero.partition_size[i])
        start = dist.get_rank(group=zero.real_dp_process_group[i]) * size
        flat = torch.cat([g.reshape(-1) for g in zero.averaged_gradients[i]])
        offsets = getattr(zero, "round_robin_bit16_offsets", None)
        place = 0
        for index, param in enumerate(group):
            place = offsets[i][index] if offsets is not None else place
            low, high = max(place, start), min(place + param.numel(), start + size)
            if low < high:
                pieces.setdefault(id(param), []).append(
                    (low - place, flat[low - start : high - start])
                )
            place += param.numel()
    return pieces


def whole(param: torch.Tensor, mine: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """The parameter's gradient from every rank's pieces (a sum: each element has one owner)."""
    flat = torch.zeros(param.numel())
    for offset, piece in mine:
        flat[offset : offset + piece.numel()] = piece.float()
    dist.all_reduce(flat)
    return flat.reshape(param.shape)


def train(stage: int, model_name: str, round_robin: bool, report) -> dict[str, torch.Tensor]:
    import deepspeed
    from deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
    )

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MODELS[model_name]()
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        config={
            "train_micro_batch_size_per_gpu": 3,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage, "round_robin_gradients": round_robin},
            "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0,
            "steps_per_print": 2**31,
        },
        dist_init_required=False,
    )
    zero = engine.optimizer
    outcomes: list[tuple[str, str, str]] = []  # (read, step and parameter, outcome)

    def count(kind: str, outcome: str, where: str) -> None:
        outcomes.append((kind, where, outcome))

    for step in range(STEPS):
        reference_optimizer.zero_grad()
        full = torch.cat([batch(step, r) for r in range(dist.get_world_size())])
        loss_of(reference(full)).backward()
        want = {n: p.grad.clone() for n, p in reference.named_parameters()}
        engine.backward(loss_of(engine(batch(step, rank))))
        pieces = layout_pieces(zero)
        for name, param in model.named_parameters():
            got, raised = guarded(safe_get_full_grad, param)
            where = f"step {step} {name}"
            count("safe_get_full_grad", raised or verdict(got, want[name], want), where)
            by_layout = whole(param, pieces.get(id(param), []))
            count("layout gradient", verdict(by_layout, want[name], want), where)
        engine.step()
        reference_optimizer.step()
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        moments = {
            n: reference_optimizer.state[p]["exp_avg"] for n, p in reference.named_parameters()
        }
        for name, param in model.named_parameters():
            where = f"step {step} {name}"
            got, raised = guarded(safe_get_full_fp32_param, param)
            count("safe_get_full_fp32_param", raised or verdict(got, weights[name], weights), where)
            got, raised = guarded(lambda p: safe_get_full_optimizer_state(p, "exp_avg"), param)
            count("exp_avg", raised or verdict(got, moments[name], moments), where)
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    gap = max(float((trained[n] - p.detach()).abs().max()) for n, p in reference.named_parameters())
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, outcomes)
    bad = False
    for kind in dict.fromkeys(kind for kind, _, _ in outcomes):
        reads: dict[str, list[str]] = {}
        for rank_outcomes in everyone:
            for k, where, outcome in rank_outcomes:
                if k == kind:
                    reads.setdefault(where, []).append(outcome)
        classes: dict[str, list[str]] = {}
        for where, seen in reads.items():  # a read raising on any rank raises
            raised = [o for o in seen if o.startswith("raises")]
            outcome = raised[0] if raised else seen[0]
            label = (
                "raise"
                if raised
                else "ok"
                if outcome == "ok"
                else "are another parameter's"
                if outcome.startswith("is ")
                else "are wrong"
            )
            classes.setdefault(label, []).append(f"{where}: {outcome}")
        bad = bad or (kind != "layout gradient" and set(classes) != {"ok"})
        parts = [
            f"{len(found)} {label}" + ("" if label == "ok" else f" (first: {found[0]})")
            for label, found in classes.items()
        ]
        report(f"  {kind}, {len(reads)} reads: " + "; ".join(parts))
    report(f"  trained weights: max |DeepSpeed - reference| {gap:.3g}")
    report(f"RESULT {round_robin} {int(bad)}")
    return trained


def worker(rank, world_size, store_path, stage, folder):
    os.environ.update(
        DS_ACCELERATOR="cpu",
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
    )  # MASTER_PORT: main's
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world_size),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=DEADLINE),
    )

    def report(line):
        if rank != 0:
            return
        with open(os.path.join(folder, f"rank{rank}.log"), "a") as f:
            f.write(line + "\n")

    for model_name in MODELS:
        trained = {}
        for round_robin in (False, True):
            report(f"ZeRO-{stage} {model_name} round_robin_gradients={round_robin}:")
            trained[round_robin] = train(stage, model_name, round_robin, report)
        same = all(torch.equal(trained[False][n], trained[True][n]) for n in trained[False])
        gap = max(float((trained[False][n] - trained[True][n]).abs().max()) for n in trained[True])
        report(
            f"ZeRO-{stage} {model_name}: trained weights with the option true against false: "
            f"{'bitwise equal' if same else f'max difference {gap:.3g}'}"
        )
    dist.destroy_process_group()


def main():
    import deepspeed

    print(
        f"deepspeed {deepspeed.__version__}, torch {torch.__version__}; W=2, Adam lr 0.01, "
        f"{STEPS} steps; 'ok': within {TOLERANCE:g} of the single-process reference; one read "
        "per parameter and step, raising where it raises on either rank"
    )
    with socket.socket() as probe:  # a free port for DeepSpeed's env checks (the group is a file)
        probe.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(probe.getsockname()[1])  # the spawned ranks inherit it
    code = 0
    for stage in (1, 2):
        with tempfile.TemporaryDirectory() as folder:
            try:
                mp.start_processes(
                    worker,
                    args=(2, os.path.join(folder, "store"), stage, folder),
                    nprocs=2,
                    start_method="spawn",
                )
            except Exception as exc:  # a rank failed outright: its log says how far it got
                print(f"ZeRO-{stage}: a rank failed: {str(exc).splitlines()[-1][:200]}")
                code = 2
            path = os.path.join(folder, "rank0.log")  # rank 0 reports both ranks' reads
            with open(path) if os.path.exists(path) else open(os.devnull) as f:
                lines = f.read().splitlines()
        for line in lines:
            if line.startswith("RESULT"):
                if line == "RESULT True 1":
                    code = max(code, 1)
            else:
                print(line)
    return code


if __name__ == "__main__":
    sys.exit(main())
