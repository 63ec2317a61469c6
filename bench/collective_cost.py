"""What one gloo collective costs on this machine, in bare torch.distributed (no ddpcheck): the
floor under every random example's marginal cost, since the target's DDP and ZeRO issue tens of
them per example.

Prints, per world size, for each op on a 4-element float tensor (the size of the "used anywhere"
flags; bucket all-reduces of a random example are a few KB and cost about the same): the wall
time per op, the CPU per op of the whole rank process and of its main thread (the rest is gloo's
own threads: its TCP event loop and its two work threads), and the context switches per op; then
what an idle rank costs: gloo's event loop wakes every 10 ms whether or not anything is sent.

    python bench/collective_cost.py [--world-sizes 2,4] [--ops 300]
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

IDLE_SECONDS = 5.0


def _process_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _switches() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_nvcsw + r.ru_nivcsw


def _ops(world_size: int) -> dict:
    t = torch.ones(4)
    return {
        "all_reduce": lambda: dist.all_reduce(t),
        "all_reduce async": lambda: dist.all_reduce(t, async_op=True).wait(),
        "broadcast": lambda: dist.broadcast(t, 0),
        "all_gather": lambda: dist.all_gather([torch.empty(4) for _ in range(world_size)], t),
        "barrier": lambda: dist.barrier(),
    }


def _rank(rank: int, world_size: int, port: int, n: int, out) -> None:
    torch.set_num_threads(1)  # as ddpcheck's ranks run
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}"
    )
    rows = []
    for name, op in _ops(world_size).items():
        for _ in range(20):
            op()
        dist.barrier()
        cpu, main, switches, wall = (
            _process_cpu(),
            time.thread_time(),
            _switches(),
            time.perf_counter(),
        )
        for _ in range(n):
            op()
        wall = time.perf_counter() - wall
        rows.append(
            (
                name,
                wall / n,
                (_process_cpu() - cpu) / n,
                (time.thread_time() - main) / n,
                (_switches() - switches) / n,
            )
        )
    dist.barrier()
    cpu = _process_cpu()
    time.sleep(IDLE_SECONDS)
    idle = (_process_cpu() - cpu) / IDLE_SECONDS
    dist.barrier()
    if rank == 0:
        out.put((rows, idle))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world_size: int, n: int):
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(world_size, _free_port(), n, queue), nprocs=world_size)
    return queue.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--ops", type=int, default=300)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {os.cpu_count()} cores, gloo, 4 float32 elements, "
        f"{args.ops} ops each, rank 0's figures"
    )
    print(
        f"{'W':>2}  {'op':<17} {'wall/op':>9} {'CPU/op':>9} {'main thread':>12} {'ctx sw/op':>10}"
    )
    for world_size in map(int, args.world_sizes.split(",")):
        rows, idle = measure(world_size, args.ops)
        for name, wall, cpu, main_thread, switches in rows:
            print(
                f"{world_size:>2}  {name:<17} {wall * 1e6:>6.0f} us {cpu * 1e6:>6.0f} us "
                f"{main_thread * 1e6:>9.0f} us {switches:>10.1f}"
            )
        print(
            f"{world_size:>2}  idle rank: {idle * 100:.2f} % of a core (gloo's event loop, "
            f"{IDLE_SECONDS:.0f} s asleep)"
        )


if __name__ == "__main__":
    main()
