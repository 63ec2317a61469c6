"""DeepSpeed's own data path over a scenario's epochs: the engine's loader
(``engine.deepspeed_io``), ``engine.backward`` and ``engine.step`` deciding the windows, judged by
what each step consumed and by the numbers; what DeepSpeed weighs otherwise by its documented
design is declined, quoting it (no DeepSpeed needed for those); a loop whose loader loads the
whole dataset on every rank is caught. The runs skip without DeepSpeed."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.data import SequentialSampler

import ddpcheck
from ddpcheck import Epochs, EquivalenceError, NothingChecked, Scenario, targets, zoo
from ddpcheck._oracle.sample_weights import DUPLICATED
from ddpcheck.features import declines, of
from ddpcheck.models import Layer, ModelSpec, SpecData
from ddpcheck.targets.deepspeed import DeepSpeedTarget


def _adam(samples: int, accumulation: int = 2) -> Scenario:
    """Two epochs of ``samples`` in steps of 4, Adam with a decaying learning rate."""
    return Scenario(
        zoo.MLP,
        dtype="float32",
        optimizer=torch.optim.Adam,
        lr_decay=0.9,
        global_batch=4,
        accumulation=accumulation,
        epochs=Epochs(samples=samples, epochs=2),
    )


#: 8 samples in steps of 4 (two micro-batches of 2): every window full
FULL = _adam(8)
#: 10 samples in steps of 4 without accumulation: each epoch's last batch holds 2 (1 per rank)
SHORT_BATCH = _adam(10, accumulation=1)
#: 10 samples in steps of 4 of two micro-batches: each epoch's last window one micro-batch
SHORT_WINDOW = _adam(10)


@dataclasses.dataclass(frozen=True)
class WholeDatasetOnEveryRank(DeepSpeedTarget):
    """A DeepSpeed loop whose loader samples the whole dataset on every rank
    (``deepspeed_io(data_sampler=SequentialSampler(dataset))``, a sampler that knows no ranks):
    each step trains every rank's copy of the same samples, and the next steps' go unused."""

    def data_sampler(self, run):
        return SequentialSampler(run.dataset)


def test_deepspeed_declines_what_its_design_weighs_otherwise_by_name():
    zero1 = targets.DEEPSPEED_ZERO1
    assert zero1.supports(FULL) is None and zero1.supports(SHORT_BATCH) is None
    why = zero1.supports(SHORT_WINDOW)
    assert "its last window holds fewer samples than accumulation=2" in why
    assert "deepspeedai/DeepSpeed#7439" in why and "micro-step counter" in why
    summed = dataclasses.replace(SHORT_BATCH, reduction="sum")
    assert "summed or token objective" in targets.DEEPSPEED_ZERO2.supports(summed)
    # the loader: a per-device size, the sampler's padding, dataloader_drop_last
    assert zero1.supports_at(SHORT_BATCH, 2) is None
    assert "a micro-batch of 4 samples over 3 ranks" in zero1.supports_at(SHORT_BATCH, 3)
    odd = _adam(9, accumulation=1)
    assert "9 samples over 2 ranks: DistributedSampler(" in zero1.supports_at(odd, 2)
    dropping = DeepSpeedTarget(stage=1, config={"dataloader_drop_last": True})
    assert "the last holds 1, and dataloader_drop_last=true" in dropping.supports_at(SHORT_BATCH, 2)
    assert dropping.supports_at(FULL, 2) is None


def test_deepspeed_trains_epochs_through_its_own_loader_and_boundary():
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    # ZeRO-2 reduces each micro-batch of a full window; ZeRO-1 steps on a short last batch
    ddpcheck.check_example(targets.DEEPSPEED_ZERO2, FULL, 2)
    ddpcheck.check_example(targets.DEEPSPEED_ZERO1, SHORT_BATCH, 2)
    with pytest.raises(NothingChecked, match="micro-step counter"):
        ddpcheck.check_example(targets.DEEPSPEED_ZERO1, SHORT_WINDOW, 2)


def test_a_deepspeed_loader_of_the_whole_dataset_on_every_rank_is_caught():
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    with pytest.raises(EquivalenceError) as caught:
        ddpcheck.check_example(WholeDatasetOnEveryRank(stage=1), SHORT_BATCH, 2)
    first = caught.value.divergences[0]  # both ranks took samples 0-3, the step's 4
    assert (first.kind, first.step) == (DUPLICATED, 0), caught.value


def test_a_layer_a_rank_skips_in_one_micro_batch_of_the_sampler_is_declined():
    # found by the soak (bench/soak.py --epochs): a layer each step's contiguous shards use on
    # both ranks, which DistributedSampler's every-other-sample share of a micro-batch leaves
    # unused on one -- DeepSpeed's own bug then (bench/deepspeed_unused_parameter.py: the ranks'
    # reductions differ in size, "collectives mismatched"), which the target declines
    layers = (Layer(kind="conv2d"), Layer(kind="conv2d", use="sample"))
    scenario = Scenario(
        ModelSpec(layers=layers, width=2),
        data=SpecData(width=2),
        accumulation=2,
        dtype="float32",
        seed=42919,
        epochs=Epochs(samples=16),
    )
    assert "unused-on-some-ranks" in of(scenario, 2)
    assert "unused-on-some-ranks" in declines(targets.DEEPSPEED_ZERO2, scenario, 2)
