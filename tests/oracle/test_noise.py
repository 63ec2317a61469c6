"""What the reference cannot pin down, whatever the batch (``Reference.noise``).

Data-parallel code rounds where the single-process reference does not even when the batch cannot
be re-split: one sample at W=3 is its loss scaled by 3 and its gradient divided by 3 (torch's DDP
multiplies by 1/3), a rounding at every layer its backward crosses. Where the scenario is
ill-conditioned that rounding is amplified (Adam's ``lr / eps`` on a gradient that is zero in
exact arithmetic, a gradient through a width-2 LayerNorm that barely depends on its input), and
re-splitting one sample finds no spread at all. The reference's variants now include worlds of
3 and 5 ranks and rounding-level perturbations: such examples pass, or -- where the spread is as
large as a bug (``tolerances.RESOLUTION``) -- are declined as chaotic (``ScenarioError``, exit 2),
never exit 1; a bug beside the noise is still reported. The variants cost nothing on a passing
example: they are trained only when a comparison is beyond the fixed tolerance.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ddpcheck import targets
from ddpcheck._language.records import RankRecord
from ddpcheck._oracle import reference as reference_module
from ddpcheck._oracle.compare import CHAOTIC, compare
from ddpcheck._oracle.reference import Variant, _train, reference_run
from ddpcheck._oracle.tolerances import noise_verdict
from ddpcheck._runs.example import check_example
from ddpcheck._runs.pipeline import Outcome, one_behind_the_other
from ddpcheck._runs.settings import Settings
from ddpcheck.errors import EquivalenceError, ExitCode, ScenarioError
from ddpcheck.models import Layer, ModelSpec, SpecData
from ddpcheck.scenario import Scenario
from tests.oracle.test_compare import ShiftedSoftmax
from tests.patience import patience

#: Issue 37's example, shrunk by ``ddpcheck check torch_fsdp --examples 60 --world-sizes 2,3
#: --seed 5``: one sample, a float32 width-2 LayerNorm after a conv. At W=3 every correct target
#: (torch's DDP and FSDP2 too) was 4.8e-4 from the reference on ``l1.conv.bias``'s gradient at
#: step 1, and re-splitting one sample measured a spread of 0.
LAYERNORM = Scenario(
    model=ModelSpec(
        layers=(
            Layer(frozen=True, float32=True),
            Layer(kind="conv1d"),
            Layer(kind="layernorm", frozen=True, float32=True),
            Layer(),
        ),
        width=2,
    ),
    data=SpecData(width=2),
    optimizer=torch.optim.Adam,
    optimizer_kwargs={"lr": 0.01, "eps": 0.001},
    global_batch=1,
    seed=220,
)


def shifted(dtype: str = "float64", seed: int = 0, global_batch: int = 1) -> Scenario:
    """Adam on a bias softmax ignores: its gradient is rounding noise, amplified by lr/eps."""
    return Scenario(
        model=ShiftedSoftmax,
        optimizer=torch.optim.Adam,
        optimizer_kwargs={"lr": 0.1},
        global_batch=global_batch,
        steps=3,
        seed=seed,
        dtype=dtype,
    )


@dataclasses.dataclass(frozen=True)
class OffBy(targets.TorchDDPTarget):
    """torch DDP with a seeded bug: ``error`` added to element 0 of ``name``'s synchronised
    gradient at ``step``, on every rank (the replicas stay identical)."""

    name: str = "head.bias"
    error: float = 1e-6
    step: int = 0

    def after_backward(self, model, optimizer):
        step = getattr(model, "_steps_seen", 0)
        model._steps_seen = step + 1
        if step == self.step:
            with torch.no_grad():
                dict(model.module.named_parameters())[self.name].grad.view(-1)[0] += self.error


def _declined_or_passed(target, scenario, world_size) -> str:
    try:
        check_example(target, scenario, world_size, Settings(deadline=patience(60)))
    except ScenarioError as declined:
        assert declined.exit_code == ExitCode.SETUP, declined
        assert f"({CHAOTIC} at step" in str(declined), declined
        return "declined"
    return "passed"


@pytest.mark.parametrize(
    "target", [targets.TORCH_DDP, targets.PARALLEL], ids=["torch_ddp", "parallel"]
)
def test_the_layernorm_example_of_issue_37_is_no_divergence_at_w3(target):
    assert _declined_or_passed(target, LAYERNORM, 3) == "passed"


def test_a_bug_beside_the_layernorm_example_is_still_reported():
    """The example computes in float32 (its LayerNorm), so its tolerance is float32's: an error
    on a well-conditioned gradient at the step where ``l1.conv.bias`` is noise must exceed that
    tolerance (~6e-3 on ``head.bias`` there), and is reported on that parameter alone (its
    gradient, then what the step made of it)."""
    with pytest.raises(EquivalenceError) as found:
        check_example(
            OffBy(name="head.bias", error=2e-2, step=1),
            LAYERNORM,
            3,
            Settings(deadline=patience(60)),
        )
    rows = found.value.divergences
    assert (rows[0].step, rows[0].name, rows[0].kind) == (
        1,
        "head.bias",
        "reference differs (gradient)",
    ), found.value
    assert all(d.target_fault and d.name.startswith("head.bias") for d in rows), found.value


@pytest.mark.parametrize(
    "target", [targets.TORCH_DDP, targets.PARALLEL], ids=["torch_ddp", "parallel"]
)
def test_one_sample_at_w3_scaled_by_3_and_divided_back_is_no_divergence_in_float64(target):
    """The same mechanism in float64: the shifted softmax's bias at W=3 with one sample was a
    divergence at every seed before the variants scaled the loss (``reference differs
    (parameter)`` on ``shift``: 1e-11 against a 1e-12 tolerance)."""
    assert [_declined_or_passed(target, shifted(seed=seed), 3) for seed in range(3)] == [
        "passed"
    ] * 3


def test_a_1e6_error_beside_the_float64_noise_is_still_reported():
    with pytest.raises(EquivalenceError) as found:
        check_example(
            OffBy(name="out.bias", error=1e-6, step=1),
            shifted(),
            3,
            Settings(deadline=patience(60)),
        )
    rows = found.value.divergences
    assert (rows[0].step, rows[0].name, rows[0].kind) == (
        1,
        "out.bias",
        "reference differs (gradient)",
    ), found.value
    assert all(d.target_fault for d in rows)


def test_adam_sign_noise_in_float32_is_declined_as_chaotic_not_a_divergence():
    """float32 Adam at its default eps on the shifted softmax: the bias's update is +-lr by the
    sign of rounding noise, on the ranks and in the reference alike -- no tolerance could tell a
    bug from it, so the example cannot be judged (exit 2, never 1)."""
    assert (
        _declined_or_passed(targets.PARALLEL, shifted("float32", global_batch=6), 3) == "declined"
    )


def test_among_random_examples_a_chaotic_one_is_skipped_as_unjudgeable_not_a_verdict():
    """What ``fuzz`` (``ddpcheck check``'s random examples) is handed for each example: the
    chaotic one is skipped as unjudgeable -- counted among the declined, not among the examples,
    never a failure -- and the next one runs and is judged."""
    items = [(1, 3, shifted("float32", global_batch=6)), (2, 3, shifted(seed=1))]
    outcomes = [
        outcome
        for _, outcome in one_behind_the_other(
            items, Settings(deadline=patience(60)), target_of=lambda _: targets.PARALLEL
        )
    ]
    assert outcomes[0].error is None and outcomes[0].unjudgeable, outcomes[0]
    assert "reference chaotic at step 0" in outcomes[0].skipped, outcomes[0].skipped
    assert outcomes[1] == Outcome(), outcomes[1]


def test_a_bug_at_the_chaotic_step_outranks_the_chaos():
    with pytest.raises(EquivalenceError) as found:
        check_example(
            OffBy(name="out.bias", error=1e-2, step=0),
            shifted("float32"),
            3,
            Settings(deadline=patience(60)),
        )
    rows = found.value.divergences
    assert all(d.target_fault for d in rows) and rows[0].name == "out.bias", found.value


# ---------------------------------------------------------------------------------------------
# In this process: the variants, their cost, the rule


def test_the_variants_measure_the_scaling_one_sample_at_w3_rounds():
    """Re-splitting one sample is the reference itself; a world of 3 scaled by 3 and divided
    back is what the ranks computed (4.8e-4 on the conv bias at step 1)."""
    mine = _train(LAYERNORM)[0]
    resplit = _train(LAYERNORM, Variant(3))[0]
    world = _train(LAYERNORM, Variant(3, world=3))[0]
    bias = "l1.conv.bias"
    assert torch.equal(resplit[1].grads[bias], mine[1].grads[bias])
    assert float((world[1].grads[bias] - mine[1].grads[bias]).abs().max()) > 1e-4
    spread = reference_run(LAYERNORM).noise(1).grads[bias]
    assert float(spread.max()) > 1e-4


def test_the_perturbed_variant_moves_gradients_by_rounding_only():
    mine = _train(LAYERNORM)[0]
    perturbed = _train(LAYERNORM, Variant(perturb=0))[0]
    for name, value in mine[0].grads.items():
        if value is None:
            continue
        ulps = torch.finfo(value.dtype).eps * value.abs().max()
        assert float((perturbed[0].grads[name] - value).abs().max()) <= float(ulps), name
    assert (
        _train(LAYERNORM, Variant(perturb=0))[0][1]
        .grads["head.weight"]
        .equal(perturbed[1].grads["head.weight"])
    )  # seeded: the same numbers every time


#: The map's one failing cell (docs/frameworks.md), shrunk by ``ddpcheck check deepspeed --config
#: {"communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"}} --fuzz-config
#: --only param-dtype --dtypes float32``: a width-2 LayerNorm, whose input gradient is zero in
#: exact arithmetic, under bfloat16 compute. DeepSpeed's bf16 mode builds its float32 masters from
#: the module it cast to bfloat16; that rounding moved one weight's bfloat16 copy by an ulp after
#: step 0 and flipped the sign of every gradient behind the LayerNorm at step 1 (reference
#: differs, 1.44 relative), although the run is bitwise the reference's once the reference's
#: masters start rounded too.
ROUNDED = Scenario(
    model=ModelSpec(
        layers=(Layer(kind="embedding"), Layer(), Layer(), Layer(), Layer(kind="layernorm")),
        width=2,
        tie_head=True,
    ),
    data=SpecData(width=2),
    global_batch=1,
    dtype="float32",
    param_dtype=torch.bfloat16,
)


@dataclasses.dataclass(frozen=True)
class RoundedMastersFSDP(targets.TorchFSDPTarget):
    """FSDP2 under the param_dtype policy, its float32 master weights started from their
    bfloat16 copies as DeepSpeed's bf16 mode starts them (no DeepSpeed needed here)."""

    def wrap(self, module):
        model = super().wrap(module)
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                local.copy_(local.to(torch.bfloat16))
        return model


def test_under_param_dtype_the_variants_start_masters_from_their_low_precision_copies():
    assert reference_module.noise_variants(LAYERNORM) == reference_module.NOISE_VARIANTS
    assert Variant(rounded_masters=True) in reference_module.noise_variants(ROUNDED)
    mine = _train(ROUNDED)[0]
    rounded = _train(ROUNDED, Variant(rounded_masters=True))[0]
    bias = "l3.fc.bias"
    assert torch.equal(rounded[0].grads[bias], mine[0].grads[bias])  # same bfloat16 copies
    assert float((rounded[1].grads[bias] - mine[1].grads[bias]).abs().max()) > 1e-2


def test_masters_started_from_their_bfloat16_copies_are_no_divergence(monkeypatch):
    """Without the variant, the sign flip is a divergence (exit 1), for DeepSpeed and for this
    FSDP2 alike; with it, the example passes -- declined as chaotic until its spread, a bfloat16
    step of the step's values, was measured against the policy's tolerance instead of float32's
    resolution (``tests/oracle/test_bf16_tolerance.py``). (FSDP2 declines the tied head, which
    the example does not need.)"""
    untied = dataclasses.replace(
        ROUNDED, model=dataclasses.replace(ROUNDED.model, tie_head=False), seed=23
    )
    assert _declined_or_passed(RoundedMastersFSDP(), untied, 2) == "passed"
    monkeypatch.setattr(reference_module, "PARAM_DTYPE_VARIANTS", ())
    with pytest.raises(EquivalenceError, match=r"reference differs \(gradient\)"):
        check_example(RoundedMastersFSDP(), untied, 2, Settings(deadline=patience(60)))


def _records_of(steps, initial) -> list[RankRecord]:
    """A reference run's records as one rank's: its micro-batch losses, scaled for the world its
    variant emulates, as their sum over that world (the objective it computed), reported by none."""
    steps = [
        dataclasses.replace(step, losses=(step.reported_loss,), reported_loss=None)
        for step in steps
    ]
    return [RankRecord(0, initial, steps, 0.0)]


def test_the_variants_are_trained_only_when_a_comparison_is_beyond_the_tolerance():
    scenario = shifted(global_batch=4)
    reference = reference_run(scenario)
    steps, _, initial = _train(scenario)
    before = reference_module.noise_computed()
    assert compare(_records_of(steps, initial), reference, scenario, targets.LOCAL) == []
    assert reference.noise_cache == {} and reference_module.noise_computed() == before
    steps[1].grads["out.bias"] = steps[1].grads["out.bias"] + 1e-3  # beyond: the noise is asked
    rows = compare(_records_of(steps, initial), reference, scenario, targets.LOCAL)
    assert [(d.step, d.name) for d in rows] == [(1, "out.bias")], rows
    assert reference.noise_cache and reference_module.noise_computed() == before + 1


def test_the_noise_verdict_widens_declines_and_still_finds():
    ref = torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64)
    spread = torch.tensor([0.0, 1e-8, 0.0], dtype=torch.float64)
    rtol, atol = 1e-9, 1e-12
    # 1e-8 of rounding spread at element 1 explains 2e-8 there: close
    assert (
        noise_verdict(ref + torch.tensor([0, 2e-8, 0]), ref, rtol, atol, spread, 1.0)[0] == "close"
    )
    # ... but not 1e-6 at element 0, where the reference is pinned down
    verdict, where = noise_verdict(
        ref + torch.tensor([1e-6, 2e-8, 0]), ref, rtol, atol, spread, 1.0
    )
    assert verdict == "differs" and where.tolist() == [True, False, False]
    # a spread of 1e-3 of the largest value of its kind (1.0) at element 1: chaotic
    wide = torch.tensor([0.0, 3e-4, 0.0], dtype=torch.float64)
    verdict, where = noise_verdict(ref + torch.tensor([0, 5e-4, 0]), ref, rtol, atol, wide, 1.0)
    assert verdict == "chaotic" and where.tolist() == [False, True, False]
    # ... unless a larger value of its kind elsewhere makes it small beside the bugs promised
    assert (
        noise_verdict(ref + torch.tensor([0, 5e-4, 0]), ref, rtol, atol, wide, 10.0)[0] == "close"
    )
    # a bug beside a chaotic element is still a bug
    assert (
        noise_verdict(ref + torch.tensor([1e-6, 5e-4, 0]), ref, rtol, atol, wide, 1.0)[0]
        == "differs"
    )


def test_a_chaotic_row_is_not_the_targets_fault_and_names_what_was_measured():
    scenario = shifted("float32", global_batch=6)
    reference = reference_run(scenario)
    steps, _, initial = _train(scenario, Variant(3, world=3))  # what a world of 3 computes
    rows = compare(_records_of(steps, initial), reference, scenario, targets.LOCAL)
    assert rows and all(d.kind == CHAOTIC and not d.target_fault for d in rows), rows
    assert "losses scaled by W and divided back" in rows[0].detail
