"""Long agent recordings for tests and measurements, written with the real wire encoder.

A short simulated run (``ridgeline simulate``: the simulator's vLLM-style kernels,
copies and launch calls) is cut into 1-second event batches and replayed, shifted in
time, for as long as asked, the way the agent publishes them: a stateful
:class:`aggregator.wire.EventBatchEncoder` per agent life, per-topic sequence numbers,
a ``window`` message per second. Optional: an agent restart (sequence numbers back to 0,
a new encoder stream, ``restart_downtime_s`` of no messages) and lost ``events``
messages (a sequence gap over ``lost_batches`` seconds, whose events are missing).

    .venv/bin/python tests/support/recording_synth.py OUT.rlrec --minutes 30
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

from ridgeline.agent.recording import RecordingWriter
from ridgeline.aggregator import wire
from ridgeline.probes.events import Trace
from ridgeline.probes.kineto import load_trace

_KINDS = ("kernels", "copies", "api", "ranges")


def simulated_trace(path: Path, seconds: int = 10, seed: int = 1) -> Trace:
    if not path.exists():
        subprocess.run([sys.executable, "-m", "ridgeline", "simulate", "--duration", str(seconds),
                        "--seed", str(seed), "--trace", str(path)], check=True, capture_output=True)
    return load_trace(path)


def _slices(t: Trace, t0: int, second_ns: int = 1_000_000_000):
    """Per second of the source: (offset, Trace of the events starting in it)."""
    end = max(int(getattr(t, k)["end_ns"].max()) for k in _KINDS if len(getattr(t, k)))
    out = []
    for s in range(t0, end + 1, second_ns):
        parts = {}
        for k in _KINDS:
            a = getattr(t, k)
            parts[k] = a[(a["start_ns"] >= s) & (a["start_ns"] < s + second_ns)]
        out.append((s - t0, parts))
    return out


def write_recording(out: Path, source: Trace, minutes: float, restart_at_s: float | None = None,
                    restart_downtime_s: float = 20.0, lost_at_s: float | None = None,
                    lost_batches: int = 3, host: str = "gpu-host") -> dict:
    """Write the recording; returns what was written (seconds, batches, kernels, restart, lost)."""
    t0 = min(int(getattr(source, k)["start_ns"].min()) for k in _KINDS if len(getattr(source, k)))
    sl = _slices(source, t0)
    corr_span = 1 + max(int(getattr(source, k)["correlation_id"].max()) for k in ("kernels", "copies", "api")
                        if len(getattr(source, k)))
    period = len(sl)
    total_s = int(minutes * 60)
    enc = wire.EventBatchEncoder()
    seq = {"events": 0, "window": 0}
    shift = 0                      # extra ns added after the restart (the downtime)
    kernels = batches = 0
    lost_kernels = 0
    restarted = False
    with RecordingWriter(out) as w:
        for sec in range(total_s):
            if restart_at_s is not None and not restarted and sec >= restart_at_s:
                restarted = True
                enc = wire.EventBatchEncoder()     # a new agent: new stream, seq from 0
                seq = {"events": 0, "window": 0}
                shift += int(restart_downtime_s * 1e9)
            rep, i = divmod(sec, period)
            off, parts = sl[i]
            base = rep * period * 1_000_000_000 + shift
            arrays = {}
            for k, a in parts.items():
                a = a.copy()
                a["start_ns"] += base
                a["end_ns"] += base
                if "correlation_id" in a.dtype.names:    # fresh ids per replica, as a live run has
                    a["correlation_id"] = np.where(a["correlation_id"] >= 0,
                                                   a["correlation_id"] + rep * corr_span, -1)
                arrays[k] = a
            recv = t0 + base + off + 1_000_000_000
            lost = lost_at_s is not None and lost_at_s <= sec < lost_at_s + lost_batches
            if lost:                               # published, never received: a gap
                seq["events"] += 1
                lost_kernels += len(arrays["kernels"])
            else:
                tr = Trace(names=source.names, devices=source.devices,
                           meta={"source": "simulated"}, **arrays)
                w.write(wire.encode_envelope("events", seq["events"], enc.encode(tr), host, recv), recv)
                seq["events"] += 1
                kernels += len(arrays["kernels"])
                batches += 1
            w.write(wire.encode_envelope("window", seq["window"],
                                         wire.encode_window({"duration_ns": 1_000_000_000, "gpus": []}),
                                         host, recv), recv)
            seq["window"] += 1
    return {"seconds": total_s, "batches": batches, "kernels": kernels, "lost_kernels": lost_kernels,
            "restarted": restarted, "bytes": out.stat().st_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--restart-at", type=float, default=None, metavar="S")
    ap.add_argument("--lost-at", type=float, default=None, metavar="S")
    ap.add_argument("--source", type=Path, default=Path("/tmp/ridgeline-sim10.json.gz"))
    a = ap.parse_args()
    src = simulated_trace(a.source)
    print(write_recording(a.out, src, a.minutes, a.restart_at, lost_at_s=a.lost_at))


if __name__ == "__main__":
    main()
