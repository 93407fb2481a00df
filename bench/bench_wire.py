"""Wire cost of event batches: bytes per kernel event and encode/decode speed.

    .venv/bin/python bench/bench_wire.py

For every shared trace: the kernels as one ``aggregator.wire`` event batch (names
included) against the same kernel events as Kineto JSON (compact, and gzip -6), and the
encode/decode rates in kernel events per second of one core (median of 5), measured
side by side in this run. Prints one markdown table.
"""
from __future__ import annotations

import gzip
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402

from ridgeline.aggregator import wire  # noqa: E402
from ridgeline.probes.events import Trace  # noqa: E402
from ridgeline.probes.kineto import load_trace  # noqa: E402

TRACES = ROOT.parent / "shared" / "traces"


def _median_rate(fn, n: int, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return n / max(statistics.median(times), 1e-9)


def main() -> int:
    rows = ["| trace | kernels | JSON B/kernel | JSON gz B/kernel | wire B/kernel | encode kernels/s | decode kernels/s |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for path in sorted(TRACES.glob("*/*.json.gz")):
        t = load_trace(path)
        n = len(t.kernels)
        if n < 100:
            continue
        kern = [e for e in orjson.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
                if e.get("cat") == "kernel"]
        plain = orjson.dumps(kern)
        kt = Trace(kernels=t.kernels, names=t.names, devices=t.devices)
        blob = wire.encode_event_batch(kt)
        enc = _median_rate(lambda: wire.encode_event_batch(kt), n)
        dec = _median_rate(lambda: wire.decode_event_batch(blob), n)
        rows.append(f"| {path.name} | {n} | {len(plain) / n:.0f} | {len(gzip.compress(plain, 6)) / n:.1f} | "
                    f"{len(blob) / n:.1f} | {enc:,.0f} | {dec:,.0f} |")
    print("\n".join(rows))
    print("\nReproduce: .venv/bin/python bench/bench_wire.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
