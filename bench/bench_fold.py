"""Window fold cost in-process: the incremental fold against the whole-window analysis, side by side.

    .venv/bin/python bench/bench_fold.py                   # 1x50000 and 8x100000, 5 windows each
    .venv/bin/python bench/bench_fold.py --profile         # plus where the incremental fold's time goes

For each scenario (GPUs x kernels/s per GPU, the simulated vLLM decode load of
``bench/bench_scale.py``), one second of 50 ms batches (kernels with their launch API
records) is folded into a window and the window is wire-encoded, repeatedly:

* ``incremental``: ``aggregator.windows.WindowBuilder`` as the agent runs it (one builder
  kept across windows, so remembered step shapes and kernel classes are warm, as in a
  running agent); the first window is a warm-up and not counted.
* ``whole-window``: what the window close did before the incremental fold: concatenate the
  window's batches and run ``aggregator.analysis.analyze_trace`` (``map_phases`` and the
  roofline over the whole window, kernels only).

CPU time per window (median), kernels folded per CPU second, and the ratio, in one table.
The host load average is printed with it (2 shared cores: CPU time is steadier than wall).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402


def window_batches(gpus: int, rate: int):
    """One second of the agent's feed in bench_scale: whole simulated decode steps
    (``bench_scale.StepStream``, short steps with idle between them) in 50 ms batches."""
    from bench_scale import BATCH_S, StepStream

    from ridgeline.probes.events import Device, NameTable, Trace
    stream = StepStream(gpus, rate)
    nt = NameTable(stream.names)
    devs = [Device(g, stream.gpu_name) for g in range(gpus)]
    out = []
    for i in range(int(1 / BATCH_S)):
        k, a = stream.batch(i)
        out.append(Trace(kernels=k, api=a, names=nt, devices=devs, meta={"source": "simulated"}))
    return out


def shift(batches, w: int):
    """The same window w seconds later (timestamps and correlation ids move on)."""
    from ridgeline.probes.events import Trace
    out = []
    for t in batches:
        k, a = t.kernels.copy(), t.api.copy()
        for arr in (k, a):
            arr["start_ns"] += int(w * 1e9)
            arr["end_ns"] += int(w * 1e9)
        out.append(Trace(kernels=k, api=a, names=t.names, devices=t.devices, meta=t.meta))
    return out


def incremental(batches, windows: int, profile: bool):
    from ridgeline.aggregator import wire
    from ridgeline.aggregator.windows import WindowBuilder
    wb = WindowBuilder(host="bench")
    costs = []
    prof = cProfile.Profile() if profile else None
    for w in range(windows + 1):
        bs = shift(batches, w)
        if prof is not None and w:
            prof.enable()
        c0 = time.process_time()
        for t in bs:
            wb.add_events(t)
        wire.encode_window(wb.close(w * 10**9, (w + 1) * 10**9, {}))
        c = time.process_time() - c0
        if prof is not None and w:
            prof.disable()
        if w:
            costs.append(c)
    return costs, prof


def whole_window(batches, windows: int):
    from ridgeline.aggregator import wire
    from ridgeline.aggregator.analysis import analyze_trace, document
    from ridgeline.aggregator.windows import concat_traces
    costs = []
    for w in range(windows):
        bs = shift(batches, w)
        c0 = time.process_time()
        doc = analyze_trace(concat_traces(bs), use_annotations=False)
        wire.encode_window({"gpus": [{"phases": document(doc.phases)}]})
        costs.append(time.process_time() - c0)
    return costs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default="1x50000,8x100000")
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="print the incremental fold's top functions")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    rows = []
    profiles = []
    for sc in args.scenarios.split(","):
        gpus, rate = (int(x) for x in sc.lower().split("x"))
        batches = window_batches(gpus, rate)
        n = sum(len(t.kernels) for t in batches)
        inc, prof = incremental(batches, args.windows, args.profile)
        whole = whole_window(batches, max(1, args.windows // 2))
        mi, mw = float(np.median(inc)), float(np.median(whole))
        rows.append((f"{gpus} GPU x {rate:,} kernels/s", n, mi, mw))
        if prof is not None:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
            profiles.append((sc, s.getvalue()))
    print(f"Command: `python bench/bench_fold.py {' '.join(argv if argv is not None else sys.argv[1:])}`  ")
    print(f"Host load average (1 min) before/after: {load0:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print()
    print("| scenario | kernels/window | incremental fold CPU ms/window | kernels/CPU-s (incremental) | "
          "whole-window CPU ms/window | kernels/CPU-s (whole) | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, n, mi, mw in rows:
        print(f"| {name} | {n:,} | {1000 * mi:.1f} | {n / mi:,.0f} | {1000 * mw:.1f} | {n / mw:,.0f} | "
              f"{mw / mi:.1f}x |")
    for sc, text in profiles:
        print(f"\nProfile of the incremental fold, {sc} ({args.windows} windows, by own time):\n")
        print("```")
        print("\n".join(line for line in text.splitlines() if line.strip())[:4000])
        print("```")
    return 0


if __name__ == "__main__":
    sys.exit(main())
