"""transformers' ``tp_plan="auto"`` on its own architectures: a scenario whose model is an
:class:`~ddpcheck.targets.hf_models.HfCausalLM` (a tiny random ``LlamaForCausalLM``,
``Qwen3ForCausalLM``, ...) is distributed with the model's *own* plans -- its class's
``_tp_plan`` and its config's ``base_model_tp_plan``, and with ``dp > 1`` its
``base_model_fsdp_plan`` -- by the very function ``from_pretrained(...,
distributed_config=DistributedConfig(tp_size=..., fsdp_size=...))`` calls on the model it built
(``maybe_distribute_model``: the plans resolved and expanded per layer,
``apply_tensor_parallelism`` over ``tp``, transformers' FSDP2 over ``dp``), then tied again as
``from_pretrained`` ties after loading (``tie_weights(recompute_mapping=False)``).

Not driven: ``from_pretrained``'s loading itself. The weights are rank 0's, broadcast before
distributing (the styles slice each rank's own tensor, ``src_data_rank=None``); loading the same
weights from a checkpoint saved to a temporary directory would add a save and a load per rank
and example, and the harness's own initial weights are what the one-process reference starts
from. transformers' mesh is the harness's (``("dp", "tp")``, ``tp`` innermost: the layout
``initialize_distributed_mesh`` builds for ``(pp, dp_replicate, fsdp, tp)`` with ``pp`` and
``dp_replicate`` 1), no new process group.

What the plans accept (transformers 5.25.0): ``"colwise"`` on ``q_proj``/``k_proj``/``v_proj``
hands attention its rank's slice of the heads as a local tensor, so ``tp`` must divide the
heads and the kv heads (``generation.utils`` asks ``get_kv_heads_per_rank`` the same and gets
None otherwise; the plans name no ``unit_colwise``): an uneven degree cuts a head in half and
attention's ``view`` fails. Phi-3's and OLMo 2's plans gather the projections' outputs
(``colwise_gather_output``) and accept any heads. :func:`architectures` draws only what the
plans accept; :func:`heads_problem` declines the rest (a replay line written by hand).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hypothesis import strategies as st
from torch import nn

from ddpcheck._language.scenario import Scenario
from ddpcheck._language.sharded_models import holders
from ddpcheck._language.tensor_parallel import mesh_problem, mesh_shape
from ddpcheck._language.zoo import VOCAB
from ddpcheck.targets.hf_models import ARCHITECTURES, HfCausalLM

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "GATHERED_HEADS",
    "architectures",
    "distribute_auto",
    "heads_problem",
    "own_styles",
    "shard_problem",
]

#: The architectures whose plans gather q/k/v's outputs (``colwise_gather_output``): attention
#: sees every head on every rank, so any number of heads is sharded right.
GATHERED_HEADS = frozenset({"phi3", "olmo2"})

#: The largest sizes drawn: an example of two layers trains in about a second per rank.
MAX_LAYERS, MAX_GROUP = 2, 2
#: The head widths drawn: even, as rotary embeddings need (``rotate_half``; an odd one fails in
#: every architecture's forward, the one-process reference's included).
HEAD_DIMS = (2, 4)


def architectures(tp: int) -> st.SearchStrategy[HfCausalLM]:
    """Tiny random models of transformers' architectures whose own plans accept ``tp``
    (:func:`shard_problem`), shrinking towards llama (:data:`~ddpcheck.targets.hf_models.
    ARCHITECTURES`' first), one layer, the fewest heads, the narrowest head and MLP, an untied
    head. The kv heads are a multiple of ``tp`` where the plan splits attention over them (1 to
    3 where it gathers), each serving 1 or 2 query heads; the MLP as often uneven over ``tp`` as
    even."""
    return (
        st.sampled_from(tuple(ARCHITECTURES))
        .flatmap(lambda a: _shaped(a, tp))
        .filter(lambda spec: shard_problem(spec, tp) is None)
    )


@st.composite
def _shaped(draw: st.DrawFn, architecture: str, tp: int) -> HfCausalLM:
    gathered = architecture in GATHERED_HEADS
    kv = draw(st.integers(1, 3)) if gathered else tp * draw(st.integers(1, 2))
    widths = [i for i in range(2, 3 * tp + 1) if holders(i, tp) == tp]
    return HfCausalLM(
        architecture,
        layers=draw(st.integers(1, MAX_LAYERS)),
        heads=kv * draw(st.integers(1, MAX_GROUP)),
        kv_heads=kv,
        head_dim=draw(st.sampled_from(HEAD_DIMS)),
        intermediate=draw(st.sampled_from(widths)),
        tied=draw(st.booleans()),
    )


def shard_problem(spec: HfCausalLM, tp: int) -> str | None:
    """Why ``spec``'s own plan cannot shard it over ``tp`` ranks (None: it can): ``tp`` not
    dividing the heads or kv heads of a plan that splits attention over them, or a layer the
    plan shards leaving a rank none of its features (an empty shard, on which torch's DTensor
    may hang: bench/dtensor_empty_reshape.py)."""
    if tp == 1:
        return None
    if spec.architecture not in GATHERED_HEADS and (spec.heads % tp or spec.kv_heads % tp):
        return (
            f"{spec.architecture}'s tp_plan shards q_proj/k_proj/v_proj 'colwise', which hands "
            f"attention a local slice of the heads: tp={tp} does not divide {spec.heads} heads "
            f"and {spec.kv_heads} kv heads, so a head is cut in half (transformers' "
            "get_kv_heads_per_rank: None)"
        )
    widths = {
        "the MLP's intermediate": spec.intermediate,
        "k_proj/v_proj's outputs": spec.kv_heads * spec.head_dim,
        "the vocabulary": VOCAB,
    }
    for what, width in widths.items():
        if holders(width, tp) < tp:
            return (
                f"{what} ({width} features) over tp={tp} leaves a rank an empty shard, and "
                "torch's DTensor may hang on one (bench/dtensor_empty_reshape.py)"
            )
    return None


#: Why an architecture is not checked over ``dp > 1`` yet (transformers' FSDP2 with its plans).
FSDP_UNTRIAGED = (
    "an architecture's own plan with transformers' FSDP2 over dp > 1: a rank once aborted in "
    "native code ('double free or corruption') in a later example of the same world, not "
    "reproduced on replay and not yet triaged, so not drawn where it could turn a correct "
    "run red; transformers' tied-head bug there is shown by bench/hf_fsdp_tied.py"
)


def heads_problem(scenario: Scenario, world_size: int) -> str | None:
    """:func:`shard_problem` of the scenario's model at its degree, or :data:`FSDP_UNTRIAGED`
    over ``dp > 1`` (None: none, or the model is no :class:`HfCausalLM`)."""
    spec, tensor_parallel = scenario.model, scenario.tensor_parallel
    if not isinstance(spec, HfCausalLM) or mesh_problem(tensor_parallel, world_size):
        return None
    dp, tp = mesh_shape(tensor_parallel, world_size)
    return FSDP_UNTRIAGED if dp > 1 else shard_problem(spec, tp)


def own_styles(scenario: Scenario) -> frozenset[str]:
    """The styles the scenario's model's own plan names (none: the model is no
    :class:`HfCausalLM`); its config's, without building the model."""
    if not isinstance(scenario.model, HfCausalLM):
        return frozenset()
    return frozenset((scenario.model.config().base_model_tp_plan or {}).values())


def distribute_auto(lm: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """``lm`` (a transformers ``PreTrainedModel``) distributed as ``from_pretrained`` with
    ``DistributedConfig(tp_size=tp, fsdp_size=dp)`` distributes the model it built: its own
    plans, by its own ``maybe_distribute_model``, over the harness's ``(dp, tp)`` mesh, then
    its tied weights tied again as loading ties them. Nothing at ``dp = tp = 1`` (what
    ``prepare_distribute_model`` decides: no mesh manager)."""
    from transformers.distributed.configuration_utils import DistributedConfig
    from transformers.distributed.utils import TransformersDeviceMesh

    dp, tp = mesh["dp"].size(), mesh["tp"].size()
    if dp == 1 and tp == 1:
        return lm

    class HarnessMesh(TransformersDeviceMesh):
        """transformers' mesh manager over the harness's mesh: its ``fsdp`` axis is ``dp``,
        its ``pp`` and ``dp_replicate`` axes (size 1 here) are left out."""

        def get_mesh(self, dims: str | tuple[str, ...]) -> DeviceMesh:
            dims = (dims,) if isinstance(dims, str) else dims
            kept = tuple(
                "dp" if d == "fsdp" else d for d in dims if d not in ("pp", "dp_replicate")
            )
            return mesh[kept]

    # from_pretrained builds the model untied (init.no_tie_weights) and ties after loading
    for tied in lm.all_tied_weights_keys:  # type: ignore[union-attr]
        owner, _, name = tied.rpartition(".")
        module = lm.get_submodule(owner)
        setattr(module, name, nn.Parameter(getattr(module, name).detach().clone()))
    config = DistributedConfig(tp_size=tp, fsdp_size=dp)
    lm = type(lm).maybe_distribute_model(lm, config, HarnessMesh(mesh, mesh))  # type: ignore[attr-defined]
    lm.tie_weights(recompute_mapping=False)  # type: ignore[operator]
    return lm
