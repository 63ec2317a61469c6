"""Why targets decline a feature, written once where several targets share the reason (each
target's ``declined_features`` quotes it; ``ddpcheck targets`` prints it)."""

from __future__ import annotations

__all__ = ["NO_PARAM_DTYPE", "OWN_CHECKPOINTS", "TORCH_DDP_ORDER"]

#: rank-orders, for every target with torch DDP underneath
TORCH_DDP_ORDER = (
    'torch DDP requires "the exact same parameter registration order" on every process'
)
#: checkpoint, for a framework that saves in its own format
OWN_CHECKPOINTS = "saved through the framework's own checkpoint format, not the default hooks"
#: param-dtype, the opt-in precision policy (``features.OPT_IN``), for a target not applying it
NO_PARAM_DTYPE = (
    "a param_dtype policy is the target's to apply (applies_param_dtype); "
    "torch_fsdp applies it through FSDP2's MixedPrecisionPolicy"
)
