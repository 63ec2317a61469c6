"""Render a ``ddpcheck trace`` JSON file as a timeline PNG (the picture in docs/figures.md).

One band per rank: the top row holds the step's phases (forward, backward, after_backward,
optimizer.step), the rows below hold the collectives, each bar from launch to completion, labelled
with its bucket when it carries one; a tick marks where the rank's wait() returned.

Run: ``python bench/render_trace.py [TRACE.json OUT.png]``; with no arguments it records one step
of the built-in ``parallel`` target at W=2 (what ``ddpcheck trace`` records) and writes
``docs/trace.png``. Needs matplotlib, which is not a dependency of ddpcheck (``pip install
matplotlib``); without it the script says so and exits 0.
"""

from __future__ import annotations

import json
import sys

PHASE_COLOURS = {
    "forward": "#9ecae1",
    "backward": "#4292c6",
    "after_backward": "#fdae6b",
    "optimizer.step": "#a1d99b",
}
OP_COLOURS = {"all_reduce": "#d62728", "broadcast": "#2ca02c", "all_gather": "#9467bd"}


def render(trace_path: str, png_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(trace_path) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    ranks = sorted({e["pid"] for e in events})
    lanes = {
        r: max([e["tid"] for e in events if e["pid"] == r and e["ph"] == "X"] + [0]) for r in ranks
    }
    rows_per_rank = {r: lanes[r] + 1 for r in ranks}
    # rank r's rows, top to bottom: phases, then collective lanes
    y_of, y, labels = {}, 0, []
    for r in ranks:
        for tid in range(rows_per_rank[r]):
            y_of[(r, tid)] = y
            labels.append(f"rank {r} " + ("step" if tid == 0 else f"comm {tid - 1}"))
            y -= 1
    fig, ax = plt.subplots(figsize=(12, 0.55 * len(labels) + 1.2))
    for e in events:
        if e["ph"] != "X":
            continue
        row = y_of[(e["pid"], e["tid"])]
        start, width = e["ts"] / 1e3, e["dur"] / 1e3  # ms
        if e["cat"] == "phase":
            colour, text = PHASE_COLOURS.get(e["name"], "#cccccc"), e["name"]
        else:
            colour = OP_COLOURS.get(e["name"].split()[0], "#7f7f7f")
            mib = e["args"]["bytes"] / 2**20
            text = e["name"].replace("all_reduce ", "") + (f" {mib:.1f} MiB" if mib >= 0.1 else "")
        ax.broken_barh(
            [(start, width)], (row - 0.4, 0.8), facecolors=colour, edgecolors="black", linewidth=0.4
        )
        ax.text(start + width / 2, row, text, ha="center", va="center", fontsize=7, clip_on=True)
    for e in events:
        if e["ph"] == "f":  # wait() returned here
            row = y_of[(e["pid"], 0)]
            ax.plot([e["ts"] / 1e3] * 2, [row - 0.45, row + 0.45], color="black", linewidth=1)
    ax.set_yticks([y_of[k] for k in y_of], labels)
    ax.set_xlabel("ms since the step started (one clock for all ranks)")
    title = trace.get("otherData", {}).get("title")
    ax.set_title(
        (title or "ddpcheck trace") + ": bars from launch to completion, | where wait() returned",
        fontsize=9,
    )
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


def record(trace_path: str) -> None:
    from ddpcheck.cli import main

    if main(["trace", "parallel", "--world-size", "2", "-o", trace_path]) != 0:
        sys.exit("ddpcheck trace failed")


if __name__ == "__main__":
    import importlib.util
    import os
    import tempfile

    if importlib.util.find_spec("matplotlib") is None:
        print("render_trace.py: matplotlib is not installed (pip install matplotlib); skipped")
        sys.exit(0)
    if len(sys.argv) == 3:
        render(sys.argv[1], sys.argv[2])
    elif len(sys.argv) == 1:
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "trace.json")
            record(path)
            out = os.path.join(
                os.path.dirname(os.path.abspath(__file__)), "..", "docs", "trace.png"
            )
            render(path, out)
            print(f"wrote {os.path.normpath(out)}")
    else:
        sys.exit("usage: python bench/render_trace.py [TRACE.json OUT.png]")
