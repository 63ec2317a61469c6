"""Where a rank computes, and which backend carries its tensors: one place for both choices.

Invariant: the backend follows the tensors, never the machine. CPU tensors travel by gloo
whatever GPUs are visible (NCCL cannot carry them); CUDA tensors by NCCL unless gloo is asked for
by name. Spawned worlds (``_world``) and torchrun (``ddpcheck._runs.torchrun``,
which :func:`under_torchrun` detects) both ask :func:`backend_for`; :func:`check_fits` refuses,
before any process is spawned, what the machine cannot run (no GPU; more NCCL ranks than GPUs). The
device is a run option, not part of a scenario: the full-batch reference always runs on the CPU in
the checking process, and records come back to the CPU (``_rank.transport.pack``), so one oracle
judges both.

Inside a rank, :func:`enter_rank` (called once, before the process group starts) binds the
process to its device and switches off TF32 and reduced-precision matmuls -- a float32 example
at TF32 precision would differ from the CPU reference by ~1e-3, far beyond the tolerance;
:func:`to_rank_device` is how the runner moves models and batches there. Imports torch only when
asked about CUDA or a rank, so the CLI's parser and the pytest plugin validate without it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, TypeVar, overload

from ddpcheck._base.errors import InvalidArgument

if TYPE_CHECKING:
    from typing import TypeAlias

    import torch

    #: A rank's micro-batches: ``(x, y, scale)`` each.
    MicroBatches: TypeAlias = list[tuple[torch.Tensor, torch.Tensor, float]]

M = TypeVar("M", bound="torch.nn.Module")

__all__ = [
    "BACKENDS",
    "DEVICES",
    "backend_for",
    "check_device",
    "check_fits",
    "enter_rank",
    "local_world_size",
    "under_torchrun",
    "strict_precision",
    "this_rank",
    "to_rank_device",
]

#: Devices a world can compute on ("cuda": rank r on cuda:r, or cuda:LOCAL_RANK under torchrun).
DEVICES = ("cpu", "cuda")
#: Backends a caller may ask for by name (None: the one :func:`backend_for` picks).
BACKENDS = ("gloo", "nccl")

#: This process's device once enter_rank ran (a rank); else (None) the CPU.
_rank_device: torch.device | None = None


#: What torchrun (torch.distributed.run) sets in the environment of every process it starts.
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def under_torchrun() -> bool:
    """True in a process ``torchrun`` started: ``ddpcheck check`` then uses its world."""
    return all(name in os.environ for name in _TORCHRUN_ENV)


def local_world_size() -> int:
    """Ranks torchrun started on this machine (they share its GPUs)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def check_device(device: object, name: str = "device") -> str:
    if not isinstance(device, str) or device not in DEVICES:
        raise InvalidArgument(
            f"{name}={device!r} is not a device ddpcheck runs on; use 'cpu' "
            "(the default) or 'cuda' (rank r on cuda:r)"
        )
    return device


def backend_for(device: str, requested: str | None = None, *, name: str = "backend") -> str:
    """The backend of a world computing on ``device``: gloo for the CPU, NCCL for CUDA, unless
    ``requested`` names one (gloo over CUDA tensors lets ranks share one GPU). ``name``: the
    backend's name in messages; the device's is derived from it ("--backend" -> "--device")."""
    check_device(device, name.replace("backend", "device"))
    if requested is None:
        return "nccl" if device == "cuda" else "gloo"
    if requested not in BACKENDS:
        raise InvalidArgument(
            f"{name}={requested!r} is not a backend ddpcheck starts; use "
            f"{' or '.join(map(repr, BACKENDS))} (or leave it out)"
        )
    if requested == "nccl" and device == "cpu":
        raise InvalidArgument(
            f"{name}='nccl' cannot carry CPU tensors; use it with device "
            "'cuda', or gloo (the default) on the CPU"
        )
    return requested


def check_fits(
    device: str, world_sizes: Iterable[int], backend: str | None = None, *, flag: str = "device"
) -> str:
    """The backend for ``device``; :class:`InvalidArgument` when this machine cannot run every
    world of ``world_sizes`` there: no CUDA device, a torch without NCCL, or more ranks than GPUs
    with NCCL (it refuses two ranks on one GPU; gloo shares them). Costs nothing on the CPU.
    ``flag``: the device's name in messages ("--device"; the backend's is derived from it)."""
    chosen = backend_for(device, backend, name=flag.replace("device", "backend"))
    if device == "cpu":
        return chosen
    import torch

    if not torch.cuda.is_available():
        raise InvalidArgument(
            f"{flag}={device!r}, but torch {torch.__version__} sees no CUDA "
            "device (torch.cuda.is_available() is False); run on the CPU "
            "(the default) or on a machine with a GPU"
        )
    if chosen == "nccl":
        import torch.distributed as dist

        count = torch.cuda.device_count()
        largest = max(world_sizes, default=1)
        if not dist.is_nccl_available():
            raise InvalidArgument(
                f"{flag}={device!r}: this torch was built without NCCL; ask for the gloo backend"
            )
        if largest > count:
            raise InvalidArgument(
                f"{flag}={device!r}: a world of {largest} ranks needs {largest} GPUs with NCCL "
                f"(one rank per GPU: NCCL refuses two ranks on one device), and {count} are "
                f"visible; use world sizes up to {count}, or the gloo backend to share GPUs"
            )
    return chosen


def strict_precision() -> None:
    """float32 matmuls and convolutions at full float32 precision: no TF32, no reduced-precision
    reductions (the CPU reference computes neither). Through torch's legacy flags only: mixing
    them with the newer ``fp32_precision`` API makes torch 2.13 refuse to read them back."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.set_float32_matmul_precision("highest")


def enter_rank(device: str, index: int) -> torch.device:
    """Bind this rank process to its device before its process group starts; once per process.

    ``index``: the rank, or ``LOCAL_RANK`` under torchrun; on CUDA it is taken modulo the visible
    GPUs, so gloo ranks sharing one GPU all use cuda:0 (NCCL worlds never exceed the count)."""
    import torch

    global _rank_device
    check_device(device)
    strict_precision()
    if device == "cpu":
        _rank_device = torch.device("cpu")
        return _rank_device
    # NCCL connects peers lazily by default (NCCL >= 2.22), opening descriptors during the
    # first example, which the fitness check would blame on it; connect during start-up.
    os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
    _rank_device = torch.device("cuda", index % torch.cuda.device_count())
    torch.cuda.set_device(_rank_device)
    # The CUDA context and the cuBLAS handle, now: inside the start-up deadline, and before the
    # fitness baseline is taken.
    probe = torch.ones(2, 2, device=_rank_device, requires_grad=True)
    (probe @ probe).sum().backward()
    torch.cuda.synchronize(_rank_device)
    return _rank_device


def this_rank() -> torch.device:
    """The device this process computes on: the rank's, or the CPU (the checking process)."""
    if _rank_device is None:
        import torch

        return torch.device("cpu")
    return _rank_device


@overload
def to_rank_device(value: M) -> M: ...
@overload
def to_rank_device(value: torch.Tensor) -> torch.Tensor: ...
@overload
def to_rank_device(value: MicroBatches) -> MicroBatches: ...


def to_rank_device(
    value: torch.nn.Module | torch.Tensor | MicroBatches,
) -> torch.nn.Module | torch.Tensor | MicroBatches:
    """``value`` (a module, a tensor, or a list of ``(x, y, scale)`` micro-batches: their tensors)
    on this rank's device; itself, untouched, on the CPU (the hot path of every CPU example)."""
    device = _rank_device
    if device is None or device.type == "cpu":
        return value
    if isinstance(value, list):
        return [(x.to(device), y.to(device), scale) for x, y, scale in value]  # not the scale
    return value.to(device)
