"""How long a test may wait, on this machine, now.

Every wall-clock bound in the suite -- a subprocess timeout, a wait for a marker, an assertion
that something answered "fast", a deadline given to a correct example -- is a figure measured on a
quiet 2-core machine, multiplied by :func:`slowdown`: how much slower this machine is right now.
Two measures, the larger wins: the cost of starting a Python process that imports torch (what
every rank and subprocess pays; measured once per test process, against :data:`QUIET_IMPORT`),
and the load average per core at the moment of the call (a second `make test` beside this one
doubles it). A bound that holds on a quiet machine then holds on a loaded one, and a real hang
still ends, only later.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time

#: Seconds `python -c "import torch"` takes on a quiet 2-core machine (torch 2.13, CPU build).
QUIET_IMPORT = 1.6


@functools.cache
def _import_factor() -> float:
    started = time.monotonic()
    subprocess.run(
        [sys.executable, "-c", "import torch"], capture_output=True, timeout=600, check=False
    )
    return max(1.0, (time.monotonic() - started) / QUIET_IMPORT)


def _load_factor() -> float:
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


def slowdown() -> float:
    """How many times slower than a quiet 2-core machine this one is now (>= 1)."""
    return max(_import_factor(), _load_factor())


def patience(seconds: float) -> float:
    """``seconds`` measured on a quiet machine, scaled to this one now."""
    return seconds * slowdown()
