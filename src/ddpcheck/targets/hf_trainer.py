"""The ``hf_trainer`` target: Hugging Face transformers' ``Trainer`` owns the loop (``Target.fit``).

Per example and rank: the scenario's model wrapped as a causal LM (:class:`ScenarioCausalLM`),
``TrainingArguments`` built from the scenario and the user's own arguments (:func:`arguments`), and
a ``Trainer`` subclass whose ``get_train_dataloader`` yields this rank's micro-batches in order
(``ddpcheck.targets.FitRun``: each rank fed its own, as ddpcheck's batch rule cuts the
global batch; accelerate does not prepare the loader, so it neither shards nor samples it). The
Trainer gets the scenario's optimizer and LR schedule through ``Trainer(optimizers=(optimizer,
scheduler))`` -- an ``ExponentialLR``, or a constant ``LambdaLR`` where the scenario has none,
since the Trainer would otherwise build its default linear decay -- wraps the model in torch DDP
through accelerate (``find_unused_parameters=True``, its default for a model that is no
``PreTrainedModel``), accumulates under ``no_sync``, clips with ``accelerator.clip_grad_norm_`` and
steps. A callback reports to ddpcheck: ``on_train_begin`` (model wrapped, optimizer prepared:
``run.started``), ``on_pre_optimizer_step`` (the clipped gradients ``optimizer.step()`` receives:
kept), and ``on_step_end`` -- after the step and the scheduler, but also after the Trainer's
``model.zero_grad()`` -- where the kept gradients are put back for ``run.record`` and cleared again
-- and ``on_log``, right after it: the loss the Trainer logs for the step (``log_history``'s
``"loss"``, every step's: ``logging_steps=1``), which ``run.reported`` hands to the oracle.

**Epochs** (``fit_epochs``: a scenario with a dataset, docs/scenarios.md): the Trainer's own data
path. ``Trainer(train_dataset=TrainerDataset(...))`` and ``train()`` with ``num_train_epochs``
the scenario's, ``per_device_train_batch_size`` the global micro-batch over W (or all of it under
``accelerator_config``'s ``split_batches``), ``gradient_accumulation_steps`` the accumulation and
``train_sampling_strategy="sequential"`` (its default shuffles; the reference walks the dataset
in index order). The Trainer's: ``get_train_dataloader``, accelerate's sharding of it, the epoch
loop, each window's batches and item count, the scaling and stepping. Ours: the dataset, whose
items carry their ``sample_index``, the sampler's order, and a ``training_step`` that notes which
samples each micro-batch held (``run.consumed``) and removes the index before the Trainer's own.
The short last window is the Trainer's to weigh (5.25.0 counts its own items: right). Declined,
quoting the documentation: a last micro-batch accelerate pads (``even_batches=True``) or
``dataloader_drop_last`` drops, ranks whose epochs end in different numbers of steps
(``even_batches=False``), a micro-batch W does not divide.

**The loss conventions.** ``ScenarioCausalLM.forward(input_ids, labels, **loss_kwargs)`` returns
``{"loss", "logits"}``; the Trainer sees ``**loss_kwargs`` (``model_accepts_loss_kwargs``; 4.46
looks for that name), counts the non-padding labels of the step's micro-batches
(``labels.ne(-100)``), sums the count over the ranks (``average_tokens_across_devices``: True
unless the user's arguments say otherwise -- transformers 5's default, which the target sets for
4.x, whose default is False) and passes it as ``num_items_in_batch``: the loss is the sum of the
micro-batch's terms divided by it (the current convention, ``fixed_cross_entropy``'s
``reduction="sum"``), which the Trainer multiplies by the world size against DDP's average and
does not divide by the accumulation. Without ``**loss_kwargs``
(``HfTrainerTarget(loss_kwargs=False)``: :class:`ScenarioCausalLMWithoutLossKwargs`) the Trainer
passes nothing, the loss is the mean over the micro-batch's own terms (the older convention, the
``reduction="mean"`` of HF's models, and transformers 4.45's only one), and the Trainer divides it
by the accumulation steps -- right only when every micro-batch holds as many terms
(huggingface/transformers #34191). The terms are the scenario's (``ddpcheck._language.objective``):
a token's cross-entropy (labels already the next tokens, so the model shifts nothing and declares
no ``loss_type``, and the Trainer counts ``labels`` as they are), or a sample's squared error
summed over its outputs -- the Trainer counts each label element as an item, so a per-sample loss
is multiplied by the elements per sample. The loss is computed outside autocast, in at least
float32, as the reference computes it (and HF's ``ForCausalLMLoss`` upcasts ``logits.float()``).

**Who sets what** (:data:`SCENARIO_KEYS`, :data:`HARNESS_KEYS`): the scenario owns the batch, the
accumulation, the steps, the optimizer and its schedule, the clipping, the precision and the
loss, so ``TrainingArguments`` keys that set them are refused whatever their value (the scenario's
value changes from example to example); the harness fixes how the run is driven (its world, its
loader, no checkpoints, no reporting), so those keys are accepted only with the value ddpcheck
sets. Every other key reaches ``TrainingArguments`` as given -- ``average_tokens_across_devices``,
``ddp_find_unused_parameters``, ``ddp_bucket_cap_mb``, ``seed``, what is logged. A refused key is an
:class:`InvalidArgument` when the target is built (exit 2), naming it; a value
``TrainingArguments`` itself rejects is one too, from the ranks, and so is an
``ACCELERATE_MIXED_PRECISION`` in the environment, which ``TrainingArguments`` takes as its
precision, where the scenario has no autocast. The ``ACCELERATE_*`` variables ``TrainingArguments``
itself writes there (transformers 4.x: its precision) are put back after each example.
This is the rule of every framework target's ``config``
(``ddpcheck.targets.configuration``; docs/frameworks.md, "Your own configuration")::

    HfTrainerTarget(config={"ddp_bucket_cap_mb": 5, "average_tokens_across_devices": True})
    # ddpcheck check hf_trainer --config args.json  (the same, as a JSON file)

Imports transformers only inside the hooks (and to check the key names of given arguments).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import tempfile
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from ddpcheck._base.errors import InvalidArgument, NothingChecked
from ddpcheck._language import objective
from ddpcheck._language.scenario import Scenario
from ddpcheck._language.training import EpochRun, FitRun, OptimizerLike, SchedulerLike
from ddpcheck.targets import ddp_options
from ddpcheck.targets.configuration import (
    Config,
    described,
    has,
    load_config,
    lookup,
    reconcile,
)
from ddpcheck.targets.environment import join_existing_group
from ddpcheck.targets.hf_data_path import (
    SAMPLING,
    Item,
    TrainerDataset,
    epoch_trainer,
    epochs_cannot_run,
    uneven_steps,
)
from ddpcheck.targets.option_space import options
from ddpcheck.targets.reasons import NO_PARAM_DTYPE, OWN_CHECKPOINTS, TORCH_DDP_ORDER

if TYPE_CHECKING:  # mypy skips transformers (pyproject.toml): it reads these names untyped
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState
    from transformers import TrainingArguments as Arguments

    from ddpcheck.targets.protocol import ConfigSpace

#: A batch as the Trainer takes it from ddpcheck: a micro-batch's tokens and labels.
Batch = dict[str, torch.Tensor]

__all__ = [
    "HARNESS_KEYS",
    "SCENARIO_KEYS",
    "HfTrainerTarget",
    "ScenarioCausalLM",
    "ScenarioCausalLMWithoutLossKwargs",
    "arguments",
]

_OPTIMIZER = (
    "optimizer and optimizer_kwargs (and param_groups): the Trainer gets the "
    "scenario's optimizer through Trainer(optimizers=...)"
)
_SCHEDULE = (
    "lr_decay: the Trainer gets the scenario's schedule through Trainer(optimizers=...)"
    " -- an ExponentialLR, or a constant rate"
)
_BATCH = "global_batch: each rank trains its own micro-batches of it, as ddpcheck cuts them"

#: ``TrainingArguments`` keys the scenario sets, example by example: key -> what sets it. Given
#: in the user's arguments, any value is refused.
SCENARIO_KEYS: dict[str, str] = {
    "gradient_accumulation_steps": "accumulation",
    "max_steps": "steps",
    "num_train_epochs": "steps (max_steps)",
    "per_device_train_batch_size": _BATCH,
    "auto_find_batch_size": _BATCH,
    "max_grad_norm": "max_grad_norm (0 where the scenario does not clip)",
    "bf16": "autocast=torch.bfloat16",
    "fp16": "autocast=torch.float16 (declined)",
    "learning_rate": _OPTIMIZER,
    "weight_decay": _OPTIMIZER,
    "adam_beta1": _OPTIMIZER,
    "adam_beta2": _OPTIMIZER,
    "adam_epsilon": _OPTIMIZER,
    "optim": _OPTIMIZER,
    "optim_args": _OPTIMIZER,
    "optim_target_modules": _OPTIMIZER,
    "lr_scheduler_type": _SCHEDULE,
    "lr_scheduler_kwargs": _SCHEDULE,
    "warmup_steps": _SCHEDULE,
    "warmup_ratio": _SCHEDULE,
    "label_smoothing_factor": "loss: the objective is the scenario's",
    "neftune_noise_alpha": "loss: noise in the embeddings changes the objective",
}

_LOADER = (
    "loader worker processes and their options are not tried with this target (over the "
    "harness's batches the loader is ddpcheck's; over a scenario's epochs, the Trainer's, with "
    "none)"
)
_SAMPLER = (
    "the reference walks a scenario's dataset in index order: over epochs the target sets the "
    "Trainer's train_sampling_strategy='sequential' (its default 'random' shuffles)"
)
_DISPATCH = (
    "one process iterating the loader and broadcasting its batches is not tried with this target"
)
_WORLD = "ddpcheck's world: the process group exists, on the world's device"
_MODEL = "the scenario's model is no PreTrainedModel, which this needs"

#: ``TrainingArguments`` keys ddpcheck's harness fixes: key -> (the values accepted: what the
#: target sets or what changes nothing, why). ``()``: none is accepted.
HARNESS_KEYS: dict[str, tuple[tuple, str]] = {
    "use_cpu": ((), _WORLD),
    "ddp_backend": ((), _WORLD),
    "ddp_timeout": ((), _WORLD),
    "local_rank": ((), _WORLD),
    "deepspeed": (
        (None,),
        "this target checks the Trainer over DDP (DeepSpeed has targets of "
        "its own: deepspeed_zero1, deepspeed_zero2)",
    ),
    "fsdp": ((None, "", []), "this target checks the Trainer over DDP"),
    "fsdp_config": ((None,), "this target checks the Trainer over DDP"),
    "parallelism_config": ((None,), "this target checks the Trainer over DDP"),
    "save_strategy": (("no",), "checkpoints are declined: the target sets save_strategy='no'"),
    "load_best_model_at_end": ((False,), "checkpoints and evaluation are declined"),
    "eval_strategy": (("no",), "no evaluation set: the target sets eval_strategy='no'"),
    "eval_on_start": ((False,), "no evaluation set"),
    "report_to": (
        ("none", [], ["none"], None),
        "reports leave the machine: the target sets report_to='none'",
    ),
    "push_to_hub": ((False,), "nothing is saved"),
    "logging_strategy": (
        ("steps",),
        "the target reads every step's logged loss (logging_strategy='steps', logging_steps=1) "
        "and checks it against the reference",
    ),
    "logging_steps": ((1,), "the target reads every step's logged loss (logging_steps=1)"),
    "full_determinism": (
        (False,),
        "torch.use_deterministic_algorithms(True) would outlive the "
        "example in ddpcheck's persistent ranks",
    ),
    "activation_checkpointing": ((None, False), _MODEL),
    "gradient_checkpointing": ((None, False), _MODEL),
    "use_liger_kernel": ((False,), _MODEL),
    "torch_compile": ((False,), "not tried with this target"),
    "dataloader_num_workers": ((), _LOADER),
    "dataloader_pin_memory": ((), _LOADER),
    "dataloader_persistent_workers": ((), _LOADER),
    "dataloader_prefetch_factor": ((), _LOADER),
    "dataloader_multiprocessing_context": ((), _LOADER),
    "dataloader_in_order": ((), _LOADER),
    "train_sampling_strategy": (("sequential",), _SAMPLER),
    "group_by_length": ((False,), _SAMPLER),
    "length_column_name": ((), _SAMPLER),
    "data_seed": ((), _SAMPLER),
    "remove_unused_columns": (
        (False,),
        "a scenario's dataset carries each sample's index (sample_index), which the target's "
        "training_step reads and removes: the target sets remove_unused_columns=False",
    ),
    # how accelerate prepares the Trainer's loader: split_batches, even_batches and
    # use_seedable_sampler are the user's (HfTrainerTarget.accelerator_option)
    "accelerator_config.dispatch_batches": ((None, False), _DISPATCH),
}


@dataclasses.dataclass(frozen=True)
class HfTrainerTarget(ddp_options.TorchDDPFramework):
    """transformers' ``Trainer`` over torch DDP, owning the loop (see the module docstring).

    ``config``: the user's ``TrainingArguments``, as a dict of keyword arguments or the path of
    a JSON file holding one (HF's ``HfArgumentParser.parse_json_file`` format); the keys the
    scenario or ddpcheck sets are refused (:data:`SCENARIO_KEYS`, :data:`HARNESS_KEYS`; the rule
    of ``ddpcheck.targets.configuration``). ``training_args``: its older spelling (not both).
    ``loss_kwargs``: the model's forward takes ``**loss_kwargs``, so the Trainer passes
    ``num_items_in_batch`` (False: the older convention, a mean per micro-batch).
    ``trainer_class``: your own subclass of ``transformers.Trainer`` (its ``compute_loss``, its
    ``training_step``), trained as the Trainer is; None: ``transformers.Trainer``.
    """

    # the oldest release the glue drives (docs/frameworks.md): 4.45.2 to 4.46.2 are checked, and
    # their own bugs (bench/hf_token_weights.py) are verdicts, named by targets.known_bugs; the
    # Trainer needs accelerate, from 1.1.0
    requires = (("transformers", "4.45.2"), ("accelerate", "1.1.0"))

    training_args: Config = None  # the older spelling of ``config``
    loss_kwargs: bool = True
    trainer_class: type | None = None
    config: Config = None

    declined_features: ClassVar[Mapping[str, str]] = {
        "rank-orders": TORCH_DDP_ORDER,
        "checkpoint": f"{OWN_CHECKPOINTS} (the Trainer's checkpoint folders, which this loop "
        "does not drive)",
        "grads-kept": "the Trainer clears gradients with model.zero_grad(), which sets them to "
        "None, after every step",
        "param-dtype": NO_PARAM_DTYPE,
    }

    def __post_init__(self) -> None:
        if self.config is not None and self.training_args is not None:
            raise InvalidArgument(
                "HfTrainerTarget: config= and training_args= are one field "
                "(training_args is its older spelling): give one of them"
            )
        config = self.training_args if self.config is None else self.config
        where = described("HfTrainerTarget", config)
        given = load_config(config, target=where)
        reconcile(
            given,
            target=where,
            scenario_keys=SCENARIO_KEYS,
            harness_keys=HARNESS_KEYS,
            # only a given key needs transformers' field names: the ready-made HF_TRAINER is
            # built wherever ddpcheck.targets is imported (every rank), and transformers costs
            # ~1 s to import
            known=_fields() if given else None,
            known_as="TrainingArguments field",
        )
        object.__setattr__(self, "_given", given)
        if self.trainer_class is not None:
            _check_trainer_class(self.trainer_class)

    def config_space(self) -> ConfigSpace:
        """``TrainingArguments`` keys that change how the Trainer runs DDP but not what it
        computes: counting the input tokens seen (a gather of counts every step), a smaller DDP
        bucket, and over a scenario's epochs dropping the last incomplete batch (declined where
        there is one: ``hf_data_path.DROPS_LAST``), and ``accelerator_config``'s
        ``split_batches`` and ``even_batches=False`` (uneven ranks: declined where their steps
        differ). Not
        ``average_tokens_across_devices=False`` nor ``loss_kwargs=False``: each is documented to
        weigh tokens otherwise (the module docstring), which would fail every run; name them to
        check them. Drawn keys join the user's own ``config`` (or ``training_args``, its older
        spelling, where that is the one given)."""
        # include_num_input_tokens_seen=True raises at W > 1 on 4.46.3 (fixed in 4.47.0:
        # bench/hf_token_weights.py --tokens-seen): kept, transformers' bug to report there.
        # ddp_find_unused_parameters=False: torch DDP's own option (what it cannot train is
        # declined, ddp_options). Not ddp_broadcast_buffers=False: each rank then keeps its own
        # buffers (BatchNorm's running statistics), and replicas differ by torch's design.
        field = "training_args" if self.training_args is not None else "config"
        return options(
            **{
                field: {
                    "include_num_input_tokens_seen": (True,),
                    "dataloader_drop_last": (True,),
                    "ddp_bucket_cap_mb": (1,),
                    "ddp_find_unused_parameters": (False,),
                    # how accelerate prepares the Trainer's loader (scenarios with epochs)
                    "accelerator_config": (
                        {"even_batches": False},
                        {"split_batches": True},
                        {"split_batches": True, "even_batches": False},
                    ),
                }
            }
        )

    def torch_ddp(self) -> dict[str, bool]:
        """The torch DDP options the Trainer passes (``ddp_options``): it looks for unused
        parameters unless ``ddp_find_unused_parameters`` says otherwise (None: it does, for a
        model that is no gradient-checkpointed ``PreTrainedModel``)."""
        find = vars(self)["_given"].get("ddp_find_unused_parameters")
        return {"find_unused_parameters": find is None or bool(find), "static_graph": False}

    def warm_up(self) -> None:
        from transformers import Trainer  # noqa: F401  (seconds in a rank: once per process)

    def supports(self, scenario: Scenario) -> str | None:
        cannot = ddp_options.cannot_run(
            scenario, **self.torch_ddp(), where=" (the config's ddp_find_unused_parameters)"
        )
        if cannot is not None:
            return cannot
        if scenario.reduction != "mean":
            return (
                "reduction='sum': the Trainer normalises the loss to a mean (by "
                "num_items_in_batch, or per micro-batch); a summed objective has no "
                "TrainingArguments"
            )
        if scenario.max_grad_norm is not None and scenario.grad_norm_type != 2.0:
            return (
                f"clipping the {scenario.grad_norm_type}-norm: the Trainer clips the 2-norm "
                "(accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm))"
            )
        if scenario.autocast is torch.float16:
            return (
                "autocast float16: TrainingArguments(fp16=True) runs no autocast on the CPU "
                "(accelerate's native AMP for fp16 needs a GPU) and adds a GradScaler that "
                "may skip steps on a GPU, which the reference does not"
            )
        return epochs_cannot_run(
            scenario, self.drops_last(), self.accelerator_option("even_batches")
        )

    def drops_last(self) -> bool:
        """The user's ``dataloader_drop_last`` (the Trainer's default: False)."""
        return bool(vars(self)["_given"].get("dataloader_drop_last", False))

    def accelerator_option(self, name: str) -> bool:
        """The user's ``accelerator_config`` field ``name`` (a dict's key or an
        ``AcceleratorConfig``'s field), else the Trainer's default: ``split_batches`` False,
        ``even_batches`` True."""
        given, key = vars(self)["_given"], f"accelerator_config.{name}"
        if has(given, key):
            return bool(lookup(given, key))
        return name == "even_batches"

    def model_for(self, net: torch.nn.Module, scenario: Scenario) -> torch.nn.Module:
        """The model the Trainer trains: the scenario's ``net`` as a causal LM."""
        cls = ScenarioCausalLM if self.loss_kwargs else ScenarioCausalLMWithoutLossKwargs
        return cls(net, scenario)

    def supports_at(self, scenario: Scenario, world_size: int) -> str | None:
        """A scenario with epochs whose micro-batch (across the ranks) ``world_size`` does not
        divide -- no ``per_device_train_batch_size`` gives it, and ``split_batches`` refuses
        it -- or, under ``even_batches=False``, whose ranks' epochs end in different numbers of
        optimizer steps (:func:`~ddpcheck.targets.hf_data_path.uneven_steps`)."""
        if scenario.epochs is None:
            return None
        micro = scenario.global_batch // scenario.accumulation
        if micro % world_size:
            return f"a micro-batch of {micro} samples over {world_size} ranks (" + (
                "split_batches needs a batch size that is a round multiple of the number of "
                "processes)"
                if self.accelerator_option("split_batches")
                else "no per_device_train_batch_size gives it)"
            )
        if self.accelerator_option("even_batches") or self.drops_last():
            return None
        # 4.x takes a bool, 5 also "all" / "non_padding" ("no": off)
        counted = vars(self)["_given"].get("include_num_input_tokens_seen") not in (
            None,
            False,
            "no",
        )
        split = self.accelerator_option("split_batches")
        return uneven_steps(scenario, world_size, split, every_batch=counted)

    def fit(self, module: nn.Module, run: FitRun) -> None:
        from transformers import Trainer

        join_existing_group()
        accumulation = max(len(step) for step in run.batches)
        if any(len(step) != accumulation for step in run.batches):
            raise NothingChecked(
                "HfTrainerTarget needs the same number of micro-batches every "
                "step (TrainingArguments(gradient_accumulation_steps=...) is "
                "one number)"
            )
        trainer_cls = _trainer(self.trainer_class or Trainer, _loader(run))
        self._train(module, run, trainer_cls, accumulation, data_path={}, train_dataset=None)

    def fit_epochs(self, module: nn.Module, run: EpochRun) -> None:
        """The Trainer's own data path over the scenario's dataset (the module docstring,
        "Epochs"): ``Trainer(train_dataset=...)`` with ``num_train_epochs``,
        ``per_device_train_batch_size`` (the global micro-batch over W),
        and ``gradient_accumulation_steps`` as the scenario says, your ``dataloader_drop_last``,
        and the Trainer's sequential sampler; its ``get_train_dataloader``, accelerate's sharding
        of that loader, its epoch loop and its accumulation windows decide what each step
        consumes, which ddpcheck's ``training_step`` notes (``run.consumed``)."""
        from transformers import Trainer

        join_existing_group()
        why = self.supports_at(run.scenario, run.world_size) or self.supports(run.scenario)
        if why is not None:  # asked to run what supports and supports_at decline
            raise NothingChecked(f"HfTrainerTarget declines this example: {why}")
        sequential = SAMPLING in (_fields() or set())
        trainer_cls = epoch_trainer(self.trainer_class or Trainer, run, sequential)
        data_path: dict[str, object] = {
            "max_steps": -1,  # the epochs decide
            "num_train_epochs": run.epochs,
            # the global micro-batch, which accelerate splits, or its share of each rank
            "per_device_train_batch_size": run.global_batch
            // run.accumulation
            // (1 if self.accelerator_option("split_batches") else run.world_size),
            "remove_unused_columns": False,  # the items' sample_index, which training_step reads
            **({SAMPLING: "sequential"} if sequential else {}),
        }
        self._train(
            module,
            run,
            trainer_cls,
            run.accumulation,
            data_path=data_path,
            train_dataset=TrainerDataset(run.dataset),
        )

    def _train(
        self,
        module: nn.Module,
        run: FitRun,
        trainer_cls: type,
        accumulation: int,
        *,
        data_path: Mapping[str, object],
        train_dataset: torch.utils.data.Dataset[Item] | None,
    ) -> None:
        """Build the ``TrainingArguments`` (the user's, the scenario's, the harness's, and the
        ``data_path``'s), the optimizer and schedule and the recording callback, and run
        ``trainer_cls(...).train()``."""
        from transformers import TrainerCallback, TrainingArguments

        _check_environment(run.scenario)
        device = next(module.parameters()).device
        # transformers 4.x's TrainingArguments writes its precision into os.environ, where the
        # next example's would take it back (_accelerate_environment_kept)
        with (
            _accelerate_environment_kept(),
            tempfile.TemporaryDirectory(
                prefix="ddpcheck-hf-trainer-", ignore_cleanup_errors=True
            ) as folder,
        ):
            given = vars(self)["_given"]  # set by __post_init__: no field, not in the replay line
            kwargs = arguments(given, run.scenario, run.steps, accumulation, device, folder)
            try:
                args = TrainingArguments(**{**kwargs, **data_path})
            except (TypeError, ValueError) as exc:
                raise InvalidArgument(
                    f"TrainingArguments({_shown(given)}) as ddpcheck "
                    f"completed it raised {type(exc).__name__}: {exc}"
                ) from exc
            optimizer = run.optimizer(run.params, **run.optimizer_kwargs)
            scheduler = (
                torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
                if run.gamma is None
                else torch.optim.lr_scheduler.ExponentialLR(optimizer, run.gamma)
            )
            recorder = _recorder(
                TrainerCallback, run, module, None if run.gamma is None else scheduler
            )
            recorder.trainer = trainer_cls(
                model=self.model_for(module, run.scenario),
                args=args,
                train_dataset=train_dataset,
                optimizers=(optimizer, scheduler),
                callbacks=[recorder],
            )
            recorder.trainer.train()

    def teardown(self, model: nn.Module, optimizer: OptimizerLike) -> None:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    @property
    def reports_loss(self) -> bool:
        return True  # every step's logged loss, through on_log (run.reported)

    #: the Trainer computes each micro-batch's loss through the model (ScenarioCausalLM), not
    #: through run.loss: only the loss it logs is checked
    step_losses_seen = False


def _check_environment(scenario: Scenario) -> None:
    """Refuse a precision the environment imposes on a scenario without autocast:
    ``TrainingArguments`` takes ``ACCELERATE_MIXED_PRECISION`` as its mixed precision unless
    ``bf16``/``fp16`` say otherwise (transformers 4.x also writes it there itself, which
    :func:`_accelerate_environment_kept` undoes). Every rank decides alike, before any
    collective."""
    imposed = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if imposed not in ("", "no") and scenario.autocast is None:
        raise InvalidArgument(
            f"the environment sets ACCELERATE_MIXED_PRECISION={imposed!r}, "
            "which TrainingArguments takes as its mixed precision, against "
            "the scenario's (no autocast): unset it for ddpcheck"
        )


@contextlib.contextmanager
def _accelerate_environment_kept() -> Iterator[None]:
    """The ``ACCELERATE_*`` variables of ``os.environ`` as they were before the block: from
    transformers 4.45 to 4.57, ``TrainingArguments.__post_init__`` writes
    ``ACCELERATE_MIXED_PRECISION`` there (``bf16`` for ``bf16=True``) and the next
    ``TrainingArguments`` reads it back as its own default, so an example under bfloat16 would
    leave its precision to the next example of the persistent rank
    (``bench/hf_mixed_precision_env.py``, no ddpcheck)."""
    before = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")}
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith("ACCELERATE_")]:
            if key not in before:
                del os.environ[key]
        os.environ.update(before)


def _check_trainer_class(cls: object) -> None:
    from transformers import Trainer  # the class given was built on it: imported already

    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise InvalidArgument(
            f"HfTrainerTarget(trainer_class={cls!r}) must be a subclass of "
            "transformers.Trainer (or None for the Trainer itself)"
        )


def _fields() -> set[str] | None:
    """The names ``TrainingArguments`` takes; None when transformers is not installed
    (``Target.requires`` then refuses the target before it runs)."""
    try:
        from transformers import TrainingArguments
    except ImportError:
        return None
    return {f.name for f in dataclasses.fields(TrainingArguments) if f.init}


_AVERAGE_TOKENS = "average_tokens_across_devices"


def _shown(given: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in given.items())


def arguments(
    given: dict,
    scenario: Scenario,
    steps: int,
    accumulation: int,
    device: torch.device,
    folder: str,
) -> dict:
    """The ``TrainingArguments`` keyword arguments of one run: the user's ``given`` ones, and
    what the scenario and ddpcheck's harness set (see the module docstring)."""
    fields = _fields() or set()
    return {
        "output_dir": folder,
        "disable_tqdm": True,
        # transformers 4.x defaults it to False (each rank's own token count), 5 to True
        **({"average_tokens_across_devices": True} if _AVERAGE_TOKENS in fields else {}),
        **given,
        # the scenario's
        "gradient_accumulation_steps": accumulation,
        "max_steps": steps,
        "max_grad_norm": scenario.max_grad_norm or 0.0,
        "bf16": scenario.autocast is torch.bfloat16,
        "fp16": False,
        # the harness's
        "use_cpu": device.type == "cpu",
        "save_strategy": "no",
        "eval_strategy": "no",
        "report_to": "none",
        # every step's loss logged (on_log): the reported loss the oracle compares
        "logging_strategy": "steps",
        "logging_steps": 1,
        "dataloader_pin_memory": False,
    }


class ScenarioCausalLM(torch.nn.Module):
    """The scenario's model as the Trainer trains a causal LM: ``forward(input_ids, labels,
    **loss_kwargs)`` returns ``{"loss": ..., "logits": ...}``; the loss is the sum of the
    micro-batch's terms over ``num_items_in_batch`` when the Trainer passes it, else their mean
    (the module docstring). ``model``: the scenario's module, whose parameters keep their
    objects."""

    def __init__(self, net: torch.nn.Module, scenario: Scenario):
        super().__init__()
        self.model = net
        self.scenario = scenario

    # ``**loss_kwargs`` by that name: transformers 4.46 looks for it (later releases for any
    # ``**``), to pass ``num_items_in_batch``
    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        **loss_kwargs: torch.Tensor | int,
    ) -> dict:
        return self.outputs(input_ids, labels, loss_kwargs.get("num_items_in_batch"))

    def outputs(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None,
        num_items_in_batch: torch.Tensor | int | None,
    ) -> dict:
        logits = self.model(input_ids)
        if labels is None:
            return {"logits": logits}
        with torch.autocast(logits.device.type, enabled=False):  # the loss in >= float32
            summed = objective.summed(self.scenario, logits, labels)
            if num_items_in_batch is None:  # the older convention: this micro-batch's mean
                return {"loss": summed / objective.count(self.scenario, labels), "logits": logits}
            # the Trainer counted label elements: a per-sample term holds one per output
            per_term = 1 if objective.is_token_loss(self.scenario) else math.prod(labels.shape[1:])
            return {"loss": summed * per_term / num_items_in_batch, "logits": logits}


class ScenarioCausalLMWithoutLossKwargs(ScenarioCausalLM):
    """The older convention: a forward without ``**loss_kwargs``, so the Trainer passes no
    ``num_items_in_batch`` and divides the per-micro-batch mean by the accumulation steps."""

    # no **loss_kwargs, on purpose: what the Trainer inspects to choose the older convention
    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict:
        return self.outputs(input_ids, labels, None)


def _loader(run: FitRun) -> list[Batch]:
    """This rank's micro-batches, in order, as the Trainer's batches."""
    return [{"input_ids": x, "labels": y} for step in run.batches for x, y, _ in step]


def _trainer(trainer_cls: type, batches: list[Batch]) -> type:
    """The ``Trainer`` subclass that trains on ``batches`` (classes made here: transformers is
    imported only when the target runs)."""

    class Trainer(trainer_cls):  # type: ignore[misc]  # transformers' Trainer
        def get_train_dataloader(self) -> torch.utils.data.DataLoader[Batch]:
            return torch.utils.data.DataLoader(
                batches,  # type: ignore[arg-type]  # a list
                batch_size=None,
                shuffle=False,
            )

    return Trainer


def _recorder(
    callback_cls: type, run: FitRun, module: nn.Module, scheduler: SchedulerLike | None
) -> TrainerCallback:
    """The callback through which ddpcheck records the Trainer's run (the module docstring)."""

    class Recorder(callback_cls):  # type: ignore[misc]  # transformers' callback
        def __init__(self) -> None:
            self.trainer: Trainer = None  # set once the Trainer is built
            self.kept: list = []

        def on_train_begin(
            self, args: Arguments, state: TrainerState, control: TrainerControl, **kwargs: object
        ) -> None:
            run.started(self.trainer.model_wrapped, self.trainer.optimizer)

        def on_pre_optimizer_step(
            self, args: Arguments, state: TrainerState, control: TrainerControl, **kwargs: object
        ) -> None:
            # clipped, synchronised: what optimizer.step() receives
            self.kept = [
                (p, None if p.grad is None else p.grad.detach().clone())
                for p in module.parameters()
            ]

        def on_step_end(
            self, args: Arguments, state: TrainerState, control: TrainerControl, **kwargs: object
        ) -> None:
            with _gradients_back(self.kept):
                run.record(self.trainer.model_wrapped, self.trainer.optimizer, scheduler)
            self.kept = []

        def on_log(
            self,
            args: Arguments,
            state: TrainerState,
            control: TrainerControl,
            logs: dict | None = None,
            **kwargs: object,
        ) -> None:
            # after on_step_end, on every rank: the step's logged loss ("train_loss" at the end
            # of train() is the run's mean, not a step's)
            if logs is not None and "loss" in logs:  # from the Trainer's float32 tr_loss
                run.reported(logs["loss"], torch.float32)

    return Recorder()


@contextlib.contextmanager
def _gradients_back(kept: list) -> Iterator[None]:
    """The kept gradients in ``.grad`` for the block, then cleared as the Trainer left them."""
    for p, grad in kept:
        p.grad = grad
    try:
        yield
    finally:
        for p, _ in kept:
            p.grad = None
