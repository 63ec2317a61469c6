"""xdist scheduling for this suite: a worker more than the cores, the slow tests first, and
tests that share an expensive module-scoped fixture (or a framework imported into every rank) on
one worker.

The suite is CPU-bound on two cores: what decides its wall time is that every core stays busy to
the end (hence a worker more than the cores, below). Handed out in collection order, a
minute-long test drawn last leaves one worker idle while the other finishes it; the tests marked
``slow`` (seconds of CPU each, measured: a process of their own, a search, a whole battery)
therefore go first, in collection order among themselves, and the many short ones fill in behind
them. A quick test that shares a module fixture with a slow one is marked too: split apart, a run
without xdist would build the fixture twice.

``pytest -n auto`` hands tests out one by one (``--dist load``), so the tests of one module land on
several workers and each worker computes the module's fixtures again: the wheel build of
tests/front/test_wheel.py, the fuzzing of tests/targets/test_examples.py.
In a ``-n`` run with the default ``--dist load`` the tests listed in :data:`SHARED` go to one
worker as a unit; every other test is still handed out one at a time, in the order above. (xdist's
own ``xdist_group`` marker does not group here: with pytest 9 the worker's renamed test ids do
not reach the scheduler.) An explicit other ``--dist``, ``-p no:xdist`` and runs without ``-n``
are left alone.
"""

from __future__ import annotations

import os

import pytest

#: Test-id prefixes -> the group that runs on one worker: tests sharing a costly module fixture.
SHARED = {
    "tests/front/test_wheel.py::": "wheel",  # `built`: the wheel and the sdist
    # `fuzzed`: three fuzz runs, for their verdicts and their replay lines
    "tests/targets/test_examples.py::test_the_seeded_bug_is_found_by_random_examples": (
        "examples-fuzzed"
    ),
    "tests/targets/test_examples.py::test_the_replay_line_fails_the_same_way": "examples-fuzzed",
    # one task in a world answering many parametrized tests: once, not once per worker
    "tests/front/test_bad_input.py::test_parallel_argument_errors_name_the_argument": (
        "parallel-answers"
    ),
    "tests/parallel/test_sharded_optimizer.py::test_misuse_raises_a_message_naming": "misuse",
    "tests/runs/test_trace.py::": "traces",  # `traces`: one traced step at W=2
}
#: The tests that run a framework's target (Lightning, Fabric, accelerate, the HF Trainer) or
#: build its configurations: one worker. A framework, once imported, stays in every rank of the
#: worker's persistent worlds (and in the worker): ~1.5 s of CPU per rank for lightning, as much
#: for transformers' Trainer, paid in each worker that meets it. The first five files here, run
#: with `-n 3`: 180-184 CPU-s spread over the workers, 156-157 on one (2026-12-07, back to back,
#: twice each).
FRAMEWORK_TESTS = [
    "tests/mutation/test_option_mutants.py::",
    "tests/targets/test_configurations.py::",
    "tests/targets/test_frameworks.py::",
    "tests/targets/test_hf_trainer.py::",
    "tests/targets/test_hf_tp.py::",
    "tests/targets/test_hf_models.py::",
    "tests/targets/test_deepspeed_autotp.py::",
    "tests/targets/test_hf_auto.py::",
    "tests/targets/test_accelerate_nd.py::",
    "tests/targets/test_data_path.py::",
    "tests/targets/test_config_spaces.py::",
    "tests/targets/test_declined_features.py::",
    "tests/targets/test_torchtitan.py::",
    "tests/runs/test_fuzz_config.py::test_the_draw_covers_every_option_and_shrinks_them_away",
    "tests/runs/test_fuzz_config.py::test_a_large_nested_option_is_surveyed_a_key_per_row",
    "tests/runs/test_fuzz_config.py::test_every_ready_made_option_builds_a_replayable_target",
]
SHARED.update(dict.fromkeys(FRAMEWORK_TESTS, "frameworks"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker more than xdist's count of cores. Some tests spend most of their
    wall time waiting for a deadline to pass (the hang tests, the fault table's sleepers), and
    the others mostly compute on one core: with a worker per core, 10 % of a whole run's CPU went
    unused; with one more, 3 %, and the run took 510 s, not 536 s. ``PYTEST_XDIST_AUTO_NUM_WORKERS``
    still decides when it is set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    from xdist.plugin import pytest_xdist_auto_num_workers as cores

    return cores(config) + 1


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: slow first


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            for prefix, group in SHARED.items():
                if nodeid.startswith(prefix):
                    return group
            return nodeid  # a unit of its own, as under --dist load

    return SharedFixtureScheduling(config, log)


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread_in_the_test_process():
    """One intra-op thread for torch in each process running tests, as ddpcheck gives itself
    while it checks an example (``_runs.example._beside_the_ranks``) and every rank has. What the
    tests compute here themselves -- Hypothesis draws of models, a test's own forward and
    backward beside ddpcheck's -- shares two cores with the other workers and the ranks, and a
    second thread of every small op spins waiting for a core: measured, the feature-rate test
    took 7.7 s of CPU with two threads and 1.4 s with one. No test depends on this process's
    default: the one about thread counts (tests/world/test_isolation.py) sets its own."""
    import torch

    torch.set_num_threads(1)


# Fixtures every test module may ask for by name.
from tests.processes import no_process_started  # noqa: E402,F401 -- a fixture
