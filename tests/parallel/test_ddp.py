"""parallel.DDP in real gloo worlds against a single-process full-batch reference (float64).

Every case builds its model on each rank with a *rank-dependent* seed (so the constructor's
broadcast from rank 0 matters), feeds each rank its own uneven shard of a global batch, and
returns the synchronised gradients together with the reference gradients computed from rank 0's
initial weights on the whole batch. The parent asserts: gradients match the reference (relative
error <= 1e-10), are bitwise identical across ranks, and are None exactly where the reference's
are.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddpcheck._world.registry import get_world
from parallel import DDP, InvalidArgument

WORLD_SIZES = (1, 2, 3, 4)
TINY, LARGE = 1e-9, 100.0  # one parameter per bucket / everything in one bucket
REL_TOL = 1e-10
SEED = 1234
BATCH = 7  # not divisible by 2, 3 or 4: shards are uneven


# ---------------------------------------------------------------------------------------------
# Models: each is the same function of the global batch in the reference and under DDP.


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class WithBuffers(MLP):
    """A buffer initialised randomly: its value must come from rank 0."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.rand(5) + 0.5)
        self.register_buffer("count", torch.randint(0, 100, (1,)))

    def forward(self, x):
        return super().forward(x * self.scale)


class SampleDependentBranch(MLP):
    """``extra`` is used only by samples whose first feature is positive: some shards have none."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(5, 3)

    def forward(self, x):
        out = super().forward(x)
        mask = x[:, 0] > 0  # (B,)
        if mask.any():
            out = out + torch.where(mask[:, None], self.extra(x), torch.zeros_like(out))
        return out


class GloballyUnused(MLP):
    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(5, 3)  # never called: grad must stay None everywhere


class Tied(nn.Module):
    """fc3 reuses fc2's weight (as in CS336's ToyModelWithTiedWeights): reduced once, not twice."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 4)
        self.fc2 = nn.Linear(4, 4)
        self.fc3 = nn.Linear(4, 4)
        self.fc3.weight = self.fc2.weight
        self.fc4 = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        return self.fc4(torch.tanh(self.fc3(h)))


class Frozen(MLP):
    """A frozen parameter between trainable ones: skipped by DDP, grad None."""

    def __init__(self):
        super().__init__()
        self.fc1.bias.requires_grad_(False)
        self.middle = nn.Linear(6, 6)
        self.middle.weight.requires_grad_(False)

    def forward(self, x):
        return self.fc2(torch.tanh(self.middle(torch.tanh(self.fc1(x)))))


class NonContiguous(nn.Module):
    """A parameter that is a transposed view: its gradient has non-default strides."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 5).t())  # (5, 3), strides (1, 5)
        self.b = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return torch.tanh(x @ self.w + self.b)


class MixedDtype(nn.Module):
    """float32 and float64 parameters in one model: buckets must not mix them."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 4).double()
        self.b = nn.Linear(4, 3).float()

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).float()).double()


class RankOrderedBranches(nn.Module):
    """Equal-shaped branches evaluated in a rank-dependent order (the sum is the same function).

    Backward then produces gradients in a different order on every rank; with equal shapes a
    bucket paired by readiness order would mix up gradients silently.
    """

    def __init__(self):
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(5, 3) for _ in range(4))

    def forward(self, x):
        rank = dist.get_rank() if dist.is_initialized() else 0
        order = list(range(4))
        order = order[rank % 4 :] + order[: rank % 4]
        if rank % 2:
            order.reverse()
        out = 0
        for i in order:
            out = out + torch.tanh(self.branches[i](x)) * (i + 1)
        return out


MODELS = {
    "mlp": MLP,
    "buffers": WithBuffers,
    "sample_dependent_branch": SampleDependentBranch,
    "globally_unused": GloballyUnused,
    "tied": Tied,
    "frozen": Frozen,
    "non_contiguous": NonContiguous,
    "mixed_dtype": MixedDtype,
    "rank_ordered_branches": RankOrderedBranches,
}


def make_model(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = MODELS[name]()
    if name != "mixed_dtype":
        model = model.double()
    return model


def make_batch(seed: int, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, 5, generator=g, dtype=torch.float64)
    # Only the first two samples take the sample-dependent branch: most shards never do.
    x[:, 0] = -x[:, 0].abs()
    x[:2, 0] = x[:2, 0].abs()
    y = torch.randn(batch, 3, generator=g, dtype=torch.float64)
    return x, y


def loss_fn(out: torch.Tensor, y: torch.Tensor, global_batch: int, world_size: int) -> torch.Tensor:
    """Sum of per-sample losses scaled so that DDP's mean over ranks is the global-batch mean."""
    per_sample = ((out.to(torch.float64) - y) ** 2).sum(dim=1)  # (b,)
    return per_sample.sum() * world_size / global_batch


def shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return torch.tensor_split(t, world_size)[rank]  # uneven: the first B % W ranks get one more


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        n: (None if p.grad is None else p.grad.detach().clone())
        for n, p in model.named_parameters()
    }


def reference_grads(name: str, micro_batches: int = 1) -> dict[str, torch.Tensor | None]:
    model = make_model(name, SEED)
    x, y = make_batch(SEED)
    loss_fn(model(x), y, BATCH, 1).backward()
    return grads_of(model)


# ---------------------------------------------------------------------------------------------
# Rank-side functions (module level: they travel to the ranks by pickle)


def rank_sync_once(name: str, bucket_mb: float) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(make_model(name, SEED + 1000 * rank), bucket_size_mb=bucket_mb)
    initial = {k: v.clone() for k, v in model.module.state_dict().items()}
    x, y = make_batch(SEED)
    xs, ys = shard(x, rank, world), shard(y, rank, world)
    loss_fn(model(xs), ys, BATCH, world).backward()
    model.finish_gradient_sync()
    return {
        "grads": grads_of(model.module),
        "initial": initial,
        "reference_initial": make_model(name, SEED).state_dict(),
        "reference": reference_grads(name),
        "n_buckets": len(model._buckets),
        "n_trainable": sum(p.requires_grad for p in model.module.parameters()),
        "strides": {
            n: tuple(p.grad.stride())
            for n, p in model.module.named_parameters()
            if p.grad is not None
        },
        "param_strides": {n: tuple(p.stride()) for n, p in model.module.named_parameters()},
    }


def rank_accumulate(bucket_mb: float, micro: int) -> dict:
    """no_sync accumulation where the sample-dependent branch is used only in micro-batch 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    name = "sample_dependent_branch"
    model = DDP(make_model(name, SEED + rank), bucket_size_mb=bucket_mb)
    x, y = make_batch(SEED)
    xs, ys = shard(x, rank, world), shard(y, rank, world)
    chunks = list(zip(torch.tensor_split(xs, micro), torch.tensor_split(ys, micro)))
    for i, (cx, cy) in enumerate(chunks):
        last = i == len(chunks) - 1
        context = model.no_sync() if not last else contextlib.nullcontext()
        with context:
            if len(cx):
                loss_fn(model(cx), cy, BATCH, world).backward()
            elif last:
                model(cx[:0])  # an empty last micro-batch still runs a synchronised step
    model.finish_gradient_sync()
    return {"grads": grads_of(model.module), "reference": reference_grads(name)}


def rank_subgroup(bucket_mb: float) -> dict | None:
    """DDP over ranks [1, 2] of a world of 3: src must be global rank 1, not 0."""
    group = dist.new_group([1, 2])
    try:  # a group left behind would make the world unfit for the next task
        return _in_subgroup(group, bucket_mb)
    finally:
        dist.destroy_process_group(group)


def _in_subgroup(group, bucket_mb: float) -> dict | None:
    rank = dist.get_rank()
    if rank not in (1, 2):
        return None
    group_rank = dist.get_rank(group)
    model = DDP(make_model("mlp", SEED + 77 * rank), bucket_size_mb=bucket_mb, process_group=group)
    x, y = make_batch(SEED)
    xs, ys = shard(x, group_rank, 2), shard(y, group_rank, 2)
    loss_fn(model(xs), ys, BATCH, 2).backward()
    model.finish_gradient_sync()
    torch.manual_seed(0)
    ref_model = make_model("mlp", SEED + 77 * 1)  # the group's rank 0 is global rank 1
    loss_fn(ref_model(x), y, BATCH, 1).backward()
    out = {"grads": grads_of(model.module), "reference": grads_of(ref_model)}
    return out


def rank_two_steps(bucket_mb: float) -> dict:
    """Two optimizer steps: per-iteration state must be reset by finish_gradient_sync."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(make_model("sample_dependent_branch", SEED + rank), bucket_size_mb=bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref = make_model("sample_dependent_branch", SEED)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y = make_batch(SEED)
    for step in range(3):
        xb = x.roll(step, 0)
        yb = y.roll(step, 0)
        loss_fn(model(shard(xb, rank, world)), shard(yb, rank, world), BATCH, world).backward()
        model.finish_gradient_sync()
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        loss_fn(ref(xb), yb, BATCH, 1).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=step % 2 == 0)
    return {
        "params": {n: p.detach().clone() for n, p in model.module.named_parameters()},
        "reference": {n: p.detach().clone() for n, p in ref.named_parameters()},
    }


def rank_misuse(kind: str) -> str:
    """Run one misuse on every rank; return the error message (the same on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(make_model("mlp", SEED), bucket_size_mb=TINY)
    x, y = make_batch(SEED)
    xs, ys = shard(x, rank, world), shard(y, rank, world)
    try:
        if kind == "finish_twice":
            loss_fn(model(xs), ys, BATCH, world).backward()
            model.finish_gradient_sync()
            model.finish_gradient_sync()
        elif kind == "finish_before_backward":
            model.finish_gradient_sync()
        elif kind == "forgot_finish":
            loss_fn(model(xs), ys, BATCH, world).backward()
            model(xs)
        elif kind == "finish_in_no_sync":
            with model.no_sync():
                loss_fn(model(xs), ys, BATCH, world).backward()
                model.finish_gradient_sync()
        elif kind == "double_backward":
            loss = loss_fn(model(xs), ys, BATCH, world)
            loss.backward(retain_graph=True)
            loss.backward()
        elif kind == "replaced_parameter":
            model.module.fc2.weight = nn.Parameter(model.module.fc2.weight.detach().clone())
            loss_fn(model(xs), ys, BATCH, world).backward()
            model.finish_gradient_sync()
        else:
            raise ValueError(kind)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def rank_mismatched_models() -> str:
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = nn.Linear(3, 3 + rank).double()  # rank 1 builds a different shape
    try:
        DDP(module)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def rank_bad_arguments() -> list[str]:
    messages = []
    for kwargs in (
        {"bucket_size_mb": 0},
        {"bucket_size_mb": -1.0},
        {"bucket_size_mb": float("nan")},
        {"bucket_size_mb": "25"},
    ):
        try:
            DDP(nn.Linear(2, 2), **kwargs)
        except InvalidArgument as exc:
            messages.append(str(exc))
    frozen = nn.Linear(2, 2).requires_grad_(False)
    try:
        DDP(frozen)
    except InvalidArgument as exc:
        messages.append(str(exc))
    try:
        DDP("not a module")
    except InvalidArgument as exc:
        messages.append(str(exc))
    return messages


# ---------------------------------------------------------------------------------------------
# Assertions in the parent


def assert_matches_reference(got: dict, reference: dict, rank: int, rel_tol: float = REL_TOL):
    assert got.keys() == reference.keys()
    for name, ref in reference.items():
        g = got[name]
        if ref is None:
            assert g is None, f"rank {rank}: {name} has a gradient but the reference has none"
            continue
        assert g is not None, f"rank {rank}: {name} has no gradient but the reference does"
        tol = rel_tol if g.dtype == torch.float64 else max(rel_tol, 1e-5)
        err = (g.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-300)
        assert err <= tol, f"rank {rank}: {name} relative error {float(err):.3g} > {tol}"


def assert_replicas_identical(per_rank: list[dict]):
    first = per_rank[0]
    for rank, other in enumerate(per_rank[1:], start=1):
        for name, value in first.items():
            mine = other[name]
            if value is None:
                assert mine is None, f"{name}: None on rank 0 but not on rank {rank}"
            else:
                assert mine is not None and torch.equal(value, mine), (
                    f"{name}: rank {rank} differs bitwise from rank 0"
                )


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("bucket_mb", [TINY, LARGE])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_match_full_batch_reference(name, bucket_mb, world_size):
    results = get_world(world_size).run(rank_sync_once, name, bucket_mb)
    grads = [r["grads"] for r in results]
    # The mixed model's float64 layer gets its gradient through float32 arithmetic.
    rel_tol = 1e-5 if name == "mixed_dtype" else REL_TOL
    for rank, r in enumerate(results):
        assert_matches_reference(r["grads"], r["reference"], rank, rel_tol)
        # Parameters and buffers start as rank 0's whatever each rank initialised.
        for key, value in r["reference_initial"].items():
            assert torch.equal(r["initial"][key], value), f"rank {rank}: {key} not rank 0's"
    assert_replicas_identical(grads)
    if bucket_mb == TINY:
        assert results[0]["n_buckets"] == results[0]["n_trainable"]
    else:
        n_dtypes = len({g.dtype for g in grads[0].values() if g is not None})
        assert results[0]["n_buckets"] == max(n_dtypes, 1)
    if name == "non_contiguous":
        for r in results:
            assert r["strides"]["w"] == r["param_strides"]["w"] == (1, 5)


def test_frozen_parameters_are_not_bucketed():
    results = get_world(2).run(rank_sync_once, "frozen", TINY)
    # fc1.weight, fc2.weight, fc2.bias, middle.bias: four trainable tensors, one bucket each.
    assert results[0]["n_buckets"] == 4


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("bucket_mb", [TINY, LARGE])
@pytest.mark.parametrize("micro", [2, 3])
def test_no_sync_accumulation_matches_one_large_batch(micro, bucket_mb, world_size):
    results = get_world(world_size).run(rank_accumulate, bucket_mb, micro)
    for rank, r in enumerate(results):
        assert_matches_reference(r["grads"], r["reference"], rank)
    assert_replicas_identical([r["grads"] for r in results])


@pytest.mark.parametrize("bucket_mb", [TINY, LARGE])
def test_process_group_excluding_rank_zero(bucket_mb):
    results = get_world(3).run(rank_subgroup, bucket_mb)
    assert results[0] is None
    for rank in (1, 2):
        assert_matches_reference(results[rank]["grads"], results[rank]["reference"], rank)
    assert_replicas_identical([results[1]["grads"], results[2]["grads"]])


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("bucket_mb", [TINY, LARGE])
def test_several_steps_reset_per_iteration_state(bucket_mb, world_size):
    results = get_world(world_size).run(rank_two_steps, bucket_mb)
    for rank, r in enumerate(results):
        assert_matches_reference(r["params"], r["reference"], rank)
    assert_replicas_identical([r["params"] for r in results])


MISUSES = {
    "finish_twice": "called twice",
    "finish_before_backward": "called twice, or before any forward",
    "forgot_finish": "call model.finish_gradient_sync() after loss.backward()",
    "finish_in_no_sync": "inside no_sync()",
    "double_backward": "produced twice in one synchronised backward",
    "replaced_parameter": "parameter 'fc2.weight' requires grad but was not trainable",
}


@pytest.mark.parametrize("kind", sorted(MISUSES))
def test_misuse_is_a_clear_error_on_every_rank(kind):
    messages = get_world(2).run(rank_misuse, kind)
    for message in messages:
        assert MISUSES[kind] in message


def test_ranks_wrapping_different_parameters_fail_together():
    messages = get_world(2).run(rank_mismatched_models)
    for message in messages:
        assert "ranks [1] (group ranks) wrap different parameters or buffers than rank 0" in message


def test_bad_arguments_name_the_problem():
    messages = get_world(1).run(rank_bad_arguments)
    assert messages[0] == [
        "bucket_size_mb=0 must be a positive number",
        "bucket_size_mb=-1.0 must be a positive number",
        "bucket_size_mb=nan must be a positive number",
        "bucket_size_mb='25' must be a positive number",
        "module=Linear has no parameter with requires_grad=True; there is nothing to synchronise",
        "module='not a module' must be a torch.nn.Module",
    ]


def test_no_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="needs an initialised default process group"):
        DDP(nn.Linear(2, 2))


def test_math_of_the_loss_scaling():
    """The helper's scaling: mean over ranks of scaled shard sums is the global mean."""
    _, y = make_batch(SEED)
    out = torch.zeros_like(y)
    full = loss_fn(out, y, BATCH, 1)
    parts = [loss_fn(shard(out, r, 3), shard(y, r, 3), BATCH, 3) for r in range(3)]
    assert math.isclose(float(sum(parts) / 3), float(full), rel_tol=1e-12)
