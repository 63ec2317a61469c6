"""``ddpcheck fuzz-rule``: a sharding rule's invariants, with a deadline on every call of it.

Invariant: :func:`check_rule` reports no violation exactly when, for every parameter list it tried
(Hypothesis draws them: 1 to 300 parameters shaped like real models' -- vectors, matrices, conv
kernels, large embeddings on the meta device, scalars, empty tensors -- in float32, float64,
bfloat16 and float16, at world sizes 1..8, often larger than the list; then the fixed lists of
:func:`parameter_lists`), ``rule(params, W)`` returned within the deadline one integer owner in
``[0, W)`` per parameter, returned the same valid answer when called again, and returned the same
answer on every rank of real worlds of 2..4 processes. A violation found by Hypothesis is shrunk
to the smallest parameter list that shows it. Each kind of violation (see :data:`KINDS`) has its
own message, naming the rule, the world size and the parameter list it failed on.

Where the rule runs: never in the calling process, always inside rank processes under deadlines
(``ddpcheck._rules.calls``); the parameter lists are ``ddpcheck._rules.params``.
When a world fails while no call of the rule was running, nothing was decided about the rule: that
is a set-up error (``ddpcheck.SetupError``), not a verdict.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import hypothesis

from ddpcheck._base.errors import SetupError
from ddpcheck._base.options import DEFAULT_DEADLINE
from ddpcheck._rules.calls import (
    HARD_FLOOR,
    HARD_GRACE,
    HARD_REFRESH,
    KINDS,
    MAX_WORLD_SIZE,
    Answer,
    Rule,
    answers_in_rank,
    brief_owners,
    hang_text,
    rule_name,
    search_in_rank,
)
from ddpcheck._rules.params import (
    DTYPES,
    ParamSpec,
    balance,
    describe,
    gpt_like,
    parameter_lists,
)
from ddpcheck._world.failures import WorldFailure
from ddpcheck._world.processes import read
from ddpcheck._world.registry import get_world

if TYPE_CHECKING:
    from ddpcheck._world.worlds import World

R = TypeVar("R")

__all__ = [
    "DTYPES",
    "KINDS",
    "MAX_WORLD_SIZE",
    "ParamSpec",
    "RuleReport",
    "SetupError",
    "Violation",
    "balance",
    "check_rule",
    "gpt_like",
    "parameter_lists",
]

#: World sizes of the cross-rank check (real processes).
RANK_WORLD_SIZES = (2, 3, 4)
#: Drawn examples by default; each is two calls of the rule.
DEFAULT_EXAMPLES = 200
#: Seconds the pure search may spend; once spent it starts no new call of the rule (so a slow
#: rule ends the search early, with the examples it got through, instead of running for hours).
SEARCH_BUDGET = 120.0
#: Seconds the cross-rank check may spend on one world.
CROSS_BUDGET = 60.0
#: Seconds the parent allows past a task's own limits before it declares the world hung.
WORLD_MARGIN = 30.0

#: Frames under this folder are ddpcheck's, not the rule's.
_HERE = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass(frozen=True)
class Violation:
    kind: str  # one of KINDS
    message: str


@dataclasses.dataclass
class RuleReport:
    """What :func:`check_rule` found."""

    violations: list[Violation]
    examples: int = 0  # drawn parameter lists tried by the pure search
    budget_reached: bool = False  # the pure search stopped early on SEARCH_BUDGET
    cross_rank_lists: int = 0  # parameter lists compared across the ranks of each world
    #: owners on :func:`gpt_like` at each of BALANCE_WORLD_SIZES (when the invariants hold)
    gpt_owners: dict[int, list[int]] = dataclasses.field(default_factory=dict)

    def summary(self, deadline: float, seed: int | None) -> str:
        """What held, on how many parameter lists (when there is no violation)."""
        budget = (
            f" (the {SEARCH_BUDGET:g} s search budget ran out first)" if self.budget_reached else ""
        )
        return (
            f"invariants hold (length, integer owners in range, deterministic, returns "
            f"within {deadline:g} s, same on every rank): {self.examples} drawn parameter "
            f"lists at world sizes 1-{MAX_WORLD_SIZE}{budget}"
            f"{'' if seed is None else f' (seed {seed})'}, "
            f"{len(parameter_lists())} fixed ones, {self.cross_rank_lists} across the ranks "
            f"of worlds of {', '.join(map(str, RANK_WORLD_SIZES))} processes"
        )

    def balance(self) -> str:
        """The optimizer-state balance on GPT-2-small parameters at each world size."""
        params = gpt_like()
        return ", ".join(
            f"W={w} {balance(owners, params, w):.3f}"
            for w, owners in sorted(self.gpt_owners.items())
        )


# ---------------------------------------------------------------------------------------------
# The parent's side


def check_rule(
    rule: Rule,
    *,
    examples: int = DEFAULT_EXAMPLES,
    seed: int | None = None,
    deadline: float = DEFAULT_DEADLINE,
    rank_world_sizes: Sequence[int] = RANK_WORLD_SIZES,
) -> RuleReport:
    """Every invariant ``rule`` breaks, each on the smallest input found (empty: none).

    ``deadline`` bounds each call of the rule (seconds). The rule travels to the rank processes
    by pickle, so it must be defined at module level of an importable module. Raises
    :class:`SetupError` (or ``WorldStartError``) when the checks could not run: no verdict.
    """
    name = rule_name(rule)
    directory = tempfile.mkdtemp(prefix="ddpcheck-fuzz-rule-")
    try:
        world = get_world(1)
        ran = _run(
            world,
            search_in_rank,
            (rule, examples, seed, deadline, directory, SEARCH_BUDGET),
            deadline,
            SEARCH_BUDGET,
            directory,
            name,
            "the search in a world of 1 process",
        )
        if isinstance(ran, Violation):
            return RuleReport([ran])
        result = ran[0]
        report = RuleReport(
            [Violation(k, result["found"][k]) for k in KINDS if k in result["found"]],
            result["examples"],
            result["budget_reached"],
        )
        if report.violations:
            if "hangs" in result["found"]:
                world.kill()  # the interrupted call may have left the rank in any state
            return report
        # The fixed lists first (the smallest first), so messages do not depend on the draws.
        lists: list[tuple[str | None, Sequence[ParamSpec]]] = list(parameter_lists().items())
        lists += [(None, specs) for specs in result["sample"]]
        report.cross_rank_lists = len(lists)
        for world_size in rank_world_sizes:
            violation = _cross_rank(rule, name, world_size, lists, deadline, directory)
            if violation is not None:
                report.violations = [violation]
                return report
        report.gpt_owners = result["gpt_owners"]
        return report
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _run(
    world: World,
    fn: Callable[..., R],
    args: tuple,
    limit: float,
    budget: float,
    directory: str,
    name: str,
    what: str,
) -> list[R] | Violation:
    """``world.run`` with a backstop deadline past the task's own limits. A failure while a rank
    was calling the rule is the rule's violation (``hangs`` or ``crashed``); any other failure is a
    :class:`SetupError`."""
    for entry in os.listdir(directory):  # no progress of an earlier task may be read as this one's
        os.unlink(os.path.join(directory, entry))
    try:
        backstop = budget + max(limit + HARD_GRACE, HARD_FLOOR) + HARD_REFRESH + WORLD_MARGIN
        return world.run(fn, *args, deadline=backstop, what=f"fuzz-rule {name}")
    except WorldFailure as failure:
        for state in failure.ranks:
            calling = read(os.path.join(directory, f"rank{state.rank}.calling"))
            if state.status == "returned" or not calling.startswith("calling\n"):
                continue
            call, where = calling[len("calling\n") :].split("\n", 1)
            stack = _trim_stack(read(os.path.join(directory, f"rank{state.rank}.hung")))
            if stack or state.status == "stuck":
                kind = "hangs"
                detail = (
                    f"{call} {hang_text(limit)} (not even on the alarm signal: stuck in C "
                    f"code?), so its process was killed; it was here:\n"
                    f"{_indent(stack or _trim_stack(state.detail))}"
                )
            else:
                kind = "crashed"
                detail = (
                    f"{call} ended its process ({state.detail or state.status}); a rule "
                    "must return, not exit or crash the interpreter"
                )
                if state.log_tail:
                    detail += f"; last output:\n{_indent(state.log_tail)}"
            return Violation(kind, f"{kind}: {name} {where}: {detail}")
        raise SetupError(
            f"fuzz-rule could not finish {what}, and no call of the rule was running "
            f"when it failed, so nothing was decided about the rule:\n"
            f"{failure}"
        ) from None


def _cross_rank(
    rule: Rule,
    name: str,
    world_size: int,
    lists: list[tuple[str | None, Sequence[ParamSpec]]],
    deadline: float,
    directory: str,
) -> Violation | None:
    """Every rank of a world of ``world_size`` answers each list; the first disagreement, or the
    first failure common to every rank, if any."""
    world = get_world(world_size)
    answers = _run(
        world,
        answers_in_rank,
        (rule, lists, deadline, directory, CROSS_BUDGET),
        deadline,
        CROSS_BUDGET,
        directory,
        name,
        f"the cross-rank check in a world of {world_size} processes",
    )
    if isinstance(answers, Violation):
        return answers
    if any(answer[0] == "hangs" for mine in answers for answer in mine):
        world.kill()  # the interrupted call may have left the rank in any state
    for i in range(min(len(mine) for mine in answers)):
        where = f"in a world of {world_size} processes on {describe(lists[i][1], lists[i][0])}"
        first = answers[0][i]
        for rank, mine in enumerate(answers[1:], 1):
            if mine[i] != first:
                return Violation(
                    "rank-dependent",
                    f"rank-dependent: {name} {where}: answered {shown(first)} on rank 0 but "
                    f"{shown(mine[i])} on rank {rank}; every rank must compute the same owners "
                    "without communicating (do not read the rank, a random generator or the "
                    "clock)",
                )
        if first[0] != "ok":  # the same failure on every rank, only inside a real world
            return Violation(first[0], f"{first[0]}: {name} {where}: on every rank, {first[1]}")
    return None


def shown(answer: Answer) -> str:
    status, value = answer
    return brief_owners(value) if isinstance(value, tuple) else f"({status}: {value})"


def _trim_stack(dump: str) -> str:
    """A faulthandler dump without its header and the frames below the rule (ddpcheck's,
    Hypothesis's, multiprocessing's)."""
    below = (
        f'File "{_HERE}',
        'File "<string>"',
        f'File "{os.path.dirname(os.path.abspath(hypothesis.__file__))}',
        f'File "{os.path.dirname(os.path.abspath(multiprocessing.__file__))}',
    )
    return "\n".join(
        line
        for line in dump.strip().splitlines()
        if not line.lstrip().startswith(below) and not line.startswith("Timeout (")
    )


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.rstrip().splitlines())
