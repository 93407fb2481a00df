"""The live straggler analysis' cost per window (aggregator.straggler_window).

    .venv/bin/python bench/bench_stragglers.py

A simulated TP group (tests/test_stragglers.py's builder: per step, one GEMM then one
all-reduce per layer on every rank, NCCL's kernel name, one rank slowed) fed to
:class:`LiveStragglers` one window at a time, as the agent does; CPU seconds of ``add`` (all
ranks' batches of one window) and of ``close`` (median over the windows after the first
three, when 3 windows are held), for several group sizes and collective rates. Prints a
markdown table; no timing assert anywhere.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np  # noqa: E402
from test_stragglers import Builder, tp_group  # noqa: E402

from ridgeline.aggregator.straggler_window import LiveStragglers  # noqa: E402
from ridgeline.probes.events import Trace  # noqa: E402


def case(ranks: int, collectives_per_s: int, windows: int = 8) -> tuple[int, float, float, int]:
    """(kernels held, CPU s of add per window, CPU s of close, collectives reported)."""
    tp = [(1000 + i, i) for i in range(ranks)]
    # one "step" of tp_group = compute + all-reduce, 600 us + jitter: scale compute to the rate
    compute_us = max(20, int(1e6 / collectives_per_s) - 60)
    t = tp_group(Builder(), tp, steps=collectives_per_s * windows, compute_us=compute_us, slow={1: 10}).trace()
    k = t.kernels
    live = LiveStragglers()
    adds, closes, reported = [], [], 0
    t0 = int(k["start_ns"].min())
    edges = np.linspace(t0, int(k["end_ns"].max()) + 1, windows + 1)
    for w in range(windows):
        sel = (k["start_ns"] >= edges[w]) & (k["start_ns"] < edges[w + 1])
        batches = [Trace(kernels=k[sel & (k["pid"] == p)], names=t.names) for p, _ in tp]
        a = time.process_time()
        for p, b in zip(tp, batches):
            live.add(b, f"cupti:{p[0]}")
        b_ = time.process_time()
        fig = live.close()
        c = time.process_time()
        reported += sum(g.collectives for g in fig.groups)
        if w >= 3:
            adds.append(b_ - a)
            closes.append(c - b_)
    return live._held, statistics.median(adds), statistics.median(closes), reported


def main() -> int:
    rows = ["| ranks | collectives/s per rank | collectives reported / run | kernels held | CPU s add (one window) | "
            "CPU s close | share of a 1 s window |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for ranks, rate in ((2, 500), (4, 1000), (8, 1000), (8, 3000)):
        held, add, close, reported = case(ranks, rate)
        rows.append(f"| {ranks} | {rate:,} | {reported:,} / {rate * 8:,} | {held:,} | {add:.4f} | {close:.4f} | "
                    f"{(add + close):.1%} |")
    print("\n".join(rows))
    print("\nReproduce: .venv/bin/python bench/bench_stragglers.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
