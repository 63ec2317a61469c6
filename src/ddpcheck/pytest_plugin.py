"""pytest plugin of ddpcheck (registered through the ``pytest11`` entry point).

Laid out in the order pytest calls it: options, configuration, session hooks, fixtures, then the
plain functions behind the fixtures. Importing it is cheap and side-effect free: it imports
neither torch nor hypothesis, and never touches the user's Hypothesis profile. Under xdist every
worker keeps its own persistent worlds; each worker stops them at the end of its session and the
controller prints the total number of examples run.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import sys
from collections.abc import Callable, Generator, Iterable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

import pytest

from ddpcheck._base.errors import DdpcheckError, ExitCode, InvalidArgument
from ddpcheck._base.options import DEFAULT_DEADLINE, DEFAULT_WORLD_SIZES, mesh_text

if TYPE_CHECKING:  # the plugin imports neither torch nor Hypothesis when it loads
    from ddpcheck._language.scenario import Scenario
    from ddpcheck._runs.admission import Request
    from ddpcheck._runs.equivalence import Report
    from ddpcheck._world.worlds import World
    from ddpcheck.targets.protocol import Target

# ---------------------------------------------------------------------------------------------
# Options
#
# 'Help' formatting (same rules as pytest's): start with a capital letter; a single phrase has no
# period; several phrases all end with periods.


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ddpcheck", "data-parallel equivalence checks")
    group.addoption(
        "--ddpcheck-world-sizes",
        action="store",
        default=None,
        metavar="W,W,...",
        help="World sizes the ddpcheck fixtures use (default 1,2,3,4)",
    )
    group.addoption(
        "--ddpcheck-mesh",
        action="store",
        default=None,
        metavar="SHAPE,...",
        help="Mesh shapes ddpcheck_run checks on, such as tp=2,dp=2xtp=2,pp=2xtp=2 (their "
        "world sizes dp*pp*tp instead of --ddpcheck-world-sizes; for targets that apply plans "
        "or run pipelines)",
    )
    group.addoption(
        "--ddpcheck-deadline",
        action="store",
        default=None,
        metavar="SECONDS",
        help="Seconds one example may take before it counts as hung (default 60)",
    )
    group.addoption(
        "--ddpcheck-without",
        action="store",
        default=None,
        metavar="FEATURE,...",
        help="Features the ddpcheck fixtures never exercise (see ddpcheck.features)",
    )
    group.addoption(
        "--ddpcheck-dtypes",
        action="store",
        default=None,
        metavar="DTYPE,...",
        help="Dtypes the ddpcheck fixtures exercise: float64, float32 or both",
    )
    group.addoption(
        "--ddpcheck-only",
        action="store",
        default=None,
        metavar="FEATURE,...",
        help="Features the ddpcheck fixtures focus on: only examples that exercise one of them",
    )
    group.addoption(
        "--ddpcheck-device",
        action="store",
        default=None,
        metavar="DEVICE",
        help="Where the fixtures' ranks compute: cpu (default) or cuda (rank r on GPU r, NCCL)",
    )
    group.addoption(
        "--ddpcheck-backend",
        action="store",
        default=None,
        metavar="BACKEND",
        help="Backend of the fixtures' worlds: gloo or nccl (default: gloo on cpu, nccl on cuda)",
    )
    group.addoption(
        "--ddpcheck-fuzz-config",
        action="store_true",
        default=False,
        help="ddpcheck_run checks the target under each option its "
        "config_space() draws too (refused for a target with none)",
    )
    group.addoption(
        "--ddpcheck-config",
        action="store",
        default=None,
        metavar="FILE",
        help="The framework's own configuration for the ready-made framework "
        "target a test passes to ddpcheck_run: a JSON file, or MODULE:NAME "
        'naming a dict (docs/frameworks.md, "Your own configuration")',
    )


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclasses.dataclass(frozen=True)
class Session:
    """One pytest session's ddpcheck: its --ddpcheck-* options as admitted once
    (``_runs.admission.Request``, no target yet: each ``ddpcheck_run`` admits its own), and how
    the session runs them."""

    request: Request
    workers: int  # processes running worlds at once (pytest-xdist's)
    given: bool = False  # a --ddpcheck-* option was on the command line

    @property
    def world_sizes(self) -> tuple[int, ...]:
        return self.request.world_sizes

    @property
    def deadline(self) -> float:
        return self.request.deadline

    @property
    def without(self) -> frozenset[str]:
        """Features never exercised: --ddpcheck-without, and the dtypes --ddpcheck-dtypes
        leaves out."""
        return self.request.battery_without

    @property
    def device(self) -> str:
        return self.request.device

    @property
    def backend(self) -> str | None:
        return self.request.backend

    @property
    def config(self) -> str | None:
        """--ddpcheck-config: ``ddpcheck_run``'s framework target is built with it."""
        return self.request.config

    def header(self) -> str:
        sizes = "world sizes " + ",".join(map(str, self.world_sizes))
        if self.request.meshes is not None:
            sizes = "meshes " + ",".join(map(mesh_text, self.request.meshes))
        without = f", without {','.join(sorted(self.without))}" if self.without else ""
        where = (
            ""
            if self.device == "cpu" and self.backend is None
            else f", device {self.device}{f' over {self.backend}' if self.backend else ''}"
        )
        options = ", options fuzzed" if self.request.fuzz_config else ""
        return (
            f"ddpcheck: {sizes}, deadline {self.deadline:g} s{without}{where}"
            f"{options}, {self.workers} worker process(es) each keeping its own worlds"
        )


#: Where the plugin keeps its state on the pytest config (``config.stash``, not attributes).
OPTIONS = pytest.StashKey[Session]()
EXAMPLES = pytest.StashKey[int]()


def resolve_options(config: pytest.Config) -> Session:
    """The --ddpcheck-* options, admitted as every door's (``_runs.admission``), once for the
    session; raises pytest.UsageError naming the flag."""
    from ddpcheck._runs.admission import PYTEST, admit, config_value

    raw = {
        name: config.getoption(f"ddpcheck_{name}")
        for name in ("world_sizes", "deadline", "without", "dtypes", "only", "device")
    }
    raw["backend"] = config.getoption("ddpcheck_backend")
    raw["mesh"] = config.getoption("ddpcheck_mesh")
    raw["config"] = framework_config = config.getoption("ddpcheck_config")
    workers = _xdist_workers(config)
    try:
        # the machine's limit only for world sizes asked for: the plugin loads in every pytest
        # run, ddpcheck's or not (torch is imported only for cuda, to ask about the GPUs)
        request = admit(
            world_sizes=DEFAULT_WORLD_SIZES if raw["world_sizes"] is None else raw["world_sizes"],
            deadline=DEFAULT_DEADLINE if raw["deadline"] is None else raw["deadline"],
            without=raw["without"] or "",
            dtypes=raw["dtypes"],
            only=raw["only"] or "",
            device=raw["device"] or "cpu",
            backend=raw["backend"],
            spelling=PYTEST,
            workers=workers,
            fits_machine=raw["world_sizes"] is not None or raw["mesh"] is not None,
            fuzz_config=bool(config.getoption("ddpcheck_fuzz_config")),
            config=framework_config,
            meshes=raw["mesh"],
        )
        if framework_config is not None:  # read now: a wrong file is the session's usage error
            config_value(framework_config, flag="--ddpcheck-config")
    except InvalidArgument as exc:
        raise pytest.UsageError(str(exc)) from None
    given = any(v is not None for v in raw.values()) or request.fuzz_config
    return Session(request, workers, given)


def _xdist_workers(config: pytest.Config) -> int:
    numprocesses = getattr(config.option, "numprocesses", None)
    if isinstance(numprocesses, int) and numprocesses > 0:
        return numprocesses
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ddpcheck: a test that runs data-parallel examples")
    config.stash[OPTIONS] = resolve_options(config)
    config.stash[EXAMPLES] = 0


def pytest_report_header(config: pytest.Config) -> str | None:
    """Only when ddpcheck was asked for (an option) or the run is verbose: the plugin loads in
    every pytest run of every project that has ddpcheck installed. A run that used the fixtures
    gets the same line in its summary (:func:`pytest_terminal_summary`)."""
    options = config.stash[OPTIONS]
    if options.given or config.getoption("verbose") > 0:
        return options.header()
    return None


# ---------------------------------------------------------------------------------------------
# Session hooks


def pytest_sessionfinish(session: pytest.Session, exitstatus: int | pytest.ExitCode) -> None:
    """Stop this process's worlds, and hand the example count to the xdist controller."""
    examples = _examples_run()
    registry = sys.modules.get("ddpcheck._world.registry")
    if registry is not None:
        registry.shutdown_worlds()
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker
        workeroutput["ddpcheck_examples"] = examples
    else:
        session.config.stash[EXAMPLES] += examples


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist controller: add up the examples every worker ran."""
    output = getattr(node, "workeroutput", {}) or {}
    node.config.stash[EXAMPLES] += int(output.get("ddpcheck_examples", 0))


#: What each outcome of a failed test means, as its report says it (``ddpcheck.errors.ExitCode``).
OUTCOMES = {
    ExitCode.FOUND: "a data-parallel bug in the target; its replay line reproduces it",
    ExitCode.SETUP: "usage or set-up, not the target's fault",
    ExitCode.NOTHING_CHECKED: "nothing was checked (every example skipped or declined)",
    ExitCode.INTERNAL: "ddpcheck's own code failed, not a verdict on the target",
    ExitCode.INCONCLUSIVE: "no verdict either way: the ranks were still working when the "
    "wait ended (raise --ddpcheck-deadline), or a hang did not "
    "recur",
}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    """A test that failed with a ddpcheck outcome says which one (its ``ExitCode``), so a bug in
    the target is never confused with a set-up problem; the summary counts them. Its traceback
    ends at the test's call into ddpcheck (:func:`hide_own_frames`)."""
    if call.excinfo is not None:
        hide_own_frames(call.excinfo)
    outcome = yield
    report = outcome.get_result()
    excinfo = call.excinfo
    if report.failed and excinfo is not None and isinstance(excinfo.value, DdpcheckError):
        code = excinfo.value.exit_code
        report.user_properties.append(("ddpcheck_outcome", code.name))
        report.sections.append(("ddpcheck", f"ExitCode.{code.name}: {OUTCOMES.get(code, '')}"))


def hide_own_frames(excinfo: pytest.ExceptionInfo[BaseException]) -> None:
    """Give every ddpcheck module in ``excinfo``'s tracebacks (its causes and an exception
    group's members too) pytest's ``__tracebackhide__`` (:func:`outcome_raised`), which pytest
    reads from a frame's locals, then its module's globals: a test that failed with a ddpcheck
    outcome then shows its own frames down to its call into ddpcheck and the outcome's message
    (the divergence table, the replay line), not the source of the function deep inside that
    raised it. Set here, when a test fails, rather than in each of ddpcheck's modules: every
    module, present and future, is covered."""
    for frame in _frames(excinfo.value, set()):
        if _own_file(frame.f_code.co_filename):
            frame.f_globals.setdefault("__tracebackhide__", outcome_raised)


def outcome_raised(excinfo: object) -> bool:
    """``__tracebackhide__`` of ddpcheck's modules: hide the frame when the exception shown is a
    ddpcheck outcome, but not :class:`ddpcheck.InternalError` (those frames are the evidence of
    ddpcheck's own failure) nor an exception of the user's code passing through ddpcheck (a
    model that raised). ``--full-trace`` shows every frame, as for pytest's own."""
    error = getattr(excinfo, "value", None)
    return isinstance(error, DdpcheckError) and error.exit_code is not ExitCode.INTERNAL


def _frames(error: BaseException | None, seen: set[int]) -> Iterator[FrameType]:
    """The frames of ``error``'s traceback, its cause's, its context's and its members' (an
    exception group, as Hypothesis raises for several distinct failures)."""
    if error is None or id(error) in seen:
        return
    seen.add(id(error))
    tb = error.__traceback__
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next
    members = getattr(error, "exceptions", ())
    for linked in (
        error.__cause__,
        error.__context__,
        *(members if isinstance(members, (tuple, list)) else ()),
    ):
        if isinstance(linked, BaseException):
            yield from _frames(linked, seen)


#: ddpcheck's own folder: the frames of its files are its business, not the failing test's.
PACKAGE = pathlib.Path(__file__).resolve().parent


@functools.cache
def _own_file(filename: str) -> bool:
    try:
        return PACKAGE in pathlib.Path(filename).resolve().parents
    except (OSError, RuntimeError):
        return False


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    if getattr(config, "workerinput", None) is not None:
        return
    total = config.stash[EXAMPLES]
    if total:
        options = config.stash[OPTIONS]
        sizes = ",".join(map(str, options.world_sizes))
        terminalreporter.write_line(
            f"ddpcheck: {total} data-parallel examples run (fixture world "
            f"sizes {sizes}, deadline {options.deadline:g} s)"
        )
    counts: dict[str, int] = {}
    for report in terminalreporter.stats.get("failed", []):
        for key, value in getattr(report, "user_properties", ()):
            if key == "ddpcheck_outcome":
                counts[value] = counts.get(value, 0) + 1
    if counts:
        terminalreporter.write_line(
            "ddpcheck outcomes of failed tests: "
            + "; ".join(
                f"{n} {name} ({OUTCOMES.get(ExitCode[name], '')})"
                for name, n in sorted(counts.items())
            )
        )


def _examples_run() -> int:
    api = sys.modules.get("ddpcheck._runs.example")
    return getattr(api, "EXAMPLES_RUN", 0) if api is not None else 0


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="session")
def ddpcheck_options(request: pytest.FixtureRequest) -> Session:
    """The resolved --ddpcheck-* options."""
    return request.config.stash[OPTIONS]


@pytest.fixture(scope="session")
def ddpcheck_world(ddpcheck_options: Session) -> Callable[[int], World]:
    """``ddpcheck_world(W)``: the persistent world of W ranks on the session's device (started on
    first use)."""
    return functools.partial(
        get_world, device=ddpcheck_options.device, backend=ddpcheck_options.backend
    )


@pytest.fixture(scope="session")
def ddpcheck_run(ddpcheck_options: Session) -> Callable[..., Report]:
    """``ddpcheck_run(target, scenario=None, world_sizes=None)``: ``assert_equivalent`` with the
    session's world sizes, deadline, excluded features, device and ``--ddpcheck-fuzz-config``;
    a ready-made framework target built with ``--ddpcheck-config`` where it is given. The
    session's options were admitted once; each call admits its target (and scenario, and world
    sizes where given) against them."""

    from ddpcheck._runs.admission import API, admit_target
    from ddpcheck._runs.equivalence import assert_admitted
    from ddpcheck._world.interrupts import interruptible

    # Python values, named as assert_equivalent names them; the configuration by its flag
    spelling = dataclasses.replace(API, config="--ddpcheck-config", meshes="--ddpcheck-mesh")

    @interruptible
    def ddpcheck_run(
        target: Target, scenario: Scenario | None = None, world_sizes: Iterable[int] | None = None
    ) -> Report:
        request = admit_target(
            ddpcheck_options.request,
            target,
            scenario=scenario,
            world_sizes=world_sizes or None,
            spelling=spelling,
        )
        return assert_admitted(request)

    return ddpcheck_run


# ---------------------------------------------------------------------------------------------
# Plain functions behind the fixtures


def get_world(world_size: int, device: str = "cpu", backend: str | None = None) -> World:
    from ddpcheck._world.registry import get_world as _get_world

    return _get_world(world_size, device=device, backend=backend)
