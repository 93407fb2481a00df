"""Reading a window record's sections for display: its engine endpoints and their
failures, the scheduling probe's threads, its verdicts in one line.

Plain Python, no terminal library: the /metrics collector (the daemon), ``ridgeline
tail`` and ``ridgeline top`` read windows through these alike.
"""
from __future__ import annotations


def verdict_text(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, list):
        return ", ".join(f"gpu{x.get('device')}/{x.get('pid')}: {x.get('verdict')}" if isinstance(x, dict) else str(x)
                         for x in v) or "-"
    if isinstance(v, dict):
        return str(v.get("verdict") or v.get("face") or v.get("name") or "-")
    return str(v)


def engine_records(engine: dict) -> list[tuple[str, dict]]:
    """(endpoint, record) pairs from the window's engine section (tracker output
    ``{"endpoints": {url: record}}`` per source, or plain records)."""
    out = []
    for src, data in (engine or {}).items():
        if not isinstance(data, dict):
            continue
        if isinstance(data.get("endpoints"), dict):
            out.extend((ep, r) for ep, r in data["endpoints"].items() if isinstance(r, dict))
        else:
            out.append((src, data))
    return out


def engine_failures(engine: dict) -> dict[str, str]:
    """Endpoint -> its latest scrape error, from the window's engine section (the engine
    probe's ``errors``, kept by the window builder until the endpoint answers)."""
    out: dict[str, str] = {}
    for data in (engine or {}).values():
        for e in (data.get("errors") if isinstance(data, dict) else None) or []:
            if isinstance(e, dict) and isinstance(e.get("endpoint"), str):
                err = str(e.get("error") or "scrape failed")
                out[e["endpoint"]] = err[len(e["endpoint"]) + 2:] if err.startswith(e["endpoint"] + ": ") else err
    return out


def sched_threads(sched: dict) -> list[dict]:
    """Thread rows from whatever the scheduling probe delivered (list or dict of threads)."""
    out = []
    for data in (sched or {}).values():
        threads = data.get("threads") if isinstance(data, dict) else None
        if isinstance(threads, dict):
            threads = [dict(v, tid=k) if isinstance(v, dict) else {"tid": k} for k, v in threads.items()]
        for th in threads or []:
            if isinstance(th, dict):
                out.append(th)
    return out
