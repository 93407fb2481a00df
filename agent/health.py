"""The agent's own cost: CPU, resident memory, records per second, drops per probe.

Contract: :class:`HealthMeter` is sampled once per window (:meth:`sample`) and returns a
plain dict with ``cpu_pct`` (percent of one core since the previous sample, user+system),
``rss_bytes``, ``peak_rss_bytes``, ``records_per_s``, and the per-probe counters it was
given (``probes: {name: {records, drops, errors, ...}}``) plus the totals
``dropped_records`` (records lost: the sum of the probes' ``drops``, which count records),
``dropped_batches`` (whole batches, scrapes or messages lost before they were read, so
their record count is unknown: the sum of the probes' ``dropped_batches``) and
``errors``. The two drop figures are never added together: they count different things.
Reading /proc is the only I/O here (thin, Linux-only; elsewhere RSS is the peak from
``resource``).
"""
from __future__ import annotations

import os
import resource
import time

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Current resident set size of this process."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_ns() -> int:
    t = os.times()
    return int((t.user + t.system) * 1e9)


class HealthMeter:
    def __init__(self, clock=time.monotonic_ns, cpu=cpu_ns):
        self._clock = clock
        self._cpu = cpu
        self._t = clock()
        self._c = cpu()
        self._records = 0
        self.started_ns = self._t

    def sample(self, probe_counters: dict[str, dict], records_total: int, extra: dict | None = None) -> dict:
        now, c = self._clock(), self._cpu()
        dt = max(now - self._t, 1)
        out = {
            "cpu_pct": 100.0 * (c - self._c) / dt,
            "rss_bytes": rss_bytes(),
            "peak_rss_bytes": peak_rss_bytes(),
            "records_per_s": (records_total - self._records) * 1e9 / dt,
            "records_total": records_total,
            "uptime_s": (now - self.started_ns) / 1e9,
            "probes": probe_counters,
            "dropped_records": sum(int(v.get("drops", 0) or 0) for v in probe_counters.values()),
            "dropped_batches": sum(int(v.get("dropped_batches", 0) or 0) for v in probe_counters.values()),
            "errors": sum(int(v.get("errors", 0) or 0) for v in probe_counters.values()),
        }
        bpf = [v["bpf_run_time_ns"] for v in probe_counters.values() if isinstance(v.get("bpf_run_time_ns"), (int, float))]
        # The sched probe reports per-program stats: {"bpf_programs": {name: {"run_time_ns": ...}}}.
        for v in probe_counters.values():
            progs = v.get("bpf_programs")
            if isinstance(progs, dict):
                bpf.extend(int(p.get("run_time_ns", 0) or 0) for p in progs.values() if isinstance(p, dict))
        if bpf:
            out["bpf_run_time_ns"] = int(sum(bpf))
        if extra:
            out.update(extra)
        self._t, self._c, self._records = now, c, records_total
        return out
