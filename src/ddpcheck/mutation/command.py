"""``ddpcheck mutants``: every mutant of the catalogue searched for a counterexample, as a table.

Exit status: 0 when every mutant is killed and the unmutated target passes the same search, 1
otherwise (a surviving mutant is a hole in the harness; a failing control makes the scores
meaningless).
"""

from __future__ import annotations

import time

from ddpcheck._internal.validation import InvalidArgument
from ddpcheck.mutation import catalogue, score, search
from ddpcheck.targets import PARALLEL, TORCH_FSDP, TorchFSDPTarget

__all__ = ["run_mutants"]


def run_mutants(only: str | None, *, budget_seconds: float, search_name: str,
                world_sizes: tuple[int, ...], deadline: float) -> int:
    """Print the mutant table as it goes; 0 when every mutant is killed and the control passes."""
    mutants = catalogue.CATALOGUE
    if only is not None:
        mutants = [catalogue.by_name(n.strip()) for n in only.split(",") if n.strip()]
        if not mutants:
            raise InvalidArgument(f"--only={only!r} names no mutant")
    widths = score.table_widths(m.name for m in mutants)
    print(f"ddpcheck mutants: {len(mutants)} mutants, {budget_seconds:g} s each, "
          f"{search_name} search, world sizes {','.join(map(str, world_sizes))} "
          "(starting worlds...)", flush=True)
    print("\n".join(score.table_lines([], widths)), flush=True)
    started = time.perf_counter()
    chosen = search.shrinking_search if search_name == "shrinking" else search.battery_search
    fsdp = [isinstance(m.target, TorchFSDPTarget) for m in mutants]
    controls = [PARALLEL] * (not all(fsdp)) + [TORCH_FSDP] * any(fsdp)  # each family's original
    rows = score.score(mutants, budget_seconds, control=controls, search=chosen,
                       world_sizes=world_sizes, deadline=deadline,
                       on_row=lambda r: print(score.table_lines([r.row()], widths)[2],
                                              flush=True))
    killed = sum(r.killed for r in rows if not r.control)
    control_ok = all(r.as_expected for r in rows if r.control)
    seconds = sorted(r.outcome.seconds for r in rows if not r.control and r.killed)
    median = seconds[len(seconds) // 2] if seconds else float("nan")
    print(f"\nkilled {killed}/{len(mutants)} "
          f"({100 * killed / max(len(mutants), 1):.0f} %); median {median:.2f} s to the first "
          f"counterexample; unmutated target {'passes' if control_ok else 'FAILS'}; "
          f"wall {time.perf_counter() - started:.1f} s")
    for r in rows:
        if r.control and r.killed:
            print(f"\nthe unmutated target failed, so the scores above mean nothing:\n"
                  f"{r.outcome.counterexample.error}")
    return 0 if killed == len(mutants) and control_ok else 1
