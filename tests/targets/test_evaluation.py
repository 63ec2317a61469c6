"""The evaluation metric a framework's own data path reports after every epoch, over an evaluation
set whose last batch is uneven: accelerate's ``gather_for_metrics`` (``even_batches`` true and
false, the evaluation loader's ``drop_last``), Lightning's epoch-level ``self.log(...,
sync_dist=True)`` in ``validation_step``, and torch's ``DistributedSampler`` loop; each checked
right, and a mislogging loop of each caught as ``metric differs``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ddpcheck
from ddpcheck import Epochs, EquivalenceError, Scenario, targets, zoo
from ddpcheck.models import Layer, ModelSpec, SpecData
from ddpcheck.mutation.broken_metrics import DropsUnevenLastBatchTarget, PaddingCountedTarget
from ddpcheck.targets.accelerate import AccelerateTarget
from ddpcheck.targets.lightning import LightningTarget

#: Two epochs of 12 samples in steps of 6 (per device 3 at W=2); an evaluation set of 7: at W=2
#: shares of 4 and 3, one padded sample, a short last batch on each rank.
UNEVEN = Scenario(
    zoo.MLP, global_batch=6, epochs=Epochs(samples=12, epochs=2, evaluation=7), seed=5
)
#: A model of 64 bytes evaluated on 35 samples: the evaluation's gathers, more bytes than the
#: parameters, are no part of the next step's communication budget (the soak's false alarm).
SMALL_MODEL = Scenario(
    ModelSpec(layers=(Layer(kind="embedding", use="sample", float32=True),), width=2),
    data=SpecData(width=2),
    global_batch=12,
    dtype="float32",
    seed=6714,
    epochs=Epochs(samples=12, epochs=2, evaluation=35),
)
#: The same with an evaluation set of 10: 5 per rank at W=2 (batches of 3 and 2), no padding.
EVEN_RANKS = dataclasses.replace(UNEVEN, epochs=Epochs(samples=12, epochs=2, evaluation=10))


def _kinds(caught: pytest.ExceptionInfo[EquivalenceError]) -> set[str]:
    return set(caught.value.kinds)


@dataclasses.dataclass(frozen=True)
class GathersWithPadding(AccelerateTarget):
    """An evaluation loop that gathers with ``accelerator.gather`` where the guide says
    ``gather_for_metrics``: the samples repeated to even out the last batch are counted."""

    def evaluate(self, accelerator, model, run, loader):
        model.eval()
        gathered = [accelerator.gather(run.evaluation_terms(model, batch)) for batch in loader]
        model.train()
        run.evaluated(run.metric_of(torch.cat(gathered)))


def test_accelerate_gathers_each_evaluation_sample_once():
    pytest.importorskip("accelerate")
    assert ddpcheck.check_example(targets.ACCELERATE, SMALL_MODEL, 2) == ()
    uneven = AccelerateTarget(config={"dataloader_config": {"even_batches": False}})
    assert ddpcheck.check_example(uneven, UNEVEN, 2) == ()
    with pytest.raises(EquivalenceError) as caught:
        ddpcheck.check_example(GathersWithPadding(), UNEVEN, 2)
    assert _kinds(caught) == {"metric differs"}, caught.value
    assert {(d.rank, d.name) for d in caught.value.divergences} == {
        (0, "metric rank 0 reports"),
        (1, "metric rank 1 reports"),
    }


def test_accelerate_declines_an_evaluation_loader_that_drops_its_last_batch():
    dropping = AccelerateTarget(evaluation_drop_last=True)
    why = dropping.supports_at(UNEVEN, 2)
    assert "an evaluation set of 7 samples in batches of 6 across the ranks" in why
    assert 'drops "the last incomplete batch' in why
    twelve = dataclasses.replace(UNEVEN, epochs=Epochs(samples=12, epochs=2, evaluation=12))
    assert dropping.supports_at(twelve, 2) is None
    assert targets.ACCELERATE.supports_at(UNEVEN, 2) is None


@dataclasses.dataclass(frozen=True)
class LogsMetricPerRank(LightningTarget):
    """``validation_step`` logs with ``sync_dist=False``: each rank's epoch value is its own
    share's mean."""

    metric_sync_dist = False


def test_lightning_logs_the_epochs_metric_synchronised_over_the_ranks():
    pytest.importorskip("lightning")
    assert ddpcheck.check_example(targets.LIGHTNING, EVEN_RANKS, 2) == ()
    with pytest.raises(EquivalenceError) as caught:
        ddpcheck.check_example(LogsMetricPerRank(), EVEN_RANKS, 2)
    assert _kinds(caught) == {"metric differs"}, caught.value
    # its validation sampler pads a set W does not divide, as Lightning warns: declined
    why = targets.LIGHTNING.supports_at(UNEVEN, 2)
    assert "an evaluation set of 7 samples over 2 ranks" in why
    assert "replicates some samples" in why


def test_torch_ddp_evaluates_each_sample_once_and_its_mutants_do_not():
    assert ddpcheck.check_example(targets.TORCH_DDP, UNEVEN, 2) == ()
    for mutant in (PaddingCountedTarget(), DropsUnevenLastBatchTarget()):
        with pytest.raises(EquivalenceError) as caught:
            ddpcheck.check_example(mutant, UNEVEN, 2)
        assert _kinds(caught) == {"metric differs"}, caught.value
