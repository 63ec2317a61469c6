"""How scenario problems are named in messages: values, exceptions and the model's modules.

Kept apart from ``ddpcheck._oracle.judgeable`` so the checks there read as checks. Every
function returns one short line (long reprs are cut), so a refusal message stays one readable
sentence.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from ddpcheck._language.scenario import Scenario, _code

__all__ = [
    "MODULE_KINDS",
    "active_modules",
    "brief",
    "code_name",
    "describe_value",
    "exception_text",
    "is_active",
    "kind_of",
    "needs_arguments",
    "scenario_line",
    "short_name",
]


def needs_arguments(function: Callable[..., object], *args: object) -> bool:
    """True when ``function(*args)`` does not even bind to its signature."""
    try:
        inspect.signature(function).bind(*args)
    except TypeError:
        return True
    except ValueError:  # no signature to read
        return False
    return False


def code_name(value: object) -> str:
    try:
        return _code(value)
    except Exception:
        return brief(value)


def short_name(value: object) -> str:
    return getattr(value, "__qualname__", None) or type(value).__qualname__


def brief(value: object) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else text[:77] + "..."


def describe_value(value: object) -> str:
    if isinstance(value, (tuple, list)):
        kinds = ", ".join(kind_of(v) for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"a {type(value).__name__} of {len(value)} ({kinds})"
    if isinstance(value, dict):
        keys = ", ".join(repr(k) for k in list(value)[:4]) + (", ..." if len(value) > 4 else "")
        return f"a dict with keys {keys}"
    return kind_of(value)


def kind_of(value: object) -> str:
    if torch.is_tensor(value):
        return f"tensor{tuple(value.shape)}"
    return type(value).__name__


def exception_text(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


MODULE_KINDS: dict[str, tuple[type[nn.Module], str]] = {
    "batchnorm": (nn.modules.batchnorm._BatchNorm, "using batch statistics"),
    "dropout": (nn.modules.dropout._DropoutNd, "with p > 0 in train mode"),
}


def is_active(module: nn.Module) -> bool:
    if isinstance(module, nn.modules.batchnorm._BatchNorm):  # eval mode without running stats
        return module.training or not module.track_running_stats  # uses batch statistics too
    return module.training and getattr(module, "p", 0) > 0


def active_modules(model: nn.Module, kind: str, hint: bool = False) -> str:
    """`` (found: bn (BatchNorm1d), ...)`` for the model's modules of ``kind`` that are active."""
    cls, how = MODULE_KINDS[kind]
    found = [
        f"{n or 'the model'} ({type(m).__name__})"
        for n, m in model.named_modules()
        if isinstance(m, cls) and is_active(m)
    ]
    if not found:
        return ""
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    text = f"{', '.join(found[:3])}{more} {how}"
    if hint and kind == "batchnorm":
        return (
            f" (the model has {text}: batch statistics depend on the batch, so the oracle "
            "cannot judge it; use eval mode, GroupNorm/LayerNorm, or SyncBatchNorm in your own "
            "test)"
        )
    return f" (found: {text})"


def scenario_line(scenario: Scenario) -> str:
    """A one-line summary of a (usually shrunk) scenario for tables, such as
    ``linear(unused)+buffer SGD B=3 steps=1 acc=2``."""
    shape, opt = _shape(scenario.model), scenario.optimizer.__name__
    return f"{shape} {opt} {' '.join(_settings(scenario))}"


def _shape(model: object) -> str:
    """How :func:`scenario_line` names a model: its layers and what is unusual about each, a
    language model's blocks, or its class's name."""
    layers = getattr(model, "layers", None)
    blocks = getattr(model, "blocks", None)
    if layers is None and isinstance(blocks, tuple):  # a sharded model (ShardedSpec): its blocks
        shape = "+".join(
            [
                "emb" if getattr(model, "embedding", False) else "inp",  # token ids in
                *(
                    b.kind
                    + ("" if b.kind.endswith("norm") else str(b.size))
                    + (f"/{kv}" if (kv := getattr(b, "kv_heads", None)) else "")  # kv heads
                    + ("qk" if getattr(b, "qk_norm", False) else "")  # q/k norms
                    for b in blocks
                ),
                ("vocab" if getattr(model, "tokens", False) else "head")  # a token head's logits
                + ("(tied)" if getattr(model, "tied", False) else ""),
            ]
        )
    elif layers is None:
        shape = getattr(model, "__qualname__", type(model).__name__)
    elif isinstance(layers, int):  # a language model's config (zoo.GPTConfig): its blocks
        shape = f"gpt({layers} block{'' if layers == 1 else 's'}" + (
            ", tied)" if getattr(model, "tied", False) else ")"
        )
    else:
        shape = (
            "+".join(
                layer.kind
                + (
                    "("
                    + ",".join(
                        f
                        for f, on in (
                            (
                                "sample" if layer.use == "sample" else "unused",
                                layer.use != "always",
                            ),
                            ("frozen", layer.frozen),
                            ("f32", layer.float32),
                        )
                        if on
                    )
                    + ")"
                    if layer.use != "always" or layer.frozen or layer.float32
                    else ""
                )
                for layer in layers
            )
            or "head"
        )
    return shape


def _epochs(scenario: Scenario) -> list[str]:
    """``N=10``, ``epochs=2`` when more than one, ``eval=7`` with an evaluation set (and
    ``eval_batch=2`` with its own batch): a scenario's dataset, if it has one."""
    if scenario.epochs is None:
        return []
    many = scenario.epochs.epochs > 1
    evaluation = scenario.epochs.evaluation
    return (
        [f"N={scenario.epochs.samples}"]
        + ([f"epochs={scenario.epochs.epochs}"] if many else [])
        + ([] if evaluation is None else [f"eval={evaluation}"])
        + ([] if (b := scenario.epochs.evaluation_batch) is None else [f"eval_batch={b}"])
    )


#: How :func:`scenario_line` abbreviates a tensor-parallel plan's styles.
_STYLE_ABBREVIATIONS = {
    "colwise": "col",
    "colwise-dtensor": "col(dt)",
    "colwise-replicate": "col(rep)",
    "rowwise": "row",
    "rowwise-replicate": "row(rep)",
    "sequence": "seq",
    "sequence-in": "seq(in)",
    "sequence-out": "seq(out)",
    "sequence-in-out": "seq(in,out)",
    "rowwise-sequence": "row(seq)",
    "colwise-sequence": "col(seq)",
    "vocab": "vocab",
    "vocab-sequence": "vocab(seq)",
    "colwise-loss": "col(loss)",
    "colwise-sequence-loss": "col(seq,loss)",
    "heads-norm": "heads",
}


def _settings(scenario: Scenario) -> list[str]:
    """The batch, the steps and every setting :func:`scenario_line` shows that is not the
    default, in its order."""
    extra = [f"B={scenario.global_batch}", f"steps={scenario.steps}", *_epochs(scenario)]
    if scenario.accumulation > 1:
        extra.append(f"acc={scenario.accumulation}")
    if scenario.param_groups is not None:
        extra.append("2 groups")
    if scenario.lr_decay is not None:
        extra.append("lr decay")
    if scenario.dtype != "float64":
        extra.append(scenario.dtype)
    for policy in ("autocast", "param_dtype"):
        dtype = getattr(scenario, policy, None)
        if dtype is not None:
            extra.append(f"{policy}={str(dtype).replace('torch.', '')}")
    if scenario.reduction != "mean":
        extra.append(scenario.reduction)
    if not scenario.set_to_none:
        extra.append("grads kept")
    if getattr(scenario, "max_grad_norm", None) is not None:
        kind = "" if scenario.grad_norm_type == 2.0 else f" {scenario.grad_norm_type:g}-norm"
        extra.append(f"clip={scenario.max_grad_norm:g}{kind}")
    if getattr(scenario, "checkpoint_after", None) is not None:
        at = scenario.resume_world_size
        extra.append(f"ckpt@{scenario.checkpoint_after}" + ("" if at is None else f"->W={at}"))
    return extra + _mesh_settings(scenario)


def _mesh_settings(scenario: Scenario) -> list[str]:
    """A scenario's mesh as :func:`scenario_line` shows it: the tensor-parallel degree and the
    modules its plan shards, or the pipeline's degree, schedule, stages and pieces."""
    extra: list[str] = []
    parallel = getattr(scenario, "tensor_parallel", None)
    if parallel is not None:  # the degree (W: the whole world) and the modules the plan shards
        sharded = ",".join(
            f"{name.removeprefix('blocks.')}:{_STYLE_ABBREVIATIONS.get(style, style)}"
            for name, style in parallel.plan
        )
        extra.append(f"tp={'W' if parallel.tp is None else parallel.tp} [{sharded}]")
    pipeline = getattr(scenario, "pipeline", None)
    if pipeline is not None:  # the degree, the schedule, its stages and each micro-batch's pieces
        degree = "W" if pipeline.pp is None else pipeline.pp
        extra.append(
            f"pp={degree} {pipeline.schedule} stages={pipeline.stages} "
            f"pieces={pipeline.microbatches}"
        )
    return extra
