"""ddpcheck's own glue is never the target's verdict (issue 37): a ready-made framework target
refuses a framework release older than it supports before any world runs (exit 2, both releases
named), and an exception raised in its glue code inside a rank is an ``InternalError`` (exit 4,
the release named) -- from the API and from the command line -- while an exception raised inside
the framework's own code stays the framework's failure (exit 1 when it needs a second rank;
exit 2, the target's set-up error naming the function, when it raises without data parallelism:
issue 50).

The framework is a fake ``deepspeed`` package on ``sys.path``, with a ``dist-info`` giving its
release: no real old release is needed. The ranks import it, so every test here starts and ends
with no world alive (a rank keeps a module it imported)."""

from __future__ import annotations

import sys
import traceback

import pytest
import torch

import ddpcheck
from ddpcheck import cli, targets, zoo
from ddpcheck.errors import ExitCode
from ddpcheck.scenario import Scenario
from ddpcheck.targets.framework import raised_in_glue

SCENARIO = Scenario(zoo.MLP, dtype="float32", global_batch=4, steps=1)
#: DeepSpeed's target by its module-level name: the command line takes it installed or not
SPEC = "ddpcheck.targets:DEEPSPEED_ZERO1"
CHECK = ["check", SPEC, "--dtypes", "float32", "--examples", "1", "--world-sizes", "2"]

#: What ``DeepSpeedTarget.warm_up`` imports, present in every fake: the set-up passes.
_WARM_UP_API = {
    "accelerator.py": "def get_accelerator():\n    return _Cpu()\n\n\nclass _Cpu:\n"
    "    def create_op_builder(self, name):\n        return None\n",
    "comm/__init__.py": "",
    "comm/torch.py": "def build_shm_op():\n    return None\n",
}


@pytest.fixture
def fake_deepspeed(tmp_path, monkeypatch):
    """``make(release, init_source)``: a fake ``deepspeed`` of that release, first on sys.path."""
    ddpcheck.shutdown_worlds()  # no rank holds a DeepSpeed imported before

    def make(release: str, init_source: str = "") -> None:
        package = tmp_path / "deepspeed"
        for name, source in {"__init__.py": init_source, **_WARM_UP_API}.items():
            (package / name).parent.mkdir(parents=True, exist_ok=True)
            (package / name).write_text(source)
        info = tmp_path / f"deepspeed-{release}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {release}\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))

    yield make
    ddpcheck.shutdown_worlds()  # ... nor this fake
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
        del sys.modules[name]


def test_an_older_release_is_refused_before_any_world_runs(fake_deepspeed, monkeypatch, capsys):
    fake_deepspeed("0.18.9")

    def no_world(*args, **kwargs):
        raise AssertionError("a world was asked for")

    monkeypatch.setattr("ddpcheck._runs.example.world_of", no_world)
    with pytest.raises(ddpcheck.SetupError, match=r"deepspeed 0\.19\.0 and later.*0\.18\.9"):
        ddpcheck.check_example(targets.DEEPSPEED_ZERO1, SCENARIO, 2)
    assert cli.main(CHECK) == ExitCode.SETUP
    err = capsys.readouterr().err
    assert "deepspeed 0.18.9 is installed here" in err and "Traceback" not in err


@pytest.mark.slow  # a fresh world, an example and a check: ~7 s of CPU
def test_a_glue_failure_is_internal_never_a_verdict(fake_deepspeed, capsys):
    fake_deepspeed("0.19.8")  # a release the target supports, without deepspeed.initialize
    with pytest.raises(ddpcheck.InternalError) as info:
        ddpcheck.check_example(targets.DEEPSPEED_ZERO1, SCENARIO, 2)
    message = str(info.value)
    assert "ddpcheck's glue code for DeepSpeedTarget failed under deepspeed 0.19.8" in message
    assert "has no attribute 'initialize'" in message and "targets/deepspeed.py" in message
    assert info.value.exit_code == ExitCode.INTERNAL
    status = cli.main(CHECK)
    out = capsys.readouterr()
    assert status == ExitCode.INTERNAL, out.out + out.err
    assert "has no attribute 'initialize'" in out.err and "diverged" not in out.out


@pytest.mark.slow  # a fresh world and an example: ~6 s of CPU
def test_an_exception_inside_the_framework_stays_its_failure(fake_deepspeed):
    fake_deepspeed(
        "0.19.8",
        "def initialize(**kwargs):\n    raise RuntimeError('the engine failed to partition')\n",
    )
    # it raises at every world size: the set-up error naming the framework's function, never
    # ddpcheck's InternalError (not a SetupError)
    with pytest.raises(ddpcheck.SetupError) as info:
        ddpcheck.check_example(targets.DEEPSPEED_ZERO1, SCENARIO, 2)
    assert "fails without data parallelism" in str(info.value), str(info.value)
    assert "the engine failed to partition" in str(info.value)
    assert "`initialize`" in str(info.value), str(info.value)


# -- which exceptions are the glue's, on exceptions raised here (no world) --------------------


class _Model:
    """A prepared model whose framework object raises inside its own code."""

    class _Accelerator:
        def clip_grad_norm_(self, *args):
            raise RuntimeError("inside the framework")

    ddpcheck_accelerator = _Accelerator()

    def parameters(self):
        return []


def _raised(call) -> BaseException:
    try:
        call()
    except Exception as exc:
        return exc
    raise AssertionError("did not raise")


def test_the_innermost_frame_or_an_attribute_hook_makes_it_the_glues():
    # the glue reads an attribute the framework's object lacks: innermost frame in the glue
    missing = _raised(lambda: targets.FABRIC.make_scheduler(object(), 0.5))
    assert isinstance(missing, AttributeError) and raised_in_glue(missing)
    assert targets.FABRIC.glue_failure(missing).exit_code == ExitCode.INTERNAL

    # ... or through an __getattr__ that recurses (DeepSpeed 0.19.0's engine)
    class Recursing(torch.nn.Module):
        def __getattr__(self, name):
            return getattr(self, name)

    recursed = _raised(lambda: targets.ACCELERATE.micro_batch(Recursing(), None, 0, 1))
    assert isinstance(recursed, RecursionError) and raised_in_glue(recursed)

    # raised inside the framework's own method: the framework's
    inside = _raised(lambda: targets.ACCELERATE.clip_grad_norm(_Model(), None, 1.0, 2.0))
    assert not raised_in_glue(inside) and targets.ACCELERATE.glue_failure(inside) is None
    # a decline the glue raises on purpose is already an outcome
    assert targets.ACCELERATE.glue_failure(ddpcheck.NothingChecked("declined")) is None


def test_a_glue_failure_while_handling_the_frameworks_is_not_the_origin():
    def framework_fails_then_glue_fails():
        try:
            raise RuntimeError("inside the framework")
        except RuntimeError:
            targets.FABRIC.make_scheduler(object(), 0.5)  # the glue, failing after it

    chained = _raised(framework_fails_then_glue_fails)
    assert isinstance(chained, AttributeError), traceback.format_exception(chained)
    assert not raised_in_glue(chained)  # the first exception raised decides
