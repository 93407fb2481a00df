"""Cost of writing Parquet recordings against the cost of publishing the same stream.

    .venv/bin/python bench/bench_parquet.py [--seconds 10]

The simulator's vLLM stream (``ridgeline simulate``: ~47k kernels, ~47k launch calls per
second of GPU time), cut into the 1-second event batches the agent publishes. Measured
side by side in one run, CPU time of one core (``process_time``, median of 3):

* publish: what the agent pays per batch to publish it: the stateful wire encoder
  (``EventBatchEncoder.encode``) and the envelope (``encode_envelope``);
* rlrec: ``ridgeline record`` writing the published envelopes to a ``.rlrec`` file;
* parquet: ``ParquetRecordingWriter.add_message`` on the decoded batches plus the flushes
  (files written every 1 M rows; the last flush included), i.e. what a sink writing
  Parquet from the agent's own batches would pay (also with lz4 in place of zstd: the
  encoder's CPU against the bytes); and ``ParquetRecordingWriter.write`` from the
  envelopes (what ``record --format parquet`` / ``export`` pay: decoding too).

Removing the files is outside the timings (a fresh folder for each run). Prints one
markdown table: CPU seconds per second of stream, events per CPU second, bytes on disk
(or on the wire) per event, the ratio to publishing, and the load average.
"""
from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from support.recording_synth import _KINDS, _slices, simulated_trace  # noqa: E402

from ridgeline.agent.parquet_recording import ParquetRecordingWriter  # noqa: E402
from ridgeline.agent.recording import RecordingWriter  # noqa: E402
from ridgeline.aggregator import wire  # noqa: E402
from ridgeline.probes.events import Trace  # noqa: E402


def _cpu(fn, repeat: int = 3) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t = time.process_time()
        out = fn()
        times.append(time.process_time() - t)
    return statistics.median(times), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=10, help="seconds of the simulated stream (batches)")
    ap.add_argument("--source", type=Path, default=Path(tempfile.gettempdir()) / "ridgeline-sim10.json.gz")
    a = ap.parse_args()
    src = simulated_trace(a.source)
    t0 = min(int(getattr(src, k)["start_ns"].min()) for k in _KINDS if len(getattr(src, k)))
    batches = [Trace(names=src.names, devices=src.devices, meta={"source": "simulated", "model": "llama-3-8b"},
                     **parts) for _, parts in _slices(src, t0)][:a.seconds]
    events = sum(len(b.kernels) + len(b.copies) + len(b.api) + len(b.ranges) for b in batches)
    recv = [1_796_119_200 * 10**9 + i * 10**9 for i in range(len(batches))]

    def publish():
        enc = wire.EventBatchEncoder()
        return [wire.encode_envelope("events", i, enc.encode(b), "bench-host", recv[i])
                for i, b in enumerate(batches)]
    pub_s, envs = _cpu(publish)
    wire_bytes = sum(len(e) for e in envs)

    tmp = Path(tempfile.mkdtemp(prefix="ridgeline-bench-parquet-"))
    runs = itertools.count()

    def fresh() -> Path:
        d = tmp / f"run{next(runs)}"
        return d

    def clean():
        for d in tmp.iterdir():
            shutil.rmtree(d) if d.is_dir() else d.unlink()

    def timed(fn):
        s, out = _cpu(fn)
        clean()
        return s, out

    try:
        def rlrec():
            p = fresh().with_suffix(".rlrec")
            with RecordingWriter(p) as w:
                for i, e in enumerate(envs):
                    w.write(e, recv[i])
            return p.stat().st_size
        rl_s, rl_bytes = timed(rlrec)

        def parquet_batches(compression="zstd"):
            with ParquetRecordingWriter(fresh(), recording="bench", compression=compression) as w:
                for i, b in enumerate(batches):
                    w.add_message("events", i, "bench-host", recv[i], recv[i], b)
            return w.bytes
        pq_s, pq_bytes = timed(parquet_batches)
        lz_s, lz_bytes = timed(lambda: parquet_batches("lz4"))

        def parquet_envelopes():
            with ParquetRecordingWriter(fresh(), recording="bench") as w:
                for i, e in enumerate(envs):
                    w.write(e, recv[i])
            return w.bytes
        pqe_s, pqe_bytes = timed(parquet_envelopes)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    secs = len(batches)
    rows = ["| path | CPU s per s of stream | events per CPU s | bytes per event | CPU vs publish |",
            "|---|---:|---:|---:|---:|"]
    for name, s, b in (("publish (wire encode + envelope)", pub_s, wire_bytes),
                       ("record .rlrec (framed envelopes)", rl_s, rl_bytes),
                       ("Parquet from the agent's batches", pq_s, pq_bytes),
                       ("Parquet from the agent's batches, lz4", lz_s, lz_bytes),
                       ("Parquet from envelopes (decode + write)", pqe_s, pqe_bytes)):
        rows.append(f"| {name} | {s / secs:.3f} | {events / max(s, 1e-9):,.0f} | {b / events:.2f} | "
                    f"{s / max(pub_s, 1e-9):.2f}x |")
    print(f"{secs} s of the simulated vLLM stream: {events:,} events "
          f"({sum(len(b.kernels) for b in batches):,} kernels), one batch per second\n")
    print("\n".join(rows))
    print("\nload average (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    print("\nReproduce: .venv/bin/python bench/bench_parquet.py --seconds", secs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
