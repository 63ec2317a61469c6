"""The oracle for a run resumed from a checkpoint (``Scenario.checkpoint_after``).

Invariant: :func:`compare_resumed` holds the run that saved the checkpoint (steps
``0..checkpoint_after`` at world size W) and the run that resumed from it (the rest, at
``resume_world_size``) to the one uninterrupted full-batch reference, with every check of
``ddpcheck.oracle.compare`` inside each part (replicas, reference, optimizer state -- sharding
judged at each part's own world size -- the LR schedule, the budget). The resumed part's
starting point is checked too: right after ``load_checkpoint`` every rank must hold the
reference's parameters and buffers after step ``checkpoint_after`` (rows at step ``"resume"``),
so weights that silently failed to load are named before they spoil a step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ddpcheck.errors import Divergence
from ddpcheck.oracle import CHECKS, compare
from ddpcheck.reference import Reference
from ddpcheck.scenario import Scenario

__all__ = ["compare_resumed"]


def compare_resumed(parts: tuple[list, list], reference: Reference, scenario: Scenario,
                    target: Any, checks: frozenset = CHECKS) -> list[Divergence]:
    """Every divergence of the two parts (``(records before, records after)``) from the
    uninterrupted reference; rows name steps of the whole run."""
    before, after = parts
    saved_at = scenario.checkpoint_after
    rows = compare(before, dataclasses.replace(reference, steps=reference.steps[:saved_at + 1]),
                   scenario, target, checks)
    if rows:
        return rows
    last = reference.steps[saved_at]
    rest = dataclasses.replace(reference, initial={**last.params, **last.buffers},
                               steps=reference.steps[saved_at + 1:])
    rows = compare(after, rest, scenario, target, checks, earlier_steps=saved_at + 1,
                   earlier_world_size=len(before))
    return [_renumbered(row, saved_at + 1) for row in rows]


def _renumbered(row: Divergence, offset: int) -> Divergence:
    if row.step == "init":
        return dataclasses.replace(
            row, step="resume", detail=f"after load_checkpoint (the state saved after step "
                                       f"{offset - 1}): {row.detail}".rstrip(": "))
    if isinstance(row.step, int):
        return dataclasses.replace(row, step=row.step + offset)
    return row
