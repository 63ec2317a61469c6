"""No rank is called guilty on evidence that cannot tell (issue 50, item 4).

A DDP that skips a bucket's all-reduce on the ranks with no gradient for it: rank 0 (correct)
issues the all-reduce, the others go on to their next collective. At W=3 the majority is the
wrong side, so neither majority nor minority names the culprit; the message says what each side
issued and names no rank. A rank that raised is still singled out.

Targets travel to the ranks by pickle: module-level classes here."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpcheck
from ddpcheck import check_example
from ddpcheck._language.records import Collective
from ddpcheck._world import sequences
from ddpcheck.scenario import Scenario
from tests.patience import patience

SCENARIO = Scenario(steps=1)


class SkippingDDP(nn.Module):
    """One bucket per parameter; a rank with no gradient for a bucket skips its all-reduce."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        for tensor in module.parameters():
            dist.broadcast(tensor.data, src=0)

    def forward(self, x):
        return self.module(x)

    def finish(self):
        for p in self.module.parameters():
            if p.grad is not None:  # the bug: a local decision about a collective
                self._launch(p)
        self._done()

    def _launch(self, p):
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()

    def _done(self):
        dist.all_reduce(torch.ones(1, dtype=torch.float64))


class SkipsABucket(ddpcheck.Target):
    """Every rank but 0 has no gradient for the last parameter (as a rank whose micro-batches
    skip a layer would), and so skips its bucket."""

    def wrap(self, module):
        return SkippingDDP(module)

    def after_backward(self, model, optimizer):
        if dist.get_rank() != 0:
            list(model.module.parameters())[-1].grad = None
        model.finish()


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_skipped_bucket_is_described_side_by_side_and_blames_no_rank(world_size):
    with pytest.raises(ddpcheck.EquivalenceError) as caught:
        check_example(SkipsABucket(), SCENARIO, world_size, deadline=patience(20))
    error, text = caught.value, str(caught.value)
    skippers = ", ".join(map(str, range(1, world_size)))
    who = f"ranks {skippers}" if world_size > 2 else "rank 1"
    they = "they" if world_size > 2 else "it"
    assert error.kinds[0] == "collectives mismatched", text
    assert f"{who} never issued the all_reduce that rank 0 issued at " in text, text
    assert "in _launch; " in text and f"{they} went on to " in text and "in _done" in text, text
    assert "guilty rank(s)" not in text and "rank 0 never issued" not in text, text
    # every rank of the disagreement is a row, each saying what it issued: no side singled out
    assert sorted({row.rank for row in error.divergences}) == list(range(world_size)), text


def _all_reduce(numel: int, site: str) -> Collective:
    return Collective(
        "all_reduce", 0, ("float64",), ((numel,),), None, None, "SUM", False, 0.0, site=site
    )


def test_the_sides_name_what_one_side_never_issued_and_where_the_other_went():
    bucket, done = _all_reduce(2, "mydp.py:80 in _launch"), _all_reduce(1, "mydp.py:90 in _done")
    found = sequences.diagnose([[bucket, done], [done], [done]], finished=[0, 1, 2])
    assert found is not None and found.mismatched
    assert found.deviants == [0]  # the majority: the wrong side here, so never called guilty
    assert found.sides() == [
        "ranks 1, 2 never issued the all_reduce that rank 0 issued at mydp.py:80 in _launch; "
        "they went on to mydp.py:90 in _done"
    ]
    # both sides stopped there (rank 0 waits in its all_reduce): the mirror line is not said
    stuck = sequences.diagnose([[bucket], [done], [done]])
    assert stuck is not None and len(stuck.sides()) == 1, stuck.sides()
    # a collective issued later is not "never issued": only the side that skipped is named
    late = sequences.diagnose([[bucket, done], [done, bucket]], finished=[0, 1])
    assert late is not None and late.sides() == []
