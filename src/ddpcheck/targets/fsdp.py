"""How the ``torch_fsdp`` target (``ddpcheck.targets.TorchFSDPTarget``) sets up torch's FSDP2.

FSDP2 (``torch.distributed.fsdp.fully_shard``) shards every parameter as a DTensor (``Shard(0)``
over the world), all-gathers it for forward and backward, reduce-scatters gradients (averaged),
and the plain optimizer steps the local shards. Its own module so the FSDP mutants
(``ddpcheck.mutation.broken_fsdp``) reuse the steps.

What FSDP2 cannot run, each found by trying the battery and random scenarios (torch 2.13, gloo,
CPU): non-contiguous parameters (``fully_shard`` raises), and a parameter used on some ranks only
(FSDP2 all-gathers a layer's parameters in its forward and reduce-scatters the gradients it got,
so a layer some ranks skip leaves the collectives unpaired) -- both declined as features by
``TorchFSDPTarget.supported_features`` -- and, declined per scenario by :func:`fsdp_cannot_run`,
a layer skipped by some ranks' micro-batches only, a parameter used outside its own layer's
forward, infinity-norm clipping with an empty shard, and a layer called twice per forward with
accumulation (reduce-scattered twice: right numbers, twice the communication). Tied weights, mixed
dtypes (per layer), frozen and globally unused parameters work: modules sharing a parameter are
sharded together (:func:`shard_leaves`).
"""

from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from ddpcheck._base.errors import InvalidArgument
from ddpcheck._language.scenario import Scenario, build_model, local_micro_batches
from ddpcheck.targets.configuration import load_config, reconcile

if TYPE_CHECKING:  # torch.distributed.fsdp and .tensor load when an FSDP2 target runs
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import Shard

__all__ = [
    "CPU_FLOOR",
    "CUDA_FLOOR",
    "FSDP_HARNESS_KEYS",
    "FSDP_SCENARIO_KEYS",
    "broadcast_from",
    "fsdp_cannot_run",
    "fsdp_config",
    "fsdp2",
    "fully_shard_options",
    "gradient_sync_off",
    "shard_last_dim",
    "shard_leaves",
    "tensor_api",
]

#: The first torch release whose FSDP2 runs on each device: on CUDA, 2.4 through its older import
#: path ``torch.distributed._composable.fsdp`` (the same ``fully_shard``, ``FSDPModule``,
#: ``MixedPrecisionPolicy``); on the CPU, where 2.4 and 2.5 raise "FSDP requires CUDA for streams",
#: the release measured by bench/torch_matrix.py (docs/torch-releases.md). Below it the target is
#: refused before any world runs (``TorchFSDPTarget.requirements``), never a verdict.
CUDA_FLOOR = "2.4"
CPU_FLOOR = "2.7"


def fsdp2() -> ModuleType:
    """FSDP2's module: ``torch.distributed.fsdp`` where it exports ``fully_shard`` (torch 2.6 and
    later), else ``torch.distributed._composable.fsdp`` (2.4, 2.5: the same API). Importing it
    costs 0.5 s after torch, so it loads only when an FSDP2 target runs."""
    import torch.distributed.fsdp as public

    if hasattr(public, "fully_shard"):
        return public
    import torch.distributed._composable.fsdp as composable  # torch 2.4, 2.5

    return composable


def tensor_api() -> ModuleType:
    """DTensor's module: ``torch.distributed.tensor`` (public from torch 2.5), else
    ``torch.distributed._tensor`` (2.4)."""
    try:
        import torch.distributed.tensor as public

        public.Shard  # noqa: B018  # an older torch has the package without the names
        return public
    except (ImportError, AttributeError):
        import torch.distributed._tensor as private

        return private


_POLICY = (
    "param_dtype: under it the target sets MixedPrecisionPolicy(param_dtype=it, "
    "reduce_dtype=torch.float32), and no cast without it"
)
#: ``fully_shard`` keywords (dotted: a field of its ``mp_policy``) the scenario sets: refused.
FSDP_SCENARIO_KEYS: dict[str, str] = {
    "mp_policy.param_dtype": _POLICY,
    "mp_policy.reduce_dtype": _POLICY,
    # a float64 scenario's output cast to float32 trains at float32 precision: not a
    # data-parallel bug, so not a verdict
    "mp_policy.output_dtype": "dtype and param_dtype: the output keeps the forward's dtype",
}
_MESH = "ddpcheck's world: the target shards over a one-dimensional mesh of it"
#: ``fully_shard`` keywords ddpcheck's harness fixes: key -> (the values accepted, why).
FSDP_HARNESS_KEYS: dict[str, tuple[tuple[object, ...], str]] = {
    "mesh": ((None,), _MESH),
    "dp_mesh_dims": ((None,), _MESH),
    "ignored_params": ((None,), "every parameter is sharded and checked"),
    "mp_policy.cast_forward_inputs": (
        (True,),
        "the reference casts every sharded module's "
        "inputs under the param_dtype policy, as FSDP2 "
        "does by default",
    ),
}


def shard_last_dim(param: torch.Tensor) -> Shard:
    """A ``fully_shard(shard_placement_fn=...)`` that shards each parameter along its last
    dimension (``Shard(0)`` is the default) where the world divides it, else along the first:
    torch 2.13 raises "FSDP does not support uneven sharding on dim 1" (documented: uneven
    sharding is only on dim 0). What ``TorchFSDPTarget.config_space`` draws, a module-level
    function so the replay line names it."""
    last = param.ndim - 1
    even = last > 0 and param.shape[last] % dist.get_world_size() == 0
    return cast("Shard", tensor_api().Shard(last if even else 0))


def fsdp_config(config: object) -> dict[str, object]:
    """``TorchFSDPTarget(config=...)`` read and checked: ``fully_shard``'s keyword arguments,
    ``mp_policy`` and ``offload_policy`` as dicts of their keyword arguments (or the objects);
    the keys the scenario or the harness sets refused (:data:`FSDP_SCENARIO_KEYS`,
    :data:`FSDP_HARNESS_KEYS`), and any key ``fully_shard`` does not take."""
    given = load_config(config, target="TorchFSDPTarget")
    if not given:
        return given
    import inspect

    MixedPrecisionPolicy, OffloadPolicy = fsdp2().MixedPrecisionPolicy, fsdp2().OffloadPolicy

    policy = given.get("mp_policy")
    if isinstance(policy, MixedPrecisionPolicy):  # the object: checked by its fields
        given["mp_policy"] = {
            f: getattr(policy, f)
            for f in ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
            if getattr(policy, f) != getattr(MixedPrecisionPolicy(), f)
        }
    for key, kind in (("mp_policy", MixedPrecisionPolicy), ("offload_policy", OffloadPolicy)):
        value = given.get(key)
        if value is not None and not isinstance(value, (dict, kind)):
            raise InvalidArgument(
                f"TorchFSDPTarget: the config's {key!r}={value!r} must be a "
                f"dict of {kind.__name__} keyword arguments or the object"
            )
    known = set(inspect.signature(fully_shard_signature()).parameters) - {"module"}
    reconcile(
        given,
        target="TorchFSDPTarget",
        scenario_keys=FSDP_SCENARIO_KEYS,
        harness_keys=FSDP_HARNESS_KEYS,
        known=known,
    )
    return given


def fully_shard_signature() -> Callable[..., object]:
    return cast("Callable[..., object]", fsdp2().fully_shard)


def config_options(
    given: dict[str, object], param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None
) -> dict[str, object]:
    """``fully_shard`` keywords from a checked config (:func:`fsdp_config`) and the scenario's
    policy: the objects built from their dicts (``offload_policy``: ``CPUOffloadPolicy``'s
    keyword arguments)."""
    CPUOffloadPolicy, MixedPrecisionPolicy = fsdp2().CPUOffloadPolicy, fsdp2().MixedPrecisionPolicy

    options = {k: v for k, v in given.items() if k != "reshard_after_forward"}
    policy = options.pop("mp_policy", None) or {}
    assert isinstance(policy, dict), policy  # fsdp_config made the object a dict of its fields
    options["mp_policy"] = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, **policy
    )
    offload = options.get("offload_policy")
    if isinstance(offload, dict):
        options["offload_policy"] = CPUOffloadPolicy(**offload)
    return options


def broadcast_from(module: nn.Module, src: int) -> None:
    """Copy rank ``src``'s parameters and buffers to every rank (FSDP2 does not broadcast; the
    scenarios initialise ranks differently on purpose). Collective: every rank calls it."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            buffer = tensor.detach().contiguous()
            dist.broadcast(buffer, src=src)
            tensor.copy_(buffer)


def fully_shard_options(
    *,
    cpu_offload: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> dict[str, object]:
    """``fully_shard`` keywords for the FSDP2 target's options: ``offload_policy``, and a
    ``MixedPrecisionPolicy`` when either dtype is set (none: FSDP2's defaults, no casts)."""
    options: dict[str, object] = {}
    if cpu_offload:
        CPUOffloadPolicy = fsdp2().CPUOffloadPolicy

        options["offload_policy"] = CPUOffloadPolicy()
    if param_dtype is not None or reduce_dtype is not None:
        MixedPrecisionPolicy = fsdp2().MixedPrecisionPolicy

        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=reduce_dtype
        )
    return options


def shard_leaves(
    module: nn.Module,
    reshard_after_forward: bool | int | None,
    **options: Any,  # fully_shard's keywords, each of its own type
) -> nn.Module:
    """``fully_shard`` every module holding parameters of its own, then the root (which takes
    whatever parameters are left): one FSDP2 parameter group per layer, as real models do.
    Modules sharing a parameter (tied weights) are sharded together, as FSDP2 requires.
    ``options``: more ``fully_shard`` keywords, the same for every call
    (:func:`fully_shard_options`)."""
    fully_shard = fsdp2().fully_shard

    groups: list[list[nn.Module]] = []  # modules that must share one fully_shard call
    owner: dict[int, list[nn.Module]] = {}  # id(parameter) -> its group
    for child in list(module.modules())[1:]:
        own = list(child.parameters(recurse=False))
        if not own:
            continue
        joined = list({id(owner[id(p)]): owner[id(p)] for p in own if id(p) in owner}.values())
        group = [m for g in joined for m in g] + [child]
        groups = [g for g in groups if all(g is not j for j in joined)] + [group]
        for m in group:
            for p in m.parameters(recurse=False):
                owner[id(p)] = group
    for group in groups:
        fully_shard(
            group if len(group) > 1 else group[0],
            reshard_after_forward=reshard_after_forward,
            **options,
        )
    fully_shard(module, reshard_after_forward=reshard_after_forward, **options)
    return module  # an FSDPModule now: fully_shard swaps its class in place and returns it


@contextlib.contextmanager
def gradient_sync_off(model: nn.Module) -> Iterator[None]:
    """FSDP2's accumulation: no reduce-scatter for these micro-batches (the unsharded gradients
    accumulate locally), and back on for the last one, which reduces the sum."""
    sharded = cast("FSDPModule", model)  # the root fully_shard returned
    sharded.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        sharded.set_requires_gradient_sync(True)


#: The last answers of :func:`fsdp_cannot_run`, by the scenario's identity (a Scenario holds
#: dicts: it has no hash), each holding its scenario so the id is not reused: a drawn scenario is
#: asked at the draw and again at admission, a battery scenario at every world size, and each
#: answer costs forwards of every rank's micro-batches (~10-50 ms).
_ANSWERS: collections.OrderedDict[tuple[int, tuple[int, ...]], tuple[Scenario, str | None]] = (
    collections.OrderedDict()
)
_KEPT_ANSWERS = 32


def fsdp_cannot_run(scenario: Scenario, world_sizes: tuple[int, ...] = (2, 3, 4)) -> str | None:
    """Why FSDP2 cannot run ``scenario`` (:func:`_cannot_run`), remembered for the last few
    scenarios asked."""
    sizes = tuple(world_sizes)
    key = (id(scenario), sizes)
    kept = _ANSWERS.get(key)
    if kept is not None and kept[0] is scenario:
        return kept[1]
    why = _cannot_run(scenario, sizes)
    _ANSWERS[key] = (scenario, why)
    while len(_ANSWERS) > _KEPT_ANSWERS:
        _ANSWERS.popitem(last=False)
    return why


def _cannot_run(scenario: Scenario, world_sizes: tuple[int, ...]) -> str | None:
    """Why FSDP2 cannot run ``scenario``, read from forwards of every rank's micro-batches on
    the initial weights (as ``ddpcheck.features`` reads parameter usage); None when it can:

    * a layer whose forward runs in some rank's micro-batch but not in another's at the same
      point (data-dependent branches): FSDP2 all-gathers a layer's parameters in its forward
      pre-hook, so the ranks' collectives would not pair;
    * infinity-norm clipping where some rank holds an empty shard (fewer rows than W), on
      which torch 2.13's ``clip_grad_norm_`` raises;
    * a parameter used outside its own layer's forward (a head tied to an embedding's weight
      by reading ``embedding.weight`` in the parent): FSDP2 holds it unsharded only there;
    * a layer called more than once per forward, with accumulation: FSDP2 reduce-scatters its
      gradient once per call then (``bench/fsdp_reused_module.py``), twice the budget.
    """
    model = build_model(scenario, scenario.seed)
    why = _empty_shard(scenario, model, world_sizes)
    if why is not None:
        return why
    forwards = _Forwards(model)
    with forwards.hooked(), torch.no_grad():
        for world_size in world_sizes:
            for step in range(scenario.steps):
                why = _step_cannot_run(forwards, scenario, step, world_size)
                if why is not None:
                    return why
    return None


def _empty_shard(scenario: Scenario, model: nn.Module, world_sizes: tuple[int, ...]) -> str | None:
    """Infinity-norm clipping where some rank holds an empty shard of a parameter."""
    if scenario.max_grad_norm is not None and math.isinf(scenario.grad_norm_type):
        for name, p in model.named_parameters():
            if p.requires_grad and (p.dim() == 0 or p.shape[0] < max(world_sizes)):
                return (
                    f"parameter {name!r} has {p.shape[0] if p.dim() else 0} rows, so some "
                    f"rank holds an empty shard of it at W={max(world_sizes)}, and torch "
                    "2.13's clip_grad_norm_ with norm_type=inf raises on an empty DTensor "
                    "shard (_foreach_norm: the infinity norm has no identity)"
                )
    return None


class _Forwards:
    """Forwards of ``model`` watched: which layers (modules holding parameters of their own) ran
    in the last one, in order (``called``), and the parameters used outside the forward of every
    layer holding them (``outside``, never cleared: the first one ends the search)."""

    def __init__(self, model: nn.Module):
        self.model = model
        # id(parameter) -> the modules holding it (tied: several)
        self.owners: dict[int, list[nn.Module]] = {}
        for m in model.modules():
            for p in m.parameters(recurse=False):
                self.owners.setdefault(id(p), []).append(m)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.active: list[nn.Module] = []  # the layers whose forward is running
        self.called: list[str] = []
        self.outside: list[str] = []

    @contextlib.contextmanager
    def hooked(self) -> Iterator[None]:
        """Every layer's forward hooked (entered and left) while the block runs."""
        hooks = []
        for name, m in self.model.named_modules():
            if any(True for _ in m.parameters(False)):
                hooks.append(
                    m.register_forward_pre_hook(lambda m, a, name=name: self._enter(m, a, name))
                )
                hooks.append(m.register_forward_hook(self._leave))
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

    def _enter(self, module: nn.Module, _: object, name: str) -> None:
        self.called.append(name)
        self.active.append(module)

    def _leave(self, *_: object) -> None:
        self.active.pop()

    def forward(self, x: torch.Tensor) -> None:
        """One forward of ``x``, its layers and parameter uses watched."""
        self.called.clear()
        with _Uses(self):
            self.model(x)


class _Uses(TorchFunctionMode):
    """Every parameter a torch function computes with, outside the forward of each layer holding
    it, appended to ``forwards.outside``."""

    def __init__(self, forwards: _Forwards):
        super().__init__()
        self.forwards = forwards

    def __torch_function__(
        self,
        func: Callable[..., object],
        types: object,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        f = self.forwards
        # reading an attribute (param.dtype, .shape) computes nothing with the parameter
        reads = getattr(func, "__name__", "") == "__get__"
        for value in [] if reads else [*args, *(kwargs or {}).values()]:
            holders = f.owners.get(id(value))
            if holders is not None and not any(h is m for h in holders for m in f.active):
                f.outside.append(f.names[id(value)])
        return func(*args, **(kwargs or {}))


def _step_cannot_run(
    forwards: _Forwards, scenario: Scenario, step: int, world_size: int
) -> str | None:
    """Why FSDP2 cannot run one step at ``world_size``, from every rank's micro-batches."""
    seen = []
    for rank in range(world_size):
        uses = []
        for x, _ in local_micro_batches(scenario, step, rank, world_size):
            forwards.forward(x)
            why = _forward_cannot_run(forwards, scenario)
            if why is not None:
                return why
            uses.append(frozenset(forwards.called))
        seen.append(uses)
    return _unpaired(seen, step, world_size)


def _forward_cannot_run(forwards: _Forwards, scenario: Scenario) -> str | None:
    """A parameter used outside its layer's forward, or a layer run twice with accumulation."""
    if forwards.outside:
        return (
            f"parameter {forwards.outside[0]!r} is used outside its layer's "
            "forward (a weight tied by reading it in another "
            "module); FSDP2 holds it whole only inside that forward"
        )
    called = forwards.called
    twice = sorted({n for n in called if called.count(n) > 1})
    if twice and scenario.accumulation > 1:
        return (
            f"layer {twice[0]!r} runs more than once per forward, "
            "with accumulation: FSDP2 (torch 2.13) then reduce-"
            "scatters its gradient once per call in the window's "
            "last micro-batch -- the right numbers, its bytes twice "
            "on the wire, which the communication budget reports "
            "(bench/fsdp_reused_module.py)"
        )
    return None


def _unpaired(seen: list[list[frozenset[str]]], step: int, world_size: int) -> str | None:
    """A layer whose forward runs in one rank's micro-batch but not in rank 0's at the same
    point (``seen``: per rank, per micro-batch, the layers that ran)."""
    for rank, uses in enumerate(seen[1:], 1):
        for i, (here, there) in enumerate(zip(seen[0], uses)):
            if here != there:
                layer = sorted(here ^ there)[0]
                return (
                    f"layer {layer!r} runs in micro-batch {i} of step {step} "
                    f"on one of ranks 0 and {rank} only (W={world_size}); "
                    "FSDP2 all-gathers a layer's parameters in its forward, "
                    "so the ranks' collectives would not pair"
                )
    return None
