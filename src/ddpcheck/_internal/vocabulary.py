"""The names of the capability vocabulary, and their parsing (``ddpcheck.features`` uses them).

Apart from ``ddpcheck.features`` because the pytest plugin and the command line parse feature
names before anything imports torch.
"""

from __future__ import annotations

from typing import Iterable

from ddpcheck._internal.validation import InvalidArgument

__all__ = ["FEATURES", "parse"]


#: Every feature a scenario can exercise, with what it means (the order of reports).
FEATURES: dict[str, str] = {
    "float64": "float64 scenarios",
    "float32": "float32 scenarios (calibrated tolerance)",
    "accumulation": "several micro-batches per step, all but the last under no_sync()",
    "unused-on-some-ranks": "a trainable parameter with a gradient on some ranks but None on "
                            "others (its layer is used by some samples only)",
    "unused-everywhere": "a trainable parameter no rank uses in a step (its grad stays None)",
    "frozen": "parameters with requires_grad=False",
    "tied": "one parameter used twice in a step (tied or reused weights)",
    "buffers": "buffers, which must start as rank 0's",
    "mixed-dtypes": "float32 and float64 parameters in one model",
    "non-contiguous": "a parameter created non-contiguous (a transposed view)",
    "param-groups": "several param groups with their own hyperparameters",
    "lr-schedule": "an LR schedule stepped after every optimizer step",
    "clipping": "the synchronised gradients clipped to a global norm before every step "
                "(max_grad_norm, grad_norm_type)",
    "uneven-batches": "a global batch not divisible by W (some ranks get fewer, or no, samples)",
    "broadcast": "ranks initialised differently: the target must broadcast rank 0's state",
    "grads-kept": "zero_grad(set_to_none=False): gradients kept (zeroed) between steps",
    "rank-orders": "each rank registers parameters and buffers in its own order (same names and "
                   "shapes)",
    "checkpoint": "a checkpoint saved after a step and the run resumed from it, possibly at "
                  "another world size (save_checkpoint / load_checkpoint)",
}


def parse(text: str | Iterable[str], flag: str = "--without") -> frozenset[str]:
    """``"accumulation,buffers"`` (or an iterable of names) -> a validated set of features."""
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text)]
    names = [n for n in names if n]
    unknown = [n for n in names if n not in FEATURES]
    if unknown:
        raise InvalidArgument(f"{flag}: {', '.join(map(repr, unknown))} "
                              f"{'is not a feature' if len(unknown) == 1 else 'are not features'};"
                              f" known: {', '.join(FEATURES)}")
    return frozenset(names)
