"""ddpcheck.strategies and ddpcheck.models: every drawn scenario builds and runs, prints as code,
and shrinks to small models; the pytest plugin leaves the user's Hypothesis settings alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis.errors import NoSuchExample

import ddpcheck
from ddpcheck import check_example, targets
from ddpcheck import strategies as dst
from ddpcheck._language.objective import check_output
from ddpcheck._runs.replay import from_repr
from ddpcheck.features import declines
from ddpcheck.models import Layer, ModelSpec
from ddpcheck.scenario import build_model
from tests.patience import patience
from tests.shrink import find

FAST = settings(
    max_examples=25,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
#: For ``find`` asked whether something is drawn at all: the first one found is the answer, so
#: nothing is shrunk (shrinking a scenario that only had to exist cost 6 s of CPU).
EXISTS = settings(FAST, phases=[Phase.generate])


@FAST
@given(
    dst.scenarios(
        models=dst.models(mixed_dtypes=True), dtypes=("float64", "float32"), resume_world_sizes=(1,)
    )
)  # alone: a checkpoint resumes at W=1 too
def test_every_drawn_scenario_builds_prints_as_code_and_runs_alone(scenario):
    assert from_repr(repr(scenario)) == scenario
    model = build_model(scenario, scenario.seed)
    x, y = scenario.data(0, scenario.global_batch, scenario.torch_dtype)
    assert check_output(scenario, model(x), y) is None  # the loss takes what the model returns
    check_example(targets.LOCAL, scenario, 1)  # W=1: no synchronisation needed to match


def test_registration_order_is_independent_of_execution_order():
    spec = ModelSpec(
        layers=(Layer("linear"), Layer("conv1d"), Layer("layernorm")), registration=(2, 0, 1)
    )
    names = [n for n, _ in spec().named_parameters()]
    assert names[0].startswith("l2.") and names[-1].startswith("head.")
    assert ModelSpec(
        layers=spec.layers
    )().state_dict().keys() != spec().state_dict().keys() or names != [
        n for n, _ in ModelSpec(layers=spec.layers)().named_parameters()
    ]


def test_layer_vocabulary_has_the_promised_parameter_properties():
    spec = ModelSpec(
        layers=(
            Layer("transposed"),
            Layer("embedding"),
            Layer("linear", frozen=True),
            Layer("reused", use="never"),
            Layer("buffer"),
            Layer("attention", float32=True),
        ),
        tie_head=True,
    )
    model = build_model(ddpcheck.Scenario(spec, data=spec.data), 0)
    params = dict(model.named_parameters())
    assert not params["l0.weight"].is_contiguous()  # non-contiguous gradients follow
    assert not params["l2.fc.weight"].requires_grad
    assert params["l5.qkv.weight"].dtype == torch.float32
    assert params["head.weight"].dtype == torch.float64
    assert "l4.scale" in dict(model.named_buffers())
    x, _ = spec.data(0, 6, torch.float64)
    model(x).pow(2).sum().backward()
    assert params["l3.fc.weight"].grad is None  # never used
    assert params["l1.table.weight"].grad is not None  # used by the embedding and the tied head


def test_a_channels_last_conv_is_drawn_as_a_non_contiguous_parameter():
    spec = ModelSpec(layers=(Layer("conv_channels_last"),))
    scenario = ddpcheck.Scenario(spec, data=spec.data, dtype="float32")
    weight = dict(build_model(scenario, 0).named_parameters())["l0.conv.weight"]
    assert weight.stride() == (6, 1, 2, 2) and not weight.is_contiguous()  # kept by the cast
    assert "non-contiguous" in ddpcheck.features.of(scenario, 2)
    channels_last = ddpcheck.Scenario(ddpcheck.zoo.ChannelsLastConv)
    assert "non-contiguous" in ddpcheck.features.of(channels_last, 2)
    # drawn by the default strategy, and by the non-contiguous row half the time; never `without`
    find(
        dst.models(),
        lambda m: any(layer.kind == "conv_channels_last" for layer in m.layers),
        settings=EXISTS,
    )
    find(
        dst.exercising("non-contiguous", world_size=2),
        lambda s: any(layer.kind == "conv_channels_last" for layer in s.model.layers),
        settings=EXISTS,
    )
    with pytest.raises(NoSuchExample):
        find(
            dst.models(without={"non-contiguous"}),
            lambda m: any(layer.kind == "conv_channels_last" for layer in m.layers),
            settings=EXISTS,
        )


def test_shrinking_reaches_small_models():
    # The smallest model with a layer that no sample uses is that one layer alone.
    found = find(
        dst.models(),
        lambda m: any(layer.use == "never" for layer in m.layers),
        settings=settings(database=None, max_examples=500),
    )
    assert found == ModelSpec(layers=(Layer("linear", use="never"),), width=2)
    # The smallest scenario with accumulation and an uneven batch at W=3.
    scenario = find(
        dst.scenarios(),
        lambda s: s.accumulation > 1 and s.global_batch % 3,
        # derandomized: one run in ten or so stopped at Adam once token losses were drawn too
        settings=settings(database=None, max_examples=500, derandomize=True),
    )
    assert scenario.model == ModelSpec(width=2)
    assert (scenario.global_batch, scenario.accumulation, scenario.steps) == (1, 2, 1)
    assert scenario.optimizer is torch.optim.SGD


class _Declining(ddpcheck.Target):
    """Declines two features outright, one of them depending on W, and four-step scenarios."""

    supported_features = ddpcheck.features.FEATURES.keys() - {"rank-orders", "uneven-batches"}

    def supports(self, scenario):
        return "four steps are too many here" if scenario.steps == 4 else None


@FAST
@given(dst.examples(_Declining(), world_sizes=(2, 3)))
def test_examples_draw_only_what_the_target_runs_at_their_world_size(example):
    scenario, world_size = example
    assert world_size in (2, 3)
    assert declines(_Declining(), scenario, world_size) is None
    assert not scenario.rank_orders and scenario.global_batch % world_size == 0
    assert scenario.steps < 4


def test_examples_refuse_what_could_never_run():
    class Float32Only(ddpcheck.Target):
        supported_features = ddpcheck.features.FEATURES.keys() - {"float64"}

    with pytest.raises(ddpcheck.NothingChecked, match="supports none of the dtypes float64"):
        dst.examples(Float32Only())
    with pytest.raises(ddpcheck.InvalidArgument, match=r"world_sizes=\(0,\) contains 0"):
        dst.examples(targets.LOCAL, world_sizes=(0,))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: dst.world_sizes(min_size=0), "min_size=0 must be an integer >= 1"),
        (lambda: dst.world_sizes(min_size=3, max_size=2), "Cannot have max_size=2 < min_size=3"),
        (lambda: dst.layers(kinds=("lstm",)), "kinds=('lstm',) must be a non-empty subset"),
        (lambda: dst.models(max_layers=-1), "max_layers=-1 must be an integer >= 0"),
        (
            lambda: dst.scenarios(dtypes=("float16",)),
            "dtypes=('float16',) must be a non-empty subset",
        ),
        (
            lambda: dst.scenarios(models=[1]),
            "Expected a SearchStrategy, such as ddpcheck.strategies.models(), but got models=[1]",
        ),
        (lambda: dst.scenarios(max_steps=0), "max_steps=0 must be an integer >= 1"),
    ],
)
def test_strategy_misuse_names_the_argument(call, message):
    with pytest.raises(ddpcheck.InvalidArgument) as info:
        call()
    assert message in str(info.value)


def test_model_spec_rejects_a_bad_registration_order():
    with pytest.raises(ValueError, match=r"registration=\(0, 0\) must be a permutation"):
        ModelSpec(layers=(Layer(), Layer()), registration=(0, 0))


# ---------------------------------------------------------------------------------------------
# The plugin


def _pytest(tmp_path, body, *args):
    (tmp_path / "test_it.py").write_text(textwrap.dedent(body))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            str(tmp_path / "test_it.py"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=patience(300),
        cwd=tmp_path,
    )


def test_plugin_leaves_the_users_hypothesis_profile_and_torch_alone(tmp_path):
    out = _pytest(
        tmp_path,
        """
        import sys
        from hypothesis import settings
        settings.register_profile("mine", max_examples=123)
        settings.load_profile("mine")

        def test_profile():
            import ddpcheck.pytest_plugin, ddpcheck.strategies
            assert settings.default.max_examples == 123
            assert "ddpcheck.pytest_plugin" in sys.modules
    """,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # Quiet in a project that does not use it: no header, no summary line.
    assert "ddpcheck:" not in out.stdout
    verbose = _pytest(tmp_path, "def test_nothing():\n    pass\n", "-v")
    assert "ddpcheck: world sizes 1,2,3,4, deadline 60 s" in verbose.stdout

    out = subprocess.run(
        [sys.executable, "-c", "import sys, ddpcheck.pytest_plugin; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=patience(60),
    )
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_plugin_fixtures_run_a_target_narrowed_by_the_flags_and_count_examples(tmp_path):
    # One pytest process for the fixtures, the flags that narrow them, and the count (a pytest
    # with torch, a fork server and its worlds costs ~10 CPU-s: once, not once per flag).
    from ddpcheck.battery import BATTERY

    without = frozenset({"accumulation", "float32"})
    # every battery scenario parallel runs with those features excluded, at W=1 and W=2
    n = sum(
        declines(targets.PARALLEL, scenario, w, without) is None
        for _, scenario in BATTERY
        for w in (1, 2)
    )
    out = _pytest(
        tmp_path,
        f"""
        from ddpcheck import targets

        def test_run(ddpcheck_run, ddpcheck_options, ddpcheck_world):
            assert ddpcheck_options.world_sizes == (1, 2)
            assert ddpcheck_options.without == {{"accumulation", "float32"}}
            report = ddpcheck_run(targets.PARALLEL)
            assert report.count == {n}
            assert not report.features & {{"accumulation", "float32"}}
            assert any("excluded with --without" in line for line in report.skipped_lines())
            assert ddpcheck_world(2).world_size == 2
    """,
        "--ddpcheck-world-sizes",
        "1,2",
        "--ddpcheck-deadline",
        "30",
        "--ddpcheck-without",
        "accumulation",
        "--ddpcheck-dtypes",
        "float64",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ddpcheck: world sizes 1,2, deadline 30 s" in out.stdout
    assert "without accumulation,float32" in out.stdout
    assert (
        f"ddpcheck: {n} data-parallel examples run (fixture world sizes 1,2, deadline 30 s)"
        in out.stdout
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ddpcheck-world-sizes", "2,x"], "--ddpcheck-world-sizes='2,x' must be comma-separated"),
        (
            ["--ddpcheck-world-sizes", "0"],
            "--ddpcheck-world-sizes='0' contains 0; every world size must be a positive integer",
        ),
        (["--ddpcheck-deadline", "-3"], "--ddpcheck-deadline='-3' must be a positive number"),
        (["--ddpcheck-world-sizes", "1000"], "lower the largest world size"),
        (
            ["--ddpcheck-without", "buffer"],
            "'buffer' is not a feature (did you mean 'buffers'?); known:",
        ),
        (
            ["--ddpcheck-dtypes", "float16"],
            "--ddpcheck-dtypes='float16' must name float64, float32 "
            "or both (did you mean 'float64'?)",
        ),
    ],
)
def test_plugin_rejects_bad_options_naming_the_flag(tmp_path, args, message):
    out = _pytest(tmp_path, "def test_nothing():\n    pass\n", *args)
    assert out.returncode == 4, out.stdout + out.stderr
    assert message in out.stderr


@pytest.mark.slow
@pytest.mark.thorough  # make test: printed scenarios evaluated in a fresh interpreter
def test_a_random_scenario_replays_in_a_fresh_process(tmp_path):
    # The replay line must rebuild ModelSpec scenarios where ddpcheck.models was never imported.
    spec = ModelSpec(
        layers=(Layer("embedding", use="sample"), Layer("attention", float32=True)),
        width=3,
        registration=(1, 0),
        tie_head=True,
    )
    scenario = ddpcheck.Scenario(spec, data=spec.data, steps=1)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpcheck",
            "replay",
            "parallel",
            "--world-size",
            "2",
            "--scenario",
            repr(scenario),
        ],
        capture_output=True,
        text=True,
        timeout=patience(120),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "equivalent at world size 2" in out.stdout


@FAST
@given(
    dst.scenarios(models=dst.models(mixed_dtypes=True), dtypes=("float64", "float32")),
    dst.world_sizes(),
)
def test_a_spec_models_usage_read_from_its_data_is_what_its_gradients_say(scenario, world_size):
    """features reads which ranks use which layer of a ModelSpec from the data alone; the forward
    and backward of every rank's shard must agree."""
    from ddpcheck._language.features import _spec_usage, _usage
    from ddpcheck.models import ModelSpec

    assume(isinstance(scenario.model, ModelSpec))  # a fifth are language models (test_tokens.py)
    model = build_model(scenario, scenario.seed)
    assert _spec_usage(scenario, scenario.model, world_size) == _usage(
        scenario, model, world_size
    ), scenario
