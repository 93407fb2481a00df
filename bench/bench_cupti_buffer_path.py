"""Injection library: per-record cost of the completed-buffer path, the one-file library
before the split (commit c6b3232) beside the library of this checkout, in one run.

The completed-buffer path (process_buffer: copy a CUPTI buffer into a pool slot grouped by
kind, intern the kernel and marker names, fix the clocks) runs on CUPTI's thread inside the
served process, so its cost per record is the library's overhead per kernel. The split of
ridgeline_cupti.c into ten files could have made it slower (helpers no longer inlined across
translation units). This bench builds both libraries from source into a temporary folder
with the Makefile of each (the old one from ``git archive <base>``, this checkout's with its
test twin, which carries the ridgeline_test_* entry points), plus any ``--commit`` (another
commit's library, from its own tree) and ``--variant`` (this checkout built with extra
CFLAGS, e.g. ``-flto``), then alternates them: each run is one
child process per library (order rotated every round), which feeds the same synthetic
buffer (kernels + runtime API + external correlations + memcpy/memset + NVTX markers, as
tests/support/cupti_records.py builds it) ``--buffers`` times and reads the calling thread's CPU
time around each call (CLOCK_THREAD_CPUTIME_ID: the sender thread and other processes on a
loaded machine are not counted). A run's figure is the median over its buffers; the table
gives min / median / max over runs, and the median of the per-round ratios to the base.

Usage: .venv/bin/python bench/bench_cupti_buffer_path.py [--runs 7] [--buffers 40]
       [--base c6b3232] [--commit first-split=fc21c1a] [--variant lto=-flto]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
BUFFER_BYTES = 4 << 20
BASE = "c6b3232"  # the last commit with the one-file ridgeline_cupti.c


def cupti_include() -> str | None:
    """The CUPTI header folder the Makefile would pick (passed to both builds, so that the
    old tree, built outside this checkout, uses the same headers)."""
    cands = [*sorted((ROOT / ".venv" / "lib").glob("python3*/site-packages/nvidia/cu13/include")),
             *sorted((ROOT / ".venv" / "lib").glob("python3*/site-packages/nvidia/cuda_cupti/include")),
             Path("/usr/local/cuda/extras/CUPTI/include"), Path("/usr/local/cuda/include")]
    for c in cands:
        if (c / "cupti_activity.h").is_file():
            return str(c)
    return None


def make(native: Path, target: Path, extra_cflags: str, inc: str, out_vars: dict[str, Path]) -> None:
    """Build ``target`` with the Makefile in ``native``. Extra flags go through the
    environment: a CFLAGS on make's command line would replace the Makefile's own
    ``CFLAGS +=`` (-fPIC, -fvisibility=hidden, the include folders)."""
    env = dict(os.environ, CFLAGS=f"-O2 -g {extra_cflags}".strip())
    cmd = ["make", "-s", "-C", str(native), f"CUPTI_INCLUDE={inc}",
           *(f"{k}={v}" for k, v in out_vars.items()), str(target)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0 or not target.is_file():
        raise SystemExit(f"bench_cupti_buffer_path: build of {target.name} in {native} failed: "
                         f"{(p.stderr.strip().splitlines() or ['no output'])[-1]}")


def archived_test_library(work: Path, rev: str, inc: str) -> Path:
    """The library with the ridgeline_test_* entry points of commit ``rev``, built by that
    commit's own Makefile from ``git archive``: the shipped library itself before the split,
    its test twin (build/libridgeline_cupti_test.so) after."""
    tree = Path(tempfile.mkdtemp(prefix=f"rev-{rev}-", dir=work))   # the same commit may be asked twice (A/A)
    arch = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "probes/native"], capture_output=True)
    if arch.returncode != 0:
        raise SystemExit(f"bench_cupti_buffer_path: git archive {rev} failed: {arch.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(tree)], input=arch.stdout, check=True)
    native = tree / "probes" / "native"
    split = "TESTLIB" in (native / "Makefile").read_text()
    lib = native / ("build/libridgeline_cupti_test.so" if split else "libridgeline_cupti.so")
    make(native, lib, "", inc, {})
    return lib


def build_all(work: Path, base: str, commits: list[tuple[str, str]], variants: list[tuple[str, str]],
              inc: str) -> list[tuple[str, str, Path]]:
    """(label, how built, library with the ridgeline_test_* entry points) for each build."""
    libs = [(f"pre-split {base}", "one file, -O2", archived_test_library(work, base, inc))]
    for label, rev in commits:
        libs.append((label, f"commit {rev}, -O2", archived_test_library(work, rev, inc)))
    native = ROOT / "probes" / "native"
    for label, flags in [("this checkout", ""), *variants]:
        d = work / f"build-{len(libs)}"
        lib, stub = d / "libridgeline_cupti.so", d / "build" / "libcupti_stub.so"
        testlib = d / "build" / "libridgeline_cupti_test.so"
        make(native, testlib, flags, inc, {"LIB": lib, "STUB": stub})
        libs.append((label, f"ten files, -O2 {flags}".strip(), testlib))
    return libs


def fitting_buffer(R):
    """The largest synthetic buffer (kernels with their runtime API and external correlation
    records, memcpys, memsets, NVTX markers) that fits one 4 MiB pool slot, as CUPTI's own
    buffers of that size do."""
    per = BUFFER_BYTES // (R.KERNEL.itemsize + R.API.itemsize + R.EXTCORR.itemsize)
    while True:
        b = R.make_buffer(per, seed=3, with_markers=True)
        if len(b.data) <= BUFFER_BYTES:
            return b
        per = per * BUFFER_BYTES // len(b.data) - 8


def child(lib_path: str, buffers: int, warm: int) -> None:
    """One run: the library in this process, its completed-buffer path fed ``buffers``
    times; prints {"ns_per_record": [...], "records": n} on stdout."""
    sys.path.insert(0, str(ROOT / "tests"))
    from support import cupti_records as R  # the project's synthetic CUPTI buffers (tests/support)
    os.environ["RIDGELINE_POOL_SLOTS"] = "64"
    lib = ctypes.CDLL(lib_path)
    lib.ridgeline_test_init.argtypes = [ctypes.c_char_p, ctypes.c_uint32]
    lib.ridgeline_test_buffer_completed.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    # No agent listens: the sender drops each slot and counts it; the path measured is the same.
    sock = f"/nonexistent/ridgeline-bench-{os.getpid()}.sock".encode()
    if lib.ridgeline_test_init(sock, 130500) != 0:
        raise SystemExit(f"bench_cupti_buffer_path: ridgeline_test_init failed in {lib_path}")
    b = fitting_buffer(R)
    n_rec = len(b.kernels) + len(b.api) + len(b.extcorr) + len(b.copies) + len(b.memsets) + len(b.markers)
    out = []
    for i in range(warm + buffers):
        t = time.thread_time_ns()
        lib.ridgeline_test_buffer_completed(b.data, len(b.data))
        dt = time.thread_time_ns() - t
        if i >= warm:
            out.append(dt / n_rec)
        while not lib.ridgeline_test_pool_idle():
            time.sleep(0.0005)
    # The path measured must be the whole one: a buffer larger than a pool slot, or a walk
    # cut short, is counted and dropped after the first pass (what an earlier version of this
    # bench and bench_cupti_decode's library row timed without knowing).
    c = (ctypes.c_uint64 * 8)()
    lib.ridgeline_test_counters(c, 8)
    if c[1] or c[6] or c[7] != (warm + buffers) * n_rec:
        raise SystemExit(f"bench_cupti_buffer_path: {lib_path} did not take every record "
                         f"(dropped_pool_full {c[1]}, walk_errors {c[6]}, records_in {c[7]} of {(warm + buffers) * n_rec})")
    lib.ridgeline_test_shutdown()
    print(json.dumps({"ns_per_record": out, "records": n_rec}))


def one_run(lib: Path, buffers: int, warm: int) -> tuple[float, int]:
    p = subprocess.run([PY, __file__, "--child", str(lib), "--buffers", str(buffers), "--warm", str(warm)],
                       capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"bench_cupti_buffer_path: run of {lib} failed: "
                         f"{(p.stderr.strip().splitlines() or ['no output'])[-1]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    return statistics.median(r["ns_per_record"]), r["records"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7, help="rounds; each runs every library once")
    ap.add_argument("--buffers", type=int, default=40, help="buffers fed per run (median taken)")
    ap.add_argument("--warm", type=int, default=3, help="buffers fed first and not timed")
    ap.add_argument("--base", default=BASE, help="commit of the library compared against")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=CFLAGS",
                    help="also this checkout built with extra CFLAGS (repeatable), e.g. lto=-flto")
    ap.add_argument("--commit", action="append", default=[], metavar="LABEL=REV",
                    help="also the library of another commit (repeatable), e.g. first-split=fc21c1a")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.buffers, a.warm)
        return 0
    if a.runs < 1 or a.buffers < 1 or a.warm < 0:
        print("bench_cupti_buffer_path: --runs and --buffers must be >= 1, --warm >= 0", file=sys.stderr)
        return 2
    pairs: dict[str, list[tuple[str, str]]] = {"--variant": [], "--commit": []}
    for opt, given in (("--variant", a.variant), ("--commit", a.commit)):
        for v in given:
            label, sep, value = v.partition("=")
            if not sep or not label or (opt == "--commit" and not value):
                print(f"bench_cupti_buffer_path: {opt} {v!r}: expected LABEL={'CFLAGS' if opt == '--variant' else 'REV'}",
                      file=sys.stderr)
                return 2
            pairs[opt].append((label, value))
    if not shutil.which("make") or not shutil.which(os.environ.get("CC", "cc")):
        print("bench_cupti_buffer_path: needs make and a C compiler", file=sys.stderr)
        return 2
    inc = cupti_include()
    if not inc:
        print("bench_cupti_buffer_path: CUPTI headers not found (scripts/setup.sh installs them into .venv)",
              file=sys.stderr)
        return 2
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ridgeline-bench-cupti-") as tmp:
        libs = build_all(Path(tmp), a.base, pairs["--commit"], pairs["--variant"], inc)
        per_lib: list[list[float]] = [[] for _ in libs]
        n_rec = 0
        for r in range(a.runs):
            k = r % len(libs)   # rotate the order: no library always runs first or last
            for i in [*range(k, len(libs)), *range(0, k)]:
                ns, n_rec = one_run(libs[i][2], a.buffers, a.warm)
                per_lib[i].append(ns)
    load1 = os.getloadavg()
    print(f"# bench_cupti_buffer_path: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"{a.runs} rounds x {a.buffers} buffers of {n_rec:,} mixed records (4 MiB), calling thread's CPU time; "
          f"load average {load0[0]:.1f} at start, {load1[0]:.1f} at end")
    extra = "".join(f" --commit {shlex.quote(v)}" for v in a.commit) + "".join(f" --variant {shlex.quote(v)}" for v in a.variant)
    print(f"# command: .venv/bin/python bench/bench_cupti_buffer_path.py --runs {a.runs} --buffers {a.buffers} "
          f"--base {a.base}{extra}")
    print("| library | build | min ns/record | median ns/record | max ns/record | vs pre-split (median of rounds) |")
    print("|---|---|---:|---:|---:|---:|")
    base = per_lib[0]
    for (label, how, _), xs in zip(libs, per_lib):
        ratio = statistics.median(x / b for x, b in zip(xs, base))
        print(f"| {label} | {how} | {min(xs):.1f} | {statistics.median(xs):.1f} | {max(xs):.1f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
