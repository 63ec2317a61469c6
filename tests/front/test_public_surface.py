"""One public surface: ``ddpcheck.__all__`` is what the README documents, every name is reachable
from a fresh ``import ddpcheck`` (without importing torch until a name needs it), every outcome
derives from ``DdpcheckError`` with its ``ExitCode``, and whatever ddpcheck prints as code --
scenarios, replay lines, survey cells -- evaluates after ``import ddpcheck, torch`` alone.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import subprocess
import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ddpcheck
from ddpcheck import features
from ddpcheck import strategies as dst
from ddpcheck.battery import BATTERY
from ddpcheck.errors import ExitCode
from tests.patience import patience

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _fresh(code: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=patience(300),
        cwd=ROOT,
    )


def test_all_is_what_the_readme_documents():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- public-api.*?-->(.*?)<!-- /public-api -->", text, re.S)
    assert block, "README.md has no <!-- public-api --> list"
    documented = set(re.findall(r"`(\w+)`", block.group(1)))
    assert documented == set(ddpcheck.__all__), (
        f"documented only: {sorted(documented - set(ddpcheck.__all__))}; "
        f"in __all__ only: {sorted(set(ddpcheck.__all__) - documented)}"
    )


def test_every_public_name_is_reachable_from_a_fresh_import_and_torch_loads_late():
    done = _fresh(
        "import sys, ddpcheck\n"
        "assert 'torch' not in sys.modules, 'import ddpcheck loaded torch'\n"
        "assert 'hypothesis' not in sys.modules, 'import ddpcheck loaded hypothesis'\n"
        "missing = [n for n in ddpcheck.__all__ if getattr(ddpcheck, n, None) is None]\n"
        "assert not missing, missing\n"
        "assert sorted(dir(ddpcheck)) == sorted(set(dir(ddpcheck))), 'dir() repeats names'\n"
    )
    assert done.returncode == 0, done.stderr


def test_the_ready_made_targets_import_no_framework_until_one_runs():
    # every rank imports ddpcheck.targets; HF_TRAINER's construction once imported transformers
    # (and accelerate through it): ~1 s of CPU in every rank of every world, every CLI run
    done = _fresh(
        "import sys, ddpcheck, ddpcheck.targets, ddpcheck.cli\n"
        "ddpcheck.targets.HfTrainerTarget(config={}).supported_features\n"
        "frameworks = ('transformers', 'accelerate', 'lightning', 'deepspeed')\n"
        "loaded = [m for m in frameworks if m in sys.modules]\n"
        "assert not loaded, f'importing the targets loaded {loaded}'\n"
    )
    assert done.returncode == 0, done.stderr


def test_outcomes_have_one_root_and_one_exit_code_each():
    expected = {
        ddpcheck.EquivalenceError: ExitCode.FOUND,
        ddpcheck.InvalidArgument: ExitCode.SETUP,
        ddpcheck.SetupError: ExitCode.SETUP,
        ddpcheck.WorldStartError: ExitCode.SETUP,
        ddpcheck.ScenarioError: ExitCode.SETUP,
        ddpcheck.WorldFailure: ExitCode.SETUP,
        ddpcheck.NothingChecked: ExitCode.NOTHING_CHECKED,
        ddpcheck.InternalError: ExitCode.INTERNAL,
        ddpcheck.Inconclusive: ExitCode.INCONCLUSIVE,
    }
    for cls, code in expected.items():
        assert issubclass(cls, ddpcheck.DdpcheckError), cls
        assert cls.exit_code is code, cls
    assert issubclass(ddpcheck.EquivalenceError, AssertionError)  # pytest shows it as a failure
    assert issubclass(ddpcheck.InvalidArgument, ValueError)
    assert [int(c) for c in ExitCode] == [0, 1, 2, 3, 4, 5, 130, 143, 141]


def _exercising(feature: str) -> list[str]:
    """Reprs of four random scenarios exercising ``feature``."""
    texts = []

    @settings(
        max_examples=4,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def draw(data):
        texts.append(repr(data.draw(dst.exercising(feature, world_size=3))))

    draw()
    return texts


def _printed_scenarios() -> list[str]:
    """Reprs of the battery and of random scenarios exercising every feature."""
    texts = [repr(scenario) for _, scenario in BATTERY]
    for feature in features.FEATURES:
        texts += _exercising(feature)
    texts.append(
        repr(ddpcheck.Scenario(ddpcheck.zoo.MLP, max_grad_norm=0.5, grad_norm_type=math.inf))
    )
    return texts


def test_printed_scenarios_evaluate_after_importing_ddpcheck_and_torch_alone():
    texts = _printed_scenarios()
    done = _fresh(
        "import json, sys\n"
        "import ddpcheck, torch\n"
        "texts = json.loads(sys.stdin.read())\n"
        "for text in texts:\n"
        "    scenario = eval(text, {'ddpcheck': ddpcheck, 'torch': torch})\n"
        "    assert repr(scenario) == text, (repr(scenario), text)\n"
        "print(len(texts))\n",
        stdin=json.dumps(texts),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout) == len(texts) >= 60


def test_replay_lines_name_only_what_a_fresh_interpreter_can_import():
    from ddpcheck._runs.replay import replay_command

    scenario = ddpcheck.Scenario(ddpcheck.zoo.MLP, max_grad_norm=1.0, grad_norm_type=math.inf)
    line = replay_command(ddpcheck.targets.TORCH_DDP, scenario, 2)
    text = re.search(r"--scenario '(.*)'$", line).group(1)
    done = _fresh(f"import ddpcheck, torch\nprint(repr(eval({text!r})))")
    assert done.returncode == 0 and done.stdout.strip() == text, done.stderr
