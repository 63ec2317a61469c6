"""A target declares what it declines once, on its class, with why: ``declined_features`` derives
``supported_features``, ``ddpcheck targets`` prints the reasons, and a declined example quotes
them."""

from __future__ import annotations

import dataclasses

import pytest

import ddpcheck
from ddpcheck import features, targets, zoo
from ddpcheck.features import FEATURES


@dataclasses.dataclass(frozen=True)
class NoOrders(ddpcheck.Target):
    declined_features = {"rank-orders": "my wrapper pairs tensors by position"}  # noqa: RUF012


def test_declining_a_feature_supports_every_other():
    assert NoOrders.supported_features == frozenset(FEATURES) - {"rank-orders"}
    assert dict(NoOrders.declined_features) == {
        "rank-orders": "my wrapper pairs tensors by position"
    }


def test_a_declined_example_quotes_the_reason():
    scenario = ddpcheck.Scenario(zoo.MLP, rank_orders=True)
    why = features.declines(NoOrders(), scenario, 2)
    assert why == "needs rank-orders (NoOrders declines it: my wrapper pairs tensors by position)"


def test_an_opt_in_feature_stays_governed_by_its_flag():
    # the reason says why the flag is unset; the flag still decides
    assert "param-dtype" in targets.ParallelTarget.supported_features
    assert "param-dtype" not in features.supported_by(targets.PARALLEL)
    assert "param-dtype" in targets.READY_MADE[0].declines


def test_one_declaration_only_and_only_features():
    with pytest.raises(TypeError, match="both supported_features and declined_features"):
        type(
            "Both",
            (ddpcheck.Target,),
            {"supported_features": frozenset(), "declined_features": {"rank-orders": "x"}},
        )
    with pytest.raises(TypeError, match=r"names \['rank-order'\], which are not features"):
        type("Typo", (ddpcheck.Target,), {"declined_features": {"rank-order": "x"}})


@pytest.mark.parametrize("entry", targets.READY_MADE, ids=lambda e: e.name)
def test_every_ready_made_decline_has_its_own_reason(entry):
    # a reason the class wrote, not the generic "not in ...supported_features"
    for feature, why in entry.declines.items():
        assert "supported_features" not in why, (entry.name, feature, why)


#: Built in the test, not at collection: building them imports the frameworks (lightning.fabric
#: alone ~1.2 s of CPU), which every xdist worker would pay while collecting.
UNUSED_OFF = {
    "AccelerateTarget": lambda: targets.AccelerateTarget(
        config={
            "kwargs_handlers": [
                {"class": "DistributedDataParallelKwargs", "find_unused_parameters": False}
            ]
        }
    ),
    "FabricTarget": lambda: targets.FabricTarget(
        config={"strategy": {"name": "ddp", "find_unused_parameters": False}}
    ),
    "LightningTarget": lambda: targets.LightningTarget(
        config={"strategy": {"name": "ddp", "find_unused_parameters": False}}
    ),
    "HfTrainerTarget": lambda: targets.HfTrainerTarget(
        config={"ddp_find_unused_parameters": False}
    ),
}


@pytest.mark.parametrize("name", UNUSED_OFF)
def test_a_feature_your_ddp_options_rule_out_is_declined_with_torchs_reason(name):
    target = UNUSED_OFF[name]()
    # (it said "not in AccelerateTarget.supported_features")
    assert {"unused-everywhere", "unused-on-some-ranks"}.isdisjoint(target.supported_features)
    why = ddpcheck.features.why_unsupported(target, "unused-everywhere")
    assert "find_unused_parameters=False" in why and "Expected to have finished" in why, why
    assert "unused-everywhere" in type(target)().supported_features  # the default looks for them
