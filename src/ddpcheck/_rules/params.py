"""Parameter lists a sharding rule is called with: fixed ones, and a Hypothesis strategy.

Invariant: every list is plain data (:class:`ParamSpec`: a dtype and a shape) that builds the same
tensors in any process -- large ones on the meta device, so a 250,000 x 8,192 embedding costs no
memory -- and describes itself in one line for messages (:func:`describe`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from hypothesis import strategies as st

__all__ = [
    "DTYPES",
    "MAX_PARAMS",
    "ParamSpec",
    "balance",
    "describe",
    "gpt_like",
    "param_lists_strategy",
    "parameter_lists",
]

#: Dtypes of the drawn parameters.
DTYPES = ("float32", "float64", "bfloat16", "float16")
#: Parameters per drawn list, at most.
MAX_PARAMS = 300
#: Parameters with more elements than this are built on the meta device (no memory).
META_ABOVE = 4096

_ELEMENT_SIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter a rule is called with: its dtype and shape. Large ones live on the meta
    device, so a 250,000 x 8,192 embedding costs no memory."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _ELEMENT_SIZE[self.dtype]

    @property
    def meta(self) -> bool:
        return self.numel > META_ABOVE

    def tensor(self) -> torch.Tensor:
        return torch.zeros(
            self.shape, dtype=getattr(torch, self.dtype), device="meta" if self.meta else "cpu"
        )

    def describe(self) -> str:
        return f"{self.dtype} {self.shape}{' meta' if self.meta else ''}"


def gpt_like(
    layers: int = 12, width: int = 768, vocab: int = 50257, context: int = 1024
) -> list[ParamSpec]:
    """GPT-2-small-shaped float32 parameters, in registration order."""
    shapes: list[tuple[int, ...]] = [(vocab, width), (context, width)]
    for _ in range(layers):
        shapes += [
            (width,),
            (width,),
            (width, 3 * width),
            (3 * width,),
            (width, width),
            (width,),
            (width,),
            (width,),
            (width, 4 * width),
            (4 * width,),
            (4 * width, width),
            (width,),
        ]
    shapes += [(width,), (width,)]
    return [ParamSpec("float32", s) for s in shapes]


def parameter_lists() -> dict[str, list[ParamSpec]]:
    """Fixed named parameter lists checked after the drawn ones: tiny, mixed-dtype, GPT-shaped."""
    f32, f64 = "float32", "float64"
    return {
        "tiny": [ParamSpec(f32, (4,))],
        "mlp": [
            ParamSpec(f32, (8, 5)),
            ParamSpec(f32, (8,)),
            ParamSpec(f32, (3, 8)),
            ParamSpec(f32, (3,)),
        ],
        "mixed dtypes": [ParamSpec(f64, (6, 5)), ParamSpec(f64, (6,)), ParamSpec(f32, (3, 6))],
        "equal sizes": [ParamSpec(f32, (7,)) for _ in range(5)],
        "gpt-like": gpt_like(),
    }


def describe(specs: Sequence[ParamSpec], name: str | None = None, limit: int = 10) -> str:
    """``2 parameters [float32 (4,), float64 (3, 4)]``; runs of three or more equal parameters
    are counted (``[120 x float32 (1,)]``), long lists end with ``... N more``."""
    runs: list[list] = []
    for spec in specs:
        if runs and runs[-1][1] == spec:
            runs[-1][0] += 1
        else:
            runs.append([1, spec])
    items = [
        f"{n} x {spec.describe()}" if n > 2 else ", ".join([spec.describe()] * n)
        for n, spec in runs[:limit]
    ]
    if len(runs) > limit:
        items.append(f"... {sum(n for n, _ in runs[limit:])} more")
    count = f"{len(specs)} parameter{'' if len(specs) == 1 else 's'}"
    return f"{name + ' (' + count + ')' if name else count} [{', '.join(items)}]"


def param_lists_strategy() -> st.SearchStrategy[tuple[ParamSpec, ...]]:
    """Hypothesis strategy for parameter lists shaped like real models'.

    Small lists are drawn often (a third of the lengths are 1..3, a third 1..16); half the lists
    repeat a block of shapes like a stack of layers, after an optional embedding; half mix
    dtypes parameter by parameter. Everything shrinks towards one ``float32 (1,)``.
    """
    dtype = st.sampled_from(DTYPES)
    dim = st.one_of(st.integers(1, 64), st.integers(1, 4096))
    vector = st.tuples(dim)
    matrix = st.tuples(dim, dim)
    conv = st.builds(
        lambda o, i, k: (o, i, k, k),
        st.integers(1, 512),
        st.integers(1, 512),
        st.sampled_from((1, 3, 5, 7)),
    )
    embedding = st.tuples(st.integers(1000, 262144), st.integers(64, 8192))
    shape = st.one_of(vector, matrix, vector, matrix, conv, embedding, st.just(()), st.just((0,)))
    param = st.builds(ParamSpec, dtype, shape)

    @st.composite
    def lists(draw: st.DrawFn) -> tuple[ParamSpec, ...]:
        n = draw(st.one_of(st.integers(1, 3), st.integers(1, 16), st.integers(1, MAX_PARAMS)))
        if draw(st.booleans()):  # layers: [embedding] + block * k, cut to n
            head = draw(st.lists(st.builds(ParamSpec, dtype, embedding), max_size=1))
            block = draw(st.lists(param, min_size=1, max_size=6))
            specs = (head + block * n)[:n]
        else:
            specs = draw(st.lists(param, min_size=n, max_size=n))
        if not draw(st.booleans()):  # one dtype for the whole list
            base = draw(dtype)
            specs = [ParamSpec(base, s.shape) for s in specs]
        return tuple(specs)

    return lists()


def balance(owners: Sequence[int], params: Sequence[ParamSpec], world_size: int) -> float:
    """Bytes of the most loaded rank over the ideal share (1.0 is perfect), for owners a rule
    returned (the rule itself is not called here)."""
    loads = [0] * world_size
    for p, owner in zip(params, owners):
        loads[int(owner)] += p.nbytes
    total = sum(loads)
    return max(loads) * world_size / total if total else 1.0
