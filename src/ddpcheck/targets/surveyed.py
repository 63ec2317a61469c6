"""The stacks surveyed for a ready-made target and left without one: the releases tried and, for
each, exactly what stops it on this platform (torch's CPU build, gloo). ``ddpcheck targets``
prints them after the ready-made ones, and ``ddpcheck check NAME`` answers with the reason
(exit 2, a set-up error: nothing about the user's code is judged) instead of "no such target".
Each reason is measured by a standalone ``bench/`` script named in it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Surveyed:
    """One stack without a ready-made target, and why."""

    name: str  # the name ``ddpcheck check NAME`` would take
    framework: str  # the distribution
    tried: tuple[str, ...]  # its releases tried, each with torch 2.13.0+cpu
    why: str  # what stops it, as measured
    bench: str  # the standalone script that shows it

    def message(self) -> str:
        """What ``ddpcheck check NAME`` prints (exit 2)."""
        return (
            f"target {self.name!r} is not available: {self.framework} "
            f"{', '.join(self.tried)} tried with torch 2.13.0 on the CPU over gloo; {self.why} "
            f"(python {self.bench}; docs/pipeline-parallel.md, the N-D option-space map)"
        )


SURVEYED: tuple[Surveyed, ...] = ()  # torchtitan and DeepSpeed AutoTP were; both have targets now


def surveyed(name: str) -> Surveyed | None:
    """The surveyed stack called ``name``, if any."""
    return next((s for s in SURVEYED if s.name == name), None)
