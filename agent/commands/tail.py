"""``ridgeline tail``: print the agent's stream, decoded, and report sequence gaps."""
from __future__ import annotations

import sys
import time

from ridgeline.agent.commands import description
from ridgeline.probes.errors import InputError, RuntimeFailure


def register(sub) -> None:
    from ridgeline.agent.subscriber import add_stream_arguments
    p = sub.add_parser("tail", help="print decoded records from the agent's stream",
                       description=description(__doc__) + " Windows are printed with their answer (the "
                       "binding face, its reasons and the other faces' figures), as top and the report give it.")
    add_stream_arguments(p)
    p.add_argument("--json", action="store_true", help="one JSON object per line (NDJSON)")
    p.add_argument("--count", type=int, default=0, metavar="N", help="stop after N records (0: never)")
    p.add_argument("--timeout", type=float, default=0.0, metavar="S",
                   help="give up after S seconds without a record (0: wait forever); exit 1")
    p.set_defaults(func=run)


def jsonable(obj):
    """Decoded payloads as JSON-able values: arrays as lists, bytes as their length."""
    import numpy as np
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {"bytes": len(obj)}
    if isinstance(obj, np.ndarray):
        if obj.dtype.names:
            return {"records": int(len(obj)), "fields": list(obj.dtype.names)}
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if hasattr(obj, "kernels") and hasattr(obj, "names"):   # a Trace (event batch)
        return {"kernels": len(obj.kernels), "copies": len(obj.copies), "api": len(obj.api),
                "ranges": len(obj.ranges)}
    if isinstance(obj, float) and obj != obj:
        return None
    return obj


def summary(msg) -> str:
    import msgspec

    from ridgeline.probes.records import Health, window_of
    p = msg.payload
    if msg.topic == "window" and isinstance(p, dict):
        try:
            w = window_of(p)
        except msgspec.ValidationError as exc:    # a producer's bug, said in one line
            return f"window not readable as a window record: {exc}"
        kern = sum(g.kernels for g in w.gpus)
        a = w.agent
        from ridgeline.agent.window_sections import verdict_text
        vs = verdict_text(w.verdict)
        from ridgeline.aggregator.answer import answer_lines, verdict_records
        # The answer, as the report and top word it (aggregator.answer), on the record's
        # one line: `tail` prints one line per record.
        answer = "".join(" | " + line.strip() for rec in verdict_records(p.get("verdict"))
                         for line in answer_lines(rec))
        return (f"{len(w.gpus)} gpu/process, {kern} kernels, verdict {vs}, agent cpu={a.cpu_pct or 0:.1f}% "
                f"rss={(a.rss_bytes or 0) / 2**20:.0f}MiB" + answer)
    if msg.topic == "health" and isinstance(p, dict):
        try:
            h = msgspec.convert(p, Health)
        except msgspec.ValidationError as exc:
            return f"health not readable as a health record: {exc}"
        return (f"cpu={h.cpu_pct or 0:.1f}% rss={(h.rss_bytes or 0) / 2**20:.0f}MiB "
                f"records/s={h.records_per_s or 0:.0f} dropped records={h.dropped_records or 0} "
                f"batches={h.dropped_batches or 0} stream={h.publisher_drops or 0}")
    import orjson
    text = orjson.dumps(jsonable(p), option=orjson.OPT_NON_STR_KEYS).decode()
    return text if len(text) < 200 else text[:197] + "..."


def run(args) -> int:
    import orjson

    from ridgeline.agent.subscriber import open_stream
    if args.count < 0:
        raise InputError("--count must be >= 0")
    if not args.timeout >= 0:
        raise InputError("--timeout must be >= 0")
    sub = open_stream(args)
    out = sys.stdout
    n = 0
    last = time.monotonic()
    try:
        while not args.count or n < args.count:
            msg = sub.receive(0.5)
            if sub.refused:
                raise RuntimeFailure(f"tail: {sub.refused}")
            if msg is None:
                if args.timeout and time.monotonic() - last > args.timeout:
                    raise RuntimeFailure(f"tail: no record for {args.timeout:g} s from {args.endpoint} "
                                         "(is `ridgeline agent` running?)")
                continue
            last = time.monotonic()
            if msg.gap:
                print(f"ridgeline tail: gap on {msg.topic}: {msg.gap} message(s) missing before seq {msg.seq}",
                      file=sys.stderr, flush=True)
            if msg.restarted:
                print(f"ridgeline tail: {msg.topic} sequence restarted at {msg.seq} (agent restarted)",
                      file=sys.stderr, flush=True)
            if args.json:
                rec = {"topic": msg.topic, "seq": msg.seq, "host": msg.host, "ts_ns": msg.ts_ns,
                       "gap": msg.gap, "payload": jsonable(msg.payload)}
                out.write(orjson.dumps(rec, option=orjson.OPT_NON_STR_KEYS).decode() + "\n")
            else:
                out.write(f"{msg.topic:<7} #{msg.seq:<6} {msg.host} {summary(msg)}\n")
            out.flush()
            n += 1
    finally:
        if sub.bad:
            print(f"ridgeline tail: {sub.bad} undecodable message(s) skipped", file=sys.stderr)
        gaps = sum(sub.seq.gaps.values())
        if gaps:
            print(f"ridgeline tail: {gaps} message(s) missing in total "
                  + ", ".join(f"{t}={g}" for t, g in sub.seq.gaps.items()), file=sys.stderr)
        sub.close()
    return 0
