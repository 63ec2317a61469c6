"""How close a rank must come to the full-batch reference: the one tolerance table.

Replicas are compared bitwise (``ddpcheck._oracle.compare``); a rank against the reference
differs by the rounding of another summation order, which this table bounds per dtype, world size
and step -- far below what real bugs produce (``bench/tolerance.py`` measures the share used).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

__all__ = [
    "NOISE_FACTOR",
    "RESOLUTION",
    "TOLERANCES",
    "Tolerance",
    "close",
    "in_reported_dtype",
    "noise_verdict",
    "scaled_atol",
    "tolerance",
]


# {dtype: (rtol, atol)} for a rank against the full-batch reference, per step of training.
# float64: DDP and the reference differ by ~1e-16 relative (docs/platform.md, "Numerics"), real
# bugs by >= 1e-3; 1e-9 leaves six orders of margin on each side.
# float32: single-step gradients differ by up to ~9e-8 absolute (docs/platform.md), Adam
# amplifies differences where its second moment is near zero; see bench/tolerance.py.
# bfloat16 / float16: the precision policies (Scenario.autocast, Scenario.param_dtype) compute in
# them, and a shard rounds its activations and gradients differently from the full batch by a few
# units in the last place of the policy's dtype (bfloat16: 2^-8 relative); bench/tolerance.py
# --precision measures the share used (docs/language-models.md).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-12),
    torch.float32: (2e-4, 2e-5),
    torch.bfloat16: (2e-2, 1e-3),
    torch.float16: (4e-3, 2e-4),
}


#: The smallest error ddpcheck promises to tell from rounding wherever its tolerance is looser,
#: as a fraction of the largest value of its kind at that step (every gradient, every parameter,
#: every optimizer-state entry under one key): real data-parallel bugs move numbers by >= 1e-3
#: of their scale (docs/platform.md) -- a division by W missing or repeated, a sample or a shard
#: dropped, a shard stepped twice. See :func:`noise_verdict` for where the reference cannot.
RESOLUTION = 1e-3

#: The precision policies' compute dtypes: under them the smallest error ddpcheck can promise to
#: tell from rounding is the policy's own tolerance, not :data:`RESOLUTION` (:class:`Tolerance`).
LOW_PRECISION = (torch.bfloat16, torch.float16)


class Tolerance(tuple[float, float]):
    """``(rtol, atol)`` -- it unpacks as that pair -- and ``resolution``: the smallest error, as a
    fraction of the largest value of its kind at the step, that :func:`noise_verdict` promises
    to tell from the reference's own rounding before it calls an element chaotic.

    :data:`RESOLUTION` in float32 and float64. Under a precision policy (bfloat16 or float16
    compute: ``Scenario.autocast``, ``Scenario.param_dtype``) it is the policy's own ``rtol`` at
    that step and world size: one bfloat16 step of the values a number is computed from is
    2^-8 of them, four times RESOLUTION, so a spread of that size is no evidence that the
    reference cannot pin a number down, only that it was computed from bfloat16 operands. The
    reference's variants measure that spread element by element (``Reference.noise``, the
    ``param_dtype`` copies moved by a fraction of a step), and an element is declined only where
    it exceeds what the policy's tolerance allows the step's largest values."""

    resolution: float

    def __new__(cls, rtol: float, atol: float, resolution: float = RESOLUTION) -> Tolerance:
        made = super().__new__(cls, (rtol, atol))
        made.resolution = resolution
        return made


def tolerance(dtype: torch.dtype, world_size: int, step: int) -> Tolerance:
    """(rtol, atol) after ``step`` (0-based) steps at ``world_size``, and the resolution a spread
    is measured against (:class:`Tolerance`).

    Rounding differences come from summation order, which changes more with more shards, and
    compound over steps; both factors grow slowly so the bound stays far below real bugs.
    """
    rtol, atol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    factor = (1 + math.log2(max(world_size, 1))) * (1 + step)
    resolution = max(RESOLUTION, rtol * factor) if dtype in LOW_PRECISION else RESOLUTION
    return Tolerance(rtol * factor, atol * factor, resolution)


def in_reported_dtype(
    tol: tuple[float, float], compute: torch.dtype, reported: str | None
) -> tuple[float, float]:
    """``tol`` (the step's, for the model's ``compute`` dtype) for a number reported in a coarser
    dtype -- a framework's float32 running loss or logged metric over a float64 model -- as wide
    as that dtype's (:data:`TOLERANCES`), at the same step and world size; else ``tol``."""
    dtype = getattr(torch, reported, None) if reported else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return tol
    if torch.finfo(dtype).eps <= torch.finfo(compute).eps:
        return tol
    (rtol, atol), fallback = tol, TOLERANCES[torch.float32]
    mine, theirs = TOLERANCES.get(compute, fallback), TOLERANCES.get(dtype, fallback)
    return rtol * theirs[0] / mine[0], atol * theirs[1] / mine[1]


def scaled_atol(ref: torch.Tensor, rtol: float, atol: float) -> float:
    """The absolute tolerance for one tensor: ``atol + rtol * max|ref|``.

    Rounding noise on an element that is zero in exact arithmetic (the key bias under softmax,
    say) scales with the magnitudes summed to produce the tensor, not with the element itself;
    a floor tied to the tensor's scale keeps such elements from false alarms, while real bugs
    -- errors comparable to the values -- exceed it by orders of magnitude.
    """
    if ref.numel() == 0 or not ref.is_floating_point():
        return atol
    return atol + rtol * float(ref.detach().abs().nan_to_num(0.0, 0.0, 0.0).max())


def close(got: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> bool:
    """Within ``tolerance`` of ``ref`` (same shape and dtype; integers exactly; NaN where NaN)."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return False
    if not got.is_floating_point():
        return torch.equal(got, ref)
    return bool(
        torch.allclose(got, ref, rtol=rtol, atol=scaled_atol(ref, rtol, atol), equal_nan=True)
    )


def all_close(pairs: Iterable[tuple[object, object]], rtol: float, atol: float) -> bool:
    """True only when :func:`close` holds for every ``(got, ref)`` pair -- floating tensors of one
    shape and dtype each -- in one pass per dtype instead of one per tensor (the comparisons were
    a fifth of a random example's cost in the checking process); False means "look at each".

    Sound because it asks less: ``torch.isclose`` elementwise with ``atol`` itself, which never
    exceeds a tensor's :func:`scaled_atol`, so a pass here is a pass there. NaN/inf where the
    reference is finite are never close, so a pass also means none."""
    groups: dict[torch.dtype, tuple[list, list]] = {}
    for got, ref in pairs:
        if not (
            torch.is_tensor(got)
            and torch.is_tensor(ref)
            and ref.is_floating_point()
            and got.dtype == ref.dtype
            and got.shape == ref.shape
        ):
            return False
        mine, theirs = groups.setdefault(ref.dtype, ([], []))
        mine.append(got.reshape(-1))
        theirs.append(ref.reshape(-1))
    return all(
        bool(
            torch.isclose(
                torch.cat(mine), torch.cat(theirs), rtol=rtol, atol=atol, equal_nan=True
            ).all()
        )
        for mine, theirs in groups.values()
    )


#: How far beyond the tolerance an element may be, in multiples of what the reference itself
#: cannot pin down there (``Reference.noise``: its spread over equally valid ways to compute it).
#: Two rounding realisations can differ by twice either's distance from a third, and the
#: variants may miss the widest one; measured over the soak (docs/figures.md).
NOISE_FACTOR = 4.0


def noise_verdict(
    got: torch.Tensor,
    ref: torch.Tensor,
    rtol: float,
    atol: float,
    spread: torch.Tensor,
    scale: float,
    resolution: float = RESOLUTION,
) -> tuple[str, torch.Tensor]:
    """Where :func:`close` fails, the verdict once each element's allowance is widened by
    ``NOISE_FACTOR * spread`` (the reference's rounding spread there, ``Reference.noise``): where
    the reference is ill-conditioned (Adam on a gradient that is zero in exact arithmetic, a
    gradient through a float32 LayerNorm that barely depends on its input), a correct target's
    rounding differs from it by as much as the reference's own variants do.

    ``scale``: the largest magnitude among the reference's values of this kind at this step. An
    element beyond its tolerance is *chaotic* where the widening exceeds both its tolerance and
    ``resolution`` of ``scale`` (:data:`RESOLUTION`; under a precision policy its own tolerance,
    :class:`Tolerance`): there the reference's own rounding is as large as the bugs
    ddpcheck promises to catch, so none could be told apart, and the element cannot be judged
    (an O(lr) Adam step whose sign is rounding: float32 with the default ``eps``).

    Returns ``("differs", mask)`` when elements that are not chaotic are beyond even their
    widened allowance (``mask``); else ``("chaotic", mask)`` when some are chaotic; else
    ``("close", mask)``, ``mask`` the elements the widening explained."""
    reference = ref.double()
    diff = (got.double() - reference).abs()
    fixed = scaled_atol(ref, rtol, atol) + rtol * reference.abs()
    widening = NOISE_FACTOR * spread.double()
    beyond = ~(diff <= fixed) & ~(got.isnan() & ref.isnan())  # NaN against a number is beyond
    chaotic = beyond & (widening > torch.clamp(fixed, min=resolution * scale))
    differs = beyond & ~(diff <= fixed + widening) & ~chaotic
    if bool(differs.any()):
        return "differs", differs
    if bool(chaotic.any()):
        return "chaotic", chaotic
    return "close", beyond
