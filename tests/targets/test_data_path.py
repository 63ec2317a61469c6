"""A framework's own data path: accelerate's ``prepare(dataloader)``, torch's
``DistributedSampler``, Lightning's ``Trainer.fit``, Fabric's ``setup_dataloaders`` and
transformers' ``Trainer.train`` over a scenario's epochs, judged by what each step consumed and
by the numbers; accelerate's ``split_batches`` keyword, accepted and ignored since 1.0, is
caught."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

import ddpcheck
from ddpcheck import Epochs, EquivalenceError, NothingChecked, Scenario, cli, targets, zoo
from ddpcheck._oracle.compare import STEPS_DIFFER
from ddpcheck._oracle.consumed import DUPLICATED, FOREIGN
from ddpcheck.targets.accelerate import AccelerateTarget
from ddpcheck.targets.builtin import TorchDDPTarget
from ddpcheck.targets.fabric import FabricTarget
from ddpcheck.targets.hf_trainer import HfTrainerTarget
from ddpcheck.targets.lightning import LightningTarget

pytest.importorskip("accelerate")

#: Two epochs of 8 samples in steps of 4 (two micro-batches of 2): every step full.
FULL = Scenario(zoo.MLP, global_batch=4, accumulation=2, epochs=Epochs(samples=8, epochs=2))
#: 10 samples in steps of 4: each epoch ends with 2 samples in a window of one micro-batch.
SHORT = Scenario(zoo.MLP, global_batch=4, accumulation=2, epochs=Epochs(samples=10, epochs=2))


#: Lightning's epochs: a micro-batch of 6 samples (per device 3 at W=2, 2 at W=3) over 18 samples
#: in steps of 12, each epoch's last step a window of one micro-batch of the two.
L_SHORT = Scenario(zoo.MLP, global_batch=12, accumulation=2, epochs=Epochs(samples=18, epochs=2))
#: the same without accumulation: the last batch short (per device 3 of 6 at W=2, 2 of 4 at W=3).
L_SHORT_BATCH = dataclasses.replace(L_SHORT, accumulation=1)
#: 16 samples in steps of 12: the last window short at W=2, and W=3 does not divide the dataset.
L_UNEVEN = dataclasses.replace(L_SHORT, epochs=Epochs(samples=16, epochs=2))

#: The Trainer's epochs: 12 samples in steps of 8 (micro-batches of 4: 2 per device at W=2),
#: each epoch's last window one micro-batch of the two.
H_SHORT = Scenario(zoo.MLP, global_batch=8, accumulation=2, epochs=Epochs(samples=12, epochs=2))
#: tokens, 8 samples in steps of 6 (3 micro-batches of 2; 1 per device at W=2): the last window
#: one micro-batch of the three, its tokens counted by the Trainer across the ranks.
H_TOKENS = Scenario(
    zoo.TinyGPT,
    data=zoo.token_data,
    loss="token_cross_entropy",
    global_batch=6,
    accumulation=3,
    epochs=Epochs(samples=8, epochs=2),
)


@dataclasses.dataclass(frozen=True)
class LightningGlobalBatchPerDevice(LightningTarget):
    """A Lightning loop whose DataLoader loads the global micro-batch on every rank (the batch
    size meant across the ranks given per device): each step trains the next steps' samples."""

    def train_loader(self, run):
        loader = super().train_loader(run)
        return type(loader)(
            run.dataset, batch_size=run.global_batch // run.accumulation, sampler=loader.sampler
        )


@dataclasses.dataclass(frozen=True)
class FabricLoaderWithoutSampler(FabricTarget):
    """A Fabric loop that turns Fabric's sampler off and gives its loader none of its own:
    every rank loads the whole dataset."""

    use_distributed_sampler: bool = False

    def train_loader(self, run):
        return type(super().train_loader(run))(run.dataset, batch_size=1)


@dataclasses.dataclass(frozen=True)
class OneEpochOnly(TorchDDPTarget):
    """A loop that trains the first epoch only (its epoch count read from the wrong place)."""

    def fit_epochs(self, module, run):
        run.epochs = 1
        super().fit_epochs(module, run)


def test_accelerates_split_batches_keyword_is_caught_by_what_the_steps_consumed():
    # the keyword is accepted and ignored: each rank loads the whole global micro-batch
    with pytest.raises(EquivalenceError) as caught:
        ddpcheck.check_example(AccelerateTarget(config={"split_batches": True}), FULL, 2)
    first = caught.value.divergences[0]
    assert (first.kind, first.step) == (FOREIGN, 0), caught.value
    assert "consumed 4 sample(s) (4, 5, 6, 7)" in first.detail
    assert "the ranks together took 8 sample(s)" in first.detail
    # through DataLoaderConfiguration the batch is split, and right; and per device, by default
    split = AccelerateTarget(config={"dataloader_config": {"split_batches": True}})
    assert ddpcheck.check_example(split, FULL, 2) == ()
    assert ddpcheck.check_example(targets.ACCELERATE, FULL, 2) == ()


def test_accelerate_declines_what_its_documented_conventions_weigh_otherwise():
    why = targets.ACCELERATE.supports(SHORT)
    assert "even_batches=True), its default" in why and "samples at the start" in why
    assert "divides every loss by gradient_accumulation_steps" in why
    uneven = AccelerateTarget(config={"dataloader_config": {"even_batches": False}})
    assert "the ranks' last batches differ in size" in uneven.supports(SHORT)
    summed = dataclasses.replace(FULL, reduction="sum")
    assert "the mean loss of each batch" in targets.ACCELERATE.supports(summed)
    assert targets.ACCELERATE.supports(FULL) is None


def test_torch_ddp_trains_short_last_windows_through_its_own_sampler():
    for w in (1, 2):
        assert ddpcheck.check_example(targets.TORCH_DDP, SHORT, w) == ()
    assert ddpcheck.check_example(targets.PARALLEL, SHORT, 3) == ()  # the harness's split
    odd = Scenario(zoo.MLP, global_batch=2, epochs=Epochs(samples=7))
    with pytest.raises(NothingChecked, match=r"7 samples over 2 ranks: DistributedSampler\("):
        ddpcheck.check_example(targets.TORCH_DDP, odd, 2)
    with pytest.raises(NothingChecked, match=r"a micro-batch of 2 samples over 3 ranks"):
        ddpcheck.check_example(targets.TORCH_DDP, SHORT, 3)


def test_a_data_path_that_stops_early_is_told_by_its_step_count():
    with pytest.raises(EquivalenceError) as caught:
        ddpcheck.check_example(OneEpochOnly(), SHORT, 2)
    first = caught.value.divergences[0]
    assert (first.kind, first.step, first.name) == (STEPS_DIFFER, 3, "optimizer steps")
    assert "rank 0: 3, rank 1: 3 optimizer step(s); the reference takes 6" in first.detail
    assert "2 epoch(s) of 10 samples in steps of the global batch B=4" in first.detail


def test_lightning_trains_epochs_through_its_own_trainer_and_sampler():
    pytest.importorskip("lightning")
    for w in (2, 3):  # the last batch of each epoch short; Lightning steps on it
        assert ddpcheck.check_example(targets.LIGHTNING, L_SHORT_BATCH, w) == ()
    full = dataclasses.replace(L_SHORT, epochs=Epochs(samples=24, epochs=2))
    assert ddpcheck.check_example(targets.LIGHTNING, full, 3) == ()


def test_lightning_declines_its_documented_scaling_of_a_short_last_window():
    # bench/lightning_short_window.py: the window's samples weigh 1 / accumulate_grad_batches
    pytest.importorskip("lightning")
    why = targets.LIGHTNING.supports(L_SHORT)
    assert "its last window holds fewer samples than accumulation=2" in why
    assert "will be automatically normalized by accumulate_grad_batches internally" in why
    assert "gradient accumulation" in LightningTarget(manual=True).supports(L_SHORT)
    for w in (2, 3):
        with pytest.raises(NothingChecked, match="normalized by accumulate_grad_batches"):
            ddpcheck.check_example(targets.LIGHTNING, L_SHORT, w)
    # the sampler's padding, as torch_ddp's data path declines it
    assert "16 samples over 3 ranks: DistributedSampler(" in targets.LIGHTNING.supports_at(
        L_UNEVEN, 3
    )
    with pytest.raises(NothingChecked, match=r"16 samples over 3 ranks: DistributedSampler\("):
        ddpcheck.check_example(targets.LIGHTNING, dataclasses.replace(L_UNEVEN, accumulation=1), 3)
    summed = dataclasses.replace(L_SHORT_BATCH, reduction="sum")
    assert "the mean loss of each batch" in targets.LIGHTNING.supports(summed)


def test_a_lightning_loader_of_the_global_batch_per_device_is_caught():
    pytest.importorskip("lightning")
    with pytest.raises(EquivalenceError) as caught:
        ddpcheck.check_example(LightningGlobalBatchPerDevice(), L_SHORT_BATCH, 2)
    first = caught.value.divergences[0]
    assert (first.kind, first.step) == (FOREIGN, 0), caught.value
    assert "the ranks together took 18 sample(s)" in first.detail  # 9 per rank: all of it


def test_fabric_trains_epochs_through_its_setup_dataloaders():
    # a short last window each epoch; Fabric's sampler, then the user's own (an evaluation set
    # W does not divide: each rank evaluates its share, unpadded, through Fabric's module)
    pytest.importorskip("lightning")
    evaluated = dataclasses.replace(SHORT, epochs=Epochs(samples=10, epochs=2, evaluation=5))
    assert ddpcheck.check_example(targets.FABRIC, evaluated, 2) == ()


@pytest.mark.thorough  # varies test_fabric_trains_epochs_through_its_setup_dataloaders
def test_fabric_trains_epochs_through_the_users_own_sampler_and_catches_none():
    pytest.importorskip("lightning")
    assert ddpcheck.check_example(FabricTarget(use_distributed_sampler=False), SHORT, 2) == ()
    with pytest.raises(EquivalenceError) as caught:  # no sampler at all: each rank loads all
        ddpcheck.check_example(FabricLoaderWithoutSampler(), SHORT, 2)
    assert caught.value.divergences[0].kind == DUPLICATED, caught.value


def test_fabric_declines_its_samplers_padding_a_dropped_batch_and_shuffling():
    odd = Scenario(zoo.MLP, global_batch=2, epochs=Epochs(samples=7))
    why = targets.FABRIC.supports_at(odd, 2)
    assert "7 samples over 2 ranks: fabric.setup_dataloaders(use_distributed_sampler=True)" in why
    assert "will add extra indices" in why
    own = FabricTarget(use_distributed_sampler=False).supports_at(odd, 2)
    assert own.startswith("7 samples over 2 ranks: DistributedSampler(drop_last=False)")
    tail = Scenario(zoo.MLP, global_batch=4, epochs=Epochs(samples=10))  # 5 a rank, batches of 2
    assert targets.FABRIC.supports_at(tail, 2) is None
    assert "drop the last incomplete batch" in FabricTarget(drop_last=True).supports_at(tail, 2)
    assert FabricTarget(drop_last=True).supports_at(SHORT, 2) is None  # 5 a rank, batches of 1
    assert "index order (a limit of ddpcheck)" in FabricTarget(shuffle=True).supports(SHORT)
    assert FabricTarget(shuffle=True).supports(dataclasses.replace(SHORT, epochs=None)) is None


def test_the_hf_trainer_trains_epochs_through_its_own_data_path():
    # its get_train_dataloader, accelerate's sharding of it and its epoch loop: a short last
    # window is weighed by the items the Trainer counts in it (num_items_in_batch), or divided
    # by the micro-batches it holds (current_gradient_accumulation_steps)
    pytest.importorskip("transformers")
    assert "epochs" not in targets.HF_TRAINER.declined_features
    assert targets.HF_TRAINER.supports(H_SHORT) is None
    assert ddpcheck.check_example(targets.HF_TRAINER, H_SHORT, 2) == ()
    assert ddpcheck.check_example(HfTrainerTarget(loss_kwargs=False), H_SHORT, 2) == ()
    assert ddpcheck.check_example(targets.HF_TRAINER, H_TOKENS, 2) == ()
    # even_batches=False: rank 1's last batch holds 1 sample of rank 0's 2, weighed right by the
    # items counted across the ranks
    uneven = HfTrainerTarget(config={"accelerator_config": {"even_batches": False}})
    odd = Scenario(zoo.MLP, global_batch=4, epochs=Epochs(samples=7, epochs=2))
    assert ddpcheck.check_example(uneven, odd, 2) == ()


def test_the_hf_trainer_declines_its_loaders_documented_conventions_by_name():
    padded = Scenario(zoo.MLP, global_batch=8, accumulation=2, epochs=Epochs(samples=11))
    why = targets.HF_TRAINER.supports(padded)
    assert "an epoch of 11 samples in micro-batches of 4 across the ranks" in why
    assert "even_batches=True, its default" in why and "samples at the start" in why
    dropped = HfTrainerTarget(config={"dataloader_drop_last": True}).supports(padded)
    assert '"Whether to drop the last incomplete batch' in dropped
    assert "no per_device_train_batch_size" in targets.HF_TRAINER.supports_at(H_SHORT, 3)
    split = HfTrainerTarget(config={"accelerator_config": {"split_batches": True}})
    assert "a round multiple of the number of processes" in split.supports_at(H_SHORT, 3)
    assert targets.HF_TRAINER.supports_at(H_SHORT, 2) is None
    # even_batches=False: the ranks' batches may differ, not their steps (nor, where every
    # batch is gathered, their batches): the Trainer enters no DDP join
    uneven = {"accelerator_config": {"even_batches": False}}
    seven = Scenario(zoo.MLP, global_batch=4, epochs=Epochs(samples=7))  # 2, 2 batches
    six = Scenario(zoo.MLP, global_batch=4, epochs=Epochs(samples=6))  # 2, 1 batches
    assert HfTrainerTarget(config=uneven).supports(six) is None
    assert HfTrainerTarget(config=uneven).supports_at(seven, 2) is None
    why = HfTrainerTarget(config=uneven).supports_at(six, 2)
    assert "hold 2, 1 batches, 2, 1 optimizer steps" in why and "DDP's join" in why
    accumulated = Scenario(zoo.MLP, global_batch=8, accumulation=2, epochs=Epochs(samples=6))
    assert HfTrainerTarget(config=uneven).supports_at(accumulated, 2) is None  # 1 step each
    counted = HfTrainerTarget(config={**uneven, "include_num_input_tokens_seen": True})
    assert "gathers every batch's token count" in counted.supports_at(accumulated, 2)


def test_hf_trainer_data_path_bugs_are_caught_at_their_step():
    pytest.importorskip("transformers")
    from tests.targets.hf_trainers import DropsTheIndex, GlobalBatchPerDevice, PerMicroBatchLoss

    # a loss divided by gradient_accumulation_steps in a window of fewer micro-batches: the
    # short last window's samples weigh half (step 1: one micro-batch of two)
    with pytest.raises(EquivalenceError) as caught:
        ddpcheck.check_example(HfTrainerTarget(trainer_class=PerMicroBatchLoss), H_SHORT, 2)
    first = caught.value.divergences[0]
    assert (first.kind, first.step) == ("reference differs (gradient)", 1), caught.value
    assert first.max_rel == pytest.approx(0.5)
    # a loader of the global micro-batch on every rank: step 0 trains step 1's samples
    with pytest.raises(EquivalenceError) as caught:
        ddpcheck.check_example(HfTrainerTarget(trainer_class=GlobalBatchPerDevice), H_SHORT, 2)
    first = caught.value.divergences[0]
    assert (first.kind, first.step) == (FOREIGN, 0), caught.value
    assert "the ranks together took 16 sample(s)" in first.detail
    # a loader that drops the samples' index cannot be judged: a usage error, never a verdict
    with pytest.raises(ddpcheck.InvalidArgument, match="carry no 'sample_index'"):
        ddpcheck.check_example(HfTrainerTarget(trainer_class=DropsTheIndex), H_SHORT, 2)


@pytest.mark.slow
def test_the_command_line_exits_1_on_the_keyword(tmp_path, monkeypatch, capsys):
    # (the configuration that splits passes the same scenarios: the first test, through the API)
    # In this process (cli.main, as the console script calls it): its worlds have accelerate
    # imported already; the claim is the command's status and its report.
    (tmp_path / "split.json").write_text(json.dumps({"split_batches": True}))
    monkeypatch.chdir(tmp_path)
    status = cli.main(
        ["check", "accelerate", "--config", "split.json", "--world-sizes", "2", "--examples", "4"]
    )
    out = capsys.readouterr().out
    assert status == 1, out
    # the battery's epochs name the batch, and so does the smaller counterexample: it is searched
    # among scenarios with epochs (elsewhere the keyword's other face, AcceleratedScheduler
    # stepping W times per step, would be shown); a search out of time under load leaves the
    # battery's verdict, named
    assert "epochs-accumulate failed at world size 2 (sample of another step)" in out
    kinds = "(sample of another step|sample duplicated|sample dropped)"
    shown = rf"diverged at world size 2( \(epochs-accumulate\))?: {kinds}"
    assert re.search(shown, out), out
    assert "replay:" in out
