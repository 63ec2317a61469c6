"""Every outcome of a check that is not "nothing found": one exception type and one exit code each.

One rule: :class:`EquivalenceError` (:attr:`ExitCode.FOUND`) means the target has a bug and its
replay line proves it. Everything that is *not* the target's fault is a :class:`SetupError`
(:attr:`ExitCode.SETUP`) -- a world that cannot start, a scenario the oracle cannot judge -- or
:class:`NothingChecked` (:attr:`ExitCode.NOTHING_CHECKED`), or a usage mistake,
:class:`InvalidArgument` (:attr:`ExitCode.SETUP` too), or ddpcheck's own glue failing,
:class:`InternalError` (:attr:`ExitCode.INTERNAL`). All of them derive from
:class:`DdpcheckError`, and each carries its ``exit_code``: the command line, the pytest plugin and
the docs read the meaning from here, never from a bare integer.

How divergences are reported: one table, the details of the first row, and a replay line.
Numbers we compute are rounded to 3 significant figures; the statistics of the first mismatch
are ``torch.testing.assert_close``'s own message, unchanged. Imports no torch (the pytest plugin
and ``ddpcheck --help`` load this module).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "DdpcheckError",
    "Divergence",
    "EquivalenceError",
    "ExitCode",
    "Inconclusive",
    "InternalError",
    "InvalidArgument",
    "NothingChecked",
    "ScenarioError",
    "SetupError",
    "WorldStartError",
    "format_table",
]


class ExitCode(enum.IntEnum):
    """The exit status of ``ddpcheck`` commands, one meaning each (``pytest.ExitCode`` style)."""

    #: Checked, and nothing found.
    OK = 0
    #: A counterexample in the target: the divergence table and a replay line that reproduces it.
    FOUND = 1
    #: A usage or set-up error, never a data-parallel bug (a bad argument, a world that cannot
    #: start, a scenario the oracle cannot judge, a target that fails without data parallelism).
    SETUP = 2
    #: Nothing was checked: every example was skipped or declined (never reported as OK).
    NOTHING_CHECKED = 3
    #: ddpcheck itself failed -- a bug in ddpcheck, never a verdict on the target: the
    #: traceback is printed (Python's own status for an uncaught exception, 1, would read as
    #: FOUND).
    INTERNAL = 4
    #: No verdict could be reached on an example, either way: its ranks were still working when
    #: the wait for them ended (a machine too slow or too loaded for the deadline, or a rank
    #: computing without end), or a hang did not recur when the example ran again, or a possibly
    #: racy verdict's replay (``replay --repeat N``) passed all N runs. Raise the deadline, or
    #: run where the machine is quieter.
    INCONCLUSIVE = 5
    #: Interrupted (Ctrl-C): every rank process stopped, every world directory removed.
    INTERRUPTED = 130
    #: Terminated (SIGTERM): the same clean stop.
    TERMINATED = 143
    #: Its output was closed before it ended (``ddpcheck ... | head``): the same clean stop, with
    #: a shell's status for a command SIGPIPE stopped (128 + 13); no verdict reached the reader,
    #: so none is claimed.
    OUTPUT_CLOSED = 141


class DdpcheckError(Exception):
    """The base of every outcome ddpcheck raises; ``exit_code`` is the command line's status."""

    exit_code: ExitCode = ExitCode.SETUP


class InvalidArgument(DdpcheckError, ValueError):
    """An argument passed to ddpcheck is invalid; the message says which and why."""


class SetupError(DdpcheckError, RuntimeError):
    """Nothing (or not everything) could be checked, through no fault of the target: the message
    names the cause and the fix. Never a verdict on the target."""


class WorldStartError(SetupError):
    """The rank processes could not start or join the process group (an environment problem,
    such as a main module without ``if __name__ == "__main__":``), never a verdict on a target."""


class ScenarioError(SetupError, InvalidArgument):
    """The scenario is one the oracle cannot judge or cannot even build: its model factory, data
    function or optimizer fails on their own, or the model is not a per-sample function (batch
    statistics, dropout), or the reference itself diverges numerically. Raised in the parent,
    before any world runs, naming the cause."""


class Inconclusive(DdpcheckError):
    """An example reached no verdict, either way (``ExitCode.INCONCLUSIVE``): its ranks were still
    working when the wait for them ended -- slowness, which is never a verdict -- or it hung once
    and passed when run again, so no replay line could prove the hang; or a possibly racy
    verdict's replay line did not reproduce it in ``--repeat N`` runs. The message says which,
    with the ranks' stacks."""

    exit_code = ExitCode.INCONCLUSIVE


class NothingChecked(SetupError):
    """Every example was skipped or declined: passing it would be a silent no-op."""

    exit_code = ExitCode.NOTHING_CHECKED


class InternalError(DdpcheckError):
    """ddpcheck's own code failed where it can tell -- the glue of a ready-made framework target,
    inside a rank -- so it is never reported as the target's failure; the message carries the
    traceback and the framework's release (:attr:`ExitCode.INTERNAL`)."""

    exit_code = ExitCode.INTERNAL


#: Rows shown in an EquivalenceError message; the rest are counted.
MAX_ROWS = 12


@dataclasses.dataclass(frozen=True)
class Divergence:
    """One thing that differs: where (step, world size, rank, parameter), what, and how much."""

    step: int | str  # int, or "init" before the first step ("-": no one step)
    world_size: int
    rank: int | None  # None: not one rank's fault (e.g. state held by several ranks)
    name: str
    kind: str
    max_abs: float | None = None
    max_rel: float | None = None
    detail: str = ""
    #: False for a row that says the oracle could not judge the target (the reference itself
    # #: went non-finite, see ``ddpcheck._oracle.compare``): not evidence of a bug. Every
    # other row is.
    target_fault: bool = True

    @classmethod
    def of(
        cls,
        step: int | str,
        world_size: int,
        rank: int | None,
        name: str,
        kind: str,
        got: torch.Tensor,
        expected: torch.Tensor,
        got_label: tuple,
        expected_label: tuple,
        rtol: float = 0.0,
        atol: float = 0.0,
    ) -> Divergence:
        """A divergence between two tensors, with assert_close's statistics as the detail."""
        import torch  # here: the plugin and the command line's --help import this module

        diff = (got.double() - expected.double()).abs()
        rel = diff / expected.double().abs().clamp_min(torch.finfo(torch.float64).tiny)
        finite = torch.isfinite(diff)
        max_abs = float(diff[finite].max()) if finite.any() else float("inf")
        max_rel = float(rel[finite].max()) if finite.any() else float("inf")
        try:
            torch.testing.assert_close(
                got, expected, rtol=rtol, atol=atol, equal_nan=True, check_dtype=False
            )
            message = "(differs only where assert_close is more lenient than the oracle)"
        except AssertionError as exc:
            message = str(exc)
        who = f"rank {got_label[1]}" if got_label[0] == "rank" else got_label[0]
        than = f"rank {expected_label[1]}" if expected_label[0] == "rank" else expected_label[0]
        return cls(
            step, world_size, rank, name, kind, max_abs, max_rel, f"{who} vs {than}: {message}"
        )

    def row(self) -> list[str]:
        return [
            str(self.step),
            str(self.world_size),
            "-" if self.rank is None else str(self.rank),
            self.name,
            self.kind,
            _sig(self.max_abs),
            _sig(self.max_rel),
        ]


def _sig(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def format_table(divergences: list[Divergence], max_rows: int = MAX_ROWS) -> str:
    header = ["step", "W", "rank", "parameter", "kind", "max abs", "max rel"]
    rows = [d.row() for d in divergences[:max_rows]]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if len(divergences) > max_rows:
        lines.append(f"... and {len(divergences) - max_rows} more")
    return "\n".join(lines)


class EquivalenceError(DdpcheckError, AssertionError):
    """A target diverged from its replicas or from the full-batch reference, broke the
    communication budget, or a rank failed or timed out: the target's bug, with its proof.

    Attributes: ``divergences`` (the rows), ``scenario``, ``world_size``, ``target`` and
    ``replay`` (a shell command that runs this one example again).
    """

    exit_code = ExitCode.FOUND

    def __init__(
        self,
        divergences: list[Divergence],
        *,
        scenario: Any,
        world_size: int,
        target: Any,
        replay: str,
        failure: object = None,
        name: str | None = None,
        communication: str = "",
    ):
        self.divergences = divergences
        #: on a mesh, the failing step's collectives per rank, by axis (``""``: not shown)
        self.communication = communication
        self.scenario = scenario
        self.world_size = world_size
        self.target = target
        self.replay = replay
        # a ddpcheck._world.failures.WorldFailure, for rank failures and timeouts
        self.failure = failure
        self.name = name
        super().__init__(self._format())

    @property
    def kinds(self) -> list[str]:
        return list(dict.fromkeys(d.kind for d in self.divergences))

    def _format(self) -> str:
        first = self.divergences[0]
        label = f" ({self.name})" if self.name else ""
        lines = [
            f"{type(self.target).__name__} diverged at world size {self.world_size}"
            f"{label}: {first.kind}",
            f"scenario: {self.scenario!r}",
            "",
            format_table(self.divergences),
        ]
        details = [d for d in self.divergences if d.detail][:1]
        for d in details:
            where = f"step {d.step}, rank {'-' if d.rank is None else d.rank}, {d.name!r}"
            lines += ["", f"first divergence ({where}):", d.detail]
        if self.communication:
            lines += ["", self.communication]
        if self.failure is not None:
            lines += ["", str(self.failure)]
        lines += ["", f"replay: {self.replay}"]
        return "\n".join(lines)


# Tracebacks and pickles name a class by its module: these are ddpcheck.errors's, where users
# import and catch them, wherever the floors keep them.
for _name in __all__:
    if isinstance(globals()[_name], type):
        globals()[_name].__module__ = "ddpcheck.errors"
