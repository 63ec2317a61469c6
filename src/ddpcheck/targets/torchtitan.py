"""``torchtitan``: torchtitan's own ``parallelize_llama`` on torchtitan's own Llama 3, at a tiny
size, over the harness's ``(dp, tp)`` mesh -- FSDP2 over ``dp_shard``, torchtitan's tensor
parallel plan (and sequence parallelism) over ``tp`` -- trained by the harness's loop.

The scenario's model is :class:`TitanLlama`, a picklable factory of a ``Llama3Model`` built from
torchtitan's own configs (``_build_llama3_layers``, its param inits, ``ComplexRoPE``), with the
vocabulary and sequences of ``ddpcheck.zoo`` (``VOCAB`` tokens, ``BLOCK`` long); the one-process
reference is the same model unparallelized. The plans stay torchtitan's: ``parallelize_llama``
applies the sharding configs its ``Llama3Model.Config.update_from_config`` writes for the
user's ``ParallelismConfig``.

What is adapted, and why (bench/torchtitan_cpu.py measures each without ddpcheck):

* the mesh: ``ParallelDims.build_mesh`` uses ``tools.utils.device_type``, ``"cuda"`` where no
  accelerator is found -- set to ``"cpu"`` for the call (the mesh's layout is torchtitan's own,
  ``tp`` innermost, the harness's too);
* the attention kernel: the language models refuse ``sdpa``, ``flex`` has no backward on the CPU
  and ``varlen`` is a CUDA kernel, so each layer's ``inner_attention`` is torchtitan's own
  ``ScaledDotProductAttention`` (causal, as flex's mask of one document; right padding is never
  attended to by a real token);
* FSDP's reduce op: torchtitan's ``gradient_divide_factor=1.0`` makes FSDP2 reduce-scatter with
  ``PREMUL_SUM``, which gloo refuses: ``set_force_sum_reduction_for_comms(True)``, the same sum;
* ``spmd_backend``: 0.3.0's default ``"spmd_types"`` refuses this eager build, so the default
  here is ``"partial_dtensor"`` (a config naming another is declined);
* RoPE's complex cache, which ``module.to(dtype)`` casts to real numbers (the harness builds
  every model in the scenario's dtype), is computed again after the cast (``restore_dtypes``).

Checked in float32 only: torchtitan's RoPE rotates in float32 whatever the model's dtype
(:data:`FLOAT32_ROPE`).

The loss: torchtitan sums each micro-batch's token cross-entropies and divides by the global
batch's non-padding tokens, and FSDP sums over ``dp`` (divide factor 1). The harness's plan
scales each micro-batch by ``dp / T`` for a wrapper that averages; :meth:`TorchTitanTarget.backward`
divides by ``dp``, which is torchtitan's ``sum / T`` exactly. ``reduction="sum"`` has no
torchtitan equivalent and is declined. With ``tp > 1`` the logits are sharded over the vocabulary
(torchtitan's loss parallelism, always on in 0.3.0): the loss runs in torch's ``loss_parallel()``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import tempfile
from collections.abc import Mapping
from contextlib import AbstractContextManager
from types import SimpleNamespace
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from ddpcheck._base.errors import InvalidArgument
from ddpcheck._language.objective import LOSS_PARALLEL, TOKEN_LOSSES
from ddpcheck._language.scenario import Scenario
from ddpcheck._language.tensor_parallel import mesh_problem, mesh_shape
from ddpcheck._language.training import OptimizerLike
from ddpcheck._language.zoo import BLOCK, VOCAB
from ddpcheck.targets.configuration import Config, described, load_config
from ddpcheck.targets.fsdp import broadcast_from
from ddpcheck.targets.option_space import options
from ddpcheck.targets.protocol import Target
from ddpcheck.targets.tensor_parallel import AUTOCAST_ON_A_MESH, TP_FLOOR, empty_micro_batch

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy
    from torch.distributed.device_mesh import DeviceMesh

    from ddpcheck.targets.protocol import ConfigSpace

__all__ = ["TITAN_FLOOR", "TitanLlama", "TorchTitanTarget", "titan_scenarios"]

#: The torchtitan release the target was built and run against (with torch 2.13.0 and triton
#: 3.9.0); 0.2.2 was taken only to its import (triton) and is not supported.
TITAN_FLOOR = "0.3.0"

#: What ``ddpcheck check torchtitan`` says where torchtitan is missing or does not import.
INSTALL = "pip install torchtitan==0.3.0 triton==3.9.0 (its models import triton)"


@dataclasses.dataclass(frozen=True)
class TitanLlama:
    """A tiny torchtitan ``Llama3Model`` (a model factory: calling it builds one): ``heads``
    attention heads of ``head_dim`` features (``dim = heads * head_dim``), ``kv_heads`` of them
    for keys and values (None: ``heads``), ``layers`` blocks, an FFN of ``hidden`` features,
    ``VOCAB`` tokens, RoPE over ``BLOCK`` positions."""

    #: every parameter takes part in every forward, and every sample holds a real token: no
    #: rank is left without a gradient (``ddpcheck.features`` reads this instead of running one)
    uses_every_parameter: ClassVar[bool] = True

    heads: int = 2
    head_dim: int = 2
    kv_heads: int | None = None
    layers: int = 1
    hidden: int = 12

    def __post_init__(self) -> None:
        kv = self.kv_heads or self.heads
        if min(self.heads, self.head_dim, self.layers, self.hidden, kv) < 1 or self.heads % kv:
            raise InvalidArgument(f"{self!r}: sizes must be positive, kv_heads divide heads")
        if self.head_dim % 2:
            raise InvalidArgument(f"{self!r}: RoPE rotates pairs, head_dim must be even")

    def config(self, parallelism: object = None) -> object:
        """torchtitan's ``Llama3Model.Config`` of this size, its attention torchtitan's SDPA,
        its sharding configs written for ``parallelism`` (a ``ParallelismConfig``; None: the
        default one) by torchtitan's own ``update_from_config``."""
        import torchtitan.models.llama3 as llama
        from torchtitan.config import ParallelismConfig
        from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
        from torchtitan.models.common.attention import ScaledDotProductAttention

        dim = self.heads * self.head_dim
        rope = ComplexRoPE.Config(dim=self.head_dim, max_seq_len=BLOCK, theta=10000)
        config = llama.Llama3Model.Config(
            dim=dim,
            vocab_size=VOCAB,
            tok_embeddings=Embedding.Config(
                num_embeddings=VOCAB, embedding_dim=dim, param_init=llama._EMBEDDING_INIT
            ),
            norm=RMSNorm.Config(normalized_shape=dim, param_init=llama._NORM_INIT),
            lm_head=Linear.Config(
                in_features=dim, out_features=VOCAB, param_init=llama._output_linear_init(dim)
            ),
            layers=llama._build_llama3_layers(
                n_layers=self.layers,
                dim=dim,
                n_heads=self.heads,
                n_kv_heads=self.kv_heads,
                hidden_dim=self.hidden,
                rope=rope,
                attn_backend="flex",  # replaced below: flex has no backward on the CPU
            ),
        )
        for layer in config.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
        parallelism = parallelism or ParallelismConfig(spmd_backend="partial_dtensor")
        config.update_from_config(config=SimpleNamespace(parallelism=parallelism))
        return config

    def __call__(self) -> nn.Module:
        model = self.config().build()  # type: ignore[attr-defined]
        with torch.no_grad():
            model.init_states(buffer_device=None)
        model.restore_dtypes = functools.partial(_complex_rope, model, self)
        return model


def _complex_rope(model: nn.Module, factory: TitanLlama) -> None:
    """RoPE's cache is complex64 (torchtitan's ``ComplexRoPE``); ``module.to(float64)`` casts it
    to real numbers, dropping the rotation: rebuilt after the scenario's cast."""
    for module in model.modules():
        rebuild = getattr(module, "_precompute_cache", None)
        if isinstance(getattr(module, "cache", None), torch.Tensor) and callable(rebuild):
            module.cache = rebuild()


#: Why float64 is declined: measured by ddpcheck's first run of this target (a float64 Adam
#: step off by 1.5e-7 relative at tp=2, float32's rounding).
FLOAT32_ROPE = (
    "torchtitan's RoPE (ComplexRoPE, CosSinRoPE alike) rotates queries and keys in float32 "
    "(query.float()) whatever the model's dtype, so a float64 model rounds to float32 there and "
    "float64's tolerance cannot judge it: checked in float32 (--dtypes float32)"
)


#: The ``ParallelismConfig`` fields a config may give and the values this target can run, each
#: other value declined with the reason (the degrees fix the mesh; see ``mesh_of``).
_RUNS_ONLY: Mapping[str, tuple[object, str]] = {
    "data_parallel_replicate_degree": (1, "DDP/HSDP over dp_replicate is not driven yet"),
    "pipeline_parallel_degree": (1, "torchtitan's pipeline (pipeline_llm) is not driven yet"),
    "context_parallel_degree": (
        1,
        "context parallelism needs flex or varlen attention, which has no backward on the CPU",
    ),
    "expert_parallel_degree": (1, "the model is dense: no experts to shard"),
    "spmd_backend": (
        "partial_dtensor",
        "torchtitan 0.3.0's spmd_types and full_dtensor refuse "
        "an eager, non-meta build ('all parameters must be DTensors on the full "
        "SPMD mesh': bench/torchtitan_cpu.py)",
    ),
    "enable_fsdp_symm_mem": (False, "symmetric memory is CUDA's (torchtitan refuses it here)"),
}


@dataclasses.dataclass(frozen=True)
class TorchTitanTarget(Target):
    """torchtitan's ``parallelize_llama`` over the harness's ``(dp, tp)`` mesh (the module
    docstring). ``config``: torchtitan's ``[parallelism]`` section -- a dict of
    ``ParallelismConfig`` fields, or a JSON file of one (``{"parallelism": {...}}`` too, as a
    job config nests it); ``data_parallel_shard_degree`` and ``tensor_parallel_degree`` fix the
    mesh, the rest reach torchtitan as given."""

    requires = (("torch", TP_FLOOR), ("torchtitan", TITAN_FLOOR))
    parallelizes = True
    config: Config = None

    declined_features: ClassVar[Mapping[str, str]] = {
        "checkpoint": "torchtitan resumes through torch.distributed.checkpoint (its "
        "CheckpointManager), not the default hooks' rank-0 state_dict",
        "rank-orders": "the initial broadcast pairs parameters by registration order",
        "autocast": AUTOCAST_ON_A_MESH,
        "float64": FLOAT32_ROPE,
    }

    def __post_init__(self) -> None:
        where = described("TorchTitanTarget", self.config)
        given = load_config(self.config, target=where)
        others = sorted(set(given) - {"parallelism"}) if "parallelism" in given else []
        if others:
            raise InvalidArgument(
                f"{where}: only a job config's [parallelism] section is taken; "
                f"{', '.join(map(repr, others))} belong to the scenario (training, optimizer, "
                "model) or to the harness's loop: leave them out"
            )
        given = dict(given.get("parallelism", given))  # type: ignore[call-overload]
        # the field names are torchtitan's to say: without it the target is refused anyway
        # (Target.requires), before any example
        known = (
            {f.name for f in dataclasses.fields(_parallelism_class())}
            if given and importlib.util.find_spec("torchtitan") is not None
            else set(given)
        )
        unknown = sorted(set(given) - known)
        if unknown:
            raise InvalidArgument(
                f"{where}: {', '.join(map(repr, unknown))} are no fields of torchtitan's "
                "ParallelismConfig (the [parallelism] section of a job config)"
            )
        object.__setattr__(self, "_given", given)

    def parallelism(self, dp: int, tp: int) -> object:
        """torchtitan's ``ParallelismConfig``: the user's fields over this example's mesh."""
        given = {"spmd_backend": "partial_dtensor", **vars(self)["_given"]}
        given.update(data_parallel_shard_degree=dp, tensor_parallel_degree=tp)
        return _parallelism_class()(**given)

    def warm_up(self) -> None:
        try:
            import torchtitan.models.llama3  # noqa: F401  (seconds: once per rank)
        except ImportError as exc:  # triton above all: its models import it
            raise ImportError(f"torchtitan's models do not import ({exc}): {INSTALL}") from exc

    def config_space(self) -> ConfigSpace:
        """The ``ParallelismConfig`` fields that change the computation on this mesh:
        sequence parallelism off (torchtitan's default is on) and FSDP's resharding policy."""
        return options(
            config={
                "enable_sequence_parallel": (False,),
                "fsdp_reshard_after_forward": ("always", "never"),
            }
        )

    def drawn_scenarios(
        self,
        world_size: int,
        dtypes: tuple[str, ...],
        without: frozenset[str],
        degrees: tuple[int, ...] | None,
    ) -> SearchStrategy[Scenario]:
        """:func:`titan_scenarios`, over the ``tp`` degrees the config leaves open."""
        wanted = vars(self)["_given"].get("tensor_parallel_degree")
        dp = vars(self)["_given"].get("data_parallel_shard_degree", -1)
        found = degrees or tuple(d for d in range(1, world_size + 1) if world_size % d == 0)
        found = (
            tuple(d for d in found if wanted in (None, d) and dp in (-1, world_size // d)) or found
        )  # none fits: every example is declined, naming the config's degrees
        return titan_scenarios(world_size, dtypes, without, found)

    def own_battery(self) -> list[tuple[str, Scenario]]:
        """:data:`BATTERY`: grouped-query attention over ``tp=2`` with accumulation (TP alone at
        W=2, FSDP2 x TP at W=4) and three heads over ``tp=3`` (W=3)."""
        return BATTERY

    def supports(self, scenario: Scenario) -> str | None:
        if not isinstance(scenario.model, TitanLlama):
            return "the torchtitan target trains torchtitan's own Llama 3 (TitanLlama models)"
        if scenario.loss not in TOKEN_LOSSES:
            return "a language model's loss: torchtitan trains on token losses"
        if scenario.reduction != "mean":
            return (
                "reduction='sum': torchtitan divides the summed token losses by the global "
                "batch's tokens (a mean); no setting of it sums"
            )
        given = vars(self)["_given"]
        for key, (runs, why) in _RUNS_ONLY.items():
            if key in given and given[key] != runs:
                return f"{key}={given[key]!r}: {why}"
        return None

    def supports_at(self, scenario: Scenario, world_size: int) -> str | None:
        problem = mesh_problem(scenario.tensor_parallel, world_size)
        if problem is not None or scenario.tensor_parallel is None:
            return problem or "torchtitan runs on a (dp_shard, tp) mesh"
        dp, tp = mesh_shape(scenario.tensor_parallel, world_size)
        given = vars(self)["_given"]
        for key, size in (("data_parallel_shard_degree", dp), ("tensor_parallel_degree", tp)):
            if given.get(key, -1) not in (-1, size):
                return f"the config's {key}={given[key]} fixes the mesh; this one has {size}"
        model = scenario.model
        if not isinstance(model, TitanLlama):
            return self.supports(scenario)
        if model.heads % tp or (model.kv_heads or model.heads) % tp:
            return f"tp={tp} must divide the heads (torchtitan's update_from_config refuses it)"
        if tp > 1 and scenario.loss not in LOSS_PARALLEL:
            return (
                f"loss={scenario.loss!r} at tp={tp}: torchtitan's logits are sharded over the "
                "vocabulary, where only the cross-entropy is computed (loss_parallel)"
            )
        return empty_micro_batch(scenario, world_size)

    def configure(self, scenario: Scenario) -> Target:
        configured = copy.copy(self)
        object.__setattr__(configured, "_scenario_model", scenario.model)
        return configured

    def parallelize(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        broadcast_from(module, 0)  # the scenarios initialise ranks differently
        dp, tp = mesh["dp"].size(), mesh["tp"].size()
        parallelism = self.parallelism(dp, tp)
        _resharded(module, vars(self)["_scenario_model"], parallelism)
        _forget_meshes()
        dims = _parallel_dims(parallelism, mesh.size())
        model = _parallelize(module, dims, parallelism)
        object.__setattr__(self, "_dp", dp)
        object.__setattr__(self, "_tp", tp)
        return model

    def micro_batch(
        self, model: nn.Module, optimizer: OptimizerLike, index: int, count: int
    ) -> AbstractContextManager[object]:
        """No ``no_sync``: torchtitan's loop reduce-scatters every micro-batch. With ``tp > 1``
        the loss runs in torch's ``loss_parallel()`` (the logits are vocabulary shards)."""
        if vars(self).get("_tp", 1) == 1:
            return super().micro_batch(model, optimizer, count - 1, count)
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        """torchtitan's normalisation: the harness's ``dp / T`` scale divided by ``dp``."""
        (loss / vars(self)["_dp"]).backward()

    def clip_grad_norm(
        self, model: nn.Module, optimizer: OptimizerLike, max_norm: float, norm_type: float
    ) -> object:
        """torchtitan's own ``clip_grad_norm_`` (its trainer's), which spans gradients on
        different meshes."""
        from torchtitan.distributed.utils import clip_grad_norm_

        return clip_grad_norm_(list(model.parameters()), max_norm, norm_type=norm_type)


def _parallelism_class() -> type:
    from torchtitan.config import ParallelismConfig

    return ParallelismConfig


def _resharded(module: nn.Module, factory: TitanLlama, parallelism: object) -> None:
    """The sharding configs torchtitan writes for ``parallelism`` (sequence parallelism on or
    off), set on the built model's modules: torchtitan copies them at build time, and the
    scenario's model was built before the example's configuration was known."""
    with torch.device("meta"):
        shadow = factory.config(parallelism).build()  # type: ignore[attr-defined]
    for name, part in shadow.named_modules():
        if hasattr(part, "_sharding_config"):
            module.get_submodule(name)._sharding_config = part._sharding_config


def _forget_meshes() -> None:
    """Empty torch's DTensor caches of sharding decisions. They key on ``DeviceMesh``, which
    compares by layout and names, not by process group: torchtitan's meshes are built anew per
    example (the last example's groups destroyed), and a cached output spec would hand the new
    example the last one's mesh, whose groups no longer resolve ("Could not resolve the process
    group", seen at the fifth example of a world before this). torch has no public way to clear
    them: these are the helpers of its public ``torch.distributed.tensor.debug`` module."""
    from torch.distributed.tensor import debug

    debug._clear_python_sharding_prop_cache()
    debug._clear_fast_path_sharding_prop_cache()


def _parallel_dims(parallelism: object, world_size: int) -> object:
    """torchtitan's ``ParallelDims`` and its meshes (new process groups, which the harness
    destroys after the example), built with torchtitan's device type set to ``"cpu"``: it is
    ``"cuda"`` where no accelerator is found."""
    import torchtitan.distributed.parallel_dims as parallel_dims

    dims = parallel_dims.ParallelDims.from_config(parallelism, world_size)
    saved, parallel_dims.device_type = parallel_dims.device_type, "cpu"
    try:
        dims.build_mesh()
    finally:
        parallel_dims.device_type = saved
    return dims


def _parallelize(module: nn.Module, dims: object, parallelism: object) -> nn.Module:
    """torchtitan's ``parallelize_llama`` as its trainer calls it, then FSDP's reduce op
    summing in a form gloo takes."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.llama3 import parallelize_llama

    model = parallelize_llama(
        module,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),  # no mixed precision
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder=tempfile.gettempdir(),
    )
    for part in model.modules():
        if isinstance(part, FSDPModule):  # PREMUL_SUM by 1.0 -> SUM: gloo has no PREMUL_SUM
            part.set_force_sum_reduction_for_comms(True)
    return model


def titan_scenarios(
    world_size: int, dtypes: tuple[str, ...], without: frozenset[str], degrees: tuple[int, ...]
) -> SearchStrategy[Scenario]:
    """Language-model scenarios on a :class:`TitanLlama` at ``world_size``: a ``tp`` of
    ``degrees``, heads a multiple of it, a token loss (cross-entropy over ``tp > 1``, where
    torchtitan's loss parallelism computes it), and what the tensor-parallel scenarios draw
    besides (``ddpcheck.targets.own_model_draws``)."""
    from hypothesis import strategies as st

    from ddpcheck._language.plans import token_losses
    from ddpcheck.targets.own_model_draws import own_model_scenarios

    @st.composite
    def models(draw: st.DrawFn, tp: int) -> TitanLlama:
        heads = tp * draw(st.sampled_from((1, 2)))
        return TitanLlama(
            heads=heads,
            head_dim=draw(st.sampled_from((2, 4))),
            kv_heads=draw(st.sampled_from((None, tp))) if heads > tp else None,
            layers=draw(st.integers(1, 2)),
            hidden=draw(st.sampled_from((12, 24))),
        )

    return own_model_scenarios(
        world_size=world_size,
        dtypes=dtypes,
        without=without,
        degrees=degrees,
        models=models,
        losses=lambda tp: token_losses() if tp == 1 else st.just("token_cross_entropy"),
        max_steps=2,
    )


def _battery_entry(heads: int, kv_heads: int | None, accumulation: int, seed: int) -> Scenario:
    from ddpcheck._language.scenario import TensorParallel
    from ddpcheck._language.zoo import token_data

    return Scenario(
        model=TitanLlama(heads=heads, head_dim=2, kv_heads=kv_heads, layers=2),
        data=token_data,
        loss="token_cross_entropy",
        optimizer=torch.optim.Adam,
        optimizer_kwargs={"lr": 0.01, "eps": 1e-3},  # float32's eps (ddpcheck.strategies)
        dtype="float32",
        global_batch=6,
        steps=2,
        accumulation=accumulation,
        seed=seed,
        tensor_parallel=TensorParallel((), 2 if heads % 3 else 3),
    )


#: The built-in battery of ``torchtitan``: grouped-query attention split over tp=2 with
#: accumulation (at W=2 tp only, at W=4 FSDP2 x TP), and 3 heads over tp=3 (W=3).
BATTERY: list[tuple[str, Scenario]] = [
    ("titan-gqa-accumulation", _battery_entry(4, 2, 2, 49)),
    ("titan-tp3", _battery_entry(3, None, 1, 50)),
]
