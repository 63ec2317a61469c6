"""Scoring a mutant catalogue: every mutant searched for a counterexample within a budget.

Invariant: :func:`score` returns one :class:`Scored` row per mutant, in catalogue order, after the
unmutated target (the control) -- which must *not* be killed, or the scores mean nothing.
:func:`run_mutants` is ``ddpcheck mutants``: the table printed as it goes, and the exit status --
0 when every mutant is killed and the unmutated target passes the same search, 1 otherwise (a
surviving mutant is a hole in the harness; a failing control makes the scores meaningless).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence

from ddpcheck._base.errors import ExitCode, InvalidArgument
from ddpcheck._base.options import DEFAULT_DEADLINE, DEFAULT_WORLD_SIZES
from ddpcheck.mutation import catalogue, search
from ddpcheck.mutation.search import Outcome, Search, shrinking_search, warm_up
from ddpcheck.targets import PARALLEL, TORCH_FSDP, Target, TorchFSDPTarget

__all__ = [
    "CONTROL",
    "TABLE_HEADER",
    "Scored",
    "run_mutants",
    "score",
    "table_lines",
    "table_widths",
]

#: The control row's name.
CONTROL = "(unmutated)"


@dataclasses.dataclass
class Scored:
    """One row of the mutant table."""

    name: str
    bug_class: str
    outcome: Outcome
    control: bool = False  # the unmutated target: it must *not* be killed

    @property
    def killed(self) -> bool:
        return self.outcome.counterexample is not None

    @property
    def as_expected(self) -> bool:
        return self.killed != self.control

    def row(self) -> list[str]:
        o = self.outcome
        if self.killed:
            verdict = "FALSE ALARM" if self.control else "killed"
        elif self.control:
            verdict = "passes" if o.exhausted else "passes (budget)"
        else:
            verdict = "SURVIVED" if o.exhausted else "SURVIVED (budget)"
        found = o.counterexample.one_line() if o.counterexample else "-"
        return [self.name, self.bug_class, verdict, str(o.examples), f"{o.seconds:.2f}", found]


TABLE_HEADER = ["mutant", "class", "killed?", "examples", "seconds", "counterexample"]


def table_widths(names: Iterable[str]) -> list[int]:
    """Column widths that fit every row before the rows exist (the table prints as it goes)."""
    return [
        max(len(CONTROL), *(len(n) for n in names)),
        len("class"),
        len("SURVIVED (budget)"),
        len("examples"),
        len("seconds"),
        len("counterexample"),
    ]


def _label(control: Target) -> str:
    """A control's row name: ``(unmutated)`` for ``parallel``, else with its class's name."""
    return CONTROL if control is PARALLEL else f"{CONTROL[:-1]} {type(control).__name__})"


def table_lines(rows: list[list[str]], widths: list[int] | None = None) -> list[str]:
    """Markdown-compatible table lines (header, rule, rows), columns padded to ``widths``."""
    widths = widths or [
        max(len(r[i]) for r in [TABLE_HEADER, *rows]) for i in range(len(TABLE_HEADER))
    ]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return [
        line(TABLE_HEADER),
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
        *[line(r) for r in rows],
    ]


def score(
    mutants: Iterable[catalogue.Mutant],
    budget_seconds: float,
    *,
    control: Target | list[Target] | None = None,
    world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
    search: Search | None = None,
    deadline: float = DEFAULT_DEADLINE,
    on_row: Callable[[Scored], None] | None = None,
) -> list[Scored]:
    """Search every mutant (``ddpcheck.mutation.catalogue.Mutant``) for a counterexample within
    ``budget_seconds`` each; ``control`` (the unmutated target, or a list of them), if given, is
    searched first with
    no budget limit short of exhausting the search. ``on_row`` sees each row as it completes."""
    search = search or shrinking_search
    out = []
    todo = [(m.name, m.bug_class, m.target, False) for m in mutants]
    # several controls (a list) when the mutants seed bugs into several unmutated targets
    controls = [] if control is None else control if isinstance(control, list) else [control]
    for unmutated in reversed(controls):
        label = _label(unmutated)
        todo.insert(0, (label, "-", unmutated, True))
    for name, bug_class, target, is_control in todo:
        budget = float("inf") if is_control else budget_seconds
        # respawns a world the previous mutant broke, outside the budget
        warm_up(world_sizes, modules=[type(target).__module__])
        outcome = search(target, budget, world_sizes=world_sizes, deadline=deadline)
        scored = Scored(name, bug_class, outcome, control=is_control)
        out.append(scored)
        if on_row is not None:
            on_row(scored)
    return out


def run_mutants(
    only: str | None,
    *,
    budget_seconds: float,
    search_name: str,
    world_sizes: tuple[int, ...],
    deadline: float,
) -> ExitCode:
    """Print the mutant table as it goes; 0 when every mutant is killed and the control passes."""
    mutants = catalogue.CATALOGUE
    if max(world_sizes) >= 4:  # a pipeline of tensor-parallel stages needs pp=2 x tp=2
        mutants = mutants + catalogue.ND_CATALOGUE
    if only is not None:
        mutants = [catalogue.by_name(n.strip()) for n in only.split(",") if n.strip()]
        if not mutants:
            raise InvalidArgument(f"--only={only!r} names no mutant")
    controls: list[Target] = []  # each family's original, in catalogue order
    for m in mutants:
        control = (
            m.control
            if m.control is not None
            else TORCH_FSDP
            if isinstance(m.target, TorchFSDPTarget)
            else PARALLEL
        )
        if all(control is not c for c in controls):
            controls.append(control)
    # the controls' rows too: "(unmutated TorchPPTarget)" is longer than its mutants' names
    widths = table_widths([*(m.name for m in mutants), *(_label(c) for c in controls)])
    print(
        f"ddpcheck mutants: {len(mutants)} mutants, {budget_seconds:g} s each, "
        f"{search_name} search, world sizes {','.join(map(str, world_sizes))} "
        "(starting worlds...)",
        flush=True,
    )
    print("\n".join(table_lines([], widths)), flush=True)
    started = time.perf_counter()
    chosen = search.shrinking_search if search_name == "shrinking" else search.battery_search
    rows = score(
        mutants,
        budget_seconds,
        control=controls,
        search=chosen,
        world_sizes=world_sizes,
        deadline=deadline,
        on_row=lambda r: print(table_lines([r.row()], widths)[2], flush=True),
    )
    killed = sum(r.killed for r in rows if not r.control)
    control_ok = all(r.as_expected for r in rows if r.control)
    seconds = sorted(r.outcome.seconds for r in rows if not r.control and r.killed)
    median = seconds[len(seconds) // 2] if seconds else float("nan")
    print(
        f"\nkilled {killed}/{len(mutants)} "
        f"({100 * killed / max(len(mutants), 1):.0f} %); median {median:.2f} s to the first "
        f"counterexample; unmutated target {'passes' if control_ok else 'FAILS'}; "
        f"wall {time.perf_counter() - started:.1f} s"
    )
    for r in rows:
        found = r.outcome.counterexample  # None unless the row was killed
        if r.control and found is not None:
            print(
                f"\nthe unmutated target failed, so the scores above mean nothing:\n{found.error}"
            )
    return ExitCode.OK if killed == len(mutants) and control_ok else ExitCode.FOUND
