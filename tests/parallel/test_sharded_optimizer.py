"""parallel.ShardedOptimizer in real gloo worlds.

Oracle: with identical, exactly representable gradients on every rank (multiples of 1/8, so the
world mean of W copies is exact), the sharded step must equal the plain optimizer's step *bitwise*,
and the replicas must be bitwise identical. The plain reference runs in the test process itself.

Rank-side functions (prefixed ``_rank_``) are module level: worlds import them by name.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from ddpcheck._rank import recorder as comm
from ddpcheck._world.registry import get_world
from parallel import InvalidArgument, ShardedOptimizer, sharding
from parallel.ddp import AveragedGrad
from tests.patience import patience

F64, F32 = torch.float64, torch.float32
# 6 params, 2 dtypes; and a list smaller than every world size above 1
SHAPES = [((4, 3), F64), ((3,), F64), ((5,), F32), ((2, 2), F64), ((1,), F64), ((6, 2), F32)]
FEW = [((3, 2), F64), ((2,), F32)]
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1)),
    "sgd_momentum_wd": (
        torch.optim.SGD,
        dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
    ),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "adam": (torch.optim.Adam, dict(lr=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
}
RULES = {"modulo": sharding.modulo, "contiguous": sharding.contiguous, "greedy": sharding.greedy}
STEPS = 3


# ------------------------------------------------------------------------- shared scenario


def make_params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(shape, generator=g, dtype=F64).to(dtype).requires_grad_()
        for shape, dtype in shapes
    ]


def grad_for(param, step, index, scale=1):
    """Multiples of 1/8 in [-1, 1]: W copies sum and divide exactly (W <= 4)."""
    g = torch.Generator().manual_seed(1000 * step + index)
    return (torch.randint(-8, 9, param.shape, generator=g).to(param.dtype) / 8) * scale


def groups_of(spec, params):
    if spec["groups"] == "one":
        return [{"params": params}]
    # interleaved membership, different hyperparameters (biases-in-no-decay style)
    return [
        {"params": params[0::2]},
        {"params": params[1::2], "lr": OPTIMIZERS[spec["opt"]][1]["lr"] * 0.5, "weight_decay": 0.0},
    ]


def halve(step):
    return 0.5**step


def run(spec, make_optimizer, rank_grad_scale=None):
    """Drive one scenario: returns the params, and the optimizer for inspection."""
    params = make_params(spec["shapes"])
    opt = make_optimizer(groups_of(spec, params))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, halve) if spec.get("sched") else None
    records = []
    for step in range(spec["steps"]):
        for i, p in enumerate(params):
            p.grad = grad_for(p, step, i)
        comm.reset()
        opt.step()
        records.append([(c.op, c.nbytes, c.dtypes, c.root) for c in comm.records()])
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
    return params, opt, records


def plain(spec):
    cls, kwargs = OPTIMIZERS[spec["opt"]]
    params, _, _ = run(spec, lambda groups: cls(groups, **kwargs))
    return [p.detach() for p in params]


def _sharded(cls, rule, kwargs):
    """What ``run`` calls to build the optimizer: a ShardedOptimizer of ``cls``."""
    return lambda groups: ShardedOptimizer(groups, cls, sharding_rule=rule, **kwargs)


def _rank_equivalence(specs):
    out = []
    for spec in specs:
        cls, kwargs = OPTIMIZERS[spec["opt"]]
        params, opt, records = run(spec, _sharded(cls, RULES[spec["rule"]], kwargs))
        stated = {id(p) for p, s in opt.state.items() if s}
        out.append(
            dict(
                params=[p.detach() for p in params],
                owners=[opt.owner_of(p) for p in params],
                stated=[id(p) in stated for p in params],
                grads_cleared=all(p.grad is None for p in params),
                records=records,
            )
        )
    return out


def equivalence_specs():
    specs = [
        dict(opt=o, groups=g, rule=r, shapes=SHAPES, steps=STEPS)
        for o in OPTIMIZERS
        for g in ("one", "two")
        for r in RULES
    ]
    specs += [
        dict(opt=o, groups="one", rule=r, shapes=FEW, steps=STEPS)
        for o in ("sgd_momentum_wd", "adam")
        for r in RULES
    ]
    specs += [
        dict(opt=o, groups="two", rule="greedy", shapes=SHAPES, steps=STEPS, sched=True)
        for o in ("sgd_nesterov", "adamw")
    ]
    return specs


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sharded_step_is_bitwise_the_plain_step_for_every_rule_and_optimizer(world_size):
    """SGD variants, Adam, AdamW x one/two interleaved groups x every rule, W=1..4 and W > #params:
    replicas bitwise identical and equal to the plain optimizer; each param's state on its owner
    only; broadcasts per step = (owner, dtype) pairs, from the owner, carrying every param once;
    gradients averaged in one int32 presence exchange plus one all-reduce per dtype."""
    specs = equivalence_specs()
    results = get_world(world_size).run(_rank_equivalence, specs, deadline=patience(120))
    for n, spec in enumerate(specs):
        expected = plain(spec)
        ranks = [r[n] for r in results]
        owners = ranks[0]["owners"]
        for rank, got in enumerate(ranks):
            where = f"{spec} rank {rank}"
            assert got["owners"] == owners, where
            for i, (p, e) in enumerate(zip(got["params"], expected)):
                assert torch.equal(p, e), f"{where} param {i}: {(p - e).abs().max()}"
            assert got["grads_cleared"], where
            if spec["opt"] != "sgd":  # stateless plain SGD keeps only a momentum_buffer=None
                assert got["stated"] == [o == rank for o in owners], where
            dtypes = [str(d).replace("torch.", "") for _, d in spec["shapes"]]
            pairs = {(o, d) for o, d in zip(owners, dtypes)}
            for step_records in got["records"]:
                reduces = [r for r in step_records if r[0] == "all_reduce"]
                casts = [r for r in step_records if r[0] == "broadcast"]
                assert [r[0] for r in step_records if r[0] not in ("all_reduce", "broadcast")] == []
                assert reduces[0][1:3] == (4 * len(owners), ("int32",)), where
                assert len(reduces) == 1 + len(set(dtypes)), where
                assert len(casts) == len(pairs) <= len(set(owners)) * len(set(dtypes)), where
                assert sorted((r[3], r[2][0]) for r in casts) == sorted(pairs), where
                assert sum(r[1] for r in casts) == sum(
                    p.numel() * p.element_size() for p in expected
                ), where
        rule, params = RULES[spec["rule"]], make_params(spec["shapes"])
        by_rule = {
            id(p): o
            for g in groups_of(spec, params)
            for p, o in zip(g["params"], rule(g["params"], world_size))
        }
        assert owners == [by_rule[id(p)] for p in params], spec
    # the scheduler must actually change the updates, or the scheduler cases prove nothing
    sched = next(s for s in specs if s.get("sched"))
    scheduled, unscheduled = plain(sched), plain({**sched, "sched": False})
    assert not all(torch.equal(a, b) for a, b in zip(scheduled, unscheduled))


# ------------------------------------------------------------------------- checkpoints


CKPT_SPECS = [
    dict(opt="adam", groups="two", rule="modulo", shapes=SHAPES[:5], steps=2),
    dict(opt="sgd_momentum_wd", groups="two", rule="greedy", shapes=SHAPES, steps=2),
]


def _rank_save(spec, to):
    cls, kwargs = OPTIMIZERS[spec["opt"]]
    params, opt, _ = run(
        spec,
        lambda groups: ShardedOptimizer(groups, cls, sharding_rule=RULES[spec["rule"]], **kwargs),
    )
    errors = []
    try:
        opt.state_dict()
    except RuntimeError as e:
        errors.append(str(e))
    opt.consolidate_state_dict(to=to)
    sd = None
    if dist.get_rank() == to:
        sd = opt.state_dict()
    else:
        try:
            opt.state_dict()
        except RuntimeError as e:
            errors.append(str(e))
    return dict(params=[p.detach() for p in params], sd=sd, errors=errors)


def _rank_resume(spec, values, sd, rule, steps):
    cls, kwargs = OPTIMIZERS[spec["opt"]]
    params = make_params(spec["shapes"])
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)
    opt = ShardedOptimizer(groups_of(spec, params), cls, sharding_rule=RULES[rule], **kwargs)
    opt.load_state_dict(sd)
    for step in range(spec["steps"], spec["steps"] + steps):
        for i, p in enumerate(params):
            p.grad = grad_for(p, step, i)
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in params]


def _plain_resume(spec, values, sd, steps):
    cls, kwargs = OPTIMIZERS[spec["opt"]]
    params = [v.clone().requires_grad_() for v in values]
    opt = cls(groups_of(spec, params), **kwargs)
    opt.load_state_dict(sd)
    for step in range(spec["steps"], spec["steps"] + steps):
        for i, p in enumerate(params):
            p.grad = grad_for(p, step, i)
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in params], opt


@pytest.mark.parametrize("case", [0, 1])
def test_checkpoint_saved_at_3_resumes_at_2_and_in_a_plain_optimizer(case):
    """Save at W=3 (Adam: one rank owns nothing of group 1), resume at W=2 under another rule and
    in a plain optimizer; also load the plain optimizer's own checkpoint at W=2. Every continued run
    equals the uninterrupted plain run bitwise, and the consolidated dict equals the plain one."""
    spec, to = CKPT_SPECS[case], case * 2  # consolidate on rank 0, and on the last rank
    saved = get_world(3).run(_rank_save, spec, to, deadline=patience(120))
    sd = saved[to]["sd"]
    for rank, r in enumerate(saved):
        if rank != to:
            assert r["sd"] is None and f"consolidate_state_dict(to={rank})" in r["errors"][1]
            assert f"consolidated on rank {to}" in r["errors"][1]
        assert "has not been consolidated" in r["errors"][0]
        assert f"consolidate_state_dict(to={rank})" in r["errors"][0]
    values = saved[0]["params"]

    # the consolidated dict is the plain optimizer's, value for value
    cls, kwargs = OPTIMIZERS[spec["opt"]]
    ref_params, ref_opt, _ = run(spec, lambda groups: cls(groups, **kwargs))
    ref_sd = ref_opt.state_dict()
    assert sd["param_groups"] == ref_sd["param_groups"]
    assert sd["state"].keys() == ref_sd["state"].keys()
    for i in ref_sd["state"]:
        for key, value in ref_sd["state"][i].items():
            assert torch.equal(torch.as_tensor(sd["state"][i][key]), torch.as_tensor(value)), (
                i,
                key,
            )

    uninterrupted = plain({**spec, "steps": spec["steps"] + 2})
    # deepcopy: load_state_dict aliases the dict's tensors, and stepping would change them
    resumed_plain, _ = _plain_resume(spec, values, copy.deepcopy(sd), 2)
    other_rule = "greedy" if spec["rule"] == "modulo" else "contiguous"
    resumed_sharded = get_world(2).run(
        _rank_resume, spec, values, sd, other_rule, 2, deadline=patience(120)
    )
    from_plain = get_world(2).run(
        _rank_resume,
        spec,
        [p.detach() for p in ref_params],
        ref_sd,
        other_rule,
        2,
        deadline=patience(120),
    )
    for name, got in (
        [("plain resume", resumed_plain)]
        + [(f"W=2 rank {r} resume of W=3 ckpt", g) for r, g in enumerate(resumed_sharded)]
        + [(f"W=2 rank {r} resume of plain ckpt", g) for r, g in enumerate(from_plain)]
    ):
        for i, (p, e) in enumerate(zip(got, uninterrupted)):
            assert torch.equal(p, e), f"{name} param {i}: {(p - e).abs().max()}"


def test_checkpoint_saved_at_2_resumes_at_3_bitwise():
    """Resharding onto more ranks: at W=3 a rank owns state nobody held at W=2 under this rule,
    and the continued run still equals the uninterrupted plain run bitwise."""
    spec = CKPT_SPECS[0]
    saved = get_world(2).run(_rank_save, spec, 0, deadline=patience(120))
    resumed = get_world(3).run(
        _rank_resume, spec, saved[0]["params"], saved[0]["sd"], "modulo", 2, deadline=patience(120)
    )
    uninterrupted = plain({**spec, "steps": spec["steps"] + 2})
    for rank, got in enumerate(resumed):
        for i, (p, e) in enumerate(zip(got, uninterrupted)):
            assert torch.equal(p, e), (rank, i)


# ------------------------------------------------------------------------- partial grads, DDP marks


def mark_averaged(params):
    """What DDP.finish_gradient_sync() leaves on each parameter it synchronised."""
    for p in params:
        p.ddp_averaged_grad = AveragedGrad(p.grad)


def _rank_partial_grads():
    """W=3: p0 on all ranks, p1 only on rank 0, p2 on none, p3 different per rank; then the DDP
    path (marked grads are not averaged again); then zero_grad on owned and non-owned params."""
    rank = dist.get_rank()
    params = make_params(FEW + FEW)  # f64, f32, f64, f32
    opt = ShardedOptimizer(params, torch.optim.Adam, lr=0.01)
    params[0].grad = torch.full_like(params[0], 0.5)
    if rank == 0:
        params[1].grad = torch.full_like(params[1], 3.0)
    params[3].grad = torch.full_like(params[3], float(rank + 1))
    before = [p.detach().clone() for p in params]
    opt.step()
    out = dict(
        grads=[None if p.grad is None else p.grad.clone() for p in params],
        changed=[not torch.equal(b, p) for b, p in zip(before, params)],
        stated=sorted(i for i, p in enumerate(params) if opt.state.get(p)),
    )

    # DDP averaged p0, p1 (marked); p2, p3 still need the optimizer's all-reduce
    for p in params:
        p.grad = torch.ones_like(p)
    mark_averaged(params[:2])
    comm.reset()
    opt.step()
    out["partial"] = [(c.op, c.nbytes) for c in comm.records() if c.op == "all_reduce"]
    mark_averaged(params)
    comm.reset()
    opt.step()
    out["all_marked"] = [c.op for c in comm.records()]

    opt.zero_grad(set_to_none=False)
    out["zeroed"] = all(p.grad is not None and not p.grad.any() for p in params)
    opt.zero_grad()
    out["cleared"] = all(p.grad is None for p in params)
    out["params"] = [p.detach() for p in params]
    return out


def test_grads_present_on_some_ranks_are_averaged_with_zeros_and_ddp_marks_skip_the_exchange():
    results = get_world(3).run(_rank_partial_grads, deadline=patience(120))
    for rank, r in enumerate(results):
        g = r["grads"]
        assert torch.equal(g[0], torch.full_like(g[0], 0.5)), rank
        assert torch.equal(g[1], torch.full_like(g[1], 1.0)), rank  # 3 / 3: zeros elsewhere
        assert g[2] is None, rank  # no rank used it: stays None, not zeros
        assert torch.equal(g[3], torch.full_like(g[3], 2.0)), rank  # (1 + 2 + 3) / 3
        assert r["changed"] == [True, True, False, True], rank
        assert 2 not in r["stated"], rank
        # only p2 (f64, 6 elements) and p3 (f32, 2) are averaged: 2 presence flags + their bytes
        assert sorted(r["partial"]) == sorted(
            [("all_reduce", 8), ("all_reduce", 48), ("all_reduce", 8)]
        ), rank
        assert r["all_marked"] == ["broadcast"] * len(r["all_marked"]) and r["all_marked"], rank
        assert r["zeroed"] and r["cleared"], rank
        for p, q in zip(r["params"], results[0]["params"]):
            assert torch.equal(p, q), rank
    # each used param's Adam state lives on exactly one rank (its owner, i % 3 under modulo)
    assert [list(r["stated"]) for r in results] == [[0, 3], [1], []]


# ------------------------------------------------------------------------- groups and subgroups


def _rank_add_param_group(rule, sharded):
    params = make_params(SHAPES)
    first, later = params[:4], params[4:]
    if sharded:
        opt = ShardedOptimizer(first, torch.optim.Adam, sharding_rule=RULES[rule], lr=0.01)
    else:
        opt = torch.optim.Adam(first, lr=0.01)
    owners_before = [opt.owner_of(p) for p in first] if sharded else []
    for step in range(4):
        if step == 2:
            opt.add_param_group({"params": later, "lr": 0.02, "betas": (0.8, 0.9)})
        for i, p in enumerate(params):
            p.grad = grad_for(p, step, i)
        opt.step()
        opt.zero_grad()
    owners_after = [opt.owner_of(p) for p in first] if sharded else []
    return dict(
        params=[p.detach() for p in params],
        kept=owners_before == owners_after,
        groups=[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
    )


def test_add_param_group_keeps_earlier_owners_and_steps_like_plain():
    expected = _rank_add_param_group("greedy", sharded=False)
    for r in get_world(3).run(_rank_add_param_group, "greedy", True, deadline=patience(120)):
        assert r["kept"]
        assert r["groups"] == expected["groups"]
        for i, (p, e) in enumerate(zip(r["params"], expected["params"])):
            assert torch.equal(p, e), i


def _rank_subgroup(spec):
    pg = dist.new_group([1, 2])
    try:  # a group left behind would make the world unfit for the next task
        return _in_subgroup(spec, pg)
    finally:
        dist.destroy_process_group(pg)


def _in_subgroup(spec, pg):
    if dist.get_rank() == 0:
        try:
            ShardedOptimizer(make_params(SHAPES), torch.optim.SGD, process_group=pg, lr=0.1)
        except InvalidArgument as e:
            return str(e)
        return "no error"
    cls, kwargs = OPTIMIZERS[spec["opt"]]
    params, opt, records = run(
        spec,
        lambda groups: ShardedOptimizer(
            groups, cls, sharding_rule=RULES[spec["rule"]], process_group=pg, **kwargs
        ),
    )
    return dict(
        params=[p.detach() for p in params],
        records=records,
        owners=[opt.owner_of(p) for p in params],
    )


def test_process_group_excluding_rank_0_broadcasts_from_global_owner_ranks():
    spec = dict(opt="adamw", groups="two", rule="modulo", shapes=SHAPES, steps=STEPS)
    message, *members = get_world(3).run(_rank_subgroup, spec, deadline=patience(120))
    assert "does not contain this rank (global rank 0)" in message
    assert "construct ShardedOptimizer only on its members" in message
    expected = plain(spec)
    for r in members:
        assert set(r["owners"]) == {0, 1}  # group ranks
        for i, (p, e) in enumerate(zip(r["params"], expected)):
            assert torch.equal(p, e), i
        for step_records in r["records"]:
            roots = {rec[3] for rec in step_records if rec[0] == "broadcast"}
            assert roots == {1, 2}  # global ranks of group ranks 0 and 1


# ------------------------------------------------------------------------- misuse


def _wrong_length(params, world_size):
    return [0] * (len(params) + 1)


def _non_integer(params, world_size):
    return [0, 0, 0.5, 0] if len(params) == 4 else [0] * len(params)


def _out_of_range(params, world_size):
    return [world_size] * len(params)


def _rank_dependent(params, world_size):
    return [dist.get_rank() % world_size] * len(params)


def _rank_misuse():
    rank = dist.get_rank()
    params = make_params(SHAPES)
    SGD = torch.optim.SGD
    attempts = {
        "instance as optimizer_cls": lambda: ShardedOptimizer(params, SGD(params, lr=0.1)),
        "not an optimizer": lambda: ShardedOptimizer(params, dict),
        "empty params": lambda: ShardedOptimizer([], SGD, lr=0.1),
        "group without params": lambda: ShardedOptimizer([{"params": []}], SGD, lr=0.1),
        "set of params": lambda: ShardedOptimizer(set(params), SGD, lr=0.1),
        "duplicate param": lambda: ShardedOptimizer(params + params[:1], SGD, lr=0.1),
        "bad optimizer kwargs": lambda: ShardedOptimizer(params, SGD, lr=-1.0),
        "rule not callable": lambda: ShardedOptimizer(params, SGD, sharding_rule="greedy", lr=0.1),
        "rule wrong length": lambda: ShardedOptimizer(
            params, SGD, sharding_rule=_wrong_length, lr=0.1
        ),
        "rule non-integer": lambda: ShardedOptimizer(
            [{"params": params[:2]}, {"params": params[2:]}],
            SGD,
            sharding_rule=_non_integer,
            lr=0.1,
        ),
        "rule out of range": lambda: ShardedOptimizer(
            params, SGD, sharding_rule=_out_of_range, lr=0.1
        ),
        "rule differs across ranks": lambda: ShardedOptimizer(
            params, SGD, sharding_rule=_rank_dependent, lr=0.1
        ),
        "params differ across ranks": lambda: ShardedOptimizer(
            params if rank == 0 else params[::-1], SGD, lr=0.1
        ),
    }
    opt = ShardedOptimizer(params, torch.optim.Adam, lr=0.01)
    attempts.update(
        {
            "owner_of a foreign tensor": lambda: opt.owner_of(torch.zeros(1)),
            "consolidate to a non-rank": lambda: opt.consolidate_state_dict(to=2),
            "load a non-state-dict": lambda: opt.load_state_dict({"params": []}),
            "load other group count": lambda: opt.load_state_dict(
                {"state": {}, "param_groups": [{"params": [0]}, {"params": [1]}]}
            ),
            "load other group size": lambda: opt.load_state_dict(
                {"state": {}, "param_groups": [{"params": [0, 1]}]}
            ),
        }
    )
    out = {}
    for label, attempt in attempts.items():
        try:
            attempt()
            out[label] = ("no error", "")
        except Exception as e:  # the test asserts on the type
            kind = (
                "parallel.InvalidArgument" if isinstance(e, InvalidArgument) else type(e).__name__
            )
            out[label] = (kind, str(e))
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.consolidate_state_dict(to=0)
    opt.step()
    try:
        opt.state_dict()
        out["state_dict after a later step"] = ("no error", "")
    except RuntimeError as e:
        out["state_dict after a later step"] = (type(e).__name__, str(e))
    return out


MISUSE = {
    "instance as optimizer_cls": [
        "optimizer_cls=<SGD instance> must be a subclass of torch.optim.Optimizer",
        "pass its class, SGD",
    ],
    "not an optimizer": ["optimizer_cls=<class 'dict'>", "torch.optim.AdamW"],
    "empty params": ["params=[] is empty", "model.parameters()"],
    "group without params": ["holds no parameter in any group"],
    "set of params": ["must be an ordered iterable", "set's order differs across ranks"],
    "duplicate param": [
        "param group 0, parameter 6 repeats an earlier parameter",
        "list each tensor once",
    ],
    "bad optimizer kwargs": [
        "optimizer_cls=SGD rejected optimizer_kwargs={'lr': -1.0}",
        "Invalid learning rate",
    ],
    "rule not callable": ["sharding_rule='greedy' is not callable", "parallel.sharding.greedy"],
    "rule wrong length": [
        "test_sharded_optimizer._wrong_length for param group 0",
        "returned 7 owners for 6 parameters",
        "exactly one owner rank per parameter",
    ],
    "rule non-integer": [
        "_non_integer for param group 1 returned owner 0.5 (type float) for parameter 2",
        "integer ranks in [0, world_size=2)",
    ],
    "rule out of range": [
        "_out_of_range for param group 0 returned owner 2 for parameter 0",
        "outside [0, world_size=2)",
    ],
    "rule differs across ranks": [
        "param group 0 differs across ranks in its owners",
        "_rank_dependent must be deterministic",
    ],
    "params differ across ranks": [
        "param group 0 differs across ranks in its parameter shapes",
        "same parameters in the same order",
    ],
    "owner_of a foreign tensor": [
        "param=<tensor shape=(1,) dtype=torch.float32> is not managed",
        "optimizer.param_groups[i]['params']",
    ],
    "consolidate to a non-rank": ["to=2 must be a rank", "[0, 2)"],
    "load a non-state-dict": [
        "keys ['params'] is not an optimizer state dict",
        "consolidate_state_dict",
    ],
    "load other group count": ["state_dict has 2 param groups, this optimizer has 1"],
    "load other group size": ["param group 0 has 6 parameters but the state_dict's has 2"],
    "state_dict after a later step": [
        "has not been consolidated since the last step()",
        "consolidate_state_dict(to=",
    ],
}


@pytest.fixture(scope="module")
def misuse():
    return get_world(2).run(_rank_misuse, deadline=patience(120))


@pytest.mark.parametrize("label", list(MISUSE))
def test_misuse_raises_a_message_naming_the_argument_and_the_fix(misuse, label):
    for rank, out in enumerate(misuse):
        kind, message = out[label]
        expected_kind = (
            "RuntimeError"
            if label == "state_dict after a later step"
            else "parallel.InvalidArgument"
        )
        assert kind == expected_kind, (rank, label, kind, message)
        for fragment in MISUSE[label]:
            assert fragment in message, (rank, fragment, message)
