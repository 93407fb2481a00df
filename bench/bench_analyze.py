"""`ridgeline analyze --json` vs Holistic Trace Analysis on the same big Kineto trace.

    .venv/bin/python bench/bench_analyze.py                 # 1,000,000 kernels (minutes; HTA needs ~10 GB)
    .venv/bin/python bench/bench_analyze.py --kernels 50000 # a quick run

Builds (or reuses) a trace of about ``--kernels`` kernels with bench/make_big_trace.py,
then runs, one after the other in fresh child processes on the same file:

* ``ridgeline analyze --json FILE`` (the whole command: import, phases, roofline, report);
* ``ridgeline``'s importer alone (``probes.kineto.load_trace``), for reference;
* HTA 0.5.0 (``pip install -e .[bench]``): ``TraceAnalysis(trace_dir=...)`` (its parse)
  plus ``get_gpu_kernel_breakdown()``.

Each child's wall time, CPU time and peak RSS come from ``os.wait4`` (the kernel's
accounting of exactly that child). Kernels per second = kernels in the file / wall time.
Also the wire cost: bytes per kernel event of an ``aggregator.wire`` event batch vs the
same kernel events as Kineto JSON, plain and gzipped, on the real trace the big one
replicates. Prints one table and writes it as markdown (``--out``).
"""
from __future__ import annotations

import argparse
import gzip
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import orjson  # noqa: E402

from make_big_trace import DEFAULT_SOURCE, make_big_trace  # noqa: E402

PY = sys.executable

LOAD_ONLY = "from ridgeline.probes.kineto import load_trace; import sys; t = load_trace(sys.argv[1]); print(len(t.kernels))"
HTA = """
import sys, logging
logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
a = TraceAnalysis(trace_dir=sys.argv[1])
kernel_type, kernels = a.get_gpu_kernel_breakdown(visualize=False)
print(len(kernels))
"""


def run_child(argv: list[str], timeout_s: float) -> dict:
    """Run one child; wall, CPU and peak RSS of exactly that child (os.wait4)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(argv, stdout=out, stderr=err, cwd=ROOT)
        deadline = t0 + timeout_s
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                p.kill()
                pid, status, ru = os.wait4(p.pid, 0)
                break
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        timed_out = wall > timeout_s
        p.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        out.seek(0)
        return {"wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime, "rss_bytes": ru.ru_maxrss * 1024,
                "rc": p.returncode, "timed_out": timed_out, "stdout": out.read()[-2000:].decode(errors="replace"),
                "stderr": err.read()[-2000:].decode(errors="replace")}


def wire_costs(source: Path) -> dict:
    """Bytes per kernel event: wire batch vs Kineto JSON (plain, gzipped) of the same kernels."""
    from ridgeline.aggregator import wire
    from ridgeline.probes.events import Trace
    from ridgeline.probes.kineto import load_trace
    trace = load_trace(source)
    raw = gzip.decompress(source.read_bytes()) if source.read_bytes()[:2] == b"\x1f\x8b" else source.read_bytes()
    kern = [e for e in orjson.loads(raw)["traceEvents"] if e.get("cat") == "kernel"]
    plain = orjson.dumps(kern)
    n = len(trace.kernels)
    batch = wire.encode_event_batch(Trace(kernels=trace.kernels, names=trace.names, devices=trace.devices))
    return {"kernels": n, "wire": len(batch) / n, "json": len(plain) / n,
            "json_gz": len(gzip.compress(plain, 6)) / n}


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=1_000_000)
    ap.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    ap.add_argument("--trace", type=Path, help="use this trace instead of building one")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--skip-hta", action="store_true")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", type=Path, default=None,
                    help="markdown output (default: docs/benchmarks-analyze.md for the full "
                         "1,000,000-kernel run only, so quick runs never overwrite it)")
    args = ap.parse_args(argv)
    if args.out is None and args.kernels == 1_000_000:
        args.out = ROOT / "docs" / "benchmarks-analyze.md"

    if args.trace:
        path = args.trace
        made = {"kernels": None, "bytes": path.stat().st_size, "replicas": "-"}
    else:
        path = args.workdir / f"ridgeline-bench-{args.kernels}.json"
        if path.exists():
            made = {"kernels": None, "bytes": path.stat().st_size, "replicas": "(reused)"}
        else:
            print(f"building {path} ...", flush=True)
            made = make_big_trace(args.source, path, args.kernels)
    load_before = loadavg()
    rows = []
    ours = run_child([PY, "-m", "ridgeline", "analyze", "--json", str(path)], args.timeout)
    rows.append(("ridgeline analyze --json", ours))
    load = run_child([PY, "-c", LOAD_ONLY, str(path)], args.timeout)
    rows.append(("ridgeline load_trace only", load))
    kernels = made["kernels"] or int(load["stdout"].strip().splitlines()[-1])
    hta = None
    if not args.skip_hta:
        hdir = Path(tempfile.mkdtemp(prefix="hta-bench-", dir=args.workdir))
        (hdir / "rank0.json").symlink_to(path.resolve())
        try:
            hta = run_child([PY, "-c", HTA, str(hdir)], args.timeout)
        finally:
            shutil.rmtree(hdir, ignore_errors=True)
        rows.append(("HTA 0.5.0 TraceAnalysis + get_gpu_kernel_breakdown", hta))
    load_after = loadavg()
    wc = wire_costs(args.source)

    def fmt(r):
        ok = "ok" if r["rc"] == 0 else (f"killed at the {args.timeout:.0f} s timeout: figures are "
                                         "lower bounds" if r["timed_out"] else f"FAILED rc={r['rc']}")
        more = ">= " if r["timed_out"] else ""
        return (f"{more}{r['wall_s']:.1f}", f"{more}{r['cpu_s']:.1f}", f"{more}{r['rss_bytes'] / 2**20:,.0f}",
                f"{'<= ' if r['timed_out'] else ''}{kernels / r['wall_s']:,.0f}", ok)

    lines = ["| run | wall s | CPU s | peak RSS MiB | kernels/s | status |", "|---|---:|---:|---:|---:|---|"]
    for name, r in rows:
        lines.append("| " + " | ".join((name,) + fmt(r)) + " |")
    ratio_lines = []
    if hta is not None and (hta["rc"] == 0 or hta["timed_out"]) and ours["rc"] == 0:
        at_least = ">= " if hta["timed_out"] else ""
        ratio_lines = [
            "| ratio (HTA / ridgeline analyze) | value | target |", "|---|---:|---|",
            f"| kernels/s (wall) | {at_least}{hta['wall_s'] / ours['wall_s']:.1f}x | >= 10x |",
            f"| CPU time | {at_least}{hta['cpu_s'] / ours['cpu_s']:.1f}x | |",
            f"| peak RSS | {at_least}{hta['rss_bytes'] / ours['rss_bytes']:.1f}x less | >= 10x less |",
        ]
    wire_lines = [
        f"| bytes per kernel event ({wc['kernels']} kernels of `{args.source.name}`) | bytes |",
        "|---|---:|",
        f"| Kineto JSON, plain | {wc['json']:.1f} |",
        f"| Kineto JSON, gzip -6 | {wc['json_gz']:.1f} |",
        f"| ridgeline wire event batch (names included) | {wc['wire']:.1f} |",
    ]
    cmd = "bench/bench_analyze.py" + ("" if args.kernels == 1_000_000 else f" --kernels {args.kernels}")
    env = (f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), Python {platform.python_version()}; "
           f"load average before {load_before}, after {load_after} (the machine is shared: "
           "other work running at the same time slows every row alike)")
    text = "\n".join([
        "# Benchmark: `ridgeline analyze` vs Holistic Trace Analysis",
        "",
        f"Trace: `{path.name}`, {kernels:,} kernels, {made['bytes'] / 1e9:.2f} GB of Kineto JSON, built by "
        f"`bench/make_big_trace.py` from `{args.source.name}` (replicas: {made['replicas']}).",
        f"Machine: {env}.",
        "",
        "Reproduce: `.venv/bin/pip install -e .[bench] && .venv/bin/python " + cmd + "`",
        "",
        *lines, "", *ratio_lines, "", *wire_lines, "",
        "Wall, CPU and peak RSS are the kernel's accounting of each child process (`os.wait4`).",
        "",
    ])
    print(text)
    for name, r in rows:
        if r["rc"] != 0:
            print(f"--- {name} stderr ---\n{r['stderr']}", file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
