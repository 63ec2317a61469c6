"""accelerate's ParallelismConfig on the CPU, without ddpcheck: what each release refuses (exit 1
when any refusal shows, 0 when accelerate runs every case, 2 when a release cannot be installed).

Two gloo ranks on the CPU, accelerate's own process-group set-up (``MASTER_ADDR``/``RANK``/
``WORLD_SIZE``/``LOCAL_RANK`` set), and five cases, each an ``Accelerator`` built afresh:

1. ``Accelerator(cpu=True, parallelism_config=ParallelismConfig(tp_size=2))``: a CPU world is
   ``DistributedType.MULTI_CPU``, which ``Accelerator.multi_device`` does not count, so
   ``ParallelismConfig._validate_accelerator`` raises "is only compatible DistributedType.FSDP
   (version 2) or DistributedType.Multi{Device}[ or DistributedType.DEEPSPEED], but got
   DistributedType.MULTI_CPU";
2. ``ParallelismConfig(dp_shard_size=2)`` with ``fsdp_plugin=FullyShardedDataParallelPlugin(
   fsdp_version=2)``: accelerate's state turns a plugin into ``DistributedType.FSDP`` only for
   the device types of its list (``state.py``: MULTI_GPU, _NPU, _XPU, ...; never MULTI_CPU), so
   the plugin is ignored and the same ValueError follows;
3. the same with ``ACCELERATE_USE_FSDP=true`` (``FSDP_VERSION=2``) in the environment instead
   of the plugin -- the switch ``accelerate launch --use_fsdp`` sets: read in the same branch;
4. ``cpu=False`` on a host without an accelerator (accelerate left to infer the device): up to
   1.12 a CPU world all the same (MULTI_CPU, the same ValueError); from 1.13
   ``DistributedType.NO``, one process per rank, so ``total_size (2) does not match
   num_processes (1)``;
5. the import that accelerate's FSDP2 x TP path makes (``Accelerator._prepare_tp``, when
   ``is_fsdp2``): ``from transformers.integrations.tensor_parallel import ReplicateParallel``,
   which transformers defines from 4.52.2 to 5.0.0 only: an ImportError with 4.52.1 and older,
   and 5.1.0 and newer (it moved its styles to ``transformers.distributed``).

With ``--accelerate A,B,...`` (and ``--transformers X,...``) it runs itself once per pair of
releases, each installed with ``pip install --target`` into a temporary folder put first on
``PYTHONPATH`` (accelerate without its dependencies: the running venv's torch; transformers with
them), and prints one table: a release per row, a case per column.

Measured 2026-12-08 (torch 2.13.0 CPU, transformers 5.25.0, 1,112 s at load 18-38): every
accelerate release with a ``ParallelismConfig`` (1.10.0, 1.10.1, 1.11.0, 1.12.0, 1.13.0, 1.14.0,
1.15.0, 1.16.0) refuses cases 1-4, and 1.10-1.12 import ``ReplicateParallel`` for every
tensor-parallel model (1.13 and later under FSDP2 only): exit 1 (docs/pipeline-parallel.md, the
N-D map). ddpcheck's ``accelerate_nd`` declines with these reasons; ``hf_tp`` at
``dp > 1`` checks transformers' own TP x FSDP2 composition, which runs on the CPU.

    python bench/accelerate_nd_cpu.py
    python bench/accelerate_nd_cpu.py --accelerate 1.10.0,1.15.0,1.16.0 --transformers 5.0.0
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable

import torch.multiprocessing as mp

WORLD = 2
CASES = (
    "cpu=True, tp_size=2",
    "cpu=True, dp_shard_size=2, FSDP2 plugin",
    "cpu=True, dp_shard_size=2, ACCELERATE_USE_FSDP=true",
    "cpu=False on a CPU host, tp_size=2",
    "_prepare_tp's import of ReplicateParallel",
)


def _case(make: Callable[[], None]) -> str:
    try:
        make()
    except Exception as error:  # a release's refusal, whatever its type: printed, not raised
        return f"{type(error).__name__}: {str(error).splitlines()[0][:220]}"
    return "ran"


def _rank(rank: int, port: str, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
    )
    from accelerate import Accelerator, ParallelismConfig
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import FullyShardedDataParallelPlugin

    def built(cpu: bool, env: dict[str, str] | None = None, **kwargs: object) -> None:
        os.environ.update(env or {})
        try:
            Accelerator(cpu=cpu, **kwargs)  # type: ignore[arg-type]
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
            for key in env or {}:
                os.environ.pop(key, None)

    def replicate_import() -> None:
        from transformers.integrations.tensor_parallel import (  # noqa: F401
            ReplicateParallel,  # type: ignore[attr-defined]
        )

    makes = (
        lambda: built(True, parallelism_config=ParallelismConfig(tp_size=2)),
        lambda: built(
            True,
            parallelism_config=ParallelismConfig(dp_shard_size=2),
            fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
        ),
        lambda: built(
            True,
            {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"},
            parallelism_config=ParallelismConfig(dp_shard_size=2),
        ),
        lambda: built(False, parallelism_config=ParallelismConfig(tp_size=2)),
        replicate_import,
    )
    lines = [f"{name}: {_case(make)}" for name, make in zip(CASES, makes, strict=True)]
    lines[-1] += f" [{_import_guard(Accelerator)}]"
    if rank == 0:
        with open(out, "w") as f:
            f.write("\n".join(lines))


def _import_guard(accelerator: type) -> str:
    """Where this release's ``_prepare_tp`` imports ``ReplicateParallel`` (read from its source:
    the path runs only past the refusals above, on a GPU)."""
    import inspect

    source = inspect.getsource(accelerator._prepare_tp)  # type: ignore[attr-defined]
    head = source.split("import ReplicateParallel")[0]
    if "import ReplicateParallel" not in source:
        return "accelerate's _prepare_tp does not import it"
    if "if self.is_fsdp2" in head:
        return "accelerate imports it under FSDP2 only"
    return "accelerate imports it for every tensor-parallel model"


def _ran(outcome: str) -> bool:
    return outcome == "ran" or outcome.startswith("ran [")


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _versions() -> str:
    import accelerate
    import torch

    try:
        import transformers

        tf = transformers.__version__
    except ImportError as error:  # case 5 says it too
        tf = f"not importable ({error})"
    return f"accelerate {accelerate.__version__}, transformers {tf}, torch {torch.__version__}"


def here() -> int:
    """The cases under the releases this interpreter imports."""
    print(_versions())
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "out.txt")
        mp.spawn(_rank, args=(_free_port(), out), nprocs=WORLD)
        with open(out) as f:
            lines = f.read().splitlines()
    for line in lines:
        print(line)
    refused = [line for line in lines if not _ran(line.split(": ", 1)[1])]
    print(f"{len(refused)} of {len(lines)} refused")
    return 1 if refused else 0


def _install(folder: str, requirement: str, deps: bool) -> str | None:
    """``requirement`` installed into ``folder`` with this interpreter's pip; None, or why not."""
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--target", folder, requirement]
    done = subprocess.run(
        [*pip, *(() if deps else ("--no-deps",))], capture_output=True, text=True, check=False
    )
    return None if done.returncode == 0 else done.stderr.strip().splitlines()[-1]


def releases(accelerate: list[str], transformers: list[str]) -> int:
    """Every pair of releases, each in a child with the two installed first on its path."""
    status = 0
    rows: list[tuple[str, list[str]]] = []
    with tempfile.TemporaryDirectory() as root:
        for tf in transformers or [""]:
            tf_dir = os.path.join(root, f"transformers-{tf}")
            if tf and (why := _install(tf_dir, f"transformers=={tf}", deps=True)) is not None:
                print(f"transformers {tf}: not installed: {why}")
                status = 2
                continue
            for acc in accelerate:
                acc_dir = os.path.join(root, f"accelerate-{acc}")
                if not os.path.isdir(acc_dir) and (
                    why := _install(acc_dir, f"accelerate=={acc}", deps=False)
                ):
                    print(f"accelerate {acc}: not installed: {why}")
                    status = 2
                    continue
                path = [acc_dir, *([tf_dir] if tf else []), os.environ.get("PYTHONPATH", "")]
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
                child = subprocess.run(
                    [sys.executable, os.path.abspath(__file__)],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=False,
                )
                lines = child.stdout.strip().splitlines()
                if child.returncode not in (0, 1) or not lines:
                    print(f"accelerate {acc}: the child failed ({child.returncode}):")
                    print(child.stderr.strip()[-2000:])
                    status = 2
                    continue
                status = max(status, child.returncode)
                rows.append((lines[0], [line.split(": ", 1)[1] for line in lines[1:-1]]))
    for versions, outcomes in rows:
        print(f"\n{versions}")
        for name, outcome in zip(CASES, outcomes, strict=True):
            print(f"  {name}: {outcome}")
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerate", default="", help="releases, comma-separated")
    parser.add_argument("--transformers", default="", help="releases, comma-separated")
    args = parser.parse_args()
    accelerate = [r for r in args.accelerate.split(",") if r]
    transformers = [r for r in args.transformers.split(",") if r]
    if not accelerate and not transformers:
        return here()
    if not accelerate:
        import accelerate as installed

        accelerate = [installed.__version__]
    return releases(accelerate, transformers)


if __name__ == "__main__":
    sys.exit(main())
