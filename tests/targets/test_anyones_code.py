"""Checking other people's implementations without knowing ddpcheck's internals: the capability
vocabulary, the hooks of a real training loop, Target.from_wrappers, the optimizer-state default,
and generators that produce what they claim."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ddpcheck
import parallel
from ddpcheck import features, targets
from ddpcheck import strategies as dst
from ddpcheck._runs.fuzz import fuzz
from tests.patience import patience

# ---------------------------------------------------------------------------------------------
# Implementations "from elsewhere", written as their authors would, and their targets


class NeedsReset(parallel.DDP):
    """A wrapper whose loop must call ``reset()`` after every step (as some trainers do)."""

    def __init__(self, module, **kwargs):
        super().__init__(module, **kwargs)
        self.dirty = False

    def forward(self, *args, **kwargs):
        if self.dirty:
            raise RuntimeError("forward before reset(): the loop forgot model.reset()")
        return super().forward(*args, **kwargs)

    def finish_gradient_sync(self):
        super().finish_gradient_sync()
        self.dirty = True

    def reset(self):
        self.dirty = False


class FreesGradsInStep(parallel.ShardedOptimizer):
    """Frees every gradient inside ``step()`` (memory-saving ZeRO code does): gradients must be
    recorded before the step, or every example would be blamed."""

    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
        return loss


class HiddenInner:
    """A ZeRO-1 wrapper that is not a torch Optimizer and keeps its inner one privately."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self._sharded = parallel.ShardedOptimizer(params, optimizer_cls, **kwargs)
        self.param_groups = self._sharded.param_groups

    def step(self):
        self._sharded.step()

    def zero_grad(self, set_to_none=True):
        self._sharded.zero_grad(set_to_none=set_to_none)


WRAPPED = ddpcheck.Target.from_wrappers(
    ddp=parallel.DDP, finish="finish_gradient_sync", optimizer=parallel.ShardedOptimizer
)
RESET_AFTER_STEP = ddpcheck.Target.from_wrappers(
    ddp=NeedsReset, finish="finish_gradient_sync", after_step="reset"
)
FORGETS_RESET = ddpcheck.Target.from_wrappers(ddp=NeedsReset, finish="finish_gradient_sync")
FREES_GRADS = ddpcheck.Target.from_wrappers(
    ddp=parallel.DDP, finish="finish_gradient_sync", optimizer=FreesGradsInStep
)
# Not a torch Optimizer, so no torch LR scheduler can drive it: it declines LR schedules.
HIDDEN_INNER = ddpcheck.Target.from_wrappers(
    ddp=parallel.DDP,
    finish="finish_gradient_sync",
    optimizer=HiddenInner,
    supports=frozenset(features.FEATURES) - {"lr-schedule"},
)


class WantsTheModel(targets.ParallelDDPTarget):
    """make_optimizer names ``model``: it gets the wrapped model (a sharded optimizer that must
    know its DDP, say)."""

    def make_optimizer(self, params, optimizer_cls, *, model, **kwargs):
        assert isinstance(model, parallel.DDP), type(model)
        return optimizer_cls(params, **kwargs)


class NoAccumulationNoUnused(targets.ParallelTarget):
    supported_features = frozenset(features.FEATURES) - {
        "accumulation",
        "unused-on-some-ranks",
        "unused-everywhere",
    }


NO_ACCUMULATION_NO_UNUSED = NoAccumulationNoUnused()


# ---------------------------------------------------------------------------------------------
# The hooks and the factory


# The battery's scenarios at W=2 and 3; a target that declares nothing skips rank-orders-adam
# (beyond torch DDP's contract), the hidden inner optimizer the LR schedules and the checkpoint.
@pytest.mark.slow
@pytest.mark.parametrize(
    "target, count",
    [
        (WRAPPED, 30),
        (RESET_AFTER_STEP, 30),
        (FREES_GRADS, 30),
        (HIDDEN_INNER, 26),
        (WantsTheModel(), 32),
    ],
    ids=["wrapped", "reset", "frees-grads", "hidden-inner", "model-kw"],
)
def test_real_loop_shapes_pass_the_battery(target, count):
    report = ddpcheck.assert_equivalent(target, world_sizes=(2, 3))
    assert report.count == count, report


def test_a_loop_hook_left_out_is_the_targets_fault():
    # it raises at W=1 too: a broken target, exit 2 (issue 50), still the target's fault
    with pytest.raises(ddpcheck.SetupError, match=r"forgot model\.reset"):
        ddpcheck.assert_equivalent(FORGETS_RESET, world_sizes=(2,))


def test_factory_targets_replay_by_their_module_name():
    from ddpcheck._runs.replay import target_spec

    assert target_spec(RESET_AFTER_STEP) == "tests.targets.test_anyones_code:RESET_AFTER_STEP"


def test_the_optimizer_state_default_finds_an_inner_optimizer():
    params = [torch.zeros(2, requires_grad=True)]
    plain = torch.optim.SGD(params, lr=0.1)
    assert ddpcheck.Target().optimizer_state(plain) is plain.state

    class Wrapper:
        def __init__(self):
            self.optim = torch.optim.Adam(params)

    wrapper = Wrapper()
    assert ddpcheck.Target().optimizer_state(wrapper) is wrapper.optim.state

    class Opaque:
        pass

    with pytest.raises(
        ddpcheck.InvalidArgument, match=r"override Target\.optimizer_state.*shards_optimizer_state"
    ):
        ddpcheck.Target().optimizer_state(Opaque())


# ---------------------------------------------------------------------------------------------
# The vocabulary: declared, honoured, reported


def test_declined_features_cost_no_example_of_the_budget():
    # 40 examples: undeclined, a third of the draws would hold accumulation or an unused layer
    result = fuzz(NO_ACCUMULATION_NO_UNUSED, examples=40, world_sizes=(2,))
    assert not result.found, result.error
    assert result.examples >= 38, (result.examples, result.declined)
    assert not result.features & {"accumulation", "unused-on-some-ranks", "unused-everywhere"}


def test_the_battery_lists_each_skipped_scenario_with_the_feature_it_needs():
    report = ddpcheck.assert_equivalent(NO_ACCUMULATION_NO_UNUSED, world_sizes=(2,))
    lines = report.skipped_lines()
    assert any(
        line.startswith("sample-branch-accumulate (W=2): needs accumulation") for line in lines
    ), lines
    assert any(
        line.startswith("unused-frozen-adamw (W=2): needs unused-everywhere") for line in lines
    ), lines
    assert "features" in str(report)


def test_unknown_feature_names_are_refused_with_the_vocabulary():
    with pytest.raises(
        ddpcheck.InvalidArgument,
        match=r"'acumulation' is not a feature "
        r"\(did you mean 'accumulation'\?\); known:",
    ):
        features.parse("acumulation")
    with pytest.raises(ddpcheck.InvalidArgument):
        ddpcheck.assert_equivalent(targets.PARALLEL, without=("nope",))


# ---------------------------------------------------------------------------------------------
# Generators that mean it: every feature is generated at a measured, useful rate


def _unused_on_some_ranks(scenario, world_size) -> bool:
    """As the ranks see it: some trainable parameter has a gradient on one rank's shard of step
    0 and None on another's (independent of ddpcheck.features)."""
    from ddpcheck._language.objective import summed
    from ddpcheck.scenario import build_model, global_batch

    model = build_model(scenario, scenario.seed)
    x, y = global_batch(scenario, 0)
    seen = []
    for xs, ys in zip(torch.tensor_split(x, world_size), torch.tensor_split(y, world_size)):
        model.zero_grad(set_to_none=True)
        summed(scenario, model(xs), ys).backward()  # an empty shard too, as ranks do
        seen.append([p.grad is None for p in model.parameters() if p.requires_grad])
    return any(len(set(flags)) > 1 for flags in zip(*seen))


RATES: dict[str, int] = {}
SHARDED: list[bool] = []


@settings(
    max_examples=200,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
@given(
    dst.scenarios(models=dst.models(mixed_dtypes=True), dtypes=("float64", "float32")),
    # as a target that opts in to nothing sees them
    st.integers(2, 4),
)
def _draw(scenario, world_size):
    for name in features.of(scenario, world_size):
        RATES[name] = RATES.get(name, 0) + 1
    SHARDED.append(_unused_on_some_ranks(scenario, world_size))


def test_every_feature_is_generated_at_a_useful_rate():
    RATES.clear()
    SHARDED.clear()
    _draw()
    # (opt-in features are drawn only for a target that opts in: tests/language/test_tokens.py)
    shares = {
        name: RATES.get(name, 0) / 200 for name in features.FEATURES if name not in features.OPT_IN
    }
    # "broadcast" is every scenario; the rarest on purpose-built random models is a layer whose
    # samples all skip it on one rank but not another: it must still be common.
    assert all(share >= 0.05 for share in shares.values()), shares
    # the claim checked the way ranks see it, not through ddpcheck.features
    assert sum(SHARDED) / len(SHARDED) >= 0.05, sum(SHARDED)
    assert sum(SHARDED) <= RATES.get("unused-on-some-ranks", 0)  # features sees every step


def test_a_ddp_without_unused_parameter_handling_is_caught_by_random_examples_alone():
    # NoFinalFlush never launches a bucket some of whose gradients are missing: on a rank whose
    # samples skip a layer, that bucket's all-reduce is never issued -- unpaired collectives.
    from ddpcheck.mutation.catalogue import NoFinalFlush

    # Found is the claim, not how small: shrinking a collective mismatch respawns the world at
    # every step (~30 respawns, 90% of this test's time); shrinking is held to its minimal
    # counterexamples by tests/mutation/test_mutants.py.
    result = fuzz(
        NoFinalFlush(), examples=200, world_sizes=(2,), deadline=patience(20), shrink=False
    )
    assert result.found
    assert result.first_failure <= 200


def test_a_misspelt_supported_feature_is_refused_not_ignored():
    class Typo(targets.ParallelTarget):
        supported_features = frozenset(features.FEATURES) - {"lr-schedul"} | {"lr-schedul"}

    with pytest.raises(ddpcheck.InvalidArgument, match=r"Typo\.supported_features: 'lr-schedul'"):
        ddpcheck.assert_equivalent(Typo(), world_sizes=(1,))
