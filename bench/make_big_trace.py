"""Build a large Kineto trace by replicating a real one with shifted timestamps and ids.

    .venv/bin/python bench/make_big_trace.py --kernels 1000000 -o /tmp/big.json

Each replica of the source's events is shifted in time by the source's span (plus a
gap) and gets fresh correlation ids, flow ids and External ids, so the result looks
like one long profile of the same workload: kernel/API/operator links stay intact.
The output is written replica by replica (streaming): memory stays at a few times the
source trace, whatever the output size. The top-level ``metadata`` object (recorders
put environment variables there) is not copied.
"""
from __future__ import annotations

import argparse
import gzip
import math
import os
import sys
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("RIDGELINE_SHARED", ROOT.parent / "shared"))
DEFAULT_SOURCE = SHARED / "traces" / "nvidia-inference" / \
    "tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz"


def _load(path: Path) -> dict:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return orjson.loads(raw)


def make_big_trace(source: Path, out: Path, kernels: int, gap_us: int = 100, compresslevel: int = 1) -> dict:
    """Write a trace with at least ``kernels`` kernel events; returns a summary dict."""
    doc = _load(source)
    events = [e for e in doc["traceEvents"] if isinstance(e, dict)]
    per_replica = sum(1 for e in events if e.get("cat") == "kernel")
    if per_replica == 0:
        raise SystemExit(f"{source}: no kernel events to replicate")
    replicas = max(1, math.ceil(kernels / per_replica))

    ts = [e["ts"] for e in events if isinstance(e.get("ts"), (int, float))]
    ends = [e["ts"] + e.get("dur", 0) for e in events if isinstance(e.get("ts"), (int, float))]
    span_us = math.ceil(max(ends) - min(ts)) + gap_us

    def ids(key, where):
        vals = [v for e in events for v in [where(e).get(key) if isinstance(where(e), dict) else None]
                if type(v) is int]
        return (max(vals) - min(vals) + 1) if vals else 0
    corr_span = max(ids("correlation", lambda e: e.get("args")), ids("id", lambda e: e))
    ext_span = ids("External id", lambda e: e.get("args"))

    # Metadata rows ("M") describe processes/threads once; events are replicated.
    meta_rows = [e for e in events if e.get("ph") == "M"]
    body = [e for e in events if e.get("ph") != "M"]
    base = [(e.get("ts"), e.get("id"), (e.get("args") or {}).get("correlation"),
             (e.get("args") or {}).get("External id")) for e in body]

    header = {k: v for k, v in doc.items() if k not in ("traceEvents", "metadata")}
    opener = gzip.open if out.suffix == ".gz" else open
    kwargs = {"compresslevel": compresslevel} if out.suffix == ".gz" else {}
    with opener(out, "wb", **kwargs) as f:
        f.write(orjson.dumps(header)[:-1] + b',"traceEvents":[')
        f.write(orjson.dumps(meta_rows)[1:-1])
        for r in range(replicas):
            dt, dc, dx = r * span_us, r * corr_span, r * ext_span
            for e, (t0, fid, corr, ext) in zip(body, base):
                if isinstance(t0, (int, float)):
                    e["ts"] = t0 + dt
                if type(fid) is int:
                    e["id"] = fid + dc
                a = e.get("args")
                if a is not None:
                    if type(corr) is int:
                        a["correlation"] = corr + dc
                    if type(ext) is int:
                        a["External id"] = ext + dx
            chunk = orjson.dumps(body)[1:-1]
            if meta_rows or r:
                f.write(b",")
            f.write(chunk)
        f.write(b"]}")
    return {"source": str(source), "output": str(out), "replicas": replicas,
            "kernels": replicas * per_replica, "events": replicas * len(body) + len(meta_rows),
            "bytes": out.stat().st_size}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="Kineto trace to replicate")
    ap.add_argument("--kernels", type=int, default=1_000_000, help="at least this many kernels")
    ap.add_argument("-o", "--output", type=Path, required=True, help=".json or .json.gz")
    args = ap.parse_args(argv)
    s = make_big_trace(args.source, args.output, args.kernels)
    print(orjson.dumps(s).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
