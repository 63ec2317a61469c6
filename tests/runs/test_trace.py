"""``ddpcheck trace``: the Chrome trace of one step, and what it shows about parallel.DDP."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from ddpcheck import cli
from ddpcheck._runs.trace import TRACE_SCENARIO, chrome_trace, overlap, record_step
from ddpcheck._world.registry import get_world
from ddpcheck.errors import ExitCode
from ddpcheck.targets import PARALLEL, PARALLEL_DDP
from tests.patience import patience


@pytest.fixture(scope="module")
def traces():
    """One recorded step of parallel.DDP (plain optimizer) at W=2, several buckets."""
    return get_world(2).run(record_step, PARALLEL_DDP, TRACE_SCENARIO, deadline=patience(120))


def _events(traces):
    # Round-trip through JSON: what a viewer loads.
    return json.loads(json.dumps(chrome_trace(traces)))["traceEvents"]


def test_one_process_track_per_rank(traces):
    events = _events(traces)
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert names == {0: "rank 0", 1: "rank 1"}
    assert {e["pid"] for e in events} == {0, 1}


def test_every_all_reduce_span_has_duration_and_args(traces):
    spans = [e for e in _events(traces) if e["ph"] == "X" and e["name"].startswith("all_reduce")]
    assert len(spans) >= 2 * 4, "3 buckets + the usage flags per rank"
    for span in spans:
        assert span["dur"] > 0, span
        assert span["args"]["bytes"] > 0 and span["args"]["dtype"], span
        assert "carries" in span["args"], span


def test_flows_pair_up_from_launch_to_wait(traces):
    events = _events(traces)
    starts = Counter(e["id"] for e in events if e["ph"] == "s")
    finishes = Counter(e["id"] for e in events if e["ph"] == "f")
    assert starts and starts == finishes
    assert set(starts.values()) == {1}
    by_id = {}
    for e in events:
        if e["ph"] in "sf":
            by_id.setdefault(e["id"], {})[e["ph"]] = e
    for pair in by_id.values():
        assert pair["s"]["pid"] == pair["f"]["pid"]
        assert pair["s"]["ts"] <= pair["f"]["ts"]


def test_buckets_are_labelled_in_launch_order(traces):
    for t in traces:
        buckets = [c for c in t.carries if c.startswith("bucket")]
        assert [b.split(":")[0] for b in buckets] == [f"bucket {i}" for i in range(3)]
        assert "layers.7.weight" in buckets[0]  # reverse registration order: last layer first


def test_first_bucket_launches_before_backward_ends(traces):
    """Overlap: the first bucket's all-reduce starts while backward is still running."""
    for t in traces:
        first_launch, backward = overlap(t)
        assert 0 < first_launch < backward, (t.rank, first_launch, backward)


def test_sharded_optimizer_step_is_traced():
    traces = get_world(2).run(record_step, PARALLEL, TRACE_SCENARIO, deadline=patience(120))
    for t in traces:
        ops = Counter(c.op for c in t.collectives)
        assert ops["broadcast"] >= 1, ops  # owners send updated parameters
        assert all(c.completed is not None for c in t.collectives if not c.async_op)


def test_cli_writes_a_loadable_trace(tmp_path, capsys):
    out = tmp_path / "trace.json"
    assert cli.main(["trace", "--world-size", "2", "-o", str(out)]) == ExitCode.OK
    events = json.loads(out.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    assert "first async all-reduce launched" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["trace", "no_such_module:X", "-o", "{tmp}/t.json"], "cannot import 'no_such_module'"),
        (["trace", "-o", "{tmp}/missing/t.json"], "does not exist"),
    ],
)
def test_cli_usage_errors_exit_2(tmp_path, capsys, argv, message):
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert cli.main(argv) == ExitCode.SETUP
    assert message in capsys.readouterr().err
