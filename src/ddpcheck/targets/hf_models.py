"""Tiny random transformers causal language models, as a scenario's model factory: the
architectures themselves (``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ...), so that the stacks
which read a model's own parallel plan -- transformers' ``tp_plan="auto"`` (its config's
``base_model_tp_plan``), DeepSpeed's AutoTP -- shard the layers as they shard a real checkpoint.

A factory is plain data (:class:`HfCausalLM`, picklable, its ``repr`` code), and calling it
builds the model from a config of the architecture's own class, shrunk: ``zoo.VOCAB`` tokens,
``heads * head_dim`` wide, every dropout 0 (the battery's models are deterministic functions of
their weights and of each sample; with ``zoo.token_data``'s right padding and causal attention a
real token never attends to padding, so no mask is passed). The model is wrapped in
:class:`HfLogits` (``(B, L)`` tokens in, ``(B, L, VOCAB)`` logits out, as ``zoo.TinyGPT``), the
transformers model at ``.lm``, where a target finds its plan and its config.

transformers is imported when a factory is called, never at import of this module: the scenario
language must not need it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from ddpcheck._base.errors import InvalidArgument
from ddpcheck._base.options import named_fields
from ddpcheck._language.zoo import BLOCK, VOCAB

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["ARCHITECTURES", "HfCausalLM", "HfLogits"]

#: transformers' ``model_type`` of each architecture drawn, with what its config needs beyond the
#: shared shape (names differ between families: Phi-3 packs q/k/v and gate/up into one layer).
#: Every one ships a ``base_model_tp_plan`` in transformers 5.25.0; Qwen3's and Gemma 3's plans
#: give ``q_norm``/``k_norm`` the style ``replicated_with_grad_allreduce``, Phi-3's and OLMo 2's
#: gather their column-wise outputs (``colwise_gather_output``).
ARCHITECTURES: Mapping[str, Mapping[str, object]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": None},
    "gemma": {},
    "gemma3_text": {"sliding_window": BLOCK},
    "phi3": {},
    "olmo2": {},
    "granite": {},
}


@named_fields
@dataclasses.dataclass(frozen=True)
class HfCausalLM:
    """A tiny random causal LM of one transformers architecture (a key of
    :data:`ARCHITECTURES`): ``layers`` decoder layers of ``heads`` query heads and ``kv_heads``
    key/value heads (grouped-query attention where fewer) of ``head_dim`` features each, an MLP
    ``intermediate`` wide, the LM head ``tied`` to the token embedding or not."""

    architecture: str = "llama"
    layers: int = 1
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 4
    intermediate: int = 8
    tied: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise InvalidArgument(
                f"{self!r}: architecture must be one of {', '.join(ARCHITECTURES)}"
            )
        sizes = (self.layers, self.heads, self.kv_heads, self.head_dim, self.intermediate)
        if min(sizes) < 1 or self.heads % self.kv_heads:
            raise InvalidArgument(
                f"{self!r}: layers, heads, kv_heads, head_dim and intermediate must be positive, "
                "heads a multiple of kv_heads"
            )

    def config(self) -> PretrainedConfig:
        """The architecture's own config class, shrunk, every dropout 0."""
        from transformers import AutoConfig

        config = AutoConfig.for_model(
            self.architecture,
            vocab_size=VOCAB,
            hidden_size=self.heads * self.head_dim,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=4 * BLOCK,
            tie_word_embeddings=self.tied,
            initializer_range=0.2,  # livelier than 0.02: tiny models, visible gradients
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
            use_cache=False,
            **ARCHITECTURES[self.architecture],
        )
        for name, value in vars(config).items():  # attention_dropout, resid_pdrop, ...
            if isinstance(value, float) and ("dropout" in name or name.endswith("pdrop")):
                setattr(config, name, 0.0)
        config._attn_implementation = "eager"  # the same kernel in every rank and the reference
        return config

    def __call__(self) -> HfLogits:
        from transformers import AutoModelForCausalLM

        return HfLogits(AutoModelForCausalLM.from_config(self.config()))


class HfLogits(nn.Module):
    """A transformers causal LM as the battery's language models are called: tokens in, logits
    out. The transformers model is ``.lm`` (its plan ``.lm._tp_plan``, its config
    ``.lm.config``)."""

    def __init__(self, lm: PreTrainedModel):
        super().__init__()
        self.lm = lm

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, L) tokens
        return self.lm(input_ids=x, use_cache=False).logits  # (B, L, VOCAB)
