"""The recorder's wrapper of an async collective's work: still a ``Work``, every call passed on.

FSDP2 waits on an all-gather only ``if isinstance(work, dist.distributed_c10d.Work)``: a wrapper
that was not one let it read gathered parameters before they arrived, under a pipeline
schedule's asynchronous unshards (every gradient wrong: tests/targets/test_pipeline.py)."""

from __future__ import annotations

import time

import torch.distributed as dist

from ddpcheck._language.records import Collective
from ddpcheck._rank.recorder import _RecordedWork


class _Pending(dist.Work):
    """A work whose wait() is counted, as a backend's would block."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def wait(self, timeout=None) -> bool:
        self.waits += 1
        return True

    def is_completed(self) -> bool:
        return self.waits > 0


def test_a_recorded_async_work_is_a_work_and_waits_for_the_real_one():
    entry = Collective(
        "all_gather_into_tensor",
        8,
        ("float32",),
        ((2,),),
        None,
        None,
        None,
        True,
        time.perf_counter(),
    )
    inner = _Pending()
    work = _RecordedWork(inner, entry)
    assert isinstance(work, dist.distributed_c10d.Work)
    assert not work.is_completed()
    assert work.wait() is True
    assert inner.waits == 1 and work.is_completed()
