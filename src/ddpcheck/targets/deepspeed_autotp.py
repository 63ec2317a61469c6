"""``deepspeed_autotp``: DeepSpeed's AutoTP training -- ``"tensor_parallel": {"autotp_size": N}``
in the config -- over the harness's ``(dp, tp)`` mesh, with your own DeepSpeed config::

    from ddpcheck.targets.deepspeed_autotp import DeepSpeedAutoTPTarget
    target = DeepSpeedAutoTPTarget(config="ds_config.json")  # or the dict initialize takes
    # command line: ddpcheck check deepspeed_autotp --config ds_config.json

AutoTP shards a transformers model by what it is: the model's own tensor-parallel plan (its
config's ``base_model_tp_plan``, converted by DeepSpeed's ``TPPlanConverter``), a
``partition_config`` or ``preset_model`` in the config, or -- a model without a plan --
DeepSpeed's parser of its linear layers. So the scenarios are the target's own
(:meth:`DeepSpeedAutoTPTarget.drawn_scenarios`): a tiny
random causal LM of one of the transformers architectures of ``ddpcheck.targets.hf_models``,
its plan left empty, the mesh drawn; the reference is the same model unparallelized.

Per example and rank: rank 0's weights broadcast first (the scenarios initialise ranks
differently; AutoTP slices each rank's own copy, as users' ranks load one checkpoint), then
``deepspeed.initialize`` with the scenario's optimizer (the client optimizer), ``ExponentialLR``
and the config completed as the ``deepspeed`` targets complete it (``engine_config``:
``gradient_accumulation_steps`` is the scenario's, DeepSpeed's own loop idiom of
``engine.backward`` and ``engine.step`` after every micro-batch) plus ``tensor_parallel
.autotp_size`` = the mesh's ``tp``. DeepSpeed builds its own ``(data_parallel,
tensor_parallel)`` mesh, row-major as the harness's (rank ``r`` at ``tp = r % tp``): the target
checks that its tensor-parallel group is the mesh's ``tp`` axis. Every rank of a group gets
the same samples (the harness's doing), which DeepSpeed's own check at the first forward
confirms; ZeRO stage 0 all-reduces the gradients over ``dp``.

AutoTP keeps each shard as a plain tensor. The harness reads a parameter, its gradient and its
optimizer state whole through the layer's own ``gather_params`` -- what DeepSpeed's 16-bit
checkpoint export calls -- on a copy (:func:`whole`). Clipping is DeepSpeed's own
``clip_grad_norm_(module.parameters(), max_norm, mpu=engine.mpu)``, the call ``engine.step()``
makes under ``gradient_clipping`` at stage 0, made by the hook with ``gradient_clipping`` left
at 0 (so it runs once, before the harness records the gradients).

**Who sets what**: as the ``deepspeed`` targets (``SCENARIO_KEYS``, ``HARNESS_KEYS`` of
``ddpcheck.targets.deepspeed``), and ``tensor_parallel.autotp_size`` is the mesh's: a config
naming one is checked on meshes of that degree only (others declined). ``zero_optimization
.stage`` 0 (the default here). Every other key reaches the engine as given
(``tensor_parallel.partition_config``, ``preset_model``, ``tp_overlap_comm``, ``tp.tp_grain_size``,
``vocab_parallel_lm_head``, ...).

Imports DeepSpeed only inside the hooks. Tried with DeepSpeed 0.19.8 (transformers 5.25.0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, ClassVar, cast

import torch
import torch.distributed as dist
from torch import nn

from ddpcheck._base.errors import InvalidArgument, NothingChecked
from ddpcheck._language.scenario import Scenario, batch_size_of, micro_batches_of
from ddpcheck._language.tensor_parallel import mesh_problem, mesh_shape
from ddpcheck._language.training import OptimizerLike, Params, SchedulerLike
from ddpcheck.targets.configuration import Config, load_config, reconcile
from ddpcheck.targets.deepspeed import (
    HARNESS_KEYS,
    SCENARIO_KEYS,
    _check_parses,
    _choose_accelerator,
    _Engine,
    _Schedule,
    engine_config,
    release_groups,
    warm_up_deepspeed,
)
from ddpcheck.targets.environment import join_existing_group
from ddpcheck.targets.fsdp import broadcast_from
from ddpcheck.targets.hf_models import ARCHITECTURES, HfCausalLM
from ddpcheck.targets.option_space import nested, options
from ddpcheck.targets.protocol import Target
from ddpcheck.targets.reasons import OWN_CHECKPOINTS

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from hypothesis.strategies import SearchStrategy
    from torch.distributed.device_mesh import DeviceMesh

    from ddpcheck.targets.option_space import Values
    from ddpcheck.targets.protocol import ConfigSpace

__all__ = ["AUTOTP_FLOOR", "DeepSpeedAutoTPTarget", "whole"]

#: The oldest DeepSpeed whose AutoTP training the glue was run on: the only one tried (AutoTP
#: training arrived in 0.16.4; ``_apply_autotp_partitioning`` and the HF-plan path are later).
AUTOTP_FLOOR = "0.19.8"

#: ds_config keys the harness fixes besides the ``deepspeed`` targets' (:data:`HARNESS_KEYS`).
AUTOTP_HARNESS_KEYS: dict[str, tuple[tuple[object, ...], str]] = {
    **HARNESS_KEYS,
    "tensor_parallel.tp.tp_group": ((None,), "the harness's mesh gives the tensor-parallel group"),
    "tensor_parallel.tp.tp_size": ((None, 0, 1), "autotp_size is the mesh's tp"),
    "zero_optimization.stage": ((None, 0), "ZeRO stages 1-3 are not checked with AutoTP yet"),
    "tensor_parallel.vocab_parallel_lm_head": (
        (None, False),
        "the scenario's loss is computed from whole logits; a vocabulary-parallel head hands "
        "each rank a shard of them, for DeepSpeed's own distributed loss (the target sets false: "
        "None would shard a tied model's head)",
    ),
}


_PLAN_REFUSED = (
    "transformers ships its plan with the style 'rowwise_split_input', which DeepSpeed's "
    "TPPlanConverter refuses: 'ValueError: HuggingFace tp_plan contains unsupported partition "
    "style(s): ['rowwise_split_input'] ... Provide an explicit "
    "'tensor_parallel.partition_config' for this model instead'"
)

#: The architectures AutoTP refuses, by how the model is handed (``handed``), with what
#: DeepSpeed 0.19.8 raises (bench/deepspeed_autotp_cpu.py --architecture NAME [--wrapped]):
#: loud refusals, declined -- a config with its own ``partition_config`` or ``preset_model``
#: lifts the first ones (DeepSpeed then reads no transformers plan).
REFUSED: Mapping[str, Mapping[str, str]] = {
    "causal_lm": {"phi3": _PLAN_REFUSED, "olmo2": _PLAN_REFUSED},
    "wrapper": {
        "phi3": "AutoTP's parser of a model without a config fails on its packed qkv_proj: "
        "'TypeError: unsupported operand type(s) for //: 'int' and 'NoneType''",
        "olmo2": "AutoTP's parser splits the attention projections but not OLMo 2's q/k norms "
        "over the whole projection: 'RuntimeError: The size of tensor a (8) must match the "
        "size of tensor b (4)'",
    },
}


@dataclasses.dataclass(frozen=True)
class DeepSpeedAutoTPTarget(Target):
    """DeepSpeed's AutoTP training over the mesh's ``tp`` axis, ZeRO stage 0 over ``dp`` (the
    module docstring). ``config``: your DeepSpeed config (a dict or a JSON file's path);
    ``handed``: ``"causal_lm"`` gives ``deepspeed.initialize`` the transformers model (AutoTP
    follows its plan), ``"wrapper"`` the module that returns its logits, which has no
    ``config`` (AutoTP's parser of linear layers)."""

    config: Config = None
    handed: str = "causal_lm"
    accumulation: int = 1  # set by configure()
    gamma: float | None = None  # the scenario's lr_decay, set by configure()

    requires = (("deepspeed", AUTOTP_FLOOR),)
    parallelizes = True
    steps_every_micro_batch = True
    declined_features: ClassVar[Mapping[str, str]] = {
        "float64": "the engine all-reduces float16, bfloat16 and float32 gradients only "
        "(split_half_float_double_sparse: 'attempting to reduce an unsupported grad type')",
        "param-dtype": "bf16 with AutoTP is not checked yet (the deepspeed targets check it)",
        "autocast": "a low-precision forward on a mesh has no calibrated tolerance yet",
        "checkpoint": f"{OWN_CHECKPOINTS} (engine.save_checkpoint)",
        "rank-orders": "the initial broadcast pairs parameters by registration order",
        "epochs": "DeepSpeed's loader would give each rank of a tensor-parallel group its own "
        "samples; the harness feeds the groups",
        "pipeline-parallel": "AutoTP shards over tp; pipelines are torch_pp's",
    }

    def __post_init__(self) -> None:
        given = load_config(self.config, target="DeepSpeedAutoTPTarget")
        reconcile(
            given,
            target="DeepSpeedAutoTPTarget",
            scenario_keys=SCENARIO_KEYS,
            harness_keys=AUTOTP_HARNESS_KEYS,
        )
        section = given.get("tensor_parallel", {})
        if not isinstance(section, Mapping):
            raise InvalidArgument(
                f"DeepSpeedAutoTPTarget: the config's 'tensor_parallel'={section!r} must be an "
                'object ({"autotp_size": N, ...})'
            )
        size = section.get("autotp_size")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 2):
            raise InvalidArgument(
                f"DeepSpeedAutoTPTarget: 'tensor_parallel.autotp_size'={size!r} must be an "
                "integer >= 2 (or left out: the mesh's tp)"
            )
        if self.handed not in ("causal_lm", "wrapper"):
            raise InvalidArgument(
                f"DeepSpeedAutoTPTarget(handed={self.handed!r}) must be 'causal_lm' or 'wrapper'"
            )
        object.__setattr__(self, "_given", given)

    @property
    def given(self) -> dict[str, object]:
        """The user's config, as loaded."""
        return cast(dict[str, object], vars(self)["_given"])

    @property
    def section(self) -> Mapping[str, object]:
        """The config's ``tensor_parallel`` section (a mapping: ``__post_init__`` checks it)."""
        return cast(Mapping[str, object], self.given.get("tensor_parallel", {}))

    def drawn_scenarios(
        self,
        world_size: int,
        dtypes: tuple[str, ...],
        without: frozenset[str],
        degrees: tuple[int, ...] | None,
    ) -> SearchStrategy[Scenario]:
        """Tiny transformers causal LMs of every architecture AutoTP takes as this target hands
        them (:data:`REFUSED`), shaped as ``hf_tp`` draws them for their own plans (key/value
        heads a multiple of ``tp``, no empty shard), on meshes of a ``tp`` above 1 -- the
        config's ``autotp_size`` where it names one."""
        from ddpcheck.targets.hf_auto import architectures
        from ddpcheck.targets.own_model_draws import own_model_scenarios

        size = self.section.get("autotp_size")
        tps = [d for d in (degrees or range(2, world_size + 1)) if world_size % d == 0]
        tps = [d for d in tps if d > 1 and size in (None, d)] or [world_size]
        refused, untied = self.refused(), "tied" in without

        def models(tp: int) -> SearchStrategy[HfCausalLM]:
            taken = architectures(tp).filter(lambda m: m.architecture not in refused)
            return taken.map(lambda m: dataclasses.replace(m, tied=False)) if untied else taken

        return own_model_scenarios(
            world_size=world_size, dtypes=dtypes, without=without, degrees=tps, models=models
        )

    def own_battery(self) -> list[tuple[str, Scenario]]:
        """:data:`BATTERY`: a Llama and a Qwen3 (q/k norms) over ``tp=2``, alone at W=2 and
        beside ``dp=2`` at W=4 (ZeRO stage 0 all-reducing over ``dp``)."""
        return BATTERY

    def config_space(self) -> ConfigSpace:
        """What an AutoTP user writes beside ``autotp_size``: the all-reduce overlapped with
        the column layers' computation (``tp_overlap_comm``), the grain of uneven splits
        (``tp.tp_grain_size``), and the model handed as the wrapper DeepSpeed's parser reads
        (``handed="wrapper"``). A ``tensor_parallel`` section of the user's config is kept
        whole, its keys not drawn."""
        drawn: dict[str, Values] = {
            "tp_overlap_comm": (True,),
            "tp": nested({"tp_grain_size": (2,)}),
        }
        if "tensor_parallel" in self.given:  # the user's section wins whole (option_space.vary)
            drawn = {}
        return options(
            config={"tensor_parallel": nested(drawn)} if drawn else {},
            fields={"handed": ("wrapper",)},
        )

    def supports(self, scenario: Scenario) -> str | None:
        if scenario.tensor_parallel is None:
            return "DeepSpeedAutoTPTarget checks tensor-parallel scenarios (a mesh)"
        if not isinstance(scenario.model, HfCausalLM):
            return (
                "AutoTP shards transformers models: the scenario's model must be an HfCausalLM "
                f"(one of {', '.join(ARCHITECTURES)}), which the target's own draws are"
            )
        if scenario.tensor_parallel.plan:
            return "AutoTP shards by the model's own plan: the scenario's plan must be empty"
        refused = self.refused().get(scenario.model.architecture)
        if refused is not None:
            return f"{scenario.model.architecture} handed as {self.handed}: {refused}"
        return None

    def refused(self) -> Mapping[str, str]:
        """The architectures AutoTP refuses as this target hands them (:data:`REFUSED`)."""
        section = self.section
        own = "partition_config" in section or "preset_model" in section
        return {} if own and self.handed == "causal_lm" else REFUSED[self.handed]

    def supports_at(self, scenario: Scenario, world_size: int) -> str | None:
        problem = mesh_problem(scenario.tensor_parallel, world_size)
        if problem is not None:
            return problem
        _, tp = mesh_shape(scenario.tensor_parallel, world_size)
        size = self.section.get("autotp_size")
        if size is not None and size != tp:
            return f"the config's autotp_size={size} is not the mesh's tp={tp}"
        if tp == 1:
            return "tp=1: autotp_size 1 is AutoTP switched off"
        dp = world_size // tp
        if any(
            batch_size_of(scenario, step) < dp * micro_batches_of(scenario, step)
            for step in range(scenario.steps)
        ):
            return "a micro-batch left empty: a transformers model runs no forward on no sample"
        spec = scenario.model
        if isinstance(spec, HfCausalLM) and min(spec.kv_heads, spec.intermediate) < tp:
            return (
                f"tp={tp} over {spec.kv_heads} key/value head(s) or an MLP {spec.intermediate} "
                "wide leaves a rank an empty shard, which the target cannot tell apart"
            )
        return None

    def configure(self, scenario: Scenario) -> Target:
        return dataclasses.replace(
            self, accumulation=scenario.accumulation, gamma=scenario.lr_decay
        )

    def warm_up(self) -> None:
        warm_up_deepspeed()

    def parallelize(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        broadcast_from(module, 0)  # AutoTP slices each rank's own copy: one checkpoint's
        object.__setattr__(self, "_tp_ranks", dist.get_process_group_ranks(mesh["tp"].get_group()))
        object.__setattr__(self, "_module", module)  # the configured copy's, for full_tensor
        return module

    def setup(
        self,
        module: nn.Module,
        params: Params,
        optimizer_cls: type[torch.optim.Optimizer],
        **kwargs: object,  # the scenario's options, for its optimizer class
    ) -> tuple[nn.Module, OptimizerLike]:
        join_existing_group()
        _choose_accelerator(next(module.parameters()).device.type)
        import deepspeed

        build: Callable[..., torch.optim.Optimizer] = optimizer_cls  # kwargs: the scenario's
        optimizer = build(params, **kwargs)
        schedule = (
            None
            if self.gamma is None
            else torch.optim.lr_scheduler.ExponentialLR(optimizer, self.gamma)
        )
        tp_ranks: list[int] = vars(self)["_tp_ranks"]
        config = engine_config(self.given, 0, self.accumulation, False)
        section = {
            **self.section,
            "autotp_size": len(tp_ranks),
            "vocab_parallel_lm_head": False,  # whole logits, for the scenario's loss
        }
        config["tensor_parallel"] = section
        if self.given:
            _check_parses(config)
        handed = module.get_submodule("lm") if self.handed == "causal_lm" else module
        engine, _, _, _ = deepspeed.initialize(
            model=handed,
            optimizer=optimizer,
            lr_scheduler=schedule,
            config=config,
            dist_init_required=False,
        )
        _check_groups(tp_ranks)
        _check_shards(module)
        return _Logits(engine, self.handed == "causal_lm"), _Engine(engine, module)

    def make_scheduler(self, optimizer: OptimizerLike, gamma: float) -> SchedulerLike:
        return _Schedule(cast(_Engine, optimizer).engine)

    def micro_batch(
        self, model: nn.Module, optimizer: OptimizerLike, index: int, count: int
    ) -> AbstractContextManager[object]:
        return nullcontext()

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        cast(_Logits, model).engine.backward(loss, scale_wrt_gas=False)

    def clip_grad_norm(
        self, model: nn.Module, optimizer: OptimizerLike, max_norm: float, norm_type: float
    ) -> object:
        """DeepSpeed's own clipping, as ``engine.step()`` calls it at stage 0."""
        from deepspeed.runtime.utils import clip_grad_norm_

        engine = cast(_Engine, optimizer).engine
        return clip_grad_norm_(engine.module.parameters(), max_norm, norm_type, mpu=engine.mpu)

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        module = vars(self).get("_module")
        shard = None if module is None else _shards(module).get(_address(tensor))
        return tensor if shard is None else whole(shard, tensor)

    def optimizer_state(
        self, optimizer: OptimizerLike
    ) -> Mapping[torch.Tensor, Mapping[str, object]]:
        """The client optimizer's state, each shard's made whole (collective, in the module's
        parameter order on every rank)."""
        engine = cast(_Engine, optimizer)
        inner: torch.optim.Optimizer = engine.engine.optimizer
        held: dict[torch.Tensor, dict[str, object]] = {}
        for param in engine.module.parameters():
            state = inner.state.get(param)
            if not state:
                continue
            sharded = callable(getattr(param, "gather_params", None))
            held[param] = {
                k: whole(param, v)
                if sharded and torch.is_tensor(v) and v.shape == param.shape
                else v
                for k, v in state.items()
            }
        return held

    def teardown(self, model: nn.Module, optimizer: OptimizerLike) -> None:
        release_groups()


def _check_groups(tp_ranks: list[int]) -> None:
    """Refuse to judge where DeepSpeed's tensor-parallel group is not the mesh's ``tp`` axis
    (the harness feeds that axis one batch)."""
    from deepspeed.utils import groups

    found = dist.get_process_group_ranks(groups.get_tensor_model_parallel_group())
    if sorted(found) != sorted(tp_ranks):
        raise NothingChecked(
            f"DeepSpeed's tensor-parallel group is ranks {found}, the mesh's tp axis "
            f"{tp_ranks}: the layouts differ"
        )


def _check_shards(module: nn.Module) -> None:
    """Decline where AutoTP left some rank an empty shard (a ``tp_grain_size`` coarser than a
    layer's share): the harness finds a shard by its storage, which an empty one lacks.
    Collective, so that every rank declines together."""
    empty = any(
        p.numel() == 0 for p in module.parameters() if callable(getattr(p, "gather_params", None))
    )
    flag = torch.tensor([float(empty)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        raise NothingChecked(
            "AutoTP left a rank an empty shard of a layer, which the target cannot tell apart "
            "from another's (it finds a shard by its storage)"
        )


class _Logits(nn.Module):
    """What the harness calls: the engine, returning logits (``HfLogits``'s contract)."""

    def __init__(self, engine: DeepSpeedEngine, causal_lm: bool):
        super().__init__()
        self.engine = engine
        self.causal_lm = causal_lm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.causal_lm:
            return cast(torch.Tensor, self.engine(input_ids=x, use_cache=False).logits)
        return cast(torch.Tensor, self.engine(x))


def _address(tensor: torch.Tensor) -> tuple:
    # a parameter, its .detach() and its gradient's: storage, offset, shape and strides
    return (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))


def _shards(module: nn.Module) -> dict[tuple, nn.Parameter]:
    """The parameters AutoTP sharded (they carry the layer's ``gather_params``), by the
    address of the parameter and of its gradient."""
    found: dict[tuple, nn.Parameter] = {}
    for param in module.parameters():
        if callable(getattr(param, "gather_params", None)):
            found[_address(param)] = param
            if param.grad is not None:
                found[_address(param.grad)] = param
    return found


@torch.no_grad()
def whole(param: nn.Parameter, shard: torch.Tensor) -> torch.Tensor:
    """``shard`` -- ``param``'s shard or a tensor laid out as it (its gradient, its optimizer
    state) -- made whole by the AutoTP layer's own ``gather_params`` on a copy, ``param``
    left as it was (collective over the tensor-parallel group)."""
    kept = param.data
    try:
        param.data = shard.detach().clone()
        param.gather_params([param])  # type: ignore[attr-defined]
        return param.data.clone()
    finally:
        param.data = kept


def _battery_entry(architecture: str, accumulation: int, clip: float | None, seed: int) -> Scenario:
    from ddpcheck._language.tensor_parallel import TensorParallel
    from ddpcheck._language.zoo import token_data

    return Scenario(
        model=HfCausalLM(architecture, heads=4, kv_heads=2, head_dim=2, intermediate=5),
        data=token_data,
        loss="token_cross_entropy",
        optimizer=torch.optim.Adam,
        optimizer_kwargs={"lr": 0.01, "eps": 1e-3},  # float32's eps (ddpcheck.strategies)
        dtype="float32",
        global_batch=8,
        steps=2,
        accumulation=accumulation,
        max_grad_norm=clip,
        seed=seed,
        tensor_parallel=TensorParallel((), 2),
    )


#: The built-in battery of ``deepspeed_autotp`` (float32: DeepSpeed reduces no float64), each
#: over ``tp=2``: at W=2 AutoTP alone, at W=4 beside ``dp=2``.
BATTERY: list[tuple[str, Scenario]] = [
    ("autotp-llama-accumulation", _battery_entry("llama", 2, None, 61)),
    ("autotp-qwen3-clip", _battery_entry("qwen3", 1, 0.5, 62)),
]
