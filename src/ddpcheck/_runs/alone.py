"""A rank's failure that needs no data parallelism: the target's set-up error, never a verdict.

Exit 1 promises a data-parallel bug. A target whose hook raises just the same in a one-process
world (a typo in ``wrap``, a ``make_optimizer`` called with the wrong arguments) is broken glue,
and a CI gate reading exit 1 would file it as a data-parallel bug. So a rank that raised is
reported as the target's :class:`SetupError` (exit 2, the hook and the traceback from the
target's first frame) when the evidence shows no second rank was needed:

- it raised at W=1 (:func:`setup_error` on a one-process world's failure), or at W>1 and the
  same scenario at W=1 raises the same exception in the same function (``example`` runs it);
- or, where the example cannot run at W=1 (declined there), every rank that raised did so in a
  set-up hook (``wrap``, ``make_optimizer``, ``setup``) before any rank issued a collective.

A raise that needs W > 1 stays exit 1, set-up hook or not: torch DDP's constructor raises at W>1
on parameters that differ across ranks, after collectives issued from C++ that no sequence file
shows.

What the pieces here decide is read from the ranks' tracebacks only: pure functions, no world.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sysconfig

import torch

from ddpcheck._base.errors import SetupError
from ddpcheck._language.scenario import Scenario
from ddpcheck._world.failures import Failure, Status, WorldFailure
from ddpcheck._world.sequences import NO_COLLECTIVE

__all__ = ["TargetSetupError", "raised_in", "setup_error", "without_data_parallelism"]

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')
#: ddpcheck's own code, torch's and the standard library's: never the target's frame
_NOT_THE_TARGETS = tuple(
    os.path.abspath(folder) + os.sep
    for folder in (
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        os.path.dirname(torch.__file__),
        sysconfig.get_paths()["stdlib"],
    )
)
#: ``_rank.runner.setup``: the frame every set-up hook (wrap, make_optimizer, setup) runs under
_SETUP_FRAME = ("runner.py", "setup")


class TargetSetupError(SetupError):
    """The target failed without data parallelism (exit 2): what a rank raised, and where.
    ``hook`` names the target's function that raised; ``scenario`` and ``world_size`` the
    example it was found on."""

    def __init__(
        self,
        message: str,
        hook: str,
        raised: tuple[str, str, str, str],
        scenario: Scenario,
        world_size: int,
    ):
        super().__init__(message)
        self.hook, self.raised = hook, raised
        self.scenario, self.world_size = scenario, world_size


@dataclasses.dataclass(frozen=True)
class Raised:
    """What one rank's traceback says: the exception's type, the target's frame that raised
    (``file``, ``function``, ``line``; the innermost ddpcheck frame when the target's code is
    not on the stack) and the traceback from that frame on."""

    exception: str
    file: str
    function: str
    line: int
    summary: str
    in_setup: bool
    origin: str  # "file:line in function" of the innermost frame: where it was raised

    @property
    def key(self) -> tuple[str, str, str, str]:
        """What must match for two failures to be "the same way": the exception's type, the
        target's function it left and the line that raised it (inside a framework's ``train``,
        the assertion that failed, not merely ``train``)."""
        return (self.exception, self.file, self.function, self.origin)


def raised_in(traceback: str) -> Raised | None:
    """The first frame of ``traceback`` outside ddpcheck, torch and the standard library (the
    target's hook ddpcheck called) and the exception's type; None without a traceback."""
    lines = traceback.rstrip().splitlines()
    frames = [(i, m) for i, m in ((i, _FRAME.match(text)) for i, text in enumerate(lines)) if m]
    if not frames or not lines:
        return None
    exception = lines[-1].strip().partition(":")[0]
    in_setup = any((os.path.basename(m["file"]), m["function"]) == _SETUP_FRAME for _, m in frames)
    theirs = [(i, m) for i, m in frames if not m["file"].startswith(_NOT_THE_TARGETS)]
    at, frame = (theirs or frames[-1:])[0]
    last = frames[-1][1]
    return Raised(
        exception,
        frame["file"],
        frame["function"],
        int(frame["line"]),
        "\n".join(lines[at:]),
        in_setup,
        f"{last['file']}:{last['line']} in {last['function']}",
    )


def _raised(failure: WorldFailure) -> list[Raised] | None:
    """What every rank that raised says, or None when a rank did anything else that is a
    failure (died, was refused, unfit) or a traceback cannot be read."""
    if failure.kind != Failure.RAISED:
        return None
    out = []
    for state in failure.ranks:
        if state.status in (Status.EXITED, Status.REFUSED, Status.UNFIT):
            return None
        if state.status == Status.RAISED:
            raised = raised_in(state.detail)
            if raised is None:
                return None
            out.append(raised)
    return out or None


def setup_error(
    target: object, scenario: Scenario, failure: WorldFailure
) -> TargetSetupError | None:
    """``failure`` as the target's set-up error when it needs no data parallelism by itself:
    a one-process world's, or (asked only where the example cannot run at W=1) every raise in a
    set-up hook before any collective."""
    raised = _raised(failure)
    if raised is None:
        return None
    before_any = failure.disagreement is None and failure.collectives == NO_COLLECTIVE
    if failure.world_size > 1 and not (before_any and all(r.in_setup for r in raised)):
        return None
    first = raised[0]
    where = (
        "in a one-process world"
        if failure.world_size == 1
        else f"in a set-up hook before any collective, at world size {failure.world_size}"
    )
    hook = first.function
    name = type(target).__name__
    return TargetSetupError(
        f"{name} fails without data parallelism: `{hook}` "
        f"({os.path.basename(first.file)}:{first.line}) raised {first.exception} {where} -- "
        "a set-up error in the target, not a data-parallel bug\n"
        f"scenario: {scenario!r}\n{first.summary}",
        hook,
        first.key,
        scenario,
        failure.world_size,
    )


def without_data_parallelism(
    failure: WorldFailure, alone: TargetSetupError, target: object, scenario: Scenario
) -> TargetSetupError | None:
    """``alone`` (the same scenario's failure at W=1) restated for ``failure`` at W>1 when a rank
    there raised the same exception in the same function; None when it failed otherwise."""
    raised = _raised(failure)
    if raised is None or alone.raised not in {r.key for r in raised}:
        return None
    first = next(r for r in raised if r.key == alone.raised)
    return TargetSetupError(
        f"{type(target).__name__} fails without data parallelism: `{alone.hook}` "
        f"({os.path.basename(first.file)}:{first.line}) raised {first.exception} at world "
        f"size {failure.world_size}, and the same at world size 1 on the same scenario -- a "
        "set-up error in the target, not a data-parallel bug\n"
        f"scenario: {scenario!r}\n{first.summary}",
        alone.hook,
        alone.raised,
        scenario,
        failure.world_size,
    )
