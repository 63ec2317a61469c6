"""Standalone: on DeepSpeed's CPU accelerator, ZeRO-1 with ``zero_optimization.contiguous_gradients:
false`` never all-reduces a gradient. No ddpcheck involved: plain torch and DeepSpeed, two
processes over gloo.

    python bench/deepspeed_contiguous_gradients.py    # in a venv with DeepSpeed; exit 1: the bug

The non-contiguous reduction path buckets gradients by comparing ``tensor.type()`` with
``"torch.cpu.FloatTensor"``, which a CPU tensor never reports (it says ``"torch.FloatTensor"``), so
no bucket is ever reduced: each rank steps with its own local gradient, 100 % off the global
batch's (upstream PR #8382, fixed in DeepSpeed 0.19.8). ddpcheck found it drawing DeepSpeed's
options (``ddpcheck check deepspeed_zero1 --fuzz-config --dtypes float32 --world-sizes 2``).

One step of SGD (lr 1) on a two-layer model, each rank its own half of a 4-sample batch; each
rank's parameters after the step against the same model trained in one process on the whole
batch. Exit 1 when they differ (the bug), 0 when they agree (``contiguous_gradients: true``, the
default, is run too, as the control).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD_SIZE = 2


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)


def reference():
    """The parameters after one step on the whole batch, in one process."""
    net = model()
    x, y = data()
    optimizer = torch.optim.SGD(net.parameters(), lr=1.0)
    ((net(x) - y) ** 2).mean().backward()
    optimizer.step()
    return [p.detach().clone() for p in net.parameters()]


def worker(rank, store_path, contiguous, queue):
    os.environ.update(
        DS_ACCELERATOR="cpu",
        RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
    )  # MASTER_PORT: main's
    try:
        dist.init_process_group(
            "gloo", store=dist.FileStore(store_path, WORLD_SIZE), rank=rank, world_size=WORLD_SIZE
        )
        import deepspeed

        net = model()
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 1, "contiguous_gradients": contiguous},
            "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0
            "steps_per_print": 2**31,
        }
        engine, _, _, _ = deepspeed.initialize(
            model=net,
            optimizer=torch.optim.SGD(net.parameters(), lr=1.0),
            config=config,
            dist_init_required=False,
        )
        x, y = data()
        xs, ys = x.tensor_split(WORLD_SIZE)[rank], y.tensor_split(WORLD_SIZE)[rank]
        engine.backward(((engine(xs) - ys) ** 2).mean())  # the engine averages over ranks
        engine.step()
        queue.put((rank, [p.detach().tolist() for p in net.parameters()], None))
    except Exception as exc:
        queue.put((rank, None, f"{type(exc).__name__}: {exc}".splitlines()[0][:200]))
    queue.close()
    queue.join_thread()
    os._exit(0)  # skip the group's teardown


def run(contiguous):
    """The largest |parameter - reference| over both ranks, or the error a rank raised."""
    with tempfile.TemporaryDirectory() as folder:
        context = mp.get_context("spawn")
        queue = context.Queue()
        procs = [
            context.Process(target=worker, args=(r, f"{folder}/store", contiguous, queue))
            for r in range(WORLD_SIZE)
        ]
        for p in procs:
            p.start()
        answers = [queue.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    errors = [error for _, _, error in answers if error]
    if errors:
        return None, errors[0]
    expected = reference()
    diff = max(
        (torch.tensor(got) - want).abs().max().item()
        for _, params, _ in answers
        for got, want in zip(params, expected, strict=True)
    )
    return diff, None


def main():
    import deepspeed

    with socket.socket() as probe:  # a free port for DeepSpeed's env checks (the group is a file)
        probe.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(probe.getsockname()[1])  # the spawned ranks inherit it
    print(f"deepspeed {deepspeed.__version__}, torch {torch.__version__}; ZeRO-1, W={WORLD_SIZE}")
    wrong = False
    for contiguous in (True, False):
        diff, error = run(contiguous)
        right = error is None and diff < 1e-5
        shown = error or f"max |parameter - reference| = {diff:.3g}"
        print(f"contiguous_gradients={contiguous!s:5}: {shown} ({'right' if right else 'WRONG'})")
        wrong |= not right
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
