"""``ddpcheck fuzz-rule``: a sharding rule's invariants, equivalence under it, and its balance.

Invariant: :func:`rule_violations` returns no violation exactly when, for every parameter list
of :func:`parameter_lists` and every world size in 1..8 (many of them larger than the list),
``rule(params, W)`` returns one integer owner in ``[0, W)`` per parameter, returns the same answer
when called again, and returns the same answer on every rank of real worlds of 2..4 processes.
Each kind of violation has its own message (see :data:`KINDS`), naming the rule, the world size
and the parameter list it failed on.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, Sequence

import torch

__all__ = ["KINDS", "Violation", "balance", "gpt_like", "parameter_lists", "rule_violations"]

#: Violation kinds, in the order they are checked.
KINDS = ("raised", "wrong length", "not an integer", "out of range", "nondeterministic",
         "rank-dependent")
#: World sizes of the pure checks; several exceed the length of several lists.
WORLD_SIZES = tuple(range(1, 9))
#: World sizes of the cross-rank check (real processes).
RANK_WORLD_SIZES = (2, 3, 4)


@dataclasses.dataclass(frozen=True)
class Violation:
    kind: str  # one of KINDS
    message: str


def gpt_like(layers: int = 12, width: int = 768, vocab: int = 50257, context: int = 1024
             ) -> list[torch.Tensor]:
    """GPT-2-small-shaped parameters, in registration order, on the meta device (no memory)."""
    shapes = [(vocab, width), (context, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (width, 3 * width), (3 * width,), (width, width), (width,),
                   (width,), (width,), (width, 4 * width), (4 * width,), (4 * width, width),
                   (width,)]
    shapes += [(width,), (width,)]
    return [torch.empty(s, device="meta") for s in shapes]


def parameter_lists() -> dict[str, list[torch.Tensor]]:
    """Named parameter lists a rule must handle: tiny, mixed-dtype, and GPT-shaped."""
    return {
        "one parameter": [torch.zeros(4)],
        "mlp (4 parameters)": [torch.zeros(8, 5), torch.zeros(8), torch.zeros(3, 8),
                               torch.zeros(3)],
        "mixed dtypes (3 parameters)": [torch.zeros(6, 5, dtype=torch.float64),
                                        torch.zeros(6, dtype=torch.float64), torch.zeros(3, 6)],
        "equal sizes (5 parameters)": [torch.zeros(7) for _ in range(5)],
        "gpt-like (148 parameters)": gpt_like(),
    }


def _name(rule: Any) -> str:
    from parallel.sharding import rule_name

    return rule_name(rule)


def _shape_check(rule: Any, answer: Any, params: Sequence[torch.Tensor], world_size: int,
                 what: str) -> Violation | None:
    where = f"{_name(rule)} on {what} at world_size={world_size}"
    if isinstance(answer, torch.Tensor):
        answer = answer.tolist()
    if isinstance(answer, (str, bytes, dict)) or not hasattr(answer, "__len__"):
        return Violation("wrong length", f"wrong length: {where} returned {answer!r}, not a "
                                         "sequence; a rule returns one owner rank per parameter")
    if len(answer) != len(params):
        return Violation("wrong length",
                         f"wrong length: {where} returned {len(answer)} owners for {len(params)} "
                         "parameters; a rule returns exactly one owner rank per parameter, in order")
    for i, owner in enumerate(answer):
        if isinstance(owner, bool) or not isinstance(owner, numbers.Integral):
            return Violation("not an integer",
                             f"not an integer: {where} returned owner {owner!r} (type "
                             f"{type(owner).__name__}) for parameter {i}; owners are int ranks")
        if not 0 <= owner < world_size:
            return Violation("out of range",
                             f"out of range: {where} returned owner {owner!r} for parameter {i}; "
                             f"owners must be in [0, world_size={world_size})")
    return None


def _answers(rule: Any, world_size: int) -> dict[str, list[int] | str]:
    """Every list's answer at ``world_size`` (an exception becomes its text)."""
    out: dict[str, list[int] | str] = {}
    for what, params in parameter_lists().items():
        try:
            answer = rule(params, world_size)
            out[what] = [int(o) for o in (answer.tolist() if isinstance(answer, torch.Tensor)
                                          else answer)]
        except Exception as exc:  # reported as a violation by the caller
            out[what] = f"{type(exc).__name__}: {exc}"
    return out


def _answers_in_rank(rule: Any) -> dict[str, list[int] | str]:
    """Inside a rank process: this rank's answers at the world's size."""
    import torch.distributed as dist

    return _answers(rule, dist.get_world_size())


def rule_violations(rule: Callable[..., Any], *, rank_world_sizes: Sequence[int] = RANK_WORLD_SIZES,
                    deadline: float = 60.0) -> list[Violation]:
    """Every invariant ``rule`` breaks (empty: none). The cross-rank check spawns (or reuses)
    worlds of ``rank_world_sizes`` processes; the rule travels to them by pickle, so it must be
    defined at module level of an importable module."""
    found: list[Violation] = []
    lists = parameter_lists()
    for world_size in WORLD_SIZES:
        for what, params in lists.items():
            try:
                first = rule(params, world_size)
            except Exception as exc:
                found.append(Violation("raised", f"raised: {_name(rule)} on {what} at world_size="
                                                 f"{world_size} raised {type(exc).__name__}: {exc}"))
                continue
            bad = _shape_check(rule, first, params, world_size, what)
            if bad is not None:
                found.append(bad)
                continue
            again = rule(params, world_size)
            if list(map(int, _as_list(again))) != list(map(int, _as_list(first))):
                found.append(Violation(
                    "nondeterministic",
                    f"nondeterministic: {_name(rule)} on {what} at world_size={world_size} "
                    f"answered {_brief(first)} and then {_brief(again)}; a rule must be a pure "
                    "function of the parameters' shapes, dtypes and order and of world_size"))
        if found:
            return _first_per_kind(found)
    from ddpcheck._internal.world import get_world

    for world_size in rank_world_sizes:
        answers = get_world(world_size).run(_answers_in_rank, rule, deadline=deadline,
                                            what=f"fuzz-rule {_name(rule)}")
        for rank, theirs in enumerate(answers[1:], 1):
            for what, answer in answers[0].items():
                if theirs[what] != answer:
                    found.append(Violation(
                        "rank-dependent",
                        f"rank-dependent: {_name(rule)} on {what} in a world of {world_size} "
                        f"answered {_brief(answer)} on rank 0 but {_brief(theirs[what])} on rank "
                        f"{rank}; every rank must compute the same owners without communicating "
                        "(do not read the rank, a random generator or the clock)"))
                    return found
    return found


def _as_list(answer: Any) -> list:
    return answer.tolist() if isinstance(answer, torch.Tensor) else list(answer)


def _brief(answer: Any, limit: int = 12) -> str:
    if isinstance(answer, str):
        return answer
    items = _as_list(answer)
    text = ", ".join(map(str, items[:limit]))
    return f"[{text}{', ...' if len(items) > limit else ''}]"


def _first_per_kind(found: list[Violation]) -> list[Violation]:
    seen: dict[str, Violation] = {}
    for v in found:
        seen.setdefault(v.kind, v)
    return [seen[k] for k in KINDS if k in seen]


def balance(rule: Callable[..., Any], params: Sequence[torch.Tensor], world_size: int) -> float:
    """Bytes of the most loaded rank over the ideal share (1.0 is perfect)."""
    loads = [0] * world_size
    for p, owner in zip(params, _as_list(rule(params, world_size))):
        loads[int(owner)] += p.numel() * p.element_size()
    total = sum(loads)
    return max(loads) * world_size / total if total else 1.0
