"""What a ready-made framework target promises besides its hooks: the releases it supports, and
that ddpcheck's own glue code failing is never reported as the framework's failure.

A framework target (``accelerate``, ``fabric``, ``lightning``, ``deepspeed_zero1/2``) is glue:
ddpcheck's code calling a framework's API the way its documentation shows. Two things can go wrong
that are nobody's data-parallel bug, and both used to end as exit 1, "rank failed" (DeepSpeed
0.19.0 lacks ``groups._release_process_group_references``, which the glue called):

* an installed release older than the glue was written for -- :attr:`Target.requires` states the
  oldest release tried and working, and :func:`check_requirements` refuses an older one in the
  checking process, before any world runs (:class:`SetupError`, exit 2, naming both releases);
* the glue itself raising in a rank, on any release -- :meth:`FrameworkTarget.glue_failure` turns
  it into :class:`InternalError` (exit 4: a bug in ddpcheck, with the traceback and the release).

Which failures are the glue's (:func:`raised_in_glue`): follow the exception's chain to the first
one raised (a failure while handling it came after, and must not hide it), then take the last
frame of its traceback in this package, ``ddpcheck/targets/``. The glue raised it when that frame
is the innermost one (a missing attribute of a module, a call with a keyword the release does not
take, the glue's own ``raise``), or when the next frame is an ``__getattr__``/``__setattr__`` the
glue's attribute access entered (a lazy module's missing name; DeepSpeed 0.19.0's
``DeepSpeedEngine.__getattr__``, which recursed without end on an attribute the glue had set).
Anything raised deeper, inside the framework's own code while it trains, stays the framework's: it
may be a real bug. A :class:`DdpcheckError` the glue raises on purpose (a decline) passes as is.

torch is a framework too. A target may state its torch floor in ``requires``, or per device in a
``requirements(device)`` method (FSDP2 runs on CUDA from torch 2.4 but on the CPU only later), and
any target, ready-made or yours, that meets an ``ImportError`` or ``AttributeError`` out of torch
-- an API the installed release lacks (torch 2.1 has no ``fully_shard``) -- is refused with
:class:`SetupError` (:func:`torch_api_missing`, exit 2), never a verdict.
"""

from __future__ import annotations

import importlib.metadata
import os
import traceback
import types

from ddpcheck._base.errors import DdpcheckError, InternalError, SetupError
from ddpcheck.targets.protocol import Target

__all__ = [
    "FrameworkTarget",
    "check_requirements",
    "install_command",
    "raised_in_glue",
    "requirements",
    "torch_api_missing",
]

#: This package's folder: ddpcheck's glue for the frameworks lives here.
_GLUE = os.path.dirname(os.path.realpath(__file__))
#: Attribute hooks an attribute access by the glue enters: their failure is the glue's.
_ATTRIBUTE_HOOKS = ("__getattr__", "__getattribute__", "__setattr__")


def requirements(target: Target, device: str = "cpu") -> tuple[tuple[str, str], ...]:
    """What ``target`` needs on ``device`` (``"cpu"``, ``"cuda"``): its ``requirements(device)``
    where it has one (a floor that depends on the device), else :attr:`Target.requires`."""
    per_device = getattr(target, "requirements", None)
    if callable(per_device):
        return tuple(per_device(device.split(":")[0]))
    return tuple(getattr(target, "requires", ()) or ())


def check_requirements(target: Target, device: str = "cpu") -> None:
    """Refuse a target whose :func:`requirements` on ``device`` name a distribution that is
    missing or older than the release given (:class:`SetupError`, naming both)."""
    from torch.torch_version import TorchVersion  # torch's comparison of release strings

    for distribution, minimum in requirements(target, device):
        release = _release(distribution)
        if release is None:
            raise SetupError(
                f"{type(target).__name__} drives {distribution}, which is not "
                f"installed here; it supports {distribution} {minimum} and later: "
                f"{install_command(distribution, minimum)}"
            )
        try:
            older = TorchVersion(release) < minimum
        except Exception:  # not a release number (a local build): let it run, as pip would
            older = False
        if older:
            on = f" on {device.split(':')[0]}" if distribution == "torch" else ""
            page = "torch-releases.md" if distribution == "torch" else "frameworks.md"
            raise SetupError(
                f"{type(target).__name__} supports {distribution} {minimum} and later{on}; "
                f"{distribution} {release} is installed here, which its glue does not support "
                f"(docs/{page} says why): {install_command(distribution, minimum)}"
            )


def torch_api_missing(target: Target, exc: BaseException) -> SetupError | None:
    """The outcome of ``exc``, raised in a rank running ``target``, when it is an
    ``ImportError`` or ``AttributeError`` out of torch: the installed torch lacks an API the
    target uses (torch 2.1.2: "cannot import name 'fully_shard' from 'torch.distributed.fsdp'").
    That is a set-up error naming the release (and the target's torch floor, where it states
    one), never a data-parallel bug; None for anything else."""
    origin = _first_raised(exc)
    if isinstance(exc, DdpcheckError) or not _out_of_torch(origin):
        return None
    release = _release("torch") or "(release unknown)"
    floor = dict(requirements(target)).get("torch")
    hint = (
        f"it supports torch {floor} and later: {install_command('torch', floor)}"
        if floor is not None
        else "install the torch release its code was written for"
    )
    return SetupError(
        f"{type(target).__name__} uses what torch {release} lacks -- "
        f"{type(origin).__name__}: {_short(origin)} -- torch's API, not a data-parallel bug; "
        f"{hint} (docs/torch-releases.md)"
    )


def _out_of_torch(exc: BaseException) -> bool:
    """An ImportError of a torch module or name, an AttributeError of a torch module, or either
    raised inside torch's own code."""
    if not isinstance(exc, (ImportError, AttributeError)):
        return False
    if isinstance(exc, ImportError) and (exc.name or "").split(".")[0] == "torch":
        return True
    obj = getattr(exc, "obj", None)
    if isinstance(obj, types.ModuleType) and obj.__name__.split(".")[0] == "torch":
        return True
    if str(exc).startswith(("module 'torch'", "module 'torch.")):
        return True
    frames = list(traceback.walk_tb(exc.__traceback__))
    if not frames or not _in_torch(frames[-1][0].f_code.co_filename):
        return False
    # nn.Module.__getattr__ raising for a module's own attribute: the caller's miss, not torch's
    return not (isinstance(exc, AttributeError) and frames[-1][0].f_code.co_name == "__getattr__")


def _in_torch(path: str) -> bool:
    import torch

    folder = os.path.dirname(os.path.realpath(torch.__file__))
    return os.path.realpath(path).startswith(folder + os.sep)


def install_command(distribution: str, minimum: str | None = None) -> str:
    """The pip command that installs ``distribution`` at a release the glue supports: the
    distribution itself, never an extra of ddpcheck, which is on no index and leaves out
    DeepSpeed (tests/front/test_install_commands.py resolves every hint)."""
    floor = "" if minimum is None else f">={minimum}"
    return f"pip install '{distribution}{floor}'"


def _release(distribution: str) -> str | None:
    """The installed release of ``distribution`` (by its metadata: its import name may differ,
    ``pytorch-lightning`` is ``pytorch_lightning``); None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def raised_in_glue(exc: BaseException) -> bool:
    """True when ``exc`` started in ddpcheck's glue code (see the module docstring)."""
    origin = _first_raised(exc)
    frames = [
        (frame.f_code.co_filename, frame.f_code.co_name)
        for frame, _ in traceback.walk_tb(origin.__traceback__)
    ]
    glue = [i for i, (path, _) in enumerate(frames) if _in_glue(path)]
    if not glue:
        return False
    last = glue[-1]
    return last == len(frames) - 1 or frames[last + 1][1] in _ATTRIBUTE_HOOKS


def _first_raised(exc: BaseException) -> BaseException:
    """The first exception of ``exc``'s chain: its explicit cause, else the one it was raised
    while handling, all the way down."""
    seen = {id(exc)}
    while True:
        earlier = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if earlier is None or id(earlier) in seen:
            return exc
        seen.add(id(earlier))
        exc = earlier


def _in_glue(path: str) -> bool:
    return os.path.dirname(os.path.realpath(path)) == _GLUE


class FrameworkTarget(Target):
    """A ready-made target driving a framework through ddpcheck's glue (see the module
    docstring): it states ``requires`` and tells its glue's failures apart."""

    def glue_failure(self, exc: BaseException) -> InternalError | None:
        """The outcome of ``exc``, raised in a rank running this target, when ddpcheck's glue
        raised it (:func:`raised_in_glue`): an :class:`InternalError` naming the framework's
        release and carrying the traceback; None for anything else."""
        if isinstance(exc, DdpcheckError) or not raised_in_glue(exc):
            return None
        origin = _first_raised(exc)
        releases = ", ".join(
            f"{name} {_release(name) or 'not installed'} (supported: {minimum} and later)"
            for name, minimum in self.requires
        )
        return InternalError(
            f"ddpcheck's glue code for {type(self).__name__} failed under {releases}: "
            f"{type(origin).__name__}: {_short(origin)} -- a bug in ddpcheck, not a verdict on "
            "the framework; please report it with this traceback:\n"
            + "".join(traceback.format_exception(exc)).rstrip()
        )


def _short(exc: BaseException, limit: int = 300) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + "..."
