"""Records every collective a rank issues through ``torch.distributed``'s Python API.

Invariant: once :func:`install` ran in a rank process, each call of a wrapped ``torch.distributed``
function appends one :class:`Collective` to the current log *before* the call goes on the wire, so
the log of a rank that hangs inside a collective still ends with that collective. The oracle uses
the log for the communication budget (gradient bytes cross the wire once per step) and to point at
the first collective where ranks disagree; ``ddpcheck trace`` draws it as a timeline.

Call site: each record carries ``site``, ``"file:line in function"`` of the first frame outside
``torch.distributed`` and this module -- the line of the target (or of ``parallel/``) that issued
it, so a hang report can point at it. It is written to the sequence file but is not part of the
signature ranks must agree on. Cost: a walk of a few frames, with the per-code-object verdict and
file name cached: 0.2-0.6 us per collective (a W=1 gloo all_reduce of 4 floats: 21.4 vs 21.0 us).

Timing: ``launched`` is taken at the call. A blocking call sets ``completed`` when it returns. An
``async_op=True`` call returns the torch ``Work`` inside a thin proxy: ``completed`` is when the
work finished (its future's callback, or else the ``wait()``), ``waited`` when ``wait()`` returned;
a collective nobody waited for keeps both None.

What it sees: calls made as ``torch.distributed.<op>(...)`` (``parallel/``, torch's
ZeroRedundancyOptimizer, FSDP2's all-gathers and reduce-scatters, most hand-written code), and
torch's functional collectives (``torch.distributed._functional_collectives``: every
redistribution of a DTensor -- a tensor-parallel plan's all-reduces, gathers and reduce-scatters,
``loss_parallel()``'s, ``DTensor.full_tensor()``, a norm over DTensors in clipping), marked
``functional`` (the outermost call only: one function of that module calling another is one
collective). What it cannot see: collectives issued from C++ (torch DDP's Reducer buckets), which
never pass through Python, and DTensor's set-up broadcasts and scatters (``distribute_tensor``),
which call c10d's functions by their own names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import CodeType, FrameType, ModuleType
from typing import SupportsIndex, SupportsInt, cast

import torch
import torch.distributed
import torch.distributed as dist

from ddpcheck._language.records import Collective

__all__ = ["Collective", "install", "paused", "record_to", "records", "reset", "restart_sequence"]

# op name -> (positional index of the tensor argument(s), name of the root argument or None)
_OPS: dict[str, tuple[int, str | None]] = {
    "all_reduce": (0, None),
    "broadcast": (0, "src"),
    "reduce": (0, "dst"),
    "all_gather": (1, None),
    "all_gather_into_tensor": (1, None),
    "all_gather_single": (1, None),  # FSDP2's parameter all-gather (torch 2.13)
    "gather": (0, "dst"),
    "scatter": (0, "src"),
    "reduce_scatter": (1, None),  # (output, input_list): counted by its input, as the others
    "reduce_scatter_tensor": (1, None),
    "reduce_scatter_single": (1, None),  # FSDP2's gradient reduce-scatter (torch 2.13)
    "all_to_all": (1, None),
    "all_to_all_single": (1, None),
    "barrier": (-1, None),
    "broadcast_object_list": (0, "src"),
    "all_gather_object": (1, None),
    "gather_object": (0, "dst"),
    "scatter_object_list": (1, "src"),
}


#: torch's functional collectives (``torch.distributed._functional_collectives``), the leaves
#: and the names that delegate to them alike: only the outermost call is recorded
_FUNCTIONAL = (
    "all_reduce",
    "broadcast",
    "all_gather_single",
    "all_gather_single_autograd",
    "all_gather_tensor",
    "all_gather_tensor_autograd",
    "reduce_scatter_single",
    "reduce_scatter_single_autograd",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd",
    "all_reduce_coalesced",
    "all_gather_single_coalesced",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced",
    "all_to_all_single",
    "all_to_all_single_autograd",
)

_log: list[Collective] = []
_inside_functional = [0]  # depth of wrapped functional calls on this (the only) thread
_installed = False
_paused = False  # inside paused(): collectives are not logged
_sequence_fd: int | None = None  # the sequence file, opened O_APPEND; None: not recording


def record_to(path: str | None) -> None:
    """Also append every collective, from now on, to the sequence file ``path`` (None: stop)."""
    global _sequence_fd
    if _sequence_fd is not None:
        os.close(_sequence_fd)
        _sequence_fd = None
    if path is not None:
        _sequence_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o600)


def restart_sequence() -> None:
    """Empty the sequence file: the world calls this at the start of every task."""
    if _sequence_fd is not None:
        os.ftruncate(_sequence_fd, 0)  # O_APPEND: the next write lands at the new end


def sequence_line(c: Collective) -> bytes:
    """One record of the sequence file: the signature fields, then the call site, as a Python
    literal."""
    return (repr((c.op, c.dtypes, c.shapes, c.root, c.group, c.reduce_op, c.site)) + "\n").encode()


# code object -> its display file name, or None for frames to skip (torch.distributed, this module)
_SITE_FILES: dict[CodeType, str | None] = {}


def call_site(depth: int = 2) -> str:
    """``"file:line in function"`` of the first caller frame outside ``torch.distributed`` and
    this module (``depth`` frames up is where to start looking); ``""`` if there is none.

    File names are shown relative to the current directory when they are under it."""
    try:
        frame: FrameType | None = sys._getframe(depth)
    except ValueError:
        return ""
    while frame is not None:
        code = frame.f_code
        try:
            shown = _SITE_FILES[code]
        except KeyError:
            shown = _SITE_FILES[code] = _display_name(code.co_filename)
        if shown is not None:
            return f"{shown}:{frame.f_lineno} in {code.co_name}"
        frame = frame.f_back
    return ""


def _display_name(path: str) -> str | None:
    if path == __file__ or path.startswith(_skipped_dir()):
        return None
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


@functools.lru_cache(maxsize=1)
def _skipped_dir() -> str:
    return os.path.dirname(torch.distributed.__file__) + os.sep


def records() -> list[Collective]:
    """The collectives issued since the last :func:`reset`, in call order."""
    return list(_log)


def reset() -> None:
    _log.clear()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Collectives issued inside are not logged: the harness's own gathers of sharded tensors
    (``Target.full_tensor``), which are no part of the target's communication. They still go to
    the sequence file, where every rank issues them in the same order."""
    global _paused
    before, _paused = _paused, True
    try:
        yield
    finally:
        _paused = before


def wrapped() -> list[str]:
    """The names of the ``torch.distributed`` functions :func:`install` wrapped."""
    return [n for n in _OPS if getattr(getattr(dist, n, None), "__ddpcheck_original__", None)]


def install() -> None:
    """Wrap ``torch.distributed``'s collectives in this process. Idempotent."""
    global _installed
    if _installed:
        return

    for name, (index, root_name) in _OPS.items():
        original = getattr(dist, name, None)
        if original is not None:
            setattr(dist, name, _wrap(name, original, index, root_name))
    import torch.distributed._functional_collectives as funcol  # in every torch >= 2.1

    for name in _FUNCTIONAL:
        original = getattr(funcol, name, None)
        if callable(original):
            _FUNCTIONAL_WRAPPED[name] = (original, _wrap_functional(name, original))
    record_functional(True)
    _installed = True


_FUNCTIONAL_WRAPPED: dict[str, tuple[Callable[..., object], Callable[..., object]]] = {}


def record_functional(enabled: bool) -> None:
    """Record torch's functional collectives (True, what :func:`install` does) or leave them
    unrecorded (False): ``bench/comm_record_cost.py`` measures what recording them costs, in one
    run, example by example."""
    import torch.distributed._functional_collectives as funcol

    for name, (original, wrapper) in _FUNCTIONAL_WRAPPED.items():
        setattr(funcol, name, wrapper if enabled else original)


def _wrap_functional(name: str, original: Callable[..., object]) -> Callable[..., object]:
    """A functional collective recorded as :func:`_wrap` records ``torch.distributed``'s: its
    first argument the tensor(s), ``group`` a process group, a mesh dimension, a name or ranks;
    ``reduceOp`` its reduction, ``src`` its root. Its result stays torch's (an
    ``AsyncCollectiveTensor``, waited for wherever torch reads it): ``completed`` stays None.
    Cost: ~30 us per call over torch's ~60 us (a one-rank all-reduce of 12 floats), each group's
    ranks looked up once per group name (``bench/comm_record_cost.py``)."""
    op = name.removesuffix("_autograd")

    @functools.wraps(original)
    def recorded(*args: object, **kwargs: object) -> object:
        if _inside_functional[0]:
            return original(*args, **kwargs)
        _inside_functional[0] += 1
        try:
            tensors = _tensors(args[0] if args else kwargs.get(_first_param(original, 0)))
            group = kwargs.get("group", _positional(original, args, "group"))
            reduce_op = kwargs.get("reduceOp", _positional(original, args, "reduceOp"))
            root = kwargs.get("src", _positional(original, args, "src"))
            record = Collective(
                op=op,
                nbytes=sum(t.numel() * t.element_size() for t in tensors),
                dtypes=tuple(str(t.dtype).replace("torch.", "") for t in tensors),
                shapes=tuple(tuple(t.shape) for t in tensors),
                root=root if isinstance(root, int) else None,
                group=_functional_group(group),
                reduce_op=None if reduce_op is None else str(reduce_op).upper(),
                async_op=False,
                launched=time.perf_counter(),
                site=call_site(),
                functional=True,
            )
            if not _paused:
                _log.append(record)
            # the harness's own gathers (paused) too, as torch.distributed's: a rank that issued
            # one DTensor collective more then pairs it with its peer's gather, which the wait
            # names as mismatched -- without them the peer seems to have issued nothing
            if _sequence_fd is not None:
                os.write(_sequence_fd, sequence_line(record))
            return original(*args, **kwargs)
        finally:
            _inside_functional[0] -= 1

    recorded.__ddpcheck_original__ = original  # type: ignore[attr-defined]
    return recorded


def _functional_group(group: object) -> tuple[int, ...] | None:
    """The global ranks of a functional collective's group: a ``(DeviceMesh, dim)`` pair, a
    one-dimensional mesh, a process group, its name or a list of ranks (None: the world's)."""
    if isinstance(group, list) and all(isinstance(r, int) for r in group):
        return tuple(group)
    try:
        from torch.distributed._functional_collectives import _resolve_group

        resolved = _resolve_group(cast(dist.ProcessGroup, group))
        if not isinstance(resolved, str):
            return _group_ranks(dist, resolved)
        if resolved not in _RANKS_OF_NAME:  # a group's name is never reused in a process
            process_group = dist.distributed_c10d._resolve_process_group(resolved)
            _RANKS_OF_NAME[resolved] = _group_ranks(dist, process_group)
        return _RANKS_OF_NAME[resolved]
    except Exception:  # a form this torch does not take: the call itself will say so
        return ()


_RANKS_OF_NAME: dict[str, tuple[int, ...] | None] = {}


def _wrap(
    name: str, original: Callable[..., object], index: int, root_name: str | None
) -> Callable[..., object]:
    @functools.wraps(original)
    def recorded(*args: object, **kwargs: object) -> object:
        tensors = _tensors(
            args[index] if 0 <= index < len(args) else kwargs.get(_first_param(original, index))
        )
        group = kwargs.get("group")
        if group is None and name != "barrier":
            group = _positional(original, args, "group")
        root = kwargs.get(root_name) if root_name else None
        if root_name and root is None:
            root = _positional(original, args, root_name)
        reduce_op = kwargs.get("op") if "op" in kwargs else _positional(original, args, "op")
        if reduce_op is None and name in (
            "all_reduce",
            "reduce",
            "reduce_scatter",
            "reduce_scatter_tensor",
            "reduce_scatter_single",
        ):
            reduce_op = dist.ReduceOp.SUM
        record = Collective(
            op=name,
            nbytes=sum(t.numel() * t.element_size() for t in tensors),
            dtypes=tuple(str(t.dtype).replace("torch.", "") for t in tensors),
            shapes=tuple(tuple(t.shape) for t in tensors),
            root=int(root) if isinstance(root, (SupportsInt, SupportsIndex)) else None,
            group=_group_ranks(dist, group),
            reduce_op=_op_name(reduce_op),
            async_op=bool(kwargs.get("async_op", _positional(original, args, "async_op") or False)),
            launched=time.perf_counter(),
            site=call_site(),
        )
        if not _paused:
            _log.append(record)
        if _sequence_fd is not None:  # before the call: a rank stuck inside it still shows it
            os.write(_sequence_fd, sequence_line(record))
        result = original(*args, **kwargs)
        if record.async_op and result is not None:
            return _RecordedWork(cast(dist.Work, result), record)  # an async op's Work
        _finish(record, completed=time.perf_counter())
        return result

    recorded.__ddpcheck_original__ = original  # type: ignore[attr-defined]
    return recorded


def _finish(entry: Collective, completed: float, waited: float | None = None) -> None:
    """Fill in the times of ``entry``, if it is still in the log (a reset may have dropped it)."""
    for i in range(len(_log) - 1, -1, -1):
        if _log[i] is entry:
            _log[i] = dataclasses.replace(entry, completed=completed, waited=waited)
            return


class _RecordedWork(dist.Work):
    """The ``Work`` of an async collective, timing its completion and its ``wait()``.

    A ``Work`` itself, delegating every method to the one it wraps: FSDP2 waits on an
    all-gather's work only ``if isinstance(work, dist.distributed_c10d.Work)``, so a wrapper that
    is not one made it read the gathered parameters before they arrived (found under a pipeline
    schedule's asynchronous unshard: every gradient wrong, a false alarm)."""

    def __init__(self, work: dist.Work, entry: Collective):
        super().__init__()
        self._work = work
        self._entry = entry
        self._done_at: float | None = None
        try:  # gloo and nccl complete a future; its callback runs on the backend's thread
            work.get_future().add_done_callback(self._on_done)
        except Exception:  # no future on this backend: completion is taken at wait()
            pass

    def _on_done(self, _future: object) -> None:
        self._done_at = time.perf_counter()

    def wait(self, timeout: timedelta | None = None) -> bool:
        result = self._work.wait() if timeout is None else self._work.wait(timeout)
        now = time.perf_counter()
        _finish(self._entry, completed=min(self._done_at or now, now), waited=now)
        return result

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> object:
        return self._work.exception()

    def source_rank(self) -> int:
        return self._work.source_rank()

    def result(self) -> list[torch.Tensor]:
        return self._work.result()

    def synchronize(self) -> None:
        self._work.synchronize()

    def get_future(self) -> torch.futures.Future:
        return self._work.get_future()

    def __getattr__(self, name: str) -> object:
        return getattr(self._work, name)


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for t in obj if isinstance(t, torch.Tensor)]
    return []


@functools.cache
def _param_names(fn: Callable[..., object]) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def _first_param(fn: Callable[..., object], index: int) -> str:
    """The name of ``fn``'s parameter at ``index``; "" where it has none (barrier's -1): no
    keyword argument is called that."""
    names = _param_names(fn)
    return names[index] if 0 <= index < len(names) else ""


def _positional(fn: Callable[..., object], args: tuple, name: str) -> object:
    names = _param_names(fn)
    if name in names:
        i = names.index(name)
        if i < len(args):
            return args[i]
    return None


def _group_ranks(dist: ModuleType, group: object) -> tuple[int, ...] | None:
    if group is None or group is dist.group.WORLD:
        return None
    try:
        return tuple(dist.get_process_group_ranks(group))
    except Exception:  # a group this rank is not part of
        return ()


def _op_name(op: object) -> str | None:
    if op is None:
        return None
    text = str(op)
    return text.split(".")[-1].upper()
