"""The window close's record work, warm, in process: ``wire.encode_window`` of a window the
builder closed over the simulator's llama-3-8b decode steps on an H100 (one GPU, phases,
roofline, verdicts), ``wire.encode_envelope`` of an agent health record with 60 probe
counters, ``windows.plain`` of that record, and ``windows.verdict_of`` of the window. Best
of 7 repeats, microseconds per call. In the live agent the same code runs once a second
with cold caches and costs several times this (``bench_scale.py --time-agent``).

    .venv/bin/python bench/bench_close.py
"""
from __future__ import annotations

import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> int:
    from support.sim_window import simulated_builder

    from ridgeline.agent.health import HealthMeter
    from ridgeline.aggregator import windows, wire
    wb = simulated_builder()
    h = HealthMeter().sample({"cupti": {f"c{i}": i for i in range(60)}}, 10,
                             extra={f"x{i}": i for i in range(25)})
    w = wb.close(0, 10**9, h)
    if not w.gpus:
        print("bench_close: the window folded no kernels", file=sys.stderr)
        return 1

    def best_us(f, n=300) -> float:
        return 1e6 * min(timeit.repeat(f, number=n, repeat=7)) / n
    print(f"encode_window {best_us(lambda: wire.encode_window(w)):.1f} us | "
          f"encode_envelope(health) {best_us(lambda: wire.encode_envelope('health', 1, h, 'x', 0)):.1f} us | "
          f"plain(health) {best_us(lambda: windows.plain(h)):.1f} us | "
          f"verdict_of {best_us(lambda: windows.verdict_of(w), 100):.1f} us | "
          f"window {len(wire.encode_window(w))} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
