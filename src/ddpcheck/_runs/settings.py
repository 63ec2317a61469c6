"""How every example of a run runs: its deadline, and where its ranks compute. What a door
admitted (``_runs.admission``) travels down as this one object -- to the examples, the searches,
the pipeline and the world -- and nothing below checks it again. A module of its own: the run's
lowest modules (``_runs.example``) take it without importing admission.
"""

from __future__ import annotations

import dataclasses

from ddpcheck._base.options import DEFAULT_DEADLINE

__all__ = ["DEFAULT_SETTINGS", "Settings"]


@dataclasses.dataclass(frozen=True)
class Settings:
    """How every example of a run runs: how long it may take before it counts as hung, and
    where its ranks compute. Admitted once at the door (``_runs.admission.admit``); everything
    below takes it as it is."""

    deadline: float = DEFAULT_DEADLINE
    device: str = "cpu"
    #: None: the device's own (gloo on the CPU, NCCL on CUDA)
    backend: str | None = None


#: Every door's defaults: a 60 s deadline, the CPU over gloo.
DEFAULT_SETTINGS = Settings()
