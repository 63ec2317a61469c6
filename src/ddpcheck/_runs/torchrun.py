"""``ddpcheck check`` inside a world someone else built: ``torchrun`` (env:// rendezvous).

Invariant: when :func:`under_torchrun` is true, :func:`check_in_world` runs the battery on the
world ``torchrun`` started -- every rank runs every example while recording its collective
sequence, each rank's record (or traceback) and sequence are gathered on rank 0, and rank 0 judges
them with the very function spawned worlds use (``ddpcheck._runs.example.verdict``:
collective sequences, then the oracle against the full-batch reference); the verdict is broadcast so
that every rank returns the same exit status. Only rank 0 prints. A scenario that checkpoints
resumes in the same world (rank 0's checkpoint broadcast to every rank); one that resumes at another
world size is skipped, saying so: torchrun's world cannot change size. Every collective runs under
the process group's timeout (the ``--deadline``), so a rank that raises or hangs makes the others
fail instead of waiting forever.

The backend follows the tensors, as in spawned worlds (``_base.devices.backend_for``): gloo on
the CPU whatever GPUs are visible; with ``device="cuda"`` each rank computes on
``cuda:LOCAL_RANK`` over NCCL, and its record comes back to rank 0 on the CPU, where the
full-batch reference runs.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any, TextIO

import torch
import torch.distributed as dist

from ddpcheck._base.devices import (
    backend_for,
    enter_rank,
    local_world_size,
    this_rank,
    under_torchrun,
)
from ddpcheck._base.errors import DdpcheckError, InvalidArgument, NothingChecked
from ddpcheck._language.scenario import Scenario
from ddpcheck._rank import recorder
from ddpcheck._rank.pickled import gathered_on_zero
from ddpcheck._rank.runner import run_example_packed, run_warm_up
from ddpcheck._rank.transport import unpack
from ddpcheck._runs.example import check_batch_plans, verdict
from ddpcheck._world.failures import Failure, RankState, Status, WorldFailure
from ddpcheck.targets.protocol import Target
from ddpcheck.targets.support import battery_for, declines

__all__ = ["check_in_world", "init_world", "local_world_size", "under_torchrun"]


def _agree(status: int) -> int:
    """Rank 0's ``status`` on every rank."""
    flag = torch.tensor([status], dtype=torch.int64, device=this_rank())
    # broadcast rank 0's verdict, so every rank stops after the same example with the same status
    dist.broadcast(flag, src=0)
    return int(flag)


def _broadcast_bytes(data: bytes | None) -> bytes:
    """Rank 0's ``data`` on every rank (a checkpoint for the resumed run), on the rank's device:
    NCCL carries only CUDA tensors."""
    device = this_rank()
    size = torch.tensor([0 if data is None else len(data)], dtype=torch.int64, device=device)
    # broadcast the checkpoint's byte count from rank 0, so every rank can size the buffer
    dist.broadcast(size, src=0)
    buffer = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        if data is not None
        else torch.empty(int(size), dtype=torch.uint8, device=device)
    )
    # broadcast rank 0's checkpoint to every rank: what a file on shared storage would carry
    dist.broadcast(buffer, src=0)
    return bytes(buffer.cpu().clone().untyped_storage())


def _run_recorded(
    target: Target,
    scenario: Scenario,
    sequence_path: str,
    part: str = "whole",
    checkpoint: bytes | None = None,
) -> tuple[tuple[str, Any], str]:
    """This rank's ``("ok", packed result)`` (its tensors on the CPU:
    ``ddpcheck._rank.transport``; the result of ``run_example(part=...)``) or
    ``("error", traceback)``, and its collective sequence."""
    recorder.restart_sequence()
    try:
        outcome: tuple = ("ok", run_example_packed(target, scenario, part, checkpoint))
    except DdpcheckError as exc:  # ddpcheck's own outcome (a decline, its glue failing)
        outcome = ("refused", f"{type(exc).__name__}: {exc}")
    except Exception:
        outcome = ("error", traceback.format_exc())
    with open(sequence_path, errors="replace") as f:
        return outcome, f.read()


def _judge(
    gathered: list[tuple[tuple[str, Any], str]],
    target: Target,
    scenario: Scenario,
    name: str,
    world_size: int,
    **where: Any,
) -> DdpcheckError | None:
    """Rank 0: the EquivalenceError of one example, or None
    (``ddpcheck._runs.example.verdict``), or the outcome ddpcheck's own code raised in
    a rank; ``where``: the run's device and backend, for the replay line."""
    outcomes = [outcome for outcome, _ in gathered]
    if any(kind == "refused" for kind, _ in outcomes):
        states = [
            RankState(
                r,
                Status.REFUSED if kind == "refused" else Status.RETURNED,
                text if kind == "refused" else "",
            )
            for r, (kind, text) in enumerate(outcomes)
        ]
        return WorldFailure(Failure.REFUSED, world_size, states, f"example {name}").refusal()
    if any(kind == "error" for kind, _ in outcomes):
        states = [
            RankState(r, Status.RAISED, text) if kind == "error" else RankState(r, Status.RETURNED)
            for r, (kind, text) in enumerate(outcomes)
        ]
        failure = WorldFailure(Failure.RAISED, world_size, states, f"example {name}")
        return verdict(target, scenario, world_size, failure=failure, name=name, **where)
    return verdict(
        target,
        scenario,
        world_size,
        records=[unpack(value) for _, value in outcomes],
        sequences=[sequence for _, sequence in gathered],
        name=name,
        **where,
    )


def _example(
    target: Target,
    scenario: Scenario,
    name: str,
    world_size: int,
    rank: int,
    sequence_path: str,
    **where: Any,
) -> DdpcheckError | None:
    """Rank 0: the EquivalenceError of one example, ddpcheck's own outcome raised in a rank
    (:func:`_judge`), or None (other ranks: None). A scenario
    with ``checkpoint_after`` saves, then resumes in this same world. ``where``: the run's
    device and backend, for the replay line."""
    if scenario.checkpoint_after is None:
        gathered = gathered_on_zero(_run_recorded(target, scenario, sequence_path))
        return _judge(gathered, target, scenario, name, world_size, **where) if rank == 0 else None
    saved = gathered_on_zero(_run_recorded(target, scenario, sequence_path, "until checkpoint"))
    failed = rank == 0 and any(kind != "ok" for (kind, _), _ in saved)
    if _agree(int(failed)):
        return _judge(saved, target, scenario, name, world_size, **where) if rank == 0 else None
    before = [unpack(value) for (_, value), _ in saved]  # (record, bytes); none off rank 0
    checkpoint = _broadcast_bytes(before[0][1] if rank == 0 else None)
    resumed = gathered_on_zero(
        _run_recorded(target, scenario, sequence_path, "resumed", checkpoint)
    )
    if rank != 0:
        return None
    if any(kind != "ok" for (kind, _), _ in resumed):
        return _judge(resumed, target, scenario, name, world_size, **where)

    return verdict(
        target,
        scenario,
        world_size,
        records=([record for record, _ in before], [unpack(value) for (_, value), _ in resumed]),
        sequences=([text for _, text in saved], [text for _, text in resumed]),
        name=name,
        **where,
    )


def check_in_world(
    target: Target,
    *,
    world_sizes: tuple[int, ...] | None,
    deadline: float,
    out: TextIO,
    without: frozenset[str] = frozenset(),
    only: frozenset[str] = frozenset(),
    device: str = "cpu",
    backend: str | None = None,
) -> int:
    """Run the battery on torchrun's world; 0 all equivalent, 1 a counterexample (printed on
    rank 0 to ``out``), 2 a usage error (``world_sizes`` not containing torchrun's size), or the
    exit code of ddpcheck's own outcome raised in a rank (4: a framework target's glue failed).
    ``without``, ``only``, ``device``/``backend``: as for ``ddpcheck.assert_equivalent``. Every
    rank's process admitted the same request (``_runs.admission``) before any collective: a refusal
    must not hang rank 0."""
    world_size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    say: Callable[[str], None] = (
        (lambda text: print(text, file=out, flush=True)) if rank == 0 else (lambda text: None)
    )
    init_world(device, backend, deadline)
    if world_sizes is not None and world_size not in world_sizes:
        say(
            f"ddpcheck check: error: --world-sizes={','.join(map(str, world_sizes))} does not "
            f"contain torchrun's world size {world_size}; under torchrun the world is the one "
            "torchrun built (drop --world-sizes, or pass --nproc-per-node to match)"
        )
        # barrier: torchrun stops every rank as soon as one exits with an error, so no rank
        # leaves before rank 0 has printed why
        dist.barrier()
        return 2
    recorder.install()
    run_warm_up(target)  # a framework's once-per-process set-up, before any example
    examples = 0
    with tempfile.TemporaryDirectory(prefix="ddpcheck-torchrun-") as folder:
        sequence_path = os.path.join(folder, f"rank{rank}.collectives")
        recorder.record_to(sequence_path)
        try:
            for name, scenario in battery_for(target):
                if declines(target, scenario, world_size, without, only) is not None:
                    continue
                if scenario.resume_world_size not in (None, world_size):
                    say(
                        f"skipped {name}: it resumes its checkpoint at world size "
                        f"{scenario.resume_world_size}, and torchrun's world is {world_size}"
                    )
                    continue
                # every rank, before any collective: a malformed plan must not hang rank 0
                check_batch_plans(target, scenario, world_size)
                error = _example(
                    target,
                    scenario,
                    name,
                    world_size,
                    rank,
                    sequence_path,
                    device=device,
                    backend=backend,
                )
                status = 0
                if isinstance(error, NothingChecked):  # declined in the ranks: not checked
                    say(f"skipped {name}: {error}")
                else:
                    examples += 1
                    if error is not None:  # the target's error, or ddpcheck's own (exit 4)
                        say(str(error))
                        status = int(error.exit_code)
                status = _agree(status)
                if status:
                    return status
        finally:
            recorder.record_to(None)
    say(
        f"ddpcheck check: {examples} examples equivalent in the torchrun world of {world_size} "
        f"(backend {dist.get_backend()}{', device cuda' if device == 'cuda' else ''})"
    )
    return 0


def init_world(device: str, backend: str | None, deadline: float) -> str:
    """Bind this rank to ``cuda:LOCAL_RANK`` (or the CPU) and join torchrun's world over the
    backend the tensors need (``_base.devices.backend_for``: gloo for CPU tensors, whatever
    GPUs are visible); the backend. A world someone already initialised must suit the device."""
    chosen = backend_for(device, backend)
    placed = enter_rank(device, int(os.environ["LOCAL_RANK"]))
    if dist.is_initialized():
        if dist.get_backend() == "nccl" and device == "cpu":
            raise InvalidArgument(
                "the process group was initialised with nccl, which cannot "
                "carry the CPU tensors of device 'cpu'; use --device cuda"
            )
        return dist.get_backend()
    nccl: dict[str, Any] = {"device_id": placed} if chosen == "nccl" else {}
    dist.init_process_group(
        chosen, init_method="env://", timeout=datetime.timedelta(seconds=deadline), **nccl
    )
    return chosen
