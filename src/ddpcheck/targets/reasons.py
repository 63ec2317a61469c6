"""Why targets decline a feature, written once where several targets share the reason (each
target's ``declined_features`` quotes it; ``ddpcheck targets`` prints it)."""

from __future__ import annotations

__all__ = [
    "COUNTS_ITS_WINDOW",
    "NO_PARAM_DTYPE",
    "NO_PIPELINE",
    "NO_PLAN",
    "OPT_IN_REASONS",
    "OWN_CHECKPOINTS",
    "TORCH_DDP_ORDER",
]

#: rank-orders, for every target with torch DDP underneath
TORCH_DDP_ORDER = (
    'torch DDP requires "the exact same parameter registration order" on every process'
)
#: checkpoint, for a framework that saves in its own format
OWN_CHECKPOINTS = "saved through the framework's own checkpoint format, not the default hooks"
#: epochs, for a framework that counts its own accumulation window and whose own DataLoader and
#: epoch loop the target does not drive yet: fed the harness's steps, it would not step after
#: an epoch's short last window
COUNTS_ITS_WINDOW = (
    "the framework counts gradient_accumulation_steps micro-batches itself, so the harness's "
    "short last window of an epoch never reaches its optimizer step; its own DataLoader and "
    "epoch loop are not driven by this target yet"
)
#: param-dtype, the opt-in precision policy (``features.OPT_IN``), for a target not applying it
NO_PARAM_DTYPE = (
    "a param_dtype policy is the target's to apply (applies_param_dtype); "
    "torch_fsdp applies it through FSDP2's MixedPrecisionPolicy"
)
#: tensor-parallel, the opt-in mesh and plan (``features.OPT_IN``), for a target applying none
NO_PLAN = (
    "a tensor-parallel plan is the target's to apply (parallelizes, Target.parallelize); "
    "torch_tp, torch_2d, parallel_tp and hf_tp apply one"
)
#: Why a target that does not set an opt-in feature's flag declines it, where its class says
#: nothing of its own (``ddpcheck.targets.support.why_unsupported``).
#: pipeline-parallel, the opt-in stages and schedule, for a target running none
NO_PIPELINE = (
    "a pipeline schedule is the target's to run (pipelines, Target.fit with run.mesh); "
    "torch_pp runs one"
)
OPT_IN_REASONS = {
    "param-dtype": NO_PARAM_DTYPE,
    "tensor-parallel": NO_PLAN,
    "pipeline-parallel": NO_PIPELINE,
}
