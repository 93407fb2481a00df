"""Reading a window record's sections for display: its engine endpoints and their
failures, the scheduling probe's threads, its verdicts in one line.

Plain Python, no terminal library: the /metrics collector (the daemon), ``ridgeline
tail`` and ``ridgeline top`` read windows through these alike.
"""
from __future__ import annotations

import msgspec

from ridgeline.probes.records import DeviceSamples, EngineSource, SchedFigures, ScrapeError


def verdict_text(v) -> str:
    """The window's verdict in one line: ``gpu<device>/<pid>: <verdict>`` per record (the
    window's ``verdict`` is a list of records, or one record where judging failed)."""
    from ridgeline.probes.records import VerdictRecord
    if v is None:
        return "-"
    if isinstance(v, list):
        parts = []
        for x in v:
            try:
                r = msgspec.convert(x, VerdictRecord)
            except msgspec.ValidationError:     # not a verdict record: shown as it is
                parts.append(str(x))
                continue
            parts.append(f"gpu{r.device}/{r.pid}: {r.verdict}")
        return ", ".join(parts) or "-"
    if isinstance(v, dict):
        return str(v.get("verdict") or v.get("face") or v.get("name") or "-")
    return str(v)


def _source(data, kind):
    """One source's record of a window section as ``kind``, or None (another shape)."""
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError:
        return None


def engine_records(engine: dict) -> list[tuple[str, dict]]:
    """(endpoint, record) pairs from the window's engine section (tracker output
    ``{"endpoints": {url: record}}`` per source, or plain records); each record is read as
    ``probes.records.EngineFigures`` by who shows it."""
    out = []
    for src, data in (engine or {}).items():
        s = _source(data, EngineSource)
        if s is None:
            continue
        if s.endpoints is not None:
            out.extend((ep, r) for ep, r in s.endpoints.items() if isinstance(r, dict))
        else:
            out.append((src, data))
    return out


def engine_failures(engine: dict) -> dict[str, str]:
    """Endpoint -> its latest scrape error, from the window's engine section (the engine
    probe's ``errors``, kept by the window builder until the endpoint answers)."""
    out: dict[str, str] = {}
    for data in (engine or {}).values():
        s = _source(data, EngineSource)
        for raw in s.errors if s is not None else ():
            e = _source(raw, ScrapeError)
            if e is None or e.endpoint is None:
                continue
            err = str(e.error or "scrape failed")
            out[e.endpoint] = err[len(e.endpoint) + 2:] if err.startswith(e.endpoint + ": ") else err
    return out


def device_samples(device: dict) -> list[list]:
    """Each device source's samples (``{"devices": [...]}`` per source) from the window's
    device section; a source of another shape gives none."""
    out = []
    for data in (device or {}).values():
        s = _source(data, DeviceSamples)
        if s is not None:
            out.append(s.devices)
    return out


def sched_threads(sched: dict) -> list[dict]:
    """Thread rows from whatever the scheduling probe delivered (list or dict of threads);
    each is read as ``probes.records.SchedThread`` by who uses it."""
    out = []
    for data in (sched or {}).values():
        s = _source(data, SchedFigures)
        threads = s.threads if s is not None else None
        if isinstance(threads, dict):
            threads = [dict(v, tid=k) if isinstance(v, dict) else {"tid": k} for k, v in threads.items()]
        out.extend(th for th in threads or () if isinstance(th, dict))
    return out
