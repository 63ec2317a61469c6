"""``ddpcheck check`` inside a world someone else built: ``torchrun`` (env:// rendezvous).

Invariant: when :func:`under_torchrun` is true, :func:`check_in_world` runs the battery on the
world ``torchrun`` started -- every rank runs every example, the records are gathered on rank 0,
rank 0 computes the full-batch reference and applies the same oracle as a spawned world, and the
verdict is broadcast so that every rank returns the same exit status. Only rank 0 prints. Every
collective runs under the process group's timeout (the ``--deadline``), so a rank that raises or
hangs makes the others fail instead of waiting forever.
"""

from __future__ import annotations

import datetime
import os
import pickle
import traceback
from typing import Any

__all__ = ["check_in_world", "under_torchrun"]

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def under_torchrun() -> bool:
    """True in a process ``torchrun`` (torch.distributed.run) started."""
    return all(name in os.environ for name in _ENV)


def _gather_to_zero(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (None elsewhere), by pickle.

    NOTE: not ``dist.gather_object``: it decodes through numpy, which torch does not require and
    which some of our machines lack. Same two steps: sizes, then padded bytes.
    """
    import torch
    import torch.distributed as dist

    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    # all-gather one int64 per rank (its record's byte count), so rank 0 can size the buffers
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64))
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    rank0 = dist.get_rank() == 0
    received = [torch.empty(longest, dtype=torch.uint8) for _ in sizes] if rank0 else None
    # gather every rank's pickled record on rank 0, which holds the reference and compares
    dist.gather(padded, received, dst=0)
    if not rank0:
        return None
    return [pickle.loads(bytes(buf[:int(n)].clone().untyped_storage()))
            for buf, n in zip(received, sizes)]


def _agree(status: int) -> int:
    """Rank 0's ``status`` on every rank."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([status], dtype=torch.int64)
    # broadcast rank 0's verdict, so every rank stops after the same example with the same status
    dist.broadcast(flag, src=0)
    return int(flag)


def check_in_world(target: Any, *, world_sizes: tuple[int, ...] | None, deadline: float,
                   out: Any) -> int:
    """Run the battery on torchrun's world; 0 all equivalent, 1 a counterexample (printed on
    rank 0 to ``out``), 2 a usage error (``world_sizes`` not containing torchrun's size)."""
    import torch.distributed as dist

    from ddpcheck._internal import recorder as comm
    from ddpcheck.api import prepare_reference, replay_command
    from ddpcheck.battery import BATTERY
    from ddpcheck.oracle import compare
    from ddpcheck.errors import Divergence, EquivalenceError
    from ddpcheck._internal.runner import run_example

    world_size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    say = (lambda text: print(text, file=out, flush=True)) if rank == 0 else (lambda text: None)
    if not dist.is_initialized():
        backend = "nccl" if _cuda() else "gloo"
        dist.init_process_group(backend, init_method="env://",
                                timeout=datetime.timedelta(seconds=deadline))
    if world_sizes is not None and world_size not in world_sizes:
        say(f"ddpcheck check: error: --world-sizes={','.join(map(str, world_sizes))} does not "
            f"contain torchrun's world size {world_size}; under torchrun the world is the one "
            "torchrun built (drop --world-sizes, or pass --nproc-per-node to match)")
        # barrier: torchrun stops every rank as soon as one exits with an error, so no rank
        # leaves before rank 0 has printed why
        dist.barrier()
        return 2
    comm.install()
    examples = 0
    for name, scenario in BATTERY:
        if target.supports(scenario) is not None:
            continue
        try:
            record: Any = ("ok", run_example(target, scenario))
        except Exception:
            record = ("error", traceback.format_exc())
        gathered = _gather_to_zero(record)
        status = 0
        if rank == 0:
            replay = replay_command(target, scenario, world_size)
            failed = [(r, text) for r, (kind, text) in enumerate(gathered) if kind == "error"]
            if failed:
                rows = [Divergence("-", world_size, r, "-", "rank failed",
                                   detail=text.strip().splitlines()[-1]) for r, text in failed]
                error = EquivalenceError(rows, scenario=scenario, world_size=world_size,
                                         target=target, replay=replay, name=name)
            else:
                records = [value for _, value in gathered]
                found = compare(records, prepare_reference(scenario), scenario,
                                target.configure(scenario))
                error = (EquivalenceError(found, scenario=scenario, world_size=world_size,
                                          target=target, replay=replay, name=name)
                         if found else None)
            if error is not None:
                say(str(error))
                status = 1
        examples += 1
        if _agree(status):
            return 1
    say(f"ddpcheck check: {examples} examples equivalent in the torchrun world of {world_size} "
        f"(backend {dist.get_backend()})")
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0
