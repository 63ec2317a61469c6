"""DeepSpeed's accumulation window over epochs, without ddpcheck: which samples each optimizer
step of DeepSpeed's own loop consumes, and the weights after the first epoch against one process.

    python bench/deepspeed_epoch_window.py     # in a venv with DeepSpeed (CPU, W=2, gloo)

10 samples, per-device batch 1, W=2, ``gradient_accumulation_steps=2`` (steps of 4 samples), two
epochs, the loop of DeepSpeed's tutorials over ``engine.deepspeed_io`` with an unshuffled
``DistributedSampler``. A one-process loop steps on samples 0-3, 4-7 and 8-9 each epoch; DeepSpeed's
engine counts its windows over the whole run (``is_gradient_accumulation_boundary``: "driven by
the internal micro-step counter"; deepspeedai/DeepSpeed#7439: "DS will not automatically handle
incomplete gradient accumulation steps"), so the first epoch's last window (8-9) is finished by
the second epoch's first batch. Prints each step's samples and the weights' distance from the
one-process loop after the first epoch; exits 1 when the steps are not the one-process loop's
(DeepSpeed's documented design: ddpcheck's ``deepspeed`` targets decline such epochs).
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DistributedSampler, TensorDataset

W, SAMPLES, EPOCHS, ACCUMULATION, LR = 2, 10, 2, 2, 0.1


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(SAMPLES, 4, generator=g), torch.randn(SAMPLES, 1, generator=g)


def model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Linear(4, 1)


def reference_first_epoch() -> torch.Tensor:
    """One process: a step per 4 samples in index order, the mean loss of the step's own."""
    x, y = data()
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for start in range(0, SAMPLES, W * ACCUMULATION):
        sl = slice(start, start + W * ACCUMULATION)
        ((net(x[sl]) - y[sl]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return torch.nn.utils.parameters_to_vector(net.parameters()).detach()


def rank(r: int, port: int, out: mp.Queue) -> None:
    os.environ.update(
        DS_ACCELERATOR="cpu", RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(W), OMP_NUM_THREADS="1"
    )
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=W)
    import deepspeed

    x, y = data()
    dataset = TensorDataset(x, y, torch.arange(SAMPLES))
    net = model()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": ACCUMULATION,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31,
    }
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    engine, _, _, _ = deepspeed.initialize(
        model=net, optimizer=opt, config=config, dist_init_required=False
    )
    sampler = DistributedSampler(dataset, num_replicas=W, rank=r, shuffle=False)
    loader = engine.deepspeed_io(dataset, data_sampler=sampler, num_local_io_workers=0)
    steps, taken, after_epoch = [], [], None
    for epoch in range(EPOCHS):
        loader.data_sampler.set_epoch(epoch)
        for bx, by, idx in loader:
            taken += [(epoch, int(i)) for i in idx]
            engine.backward(((engine(bx) - by) ** 2).mean())
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            if boundary:
                steps.append(taken)
                taken = []
        if epoch == 0:
            after_epoch = torch.nn.utils.parameters_to_vector(net.parameters()).detach().clone()
    assert after_epoch is not None
    out.put((r, steps, after_epoch.tolist()))  # plain lists: no tensor shared past the exit
    dist.destroy_process_group()


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank, args=(r, port, out)) for r in range(W)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    per_step = [sorted(s for _, steps, _ in results for s in steps[k]) for k in range(3)]
    expected = [[(0, i) for i in range(a, min(a + 4, SAMPLES))] for a in range(0, SAMPLES, 4)]
    for k, (got, want) in enumerate(zip(per_step, expected)):
        print(f"step {k}: DeepSpeed consumed (epoch, sample) {got}; one process {want}")
    off = (torch.tensor(results[0][2]) - reference_first_epoch()).abs().max().item()
    print(f"weights after DeepSpeed's first epoch: {off:.3g} off the one-process loop's")
    return 1 if per_step != expected else 0


if __name__ == "__main__":
    sys.exit(main())
