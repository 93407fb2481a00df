"""`ridgeline analyze --json` vs bare decompression and vs Holistic Trace Analysis, side by side.

    .venv/bin/python bench/bench_analyze.py --gzip               # 1M kernels from the A100 trace, .json.gz
    .venv/bin/python bench/bench_analyze.py --kernels 200000 --gzip
    .venv/bin/python bench/bench_analyze.py --source H100 --kernels 200000
    .venv/bin/python bench/bench_analyze.py --trace FILE [--skip-hta]
    .venv/bin/python bench/bench_analyze.py --trace FILE --skip-hta --baseline OTHER/.venv/bin/python
    .venv/bin/python bench/bench_analyze.py --trace FILE --skip-hta --repeat 3 --forced-readers
    .venv/bin/python bench/bench_analyze.py --scaled --kernels 200000 --source H100 --repeat 3 --one-cpu

``--scaled`` builds the trace with ``../shared/tools/scale_kineto_trace.py SRC OUT
--target-kernels N`` (the shared tool every figure of docs/benchmarks-analyze.md names:
whole copies of the source's kernel, memcpy, memset and runtime events, gzip level 6)
instead of bench/make_big_trace.py. ``--one-cpu`` pins this process and every child to
CPU 0 (``taskset -c 0``): a busy GPU host gives analyze no second CPU. With ``--repeat N``
HTA runs N times too, alternating with analyze, and the ratios are given as min / median /
max over the repetitions.

Builds (or reuses) a trace of about ``--kernels`` kernels with bench/make_big_trace.py
(default source: the shared A100 training trace; ``--source H100`` the H100 one; ``--gzip``
writes it gzipped, level 6), then runs, one after the other in fresh child processes on
the same file, in one run:

* ``zcat FILE > /dev/null`` (gzip files): the bare decompression the issue compares to;
* ISA-L inflate alone (``isal.igzip``, what the importer uses), for reference;
* with ``--baseline PYTHON``: ``PYTHON -m ridgeline analyze --json FILE``, the same command
  of another checkout (its virtual environment's python), for before/after in one run;
* ``ridgeline analyze --json FILE`` (the whole command: import, phases, roofline, report);
* with ``--forced-readers``: the same with the importer forced to one process, and to
  two (by default it takes two only when the load average leaves a CPU idle);
* with ``--repeat N``: zcat, the baseline, analyze (and the forced-reader runs) alternate N
  times, each repetition's ratios are printed and their median compared;
* with ``--old-path``: the same command with the importer's previous reader (the msgspec
  typed one, ``probes.kineto_typed``, one process) in place of the native one;
* ``ridgeline``'s importer alone (``probes.kineto.load_trace``);
* HTA 0.5.0 (``pip install -e .[bench]``): ``TraceAnalysis(trace_dir=...)`` (its parse)
  plus ``get_gpu_kernel_breakdown()``.

Each child's wall time, CPU time (its own and its children's) and peak RSS come from
``os.wait4``; peak RSS is also sampled every 50 ms as the sum over the child and its
descendants (ridgeline reads big files with two processes), and the larger figure is the
one compared. The load average before and after is printed: the machine may be shared,
so compare the ratios of rows measured in the same run, not absolute seconds across runs.
Also the wire cost: bytes per kernel event of an ``aggregator.wire`` event batch vs the
same kernel events as Kineto JSON, plain and gzipped, on the real source trace.
Prints one table and writes it as markdown (``--out``).
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import platform
import shlex
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
from make_big_trace import DEFAULT_SOURCE, SHARED, make_big_trace  # noqa: E402

SOURCES = {
    "A100": SHARED / "traces" / "nvidia-training" / "hta_a100_rank0_training.json.gz",
    "H100": DEFAULT_SOURCE,
}
SCALE_TOOL = SHARED / "tools" / "scale_kineto_trace.py"
ISAL = "from isal import igzip; import sys; f = igzip.open(sys.argv[1], 'rb')\nwhile f.read(1 << 22): pass"

PY = sys.executable

# the same command with the importer's readers forced: one process, or two (the
# default takes two only when the load average leaves a CPU idle)
FORCED_READERS = """
import functools, sys
import ridgeline.probes.kineto as k
k.load_trace = functools.partial(k.load_trace, parallel=sys.argv[2] == "2")
from ridgeline.agent.cli import main
sys.exit(main(["analyze", "--json", sys.argv[1]]))
"""
# The reader before the native one (issue 21.2): the same command with probes.kineto_native's
# load replaced by the msgspec typed reader, one process (one CPU), for old/new in one run.
OLD_PATH = """
import sys
from ridgeline.probes import kineto_native, kineto_typed
kineto_native.load = lambda path, chunk_bytes, budget=None: kineto_typed.load(path, chunk_bytes, False, budget)
from ridgeline.agent.cli import main
sys.exit(main(["analyze", "--json", sys.argv[1]]))
"""
LOAD_ONLY = "from ridgeline.probes.kineto import load_trace; import sys; t = load_trace(sys.argv[1]); print(len(t.kernels))"
HTA = """
import sys, logging
logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
a = TraceAnalysis(trace_dir=sys.argv[1])
kernel_type, kernels = a.get_gpu_kernel_breakdown(visualize=False)
print(len(kernels))
"""


def _tree_rss_bytes(root: int) -> int:
    """Resident bytes of ``root`` and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            ppid, pages = int(fields[1]), int(fields[21])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
        rss[int(d)] = pages * os.sysconf("SC_PAGE_SIZE")
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return total


def run_child(argv: list[str], timeout_s: float, shell: bool = False) -> dict:
    """Run one child; wall, CPU and peak RSS of exactly that child (os.wait4, RSS also
    sampled as the sum over its process tree)."""
    t0 = time.perf_counter()
    peak_tree = 0
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(argv, stdout=out, stderr=err, cwd=ROOT, shell=shell)
        deadline = t0 + timeout_s
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                p.kill()
                pid, status, ru = os.wait4(p.pid, 0)
                break
            peak_tree = max(peak_tree, _tree_rss_bytes(p.pid))
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        timed_out = wall > timeout_s
        p.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        out.seek(0)
        whole = out.read()
        out.seek(0)
        return {"wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime,
                # the whole output's digest: with --baseline, each repetition's document
                # must be byte-identical to the baseline's (a speed change changes no figure)
                "stdout_sha256": hashlib.sha256(whole).hexdigest(), "stdout_bytes": len(whole),
                "rss_bytes": max(ru.ru_maxrss * 1024, peak_tree),
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


def _progress(rows) -> None:
    """The row just measured, on stderr (a long run keeps what it measured if cut short)."""
    name, r = rows[-1]
    print(f"[{time.strftime('%H:%M:%S')}] {name}: wall {r['wall_s']:.1f} s, CPU {r['cpu_s']:.1f} s, "
          f"peak RSS {r['rss_bytes'] / 2**20:,.0f} MiB, rc {r['rc']}, load {loadavg()}", file=sys.stderr, flush=True)


def run_hta(path: Path, gz: bool, args) -> dict:
    """HTA on ``path``: it reads a directory of rank files, so a link to it in a fresh one."""
    hdir = Path(tempfile.mkdtemp(prefix="hta-bench-", dir=args.workdir))
    (hdir / ("rank0.json.gz" if gz else "rank0.json")).symlink_to(path.resolve())
    try:
        return run_child([PY, "-c", HTA, str(hdir)], args.timeout)
    finally:
        shutil.rmtree(hdir, ignore_errors=True)


def spread(xs: list[float], unit: str = "") -> str:
    """One ratio, or min / median / max of several."""
    xs = sorted(xs)
    if len(xs) == 1:
        return f"{xs[0]:.2f}{unit}"
    mid = xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2
    return f"{xs[0]:.2f} / {mid:.2f} / {xs[-1]:.2f}{unit} (min / median / max of {len(xs)})"


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=1_000_000)
    ap.add_argument("--source", default="A100",
                    help="trace to replicate: A100 (shared training trace), H100, or a path")
    ap.add_argument("--gzip", action="store_true", help="build the trace as .json.gz (gzip -6)")
    ap.add_argument("--trace", type=Path, help="use this trace instead of building one")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--skip-hta", action="store_true")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="python of another checkout's environment: its analyze --json is run too")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--repeat", type=int, default=1,
                    help="run zcat and analyze (and the baseline) alternately this many times")
    ap.add_argument("--forced-readers", action="store_true",
                    help="also run analyze with the importer forced to one and to two readers, in each repetition")
    ap.add_argument("--old-path", action="store_true",
                    help="also run analyze with the previous (msgspec typed) reader, each repetition")
    ap.add_argument("--skip-load-only", action="store_true", help="no importer-alone row")
    ap.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    ap.add_argument("--scaled", action="store_true",
                    help="build the trace with ../shared/tools/scale_kineto_trace.py (always gzipped)")
    ap.add_argument("--one-cpu", action="store_true", help="pin this process and its children to CPU 0")
    args = ap.parse_args(argv)
    if args.one_cpu:
        os.sched_setaffinity(0, {0})
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    source = SOURCES.get(args.source, Path(args.source))

    builder = "bench/make_big_trace.py"
    if args.trace:
        path = args.trace
        builder = "whoever made it (given with --trace)"
        made = {"kernels": None, "bytes": path.stat().st_size, "replicas": "-"}
    elif args.scaled:
        builder = f"`../shared/tools/scale_kineto_trace.py {source.name} OUT --target-kernels {args.kernels}`"
        path = args.workdir / f"ridgeline-bench-scaled-{args.kernels}-{args.source}.json.gz"
        if not path.exists():
            print(f"building {path} ...", flush=True)
            subprocess.run([PY, str(SCALE_TOOL), str(source), str(path), "--target-kernels", str(args.kernels)],
                           check=True, stdout=subprocess.DEVNULL)
        made = {"kernels": None, "bytes": path.stat().st_size, "replicas": "whole copies"}
    else:
        tag = "" if source == SOURCES["A100"] else f"-{source.name.split('_')[1]}"
        path = args.workdir / f"ridgeline-bench-{args.kernels}{tag}.json{'.gz' if args.gzip else ''}"
        if path.exists():
            made = {"kernels": None, "bytes": path.stat().st_size, "replicas": "(reused)"}
        else:
            print(f"building {path} ...", flush=True)
            made = make_big_trace(source, path, args.kernels, compresslevel=6)
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    load_before = loadavg()
    rows = []
    bare = None
    base = None
    # per repetition: (zcat, baseline, analyze, load average after, one reader, two readers)
    reps = []
    where = None
    if args.baseline:
        where = subprocess.run([str(args.baseline), "-c", "import ridgeline.probes.kineto as k; print(k.__file__)"],
                               capture_output=True, text=True, cwd=ROOT).stdout.strip()
    isal = None
    if gz:
        isal = run_child([PY, "-c", ISAL, str(path)], args.timeout)
        rows.append(("ISA-L inflate alone (isal.igzip, 4 MiB reads)", isal))
        _progress(rows)
    htas = []
    # zcat and analyze alternate, --repeat times: each pair sees about the same load
    differ = 0      # repetitions whose --json document is not the baseline's, byte for byte
    for rep in range(args.repeat):
        tag = f" #{rep + 1}" if args.repeat > 1 else ""
        if gz:
            bare = run_child(f"zcat {shlex.quote(str(path))} > /dev/null", args.timeout, shell=True)
            rows.append((f"zcat FILE > /dev/null (bare decompression){tag}", bare))
            _progress(rows)
        if args.baseline:
            base = run_child([str(args.baseline), "-m", "ridgeline", "analyze", "--json", str(path)], args.timeout)
            rows.append((f"ridgeline analyze --json, baseline (`{Path(where).parent.parent}`){tag}", base))
            _progress(rows)
        ours = run_child([PY, "-m", "ridgeline", "analyze", "--json", str(path)], args.timeout)
        rows.append((f"ridgeline analyze --json{tag}", ours))
        _progress(rows)
        if args.baseline and base["rc"] == 0 and ours["rc"] == 0:
            same = base["stdout_sha256"] == ours["stdout_sha256"]
            differ += not same
            print(f"analyze --json output{tag}: {ours['stdout_bytes']:,} bytes, "
                  f"{'identical to' if same else 'DIFFERENT from'} the baseline's", file=sys.stderr)
        forced = {}
        for readers in (("1", "2") if args.forced_readers else ()):
            forced[readers] = run_child([PY, "-c", FORCED_READERS, str(path), readers], args.timeout)
            rows.append((f"ridgeline analyze --json, importer forced to {readers} reader"
                         f"{'s' if readers == '2' else ''}{tag}", forced[readers]))
            _progress(rows)
        old = None
        if args.old_path:
            old = run_child([PY, "-c", OLD_PATH, str(path)], args.timeout)
            rows.append((f"ridgeline analyze --json, previous reader (msgspec typed, one process){tag}", old))
            _progress(rows)
        if not args.skip_hta:
            htas.append((run_hta(path, gz, args), ours))
            rows.append((f"HTA 0.5.0 TraceAnalysis + get_gpu_kernel_breakdown{tag}", htas[-1][0]))
            _progress(rows)
        reps.append((bare, base, ours, loadavg(), forced.get("1"), forced.get("2"), old))
    kernels = made["kernels"]
    if not args.skip_load_only or not kernels:
        load = run_child([PY, "-c", LOAD_ONLY, str(path)], args.timeout)
        rows.append(("ridgeline load_trace only", load))
        _progress(rows)
        kernels = kernels or int(load["stdout"].strip().splitlines()[-1])
    load_after = loadavg()
    wc = wire_costs(source)

    def fmt(r):
        ok = "ok" if r["rc"] == 0 else (f"killed at the {args.timeout:.0f} s timeout: figures are "
                                         "lower bounds" if r["timed_out"] else f"FAILED rc={r['rc']}")
        more = ">= " if r["timed_out"] else ""
        return (f"{more}{r['wall_s']:.1f}", f"{more}{r['cpu_s']:.1f}", f"{more}{r['rss_bytes'] / 2**20:,.0f}",
                f"{'<= ' if r['timed_out'] else ''}{kernels / r['wall_s']:,.0f}", ok)

    lines = ["| run | wall s | CPU s | peak RSS MiB | kernels/s | status |", "|---|---:|---:|---:|---:|---|"]
    for name, r in rows:
        lines.append("| " + " | ".join((name,) + fmt(r)) + " |")
    ratio_lines = ["| ratio | value | target |", "|---|---:|---|"]

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2
    ok = [r for r in reps if r[0] is not None and r[0]["rc"] == 0 and r[2]["rc"] == 0]
    if ok:
        def ratios(i, key):
            return [r[i][key] / r[0][key] for r in ok if r[i] is not None and r[i]["rc"] == 0]
        wall, cpu = ratios(2, "wall_s"), ratios(2, "cpu_s")
        many = len(ok) > 1
        each = (lambda xs: " (each: " + ", ".join(f"{x:.2f}" for x in xs) + ")") if many else (lambda xs: "")
        med = "median " if many else ""
        ratio_lines += [
            f"| analyze wall / zcat wall | {med}{median(wall):.2f}{each(wall)} | <= 2 |",
            f"| analyze CPU / zcat CPU | {med}{median(cpu):.2f}{each(cpu)} | |",
            f"| analyze peak RSS | {max(r[2]['rss_bytes'] for r in ok) / 2**30:.2f} GiB (largest) | <= 1 GB |",
        ]
        bwall, bcpu = ratios(1, "wall_s"), ratios(1, "cpu_s")
        if bwall:
            ratio_lines += [
                f"| baseline analyze wall / zcat wall | {med}{median(bwall):.2f}{each(bwall)} | |",
                f"| baseline analyze CPU / zcat CPU | {med}{median(bcpu):.2f}{each(bcpu)} | |",
                f"| baseline analyze peak RSS | {max(r[1]['rss_bytes'] for r in ok) / 2**30:.2f} GiB (largest) | |",
            ]
        for i, label in ((4, "one reader"), (5, "two readers")):
            fwall, fcpu = ratios(i, "wall_s"), ratios(i, "cpu_s")
            if fwall:
                ratio_lines += [
                    f"| analyze ({label} forced) wall / zcat wall | {med}{median(fwall):.2f}{each(fwall)} | |",
                    f"| analyze ({label} forced) CPU / zcat CPU | {med}{median(fcpu):.2f}{each(fcpu)} | |",
                ]
        if many:
            ratio_lines.append("| load average after each repetition | " + "; ".join(r[3] for r in ok) + " | |")
    if isal is not None and isal["rc"] == 0:
        xs = [r[2]["wall_s"] / isal["wall_s"] for r in reps if r[2]["rc"] == 0]
        if xs:
            ratio_lines.append(f"| analyze wall / ISA-L inflate wall | {spread(xs)} | <= 4 |")
            cs = [r[2]["cpu_s"] / isal["cpu_s"] for r in reps if r[2]["rc"] == 0]
            ratio_lines.append(f"| analyze CPU / ISA-L inflate CPU | {spread(cs)} (ISA-L {isal['cpu_s']:.3f} CPU s) | |")
            base = [r for r in reps if r[1] is not None and r[1]["rc"] == 0 and r[2]["rc"] == 0]
            if base:
                ratio_lines += [
                    f"| baseline analyze CPU / ISA-L inflate CPU | "
                    f"{spread([r[1]['cpu_s'] / isal['cpu_s'] for r in base])} | |",
                    f"| analyze CPU / baseline analyze CPU, same repetition | "
                    f"{spread([r[2]['cpu_s'] / r[1]['cpu_s'] for r in base])} | |",
                ]
            olds = [r for r in reps if r[6] is not None and r[6]["rc"] == 0]
            if olds:
                ratio_lines += [
                    f"| previous reader: analyze wall / ISA-L inflate wall | "
                    f"{spread([r[6]['wall_s'] / isal['wall_s'] for r in olds])} | |",
                    f"| previous reader: analyze CPU / ISA-L inflate CPU | "
                    f"{spread([r[6]['cpu_s'] / isal['cpu_s'] for r in olds])} | |",
                    f"| previous / native analyze CPU | "
                    f"{spread([r[6]['cpu_s'] / r[2]['cpu_s'] for r in olds if r[2]['rc'] == 0], 'x')} | |",
                    f"| previous reader peak RSS | {max(r[6]['rss_bytes'] for r in olds) / 2**30:.2f} GiB | |",
                ]
    pairs = [(h, o) for h, o in htas if (h["rc"] == 0 or h["timed_out"]) and o["rc"] == 0]
    if pairs:
        at_least = ">= " if any(h["timed_out"] for h, _ in pairs) else ""
        ratio_lines += [
            f"| HTA wall / analyze wall | {at_least}{spread([h['wall_s'] / o['wall_s'] for h, o in pairs], 'x')} "
            "| >= 20x |",
            f"| HTA CPU / analyze CPU | {at_least}{spread([h['cpu_s'] / o['cpu_s'] for h, o in pairs], 'x')} | |",
            f"| HTA peak RSS / analyze peak RSS | "
            f"{at_least}{spread([h['rss_bytes'] / o['rss_bytes'] for h, o in pairs], 'x')} | >= 10x |",
        ]
    wire_lines = [
        f"| bytes per kernel event ({wc['kernels']} kernels of `{source.name}`) | bytes |",
        "|---|---:|",
        f"| Kineto JSON, plain | {wc['json']:.1f} |",
        f"| Kineto JSON, gzip -6 | {wc['json_gz']:.1f} |",
        f"| ridgeline wire event batch (names included) | {wc['wire']:.1f} |",
    ]
    cmd = "bench/bench_analyze.py " + " ".join(argv if argv is not None else sys.argv[1:])
    env = (f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), Python {platform.python_version()}; "
           f"load average before {load_before}, after {load_after} (the machine is shared: "
           "other work running at the same time slows every row alike)")
    size = (f"{made['bytes'] / 1e6:,.0f} MB gzipped" if gz else f"{made['bytes'] / 1e9:.2f} GB of Kineto JSON")
    if args.one_cpu:
        env += "; every run pinned to CPU 0"
    text = "\n".join([
        f"Trace: `{path.name}`, {kernels:,} kernels, {size}, built by "
        f"{builder} from `{source.name}` (replicas: {made['replicas']}).",
        f"Machine: {env}.",
        "",
        "Reproduce: `.venv/bin/pip install -e .[bench] && .venv/bin/python " + cmd.strip() + "`",
        "",
        *lines, "", *ratio_lines, "",
        *([f"Output against the baseline: {'identical in every repetition' if not differ else f'DIFFERENT in {differ} repetition(s)'} "
           "(SHA-256 of the whole `--json` document).", ""] if args.baseline else []),
        *wire_lines, "",
        "Wall and CPU: the kernel's accounting of each child process (`os.wait4`, CPU including "
        "its waited-for children); peak RSS: the larger of wait4's and the 20 Hz sampled sum "
        "over the child's process tree.",
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
    if differ:
        print(f"bench_analyze: the --json document differs from the baseline's in {differ} repetition(s)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
