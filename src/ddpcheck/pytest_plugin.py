"""pytest plugin of ddpcheck (registered through the ``pytest11`` entry point).

Laid out in the order pytest calls it: options, configuration, session hooks, fixtures, then the
plain functions behind the fixtures. Importing it is cheap and side-effect free: it imports
neither torch nor hypothesis, and never touches the user's Hypothesis profile. Under xdist every
worker keeps its own persistent worlds; each worker stops them at the end of its session and the
controller prints the total number of examples run.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import pytest

DEFAULT_WORLD_SIZES = (1, 2, 3, 4)
DEFAULT_DEADLINE = 60.0
#: More rank processes than this per core is refused: they would mostly wait for each other.
MAX_RANKS_PER_CORE = 16


# ---------------------------------------------------------------------------------------------
# Options
#
# 'Help' formatting (same rules as pytest's): start with a capital letter; a single phrase has no
# period; several phrases all end with periods.


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("ddpcheck", "data-parallel equivalence checks")
    group.addoption("--ddpcheck-world-sizes", action="store", default=None, metavar="W,W,...",
                    help="World sizes the ddpcheck fixtures use (default 1,2,3,4)")
    group.addoption("--ddpcheck-deadline", action="store", default=None, metavar="SECONDS",
                    help="Seconds one example may take before it counts as hung (default 60)")


# ---------------------------------------------------------------------------------------------
# Configuration


class Options:
    """The resolved ddpcheck options of one pytest session."""

    def __init__(self, world_sizes: tuple[int, ...], deadline: float, workers: int):
        self.world_sizes = world_sizes
        self.deadline = deadline
        self.workers = workers

    def header(self) -> str:
        sizes = ",".join(map(str, self.world_sizes))
        return (f"ddpcheck: world sizes {sizes}, deadline {self.deadline:g} s, "
                f"{self.workers} worker process(es) each keeping its own worlds")


def resolve_options(config: Any) -> Options:
    """Every cross-option rule in one place; raises pytest.UsageError naming the flags."""
    raw = config.getoption("ddpcheck_world_sizes")
    try:
        sizes = tuple(int(p) for p in raw.split(",") if p.strip()) if raw else DEFAULT_WORLD_SIZES
    except ValueError:
        raise pytest.UsageError(f"--ddpcheck-world-sizes={raw!r} must be comma-separated "
                                "integers, such as 1,2,3,4") from None
    if not sizes or any(s < 1 for s in sizes):
        raise pytest.UsageError(f"--ddpcheck-world-sizes={raw!r} must list positive integers")
    raw_deadline = config.getoption("ddpcheck_deadline")
    try:
        deadline = float(raw_deadline) if raw_deadline is not None else DEFAULT_DEADLINE
    except ValueError:
        deadline = -1.0
    if not deadline > 0:
        raise pytest.UsageError(f"--ddpcheck-deadline={raw_deadline!r} must be a positive "
                                "number of seconds")
    workers = _xdist_workers(config)
    cores = os.cpu_count() or 1
    # Only when asked for: the plugin loads in every pytest run, ddpcheck's or not.
    if raw and workers * max(sizes) > MAX_RANKS_PER_CORE * cores:
        raise pytest.UsageError(
            f"-n {workers} with --ddpcheck-world-sizes up to {max(sizes)} would start "
            f"{workers * max(sizes)} rank processes on {cores} cores; lower -n or the largest "
            "world size")
    return Options(sizes, deadline, workers)


def _xdist_workers(config: Any) -> int:
    numprocesses = getattr(config.option, "numprocesses", None)
    if isinstance(numprocesses, int) and numprocesses > 0:
        return numprocesses
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "ddpcheck: a test that runs data-parallel examples")
    config._ddpcheck_options = resolve_options(config)
    config._ddpcheck_examples = 0


def pytest_report_header(config: Any) -> str:
    return config._ddpcheck_options.header()


# ---------------------------------------------------------------------------------------------
# Session hooks


def pytest_sessionfinish(session: Any, exitstatus: Any) -> None:
    """Stop this process's worlds, and hand the example count to the xdist controller."""
    examples = _examples_run()
    world = sys.modules.get("ddpcheck._internal.world")
    if world is not None:
        world.shutdown_worlds()
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker
        workeroutput["ddpcheck_examples"] = examples
    else:
        session.config._ddpcheck_examples += examples


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist controller: add up the examples every worker ran."""
    output = getattr(node, "workeroutput", {}) or {}
    node.config._ddpcheck_examples += int(output.get("ddpcheck_examples", 0))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: Any, config: Any) -> None:
    if getattr(config, "workerinput", None) is not None:
        return
    total = config._ddpcheck_examples
    if total:
        terminalreporter.write_line(f"ddpcheck: {total} data-parallel examples run")


def _examples_run() -> int:
    api = sys.modules.get("ddpcheck.api")
    return getattr(api, "EXAMPLES_RUN", 0) if api is not None else 0


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="session")
def ddpcheck_options(request: Any) -> Options:
    """The resolved --ddpcheck-* options."""
    return request.config._ddpcheck_options


@pytest.fixture(scope="session")
def ddpcheck_world(ddpcheck_options: Options) -> Callable[[int], Any]:
    """``ddpcheck_world(W)``: the persistent world of W ranks (spawned on first use)."""
    return get_world


@pytest.fixture(scope="session")
def ddpcheck_run(ddpcheck_options: Options) -> Callable[..., Any]:
    """``ddpcheck_run(target, scenario=None, world_sizes=None)``: ``assert_equivalent`` with the
    session's world sizes and deadline."""

    def run(target: Any, scenario: Any = None, world_sizes: Any = None) -> Any:
        import ddpcheck

        return ddpcheck.assert_equivalent(
            target, scenario, world_sizes=world_sizes or ddpcheck_options.world_sizes,
            deadline=ddpcheck_options.deadline)

    return run


# ---------------------------------------------------------------------------------------------
# Plain functions behind the fixtures


def get_world(world_size: int) -> Any:
    from ddpcheck._internal.world import get_world as _get_world

    return _get_world(world_size)
