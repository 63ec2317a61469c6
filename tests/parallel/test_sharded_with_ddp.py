"""parallel.DDP + parallel.ShardedOptimizer: gradient bytes cross the wire once per step.

DDP averages the gradients and marks them (``param.ddp_averaged_grad``); the optimizer must then
all-reduce nothing, only broadcast updated parameters from their owners.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpcheck._rank import recorder as comm
from ddpcheck._world.registry import get_world
from parallel import DDP, ShardedOptimizer, sharding
from tests.patience import patience

STEPS = 3


class Net(nn.Module):
    """float64 layers, a float32 scale (two dtypes) and a parameter no rank ever uses."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float32))
        self.unused = nn.Parameter(torch.zeros(5, dtype=torch.float64))

    def forward(self, x):
        return self.body(x) * self.scale.double()


def batches():
    g = torch.Generator().manual_seed(7)
    return [
        (
            torch.randn(6, 4, generator=g, dtype=torch.float64),
            torch.randn(6, 3, generator=g, dtype=torch.float64),
        )
        for _ in range(STEPS)
    ]


def train(model, opt, after_backward=lambda: None, record=False):
    records = []
    for x, y in batches():  # the same data on every rank: DDP's mean equals the local gradient
        loss = ((model(x) - y) ** 2).mean()
        if record:
            comm.reset()
        loss.backward()
        after_backward()
        opt.step()
        if record:
            records.append([(c.op, c.nbytes, c.dtypes, c.root) for c in comm.records()])
        opt.zero_grad(set_to_none=True)
    return records


def _rank_ddp_sharded(rule):
    torch.manual_seed(0)
    model = DDP(Net(), bucket_size_mb=0.0005)  # ~500 bytes: several buckets
    opt = ShardedOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        sharding_rule=getattr(sharding, rule),
        lr=0.01,
        weight_decay=0.1,
    )
    records = train(model, opt, model.finish_gradient_sync, record=True)
    return dict(
        params=[p.detach() for p in model.parameters()],
        records=records,
        owners=[opt.owner_of(p) for p in model.parameters()],
    )


@pytest.mark.parametrize("world_size, rule", [(2, "greedy"), (3, "modulo")])
def test_with_ddp_gradients_are_all_reduced_once_and_steps_match_plain(world_size, rule):
    torch.manual_seed(0)
    ref = Net()
    reference = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    train(ref, reference)
    params = list(ref.parameters())
    # DDP's buckets carry every trainable parameter's gradient (zeros where unused) once
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    updated_bytes = grad_bytes - ref.unused.numel() * ref.unused.element_size()
    results = get_world(world_size).run(_rank_ddp_sharded, rule, deadline=patience(120))
    for rank, r in enumerate(results):
        for i, (p, q) in enumerate(zip(r["params"], results[0]["params"])):
            assert torch.equal(p, q), f"rank {rank} param {i} differs from rank 0"
        if world_size == 2:  # (g + g) / 2 == g exactly, so DDP's mean is the local gradient
            for i, (p, e) in enumerate(zip(r["params"], params)):
                assert torch.equal(p, e.detach()), f"rank {rank} param {i}"
        dtypes = ["float64" if p.dtype == torch.float64 else "float32" for p in params]
        used = [i for i, p in enumerate(params) if p is not ref.unused]
        pairs = {(r["owners"][i], dtypes[i]) for i in used}
        for step, records in enumerate(r["records"]):
            reduces = [c for c in records if c[0] == "all_reduce"]
            floats = sum(c[1] for c in reduces if c[2][0].startswith("float"))
            flags = [c for c in reduces if c[2][0].startswith("int")]
            where = f"rank {rank} step {step}: {records}"
            assert floats == grad_bytes, where  # gradient bytes once, not twice
            assert [c[1] for c in flags] == [4 * len(params)], where  # DDP's usage flags only
            casts = [c for c in records if c[0] == "broadcast"]
            assert sorted((c[3], c[2][0]) for c in casts) == sorted(pairs), where
            assert len(casts) <= len(set(r["owners"])) * 2, where
            # the unused parameter has no gradient anywhere: it is neither stepped nor broadcast
            assert sum(c[1] for c in casts) == updated_bytes, where


def _rank_handshake():
    torch.manual_seed(0)
    model = DDP(Net(), bucket_size_mb=0.0005)
    params = list(model.parameters())
    opt = ShardedOptimizer(params, torch.optim.SGD, lr=0.1)
    x, y = batches()[0]

    def backward():
        ((model(x) - y) ** 2).mean().backward()

    def step():
        comm.reset()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return sorted((c.dtypes[0], c.nbytes) for c in comm.records() if c.op == "all_reduce")

    out = {}
    backward()
    model.finish_gradient_sync()
    out["marked"] = [hasattr(p, "ddp_averaged_grad") for p in params]
    out["synced"] = step()
    out["consumed"] = [hasattr(p, "ddp_averaged_grad") for p in params]
    with model.no_sync():  # DDP's sync skipped: no mark, so the optimizer averages
        backward()
    out["unsynced"] = step()
    backward()
    model.finish_gradient_sync()
    scale = model.module.scale
    scale.grad = scale.grad.clone()  # not the tensor DDP averaged any more
    out["replaced"] = step()
    return out


def test_ddp_marks_are_consumed_once_and_valid_only_for_the_gradient_ddp_left():
    net = Net()
    used = [p for p in net.parameters() if p is not net.unused]
    f64 = sum(p.numel() * 8 for p in used if p.dtype == torch.float64)
    flags = ("int32", 4 * len(list(net.parameters())))
    for r in get_world(2).run(_rank_handshake, deadline=patience(120)):
        assert all(r["marked"]) and not any(r["consumed"])
        assert r["synced"] == []  # every gradient already averaged by DDP
        assert r["unsynced"] == sorted([flags, ("float32", 4 * 3), ("float64", f64)])
        assert r["replaced"] == sorted([("int32", 4), ("float32", 4 * 3)])
