"""One row of the oracle's verdict: how a tensor a rank holds is judged against another -- rank
0's, bit for bit, or the reference's within a tolerance widened by the reference's own rounding
spread -- and how the difference is said (:class:`~ddpcheck._base.errors.Divergence`: the
element, both values, their ratio to the tolerance; NaN/inf as :data:`NON_FINITE`; a reference
that cannot pin the element down as :data:`CHAOTIC`). ``compare`` walks the records and asks here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch

from ddpcheck._base.errors import Divergence
from ddpcheck._oracle.tolerances import (
    NOISE_FACTOR,
    RESOLUTION,
    close,
    noise_verdict,
    scaled_atol,
)

__all__ = [
    "CHAOTIC",
    "NON_FINITE",
    "At",
    "Largest",
    "Named",
    "bitwise_equal",
    "brief",
    "chaotic_row",
    "count_of",
    "non_finite",
    "reference_row",
    "replica_row",
    "scalar_row",
    "when",
]


#: The kind of a divergence about NaN/inf: the target's fault when a rank holds them where the
#: reference is finite, not the target's fault (``target_fault=False``) when the reference holds
#: them itself.
NON_FINITE = "non-finite values"


#: The kind of a row that says the reference cannot pin an element down (``target_fault=False``):
#: its own rounding spread there is as large as the bugs ddpcheck promises to catch
#: (``tolerances.noise_verdict``), so nothing from that step on is judged.
CHAOTIC = "reference chaotic"


#: What ``Reference.noise`` varies, as the details say it.
_VARIANTS = (
    "over other summation orders, losses scaled by W and divided back, "
    "rounding-level perturbations of the gradients, and under param_dtype float32 masters "
    "started from their low-precision copies or those copies moved by a fraction of a step"
)


@dataclasses.dataclass(frozen=True)
class At:
    """Where a row stands: the step (``"init"`` before the first), the world size, the rank."""

    step: int | str
    world_size: int
    rank: int


@dataclasses.dataclass(frozen=True)
class Named:
    """How a row names a tensor: ``name`` in its name column, ``what`` in its details (``"optimizer
    state 'exp_avg' of w"``), ``label`` in a :data:`NON_FINITE` or :data:`CHAOTIC` row's name
    column (a gradient's is ``NAME.grad``, since those kinds do not say which tensor it is)."""

    name: str
    what: str
    label: str


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, same dtype and the same bits in every element: NaN payloads and the sign of
    zero included (``torch.equal`` calls NaN unequal to itself and -0.0 equal to 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(_bits(a), _bits(b))


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits as integers of the same width (complex: per real and imaginary part);
    integer and bool tensors as they are."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():
        same_width = _INT_OF_WIDTH.get(t.element_size())
        if same_width is not None:
            return t.view(same_width)
    return t


def non_finite(t: object) -> torch.Tensor | None:
    """The mask of ``t``'s NaN/inf elements, or None when it has none (or is not a float)."""
    if not torch.is_tensor(t) or not (t.is_floating_point() or t.is_complex()):
        return None
    mask = ~torch.isfinite(t)
    return mask if bool(mask.any()) else None


def when(step: int | str) -> str:
    return "at initialisation" if step == "init" else f"at step {step}"


def count_of(mask: torch.Tensor) -> str:
    return f"{int(mask.sum())} of {mask.numel()} elements"


def reference_row(
    at: At,
    named: Named,
    kind: str,
    got: object,
    ref: object,
    tol: tuple[float, float],
    noise: Callable[[], tuple[torch.Tensor | None, float]] | None = None,
) -> Divergence | None:
    """One rank's tensor against the reference's: None when it matches within tolerance, or
    within the reference's own rounding spread there (``noise()``: ``(spread, scale)``, asked
    only when the tolerance alone is exceeded -- the spread a tensor or None, ``Reference.noise``;
    the scale the largest magnitude of the reference's tensors of this kind at this step, what
    ``tolerances.noise_verdict`` measures a bug against).

    ``tol``: ``(rtol, atol)``."""
    step, world_size, rank = at.step, at.world_size, at.rank
    name, what, label = named.name, named.what, named.label
    rtol, atol = tol
    if not torch.is_tensor(ref) or not torch.is_tensor(got) or got.shape != ref.shape:
        return Divergence(
            step,
            world_size,
            rank,
            name,
            kind,
            detail=f"{brief(got)} on rank {rank}, {brief(ref)} in the reference",
        )
    mask = non_finite(got)
    if mask is not None:
        mask = mask & torch.isfinite(ref)
        if bool(mask.any()):
            return Divergence(
                step,
                world_size,
                rank,
                label,
                NON_FINITE,
                detail=f"rank {rank} has NaN/inf in {what} {when(step)} where the "
                f"reference is finite ({count_of(mask)})",
            )
    if close(got, ref, rtol, atol):
        return None
    if got.dtype != ref.dtype:
        return Divergence(
            step,
            world_size,
            rank,
            name,
            kind,
            detail=f"{brief(got)} on rank {rank}, {brief(ref)} in the reference",
        )
    spread, scale = noise() if noise is not None else (None, 0.0)
    if spread is not None and spread.shape == ref.shape:
        resolution = getattr(tol, "resolution", RESOLUTION)
        verdict, where = noise_verdict(got, ref, rtol, atol, spread, scale, resolution)
        if verdict == "close":
            return None
        if verdict == "chaotic":
            return chaotic_row(at, named, got, ref, tol, (spread, where, scale))
    else:
        spread, where = None, None
    row = Divergence.of(
        step,
        world_size,
        rank,
        name,
        kind,
        got,
        ref,
        ("rank", rank),
        ("reference", None),
        rtol,
        scaled_atol(ref, rtol, atol),
    )
    if spread is not None:
        row = dataclasses.replace(
            row,
            detail=f"{row.detail}\n(the reference's own rounding "
            f"{_VARIANTS} is at most "
            f"{float(spread[where].max()):.3g} where it differs; "
            f"the tolerance allows {NOISE_FACTOR:g}x that on "
            "top)",
        )
    return row


def scalar_row(
    at: tuple[int, int],
    world_size: int,
    rank: int | None,
    named: Named,
    kind: str,
    got: float,
    expected: float,
    tol: tuple[float, float],
    noise: Callable[[], float | None],
) -> Divergence | None:
    """A number the ranks computed or reported -- a loss, a metric -- against the reference's
    ``expected``, judged as any tensor is (:func:`reference_row`), in float64: each was computed
    in the model's dtype and summed exactly since. ``rank``: whose number it is (None: the
    ranks' together); ``at``: ``(step, earlier steps)``, the step of these records and the steps
    of the whole run before them; ``noise()``: the reference's own spread of the number over its
    variants (None: unknown), asked only when the tolerance alone is exceeded."""
    step, earlier = at

    def spread() -> tuple[torch.Tensor | None, float]:
        found = noise()
        if found is None:
            return None, 0.0
        return torch.tensor(found, dtype=torch.float64), abs(expected)

    row = reference_row(
        At(step, world_size, 0 if rank is None else rank),
        named,
        kind,
        torch.tensor(got, dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        tol,
        spread,
    )
    if row is None:
        return None
    row = dataclasses.replace(row, rank=rank)
    if row.kind != kind:
        return row  # a NaN/inf or chaotic row, which says its own
    scale = max(abs(expected), 1e-300)
    ratio = f" ({got / expected:.4g}x)" if abs(expected) > 1e-12 else ""
    return dataclasses.replace(
        row,
        max_abs=abs(got - expected),
        max_rel=abs(got - expected) / scale,
        detail=f"{named.what}: {got:.9g}, the reference's {expected:.9g}{ratio} at "
        f"step {earlier + step}, W={world_size}",
    )


def chaotic_row(
    at: At,
    named: Named,
    got: torch.Tensor,
    ref: torch.Tensor,
    tol: tuple[float, float],
    noise: tuple[torch.Tensor, torch.Tensor, float],
) -> Divergence:
    """The row (not the target's fault) for elements the reference cannot pin down; ``noise``:
    the reference's spread, where it is chaotic, and the scale a bug is measured against."""
    step, world_size, rank, label, what = at.step, at.world_size, at.rank, named.label, named.what
    (rtol, atol), (spread, where, scale) = tol, noise
    resolution = getattr(tol, "resolution", RESOLUTION)
    diff = (got.double() - ref.double()).abs()[where]
    allowed = scaled_atol(ref, rtol, atol) + rtol * ref.double().abs()[where]
    return Divergence(
        step,
        world_size,
        rank,
        label,
        CHAOTIC,
        float(diff.max()),
        None,
        target_fault=False,
        detail=f"the reference's own rounding ({_VARIANTS}) moves {what} {when(step)} by up "
        f"to {float(spread[where].max()):.3g} ({count_of(where)}); rank {rank} differs by "
        f"{float(diff.max()):.3g}. {NOISE_FACTOR:g}x that spread exceeds both the "
        f"tolerance there ({float(allowed.max()):.3g}) and {resolution:.3g} of the largest "
        f"value of its kind at this step ({resolution * scale:.3g}): no bug of the size "
        "ddpcheck promises to catch could be told apart from rounding there (not the "
        "target's fault)",
    )


def replica_row(
    at: At, name: str, kind: str, value: torch.Tensor, other: torch.Tensor
) -> Divergence:
    """Why rank ``at.rank``'s ``other`` is not bitwise rank 0's ``value``."""
    step, world_size, rank = at.step, at.world_size, at.rank
    if other.shape != value.shape or other.dtype != value.dtype:
        return Divergence(
            step,
            world_size,
            rank,
            name,
            kind,
            detail=f"{brief(other)} on rank {rank}, {brief(value)} on rank 0",
        )
    if value.is_floating_point() or value.is_complex():
        same_number = (value == other) | (value.isnan() & other.isnan())
        if bool(same_number.all()):
            differ = _bits(value) != _bits(other)
            return Divergence(
                step,
                world_size,
                rank,
                name,
                kind,
                detail=f"rank {rank} vs rank 0: equal as numbers, but "
                f"{count_of(differ)} differ in their bits (a NaN payload or "
                "the sign of a zero); replicas must be bitwise copies",
            )
    return Divergence.of(
        step, world_size, rank, name, kind, other, value, ("rank", rank), ("rank", 0)
    )


class Largest:
    """The largest finite magnitude among some tensors (others ignored), computed on the first
    call: what a bug is measured against where the reference's rounding spread is wide."""

    def __init__(self, values: Iterable[object]):
        self._values = values
        self._found: float | None = None

    def __call__(self) -> float:
        if self._found is None:
            self._found = max(
                (
                    float(v.detach().abs().nan_to_num(0.0, 0.0, 0.0).max())
                    for v in self._values
                    if torch.is_tensor(v) and v.is_floating_point() and v.numel()
                ),
                default=0.0,
            )
        return self._found


def brief(value: object) -> str:
    if torch.is_tensor(value):
        return f"tensor{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    return repr(value)
