"""``ridgeline sched --pid PID [--duration S] [--json]``: one-shot scheduling report of a process.

Per thread: on-CPU, run-queue wait, blocked and unattributed time, voluntary and
involuntary switches, migrations; where the process maps the CUDA runtime or driver,
also kernel launches, graph launches, copy bytes by direction and synchronisation
count and time (uprobes); plus the process's run-queue latency histogram.

Needs root and eBPF; otherwise one error line and exit status 2.
"""
from __future__ import annotations

import sys
import time

import numpy as np
import orjson

from ridgeline.agent.commands import description
from ridgeline.probes import proc
from ridgeline.probes.errors import InputError, RuntimeFailure
from ridgeline.probes.sched_accounting import WINDOW_DTYPE, hist_rows

_SUM_FIELDS = [n for n in WINDOW_DTYPE.names if n not in ("tid", "tgid", "comm", "exited", "runq_max_ns")]
_CUDA_FIELDS = ("launches", "graph_launches", "copies", "copy_htod_bytes", "copy_dtoh_bytes", "copy_dtod_bytes",
                "copy_htoh_bytes", "copy_peer_bytes", "copy_other_bytes", "sync_calls", "sync_ns", "copy_wait_ns",
                "nested_driver_calls")


def register(subparsers) -> None:
    p = subparsers.add_parser("sched", help="per-thread scheduling (+ CUDA call) report of a process, via eBPF",
                              description=description(__doc__, 1))
    p.add_argument("--pid", type=int, required=True, help="process to observe (all its threads)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds to observe (default 5)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--no-cuda", action="store_true", help="skip the CUDA uprobes")
    p.set_defaults(func=run)


def merge_windows(windows: list[np.ndarray]) -> dict[int, dict]:
    """Sum per-thread window rows over several windows (by tid); histogram slots added."""
    out: dict[int, dict] = {}
    for w in windows:
        for r in w:
            tid = int(r["tid"])
            d = out.get(tid)
            if d is None:
                d = out[tid] = {"tid": tid, "tgid": int(r["tgid"]), "comm": "", "exited": False, "runq_max_ns": 0,
                                **{f: 0 for f in _SUM_FIELDS if f != "runq_hist"}, "runq_hist": np.zeros(32, np.int64)}
            d["comm"] = r["comm"].decode(errors="replace") or d["comm"]
            d["exited"] = d["exited"] or bool(r["exited"])
            d["runq_max_ns"] = max(d["runq_max_ns"], int(r["runq_max_ns"]))
            for f in _SUM_FIELDS:
                if f == "runq_hist":
                    d[f] = d[f] + r[f].astype(np.int64)
                else:
                    d[f] += int(r[f])
    return out


def merge_cuda(windows: list[np.ndarray]) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for w in windows:
        for r in w:
            d = out.setdefault(int(r["tid"]), {f: 0 for f in _CUDA_FIELDS})
            for f in _CUDA_FIELDS:
                d[f] += int(r[f])
    return out


def _fail(what: str, avail) -> None:
    hint = f"; {avail.hint}" if avail.hint else ""
    raise RuntimeFailure(f"{what}: {avail.reason}{hint}")


def run(args) -> int:
    if args.duration <= 0:
        raise InputError("--duration must be positive")
    if not proc.alive(args.pid):
        raise InputError(f"no process with pid {args.pid}")
    from ridgeline.probes.cuda_uprobes import CudaUprobeProbe, libraries_of
    from ridgeline.probes.sched import SchedProbe

    sched = SchedProbe(pids=[args.pid], discover=False, seed_s=args.duration + 1.0)
    avail = sched.check()
    if not avail.ok:
        _fail("sched probe unavailable", avail)
    libs = libraries_of(args.pid) if not args.no_cuda else {"runtime": [], "driver": []}
    cuda = None
    if libs["runtime"] or libs["driver"]:
        cuda = CudaUprobeProbe(pids=[args.pid], discover=False, rescan_s=1.0)
        if not cuda.check().ok:
            cuda = None
    try:
        sched.start()
        if cuda:
            cuda.start()
    except Exception as exc:  # noqa: BLE001  bcc raises plain Exception for a compile/attach failure: one line
        sched.stop()
        if cuda:
            cuda.stop()
        raise RuntimeFailure("could not load the eBPF probes: "
                             f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    tids_before = {t: proc.comm(args.pid, t) for t in proc.tids(args.pid)}
    windows, cwindows = [], []
    t_end = time.monotonic() + args.duration
    sched.poll()          # window boundary
    if cuda:
        cuda.poll()
    try:
        while True:
            left = t_end - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(0.5, left))   # drain the ring buffer regularly
            windows.append(sched.poll()["threads"])
            if cuda:
                cwindows.append(cuda.poll()["threads"])
            if not proc.alive(args.pid):
                break
    except OSError as exc:   # a map read failing mid-run: one line, what was collected is lost with it
        raise RuntimeFailure(f"reading the eBPF maps failed: {exc}") from None
    finally:
        counters = sched.counters()
        ccounters = cuda.counters() if cuda else None
        sched.stop()
        if cuda:
            cuda.stop()
    threads = merge_windows(windows)
    cthreads = merge_cuda(cwindows)
    quiet = {t: c for t, c in tids_before.items() if t not in threads}
    hist = np.zeros(32, np.int64)
    for d in threads.values():
        hist += d["runq_hist"]
    report = {
        "pid": args.pid,
        "comm": proc.comm(args.pid) or "",
        "duration_s": args.duration,
        "threads": [],
        "quiet_threads": [{"tid": t, "comm": c or ""} for t, c in sorted(quiet.items())],
        "runq_hist": hist_rows(hist),
        "cuda_libraries": libs,
        "counters": {"sched": {k: v for k, v in counters.items() if k != "bpf_programs"},
                     "cuda": ({k: v for k, v in ccounters.items() if k != "bpf_programs"} if ccounters else None)},
    }
    for tid in sorted(threads, key=lambda t: -threads[t]["on_cpu_ns"]):
        d = dict(threads[tid])
        d["runq_hist"] = hist_rows(d["runq_hist"])
        if cuda:
            d.update(cthreads.get(tid, {f: 0 for f in _CUDA_FIELDS}))
        report["threads"].append(d)
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
        return 0
    _print_table(report, cuda is not None)
    return 0


def _ms(ns: int) -> str:
    return f"{ns / 1e6:9.1f}"


def _print_table(rep: dict, with_cuda: bool) -> None:
    out = sys.stdout
    out.write(f"pid {rep['pid']} ({rep['comm']}), {rep['duration_s']:g} s, {len(rep['threads'])} threads active"
              f", {len(rep['quiet_threads'])} without any scheduler event (blocked throughout)\n")
    head = f"{'tid':>8} {'comm':<16} {'on_cpu_ms':>9} {'runq_ms':>9} {'blocked_ms':>10} {'unattr_ms':>9} {'vol':>6} {'invol':>6} {'migr':>5}"
    if with_cuda:
        head += f" {'launch':>7} {'graph':>5} {'HtoD_MB':>8} {'DtoH_MB':>8} {'sync':>5} {'sync_ms':>8}"
    out.write(head + "\n")
    for d in rep["threads"]:
        line = (f"{d['tid']:>8} {d['comm'][:16]:<16} {_ms(d['on_cpu_ns'])} {_ms(d['runq_wait_ns'])} "
                f"{d['blocked_ns'] / 1e6:10.1f} {_ms(d['unattributed_ns'])} {d['voluntary_switches']:>6} "
                f"{d['involuntary_switches']:>6} {d['migrations']:>5}")
        if with_cuda:
            line += (f" {d['launches']:>7} {d['graph_launches']:>5} {d['copy_htod_bytes'] / 1e6:8.1f} "
                     f"{d['copy_dtoh_bytes'] / 1e6:8.1f} {d['sync_calls']:>5} {d['sync_ns'] / 1e6:8.1f}")
        out.write(line + ("  (exited)" if d["exited"] else "") + "\n")
    if rep["runq_hist"]:
        out.write("\nrun-queue latency (all threads)\n")
        peak = max(r["count"] for r in rep["runq_hist"])
        for r in rep["runq_hist"]:
            out.write(f"{r['lo_us']:>9} -> {r['hi_us']:<9} us : {r['count']:>7} |{'*' * max(1, int(40 * r['count'] / peak))}\n")
    c = rep["counters"]["sched"]
    out.write(f"\nunattributed time: events hidden from tracing ({c.get('gaps', 0)} gaps); "
              f"drops: {c.get('drops', 0)}\n")
