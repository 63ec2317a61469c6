"""What the closing line of ``ddpcheck check`` says was checked of the losses: never more than
was (``ddpcheck._front.lines.losses``)."""

from __future__ import annotations

from ddpcheck import targets
from ddpcheck._front.lines import losses


def test_the_closing_line_says_which_losses_were_checked():
    assert losses(targets.PARALLEL) == "every step's loss checked, and the loss it reports"
    assert losses(targets.TORCH_FSDP).startswith("every step's loss checked; it reports none")
    # torch DDP over epochs runs its own DistributedSampler's data path, and evaluates
    assert losses(targets.TORCH_DDP).endswith(
        "(not over epochs, where its framework's data path computes them); over epochs, the "
        "evaluation metric it reports checked after every epoch"
    )
    # the Trainer computes its losses through the model: only the one it logs is checked, over
    # epochs too (its own data path logs it as its loop over the harness's batches does)
    assert losses(targets.HF_TRAINER) == "the loss it reports checked every step"
    assert losses(targets.ACCELERATE).startswith("every step's loss checked, and the loss it")


class _OwnDataPath(targets.ParallelTarget):
    """A data path of its own that evaluates nothing: the line says so."""

    def fit_epochs(self, module, run):
        raise NotImplementedError


def test_the_closing_line_says_when_no_evaluation_metric_is_reported():
    assert losses(_OwnDataPath()).endswith(
        "; over epochs it reports no evaluation metric (EpochRun.evaluated: docs/targets.md)"
    )
    assert "evaluation metric" not in losses(targets.PARALLEL)  # the harness's loop over epochs
