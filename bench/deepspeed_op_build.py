"""What DeepSpeed does once per process on its CPU accelerator, timed: importing it, and
building the C++ op its comm backend loads (``deepspeed.comm.torch.build_shm_op``, which
``deepspeed.initialize`` reaches through ``init_distributed``) -- in an empty
``TORCH_EXTENSIONS_DIR`` (as after an install or a version switch), then again in a fresh process,
with the op built. No ddpcheck involved.

    python bench/deepspeed_op_build.py        # in a venv with DeepSpeed

Why it matters: ``deepspeed_zero1/2`` do this in ``Target.warm_up``, under its own deadline (900
s); inside the first example's deadline (60 s) it was "rank timed out" (issue 37). Prints the
seconds of each phase and where torch built the op.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

_PHASES = """
import os, time
os.environ["DS_ACCELERATOR"] = "cpu"
started = time.perf_counter()
import deepspeed
imported = time.perf_counter()
from deepspeed.comm.torch import build_shm_op
build_shm_op()
print(f"deepspeed {deepspeed.__version__}: import {imported - started:.1f} s, "
      f"op {time.perf_counter() - imported:.1f} s")
"""


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="ops-") as folder:
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": folder}
        for label in ("empty op cache", "op built"):
            done = subprocess.run(
                [sys.executable, "-c", _PHASES], env=env, capture_output=True, text=True
            )
            line = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr
            print(f"{label}: {line}")
        print(f"built in {folder}: {sorted(os.listdir(folder))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
