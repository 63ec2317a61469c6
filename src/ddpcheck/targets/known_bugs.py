"""Upstream bugs ddpcheck knows, by release: a verdict on a release known to carry one ends with
one line naming the upstream issue and the release that fixed it -- after the counterexample,
never instead of the check, never a skip (the release is checked like any other, and its bug is
exit 1 with the replay line that proves it).

A bug is named only where it can explain the verdict: the installed release carries it, the
target drives what it lives in, and the counterexample exercises every feature it needs.
Each entry is measured by a standalone script under ``bench/`` that exits 1 on the releases that
carry it and 0 on those that do not.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Callable

from ddpcheck._language.pipeline_parallel import SCHEDULES_SPLITTING_BACKWARD
from ddpcheck._language.scenario import Scenario
from ddpcheck.targets.builtin import TorchDDPTarget, TorchFSDPTarget
from ddpcheck.targets.deepspeed import DeepSpeedTarget
from ddpcheck.targets.deepspeed_autotp import DeepSpeedAutoTPTarget
from ddpcheck.targets.hf_auto import own_styles
from ddpcheck.targets.hf_models import HfCausalLM
from ddpcheck.targets.hf_tp import HfTPTarget
from ddpcheck.targets.hf_trainer import HfTrainerTarget
from ddpcheck.targets.pipeline import TorchPPTarget
from ddpcheck.targets.pipeline_nd import TorchNDTarget
from ddpcheck.targets.protocol import Target

__all__ = ["KNOWN_BUGS", "KnownBug", "known_bug_line"]


@dataclasses.dataclass(frozen=True)
class KnownBug:
    """One upstream bug: where it lives, which releases carry it, what a verdict needs."""

    distribution: str  # the package whose releases carry it
    fixed_in: str | None  # the first release without it; None: every release (not fixed)
    upstream: str  # the issue and the fix, as upstream names them
    what: str  # the bug in one clause
    needs: frozenset[str]  # the features a counterexample it explains exercises
    targets: tuple[type, ...]  # the targets that drive the code it lives in
    script: str  # the bench/ script that reproduces it without ddpcheck
    #: False where only the first release measured right is known, not the fix's own release
    fix_measured: bool = True
    #: (dotted key, value): the bug lives behind that option of the target's framework config
    option: tuple[str, object] | None = None
    #: more such options, all needed with ``option``
    also: tuple[tuple[str, object], ...] = ()
    #: the scenarios it can explain, where its features alone do not say (None: any)
    explains: Callable[[Scenario], bool] | None = None

    @property
    def fixed(self) -> str:
        if self.fixed_in is None:
            return "not fixed upstream"
        if self.fix_measured:
            return f"fixed in {self.distribution} {self.fixed_in}"
        return f"right again by {self.distribution} {self.fixed_in} (the first release measured)"

    def carried_by(self, release: str) -> bool:
        from torch.torch_version import TorchVersion  # torch's comparison of release strings

        if self.fixed_in is None:
            return True
        try:
            return bool(TorchVersion(release) < self.fixed_in)
        except Exception:  # not a release number (a local build): say nothing
            return False


KNOWN_BUGS: tuple[KnownBug, ...] = (
    KnownBug(
        distribution="torch",
        fixed_in="2.4.0",  # bench/ddp_no_sync_unused.py: wrong on 2.1.2 and 2.3.1, right on 2.4.1
        upstream="pytorch#69031 (fixed by PR #124193)",
        what="DDP(find_unused_parameters=True) never all-reduces a parameter used only inside "
        "no_sync() by some rank",
        needs=frozenset({"accumulation", "unused-on-some-ranks"}),
        targets=(TorchDDPTarget,),
        script="bench/ddp_no_sync_unused.py",
    ),
    KnownBug(
        distribution="transformers",
        # bench/hf_token_weights.py and docs/frameworks.md, "Releases tried": 4.45.2, 4.46.0 and
        # 4.46.2 wrong, 4.46.3 right
        fixed_in="4.46.3",
        upstream="huggingface/transformers #34191 (4.45: a mean per micro-batch), #34242 "
        "(4.46.0-4.46.1: each rank's own token count) and 4.46.2's no_sync on the wrong "
        "micro-batch",
        what="the Trainer's gradient accumulation weighs tokens by their micro-batch or rank",
        needs=frozenset(),
        targets=(HfTrainerTarget,),
        script="bench/hf_token_weights.py",
    ),
    KnownBug(
        distribution="deepspeed",
        # bench/deepspeed_contiguous_gradients.py: wrong on 0.19.7, right on 0.19.8
        fixed_in="0.19.8",
        upstream="DeepSpeed PR #8382",
        what="on the CPU, ZeRO's non-contiguous reduction path buckets gradients by comparing "
        'tensor.type() with "torch.cpu.FloatTensor", which CPU tensors never report, so no '
        "gradient is all-reduced",
        needs=frozenset(),
        targets=(DeepSpeedTarget,),
        script="bench/deepspeed_contiguous_gradients.py",
        option=("zero_optimization.contiguous_gradients", False),
    ),
    KnownBug(
        distribution="torch",
        # bench/fsdp2_cpu.py: FSDP2 first runs on the CPU in 2.7 (its floor there), with gradients
        # twice the reference's at W=2 on 2.7.1 and 2.8.0; right on 2.13.0, the releases between
        # not measured
        fixed_in="2.13.0",
        fix_measured=False,
        upstream="pytorch#162338 (fixed by PR #171458)",
        what="on gloo (the CPU) FSDP2's reduce-scatter sums the gradients where it promises "
        "their mean (ReduceOp.AVG), so every gradient is W times too large",
        needs=frozenset(),
        targets=(TorchFSDPTarget,),
        script="bench/fsdp2_cpu.py",
    ),
    KnownBug(
        distribution="accelerate",
        # bench/hf_split_uneven_batches.py: wrong on 1.15.0 (with transformers 5.25.0), right
        # with a __len__ counting what it yields; upstream closed the issue and both fixes
        fixed_in=None,
        upstream="huggingface/accelerate#4122 (closed; fixes #4127, #4194 closed unmerged)",
        what="under split_batches=True and even_batches=False, BatchSamplerShard.__len__ gives a "
        "rank no part of a short last batch reaches one batch more than it yields, and the HF "
        "Trainer, stepping at an epoch's end on that length, skips that rank's last step",
        needs=frozenset({"epochs"}),
        targets=(HfTrainerTarget,),
        script="bench/hf_split_uneven_batches.py",
        option=("accelerator_config.split_batches", True),
        also=(("accelerator_config.even_batches", False),),
    ),
    KnownBug(
        distribution="torch",
        # bench/pipeline_cpu.py: on 2.13.0 DDP with InterleavedZeroBubble, ZBVZeroBubble and
        # DualPipeV at dp=2 x pp=2 leaves stages' weight gradients dp-local; open upstream
        fixed_in=None,
        upstream="pytorch#144530 (open; torch's own test of DDP with pipelining skips them)",
        what="under a pipeline schedule that splits the backward into input and weight parts, "
        "DDP never all-reduces the stages' weight gradients: each pipeline keeps its own",
        needs=frozenset({"pipeline-parallel"}),
        targets=(TorchPPTarget,),
        script="bench/pipeline_cpu.py",
        option=("dp_wrapper", "ddp"),
        explains=lambda scenario: (
            scenario.pipeline is not None
            and scenario.pipeline.schedule in SCHEDULES_SPLITTING_BACKWARD
        ),
    ),
    *(
        KnownBug(
            distribution="torch",
            # bench/pp_fsdp_reshard_split.py: on 2.13.0 (the only release measured) dp=2 x pp=2,
            # InterleavedZeroBubble, ZBVZeroBubble and DualPipeV lose weight gradients of
            # stages FSDP2 reshards after forward, at the root or per layer; no upstream issue
            fixed_in=None,
            upstream="no upstream issue found (measured on 2.13.0; near it, pytorch#164756: "
            "the pipeline schedules' FSDP unshard and reshard, open)",
            what="under a pipeline schedule that splits the backward into input and weight "
            "parts, a stage FSDP2 resharded after its forward shows its sharded parameters when "
            "the input half looks for its weights in the autograd graph, so the weight half "
            "skips them: weight gradients None or partial, silently",
            needs=frozenset({"pipeline-parallel"}),
            targets=(TorchNDTarget,),
            script="bench/pp_fsdp_reshard_split.py",
            option=option,
            also=also,
            explains=lambda scenario: (
                scenario.pipeline is not None
                and scenario.pipeline.schedule in SCHEDULES_SPLITTING_BACKWARD
            ),
        )
        # at the root and below (torchtitan's reshard_after_forward_policy="always"), or below
        # only (torch's default, None: True below the root) with FSDP2 per block
        for option, also in (
            (("reshard_after_forward", True), ()),
            (("shard_blocks", True), (("reshard_after_forward", None),)),
        )
    ),
    KnownBug(
        distribution="transformers",
        # bench/hf_replicated_grad_allreduce.py: wrong on 5.25.0 (the pinned release, the only
        # one measured); no upstream issue found
        fixed_in=None,
        upstream="no upstream issue found (measured on 5.25.0)",
        what="the tensor-parallel style replicated_with_grad_allreduce (Qwen3's q_norm and "
        "k_norm) all-reduces param.grad from a post-accumulate-grad hook, after every backward: "
        "under gradient accumulation each earlier micro-batch's already-reduced gradient is "
        "summed over tp again",
        needs=frozenset({"accumulation"}),
        targets=(HfTPTarget,),
        script="bench/hf_replicated_grad_allreduce.py",
        explains=lambda scenario: (
            (
                scenario.tensor_parallel is not None
                and any(style == "heads-norm" for _, style in scenario.tensor_parallel.plan)
            )
            or "replicated_with_grad_allreduce" in own_styles(scenario)
        ),
    ),
    KnownBug(
        distribution="transformers",
        # bench/hf_fsdp_tied.py: wrong on 5.25.0 (the pinned release, the only one measured)
        fixed_in=None,
        upstream="no upstream issue found (measured on 5.25.0)",
        what="DistributedConfig(tp_size, fsdp_size) applies FSDP2 to the model built untied and "
        "from_pretrained ties the LM head to the embedding afterwards (tie_weights): the head "
        "holds a parameter FSDP2 swaps out of the embedding, and training leaves the "
        "one-process model after the first optimizer step",
        needs=frozenset({"tensor-parallel"}),
        targets=(HfTPTarget,),
        script="bench/hf_fsdp_tied.py",
        explains=lambda scenario: (
            isinstance(scenario.model, HfCausalLM)
            and scenario.model.tied
            and scenario.tensor_parallel is not None
            and scenario.tensor_parallel.tp is not None  # a tp below W: dp > 1, FSDP2 over dp
        ),
    ),
)


#: The architectures whose attention normalises q and k per head (q_norm, k_norm over head_dim).
QK_NORMED = frozenset({"qwen3", "gemma3_text"})

KNOWN_BUGS += (
    KnownBug(
        distribution="deepspeed",
        # bench/deepspeed_autotp_cpu.py --architecture qwen3 --wrapped: wrong on 0.19.8 (the
        # only release measured); Llama wrapped, and Qwen3 handed with its plan, right
        fixed_in=None,
        upstream="no upstream issue found (measured on 0.19.8)",
        what="AutoTP's parser of a model without a transformers config (no tp_plan read) splits "
        "attention's q/k projections over their heads but leaves the per-head q_norm/k_norm "
        "replicated with each rank's partial gradient, never summed over tp: the norms' "
        "replicas drift apart and leave the one-process model",
        needs=frozenset({"tensor-parallel"}),
        targets=(DeepSpeedAutoTPTarget,),
        script="bench/deepspeed_autotp_cpu.py --no-shm-op --architecture qwen3 --wrapped",
        option=("handed", "wrapper"),
        explains=lambda scenario: (
            isinstance(scenario.model, HfCausalLM) and scenario.model.architecture in QK_NORMED
        ),
    ),
)


def known_bug_line(
    target: Target, exercised: frozenset[str] | set[str], scenario: Scenario | None = None
) -> str | None:
    """The one line a verdict of ``target`` ends with, whose counterexample (``scenario``)
    exercises ``exercised``, where a known upstream bug of an installed release can explain it;
    None elsewhere."""
    for bug in KNOWN_BUGS:
        if not isinstance(target, bug.targets) or not bug.needs <= set(exercised):
            continue
        if bug.explains is not None and (scenario is None or not bug.explains(scenario)):
            continue
        options = ((bug.option,) if bug.option is not None else ()) + bug.also
        if any(_option(target, key) != value for key, value in options):
            continue
        try:
            release = importlib.metadata.version(bug.distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        if bug.carried_by(release):
            return (
                f"known upstream bug: {bug.distribution} {release} carries {bug.upstream}: "
                f"{bug.what}; {bug.fixed} ({bug.script} reproduces it without ddpcheck)"
            )
    return None


def _option(target: Target, dotted: str) -> object:
    """The value the target's framework config (``config=``, as the target read it) gives the
    dotted key, or a field of the target named so (``dp_wrapper``); None where none does."""
    if "." not in dotted and dotted in getattr(type(target), "__dataclass_fields__", {}):
        return getattr(target, dotted)
    node: object = getattr(target, "__dict__", {}).get("_given") or {}
    for key in dotted.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    return node
