"""The framework targets' option spaces draw the framework's own configuration (``config``).

What they must do: every configuration a space draws builds (a drawn option the target refuses
would end a ``--fuzz-config`` run with exit 2, or worse, be read as the framework's failure); the
spaces hold the ``config`` keys that bear on equivalence; and each key shrinks towards absent
(the framework's default), a nested one to the fewest of its own keys.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.strategies import SearchStrategy

from ddpcheck import targets
from ddpcheck.targets.option_space import drawn_options, label, space_of, vary
from tests.shrink import find

#: target -> the ``config`` keys its space must draw
CONFIG_KEYS = {
    "accelerate": ("gradient_accumulation_plugin", "kwargs_handlers"),
    "lightning": ("strategy",),
    "fabric": ("strategy",),
    "deepspeed": ("zero_optimization",),
    "deepspeed_zero1": ("zero_optimization",),
    "deepspeed_zero2": ("zero_optimization",),
    "torch_fsdp": ("shard_placement_fn",),
    "hf_trainer": (
        "include_num_input_tokens_seen",
        "ddp_bucket_cap_mb",
        "ddp_find_unused_parameters",
    ),
}
TARGETS = {
    "accelerate": targets.ACCELERATE,
    "lightning": targets.LIGHTNING,
    "fabric": targets.FABRIC,
    "deepspeed": targets.DEEPSPEED,
    "deepspeed_zero1": targets.DEEPSPEED_ZERO1,
    "deepspeed_zero2": targets.DEEPSPEED_ZERO2,
    "hf_trainer": targets.HF_TRAINER,
    "torch_fsdp": targets.TORCH_FSDP,
}


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_drawn_configuration_builds(name: str) -> None:
    target = TARGETS[name]
    space = space_of(target)
    assert space is not None

    @settings(
        max_examples=80,
        database=None,
        deadline=None,  # the first build imports the framework
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(space)
    def builds(drawn: dict) -> None:
        variant = vary(target, drawn)  # InvalidArgument, were it refused, fails the test
        assert type(variant) is type(target)

    builds()


@pytest.mark.parametrize("name", sorted(CONFIG_KEYS))
def test_the_space_draws_the_config_keys(name: str) -> None:
    labels = {label(single).split("=")[0] for single in drawn_options(space_of(TARGETS[name]))}
    for key in CONFIG_KEYS[name]:
        assert f"config.{key}" in labels, labels


def test_an_option_drawn_with_its_keys_in_another_order_is_one_row() -> None:
    # accelerate's DistributedDataParallelKwargs came out as two rows of the survey, its keys
    # in two orders
    singles = drawn_options(space_of(targets.ACCELERATE), draws=120)
    handlers = [s["config"]["kwargs_handlers"][0] for s in singles if "kwargs_handlers" in str(s)]
    assert handlers
    as_sets = [frozenset(h.items()) for h in handlers]
    assert len(as_sets) == len(set(as_sets)), handlers


def _space(target: object) -> SearchStrategy[dict[str, Any]]:
    space = space_of(target)
    assert space is not None, target
    return space


def _config(drawn: dict) -> dict:
    return drawn.get("config") or {}


def test_a_config_key_shrinks_to_absent_and_a_nested_one_to_its_fewest_keys() -> None:
    # everything but the key the predicate needs is left out, inside the key too
    assert find(
        _space(targets.FABRIC), lambda d: _config(d).get("strategy", {}).get("static_graph")
    ) == {
        "config": {
            "strategy": {"name": "ddp", "find_unused_parameters": True, "static_graph": True}
        }
    }
    assert find(
        _space(targets.DEEPSPEED_ZERO2),
        lambda d: "reduce_bucket_size" in _config(d).get("zero_optimization", {}),
    ) == {"config": {"zero_optimization": {"reduce_bucket_size": 64}}}
    (handler,) = find(_space(targets.ACCELERATE), lambda d: "kwargs_handlers" in _config(d))[
        "config"
    ]["kwargs_handlers"]
    base = {"class": "DistributedDataParallelKwargs", "find_unused_parameters": True}
    assert len(handler) == 3 and base.items() <= handler.items(), handler  # one option drawn
    # any configuration at all shrinks to one option of one key (which one: the search's)
    ((key, value),) = find(_space(targets.ACCELERATE), lambda d: "config" in d)["config"].items()
    assert not isinstance(value, dict) or len(value) == 1, (key, value)


def test_lightning_draws_the_strategy_or_the_field_never_both() -> None:
    # static_graph=True and a config strategy together are refused (LightningTarget)
    given_field = targets.LightningTarget(static_graph=True)
    assert not any("config" in single for single in drawn_options(space_of(given_field), draws=50))
    singles = {label(single) for single in drawn_options(space_of(targets.LIGHTNING))}
    assert "static_graph=True" in singles and any(s.startswith("config.strategy=") for s in singles)
    # a failure behind static_graph shrinks to the field, the simpler branch
    assert find(_space(targets.LIGHTNING), lambda d: "static_graph" in str(d)) == {
        "static_graph": True
    }


def test_a_users_own_strategy_or_zero_optimization_is_kept() -> None:
    own = targets.FabricTarget(config={"strategy": {"name": "ddp", "static_graph": True}})
    variant = vary(own, {"config": {"strategy": {"name": "ddp", "gradient_as_bucket_view": True}}})
    assert variant.config["strategy"] == {"name": "ddp", "static_graph": True}
    zero = targets.DeepSpeedTarget(stage=2, config={"zero_optimization": {"overlap_comm": True}})
    # the user's zero_optimization is never varied: only the data path's key is left to draw
    drawn = drawn_options(space_of(zero), draws=30)
    assert {"config": {"dataloader_drop_last": True}} in drawn, drawn
    for single in drawn:
        assert set(single.get("config", {})) <= {"dataloader_drop_last"}, single
        assert vary(zero, single).config["zero_optimization"] == {"overlap_comm": True}


def test_hf_trainer_honours_ddp_find_unused_parameters_false() -> None:
    # torch DDP without find_unused_parameters raises on an unused parameter: declined, as for
    # accelerate's and Lightning's own DDP options (ddp_options), never read as the Trainer's bug
    drawn = targets.HfTrainerTarget(config={"ddp_find_unused_parameters": False})
    assert not drawn.supported_features & {"unused-everywhere", "unused-on-some-ranks"}
    assert {"unused-everywhere", "unused-on-some-ranks"} <= targets.HF_TRAINER.supported_features


def test_configurations_draws_configured_targets_for_a_users_own_given_test() -> None:
    from hypothesis import strategies as st

    import ddpcheck
    from ddpcheck.targets.option_space import configurations

    base = targets.PARALLEL
    assert find(configurations(base), lambda variant: True) is base  # shrinks to the target
    assert find(configurations(base), lambda v: v.bucket_size_mb != base.bucket_size_mb)

    seen = []

    @settings(max_examples=3, deadline=None, database=None)
    @given(st.data())
    def check(data: Any) -> None:
        variant = data.draw(configurations(base))
        scenario, world_size = data.draw(ddpcheck.strategies.examples(variant, world_sizes=[2]))
        ddpcheck.check_example(variant, scenario, world_size)
        seen.append(variant)

    check()
    assert len(seen) == 3
    with pytest.raises(ddpcheck.InvalidArgument, match=r"LocalTarget has no options to draw"):
        configurations(targets.LOCAL)
