"""The choices behind the importer's fast path, measured side by side in one run.

    .venv/bin/python bench/bench_decode.py --trace /tmp/ridgeline-bench-200000.json.gz

Decompression of the whole file (each in its own child process, CPU from ``os.wait4``):
``zcat``, the standard library's gzip, python-isal's ``igzip`` (ISA-L, what the importer
uses), zlib-ng's ``gzip_ng``. Parsing of the same 64 MiB of the ``traceEvents`` array
(in this process, CPU time, best of 3, garbage collector off as in the importer):
orjson into dicts, msgspec typed decoding into the importer's structs (what the importer
uses), pysimdjson's parse, and the structural numpy scan (``json_chunks.scan``, the first
stage of the older importer path, before any field is read). zlib-ng and pysimdjson are
in the ``bench`` extra; a missing one is reported, not skipped silently. Then the whole
import of the file by one process through each importer path (child processes, CPU from
``os.wait4``): the structural scanner path and the typed path.

Issue 21.2's candidates for a columnar reader, and the one the package now uses
(``probes.kineto_native``: ``libridgeline_json.so``, simdjson's DOM parser writing the
rows), are measured on the same sample, each as a
multiple of ISA-L's inflate time for the same number of inflated bytes (the floor; the
inflate rate is measured in this process on the whole file): the typed path's per-piece
work up to its columns (``kineto_typed._decode_piece``), pysimdjson touching every
event's ``cat`` and ``ts`` (its parse alone is lazy), and a thin native layer over
simdjson's on-demand API (``bench/simdjson_columns.cpp``: every event's category, name
id, times, pid and kernel/copy args into columns, no object per event), built here with
g++ against the distribution's ``libsimdjson-dev`` when its header is present.
``--one-cpu`` pins this process and its children to CPU 0 (``taskset -c 0``'s effect).
"""
from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
SHARED_A100 = Path(os.environ.get("RIDGELINE_SHARED", ROOT.parent / "shared")) / "traces" / \
    "nvidia-training" / "hta_a100_rank0_training.json.gz"

READ = "import sys\nf = {opener}(sys.argv[1], 'rb')\nwhile f.read(1 << 22): pass"
DECOMPRESSORS = {
    "zcat FILE > /dev/null": None,
    "gzip (standard library)": READ.format(opener="__import__('gzip').open"),
    "isal.igzip (ISA-L)": READ.format(opener="__import__('isal.igzip').igzip.open"),
    "zlib_ng.gzip_ng": READ.format(opener="__import__('zlib_ng.gzip_ng').gzip_ng.open"),
}

IMPORTERS = {
    "structural numpy scanner path (kineto_scan.load)":
        "import sys; from pathlib import Path; from ridgeline.probes import kineto_scan\n"
        "kineto_scan.load(Path(sys.argv[1]), 4 << 20, False)",
    "msgspec typed path (kineto_typed.load, one process; load_trace's before the native one)":
        "import sys; from ridgeline.probes import kineto_typed; kineto_typed.load(sys.argv[1])",
    "native columnar path (kineto_native.load, what load_trace uses)":
        "import sys; from ridgeline.probes import kineto_native; kineto_native.load(sys.argv[1])",
}


def child(argv, shell=False) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, shell=shell, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(p.pid, 0)
    return time.perf_counter() - t0, ru.ru_utime + ru.ru_stime, os.waitstatus_to_exitcode(status)


def sample(path: Path, size: int) -> bytes:
    """``size`` bytes of whole events from the array, as one JSON array text."""
    from ridgeline.probes import json_chunks
    out = []
    n = 0
    for piece in json_chunks.ArrayStream(path, "traceEvents", 8 << 20).pieces():
        out.append(bytes(piece))
        n += len(piece)
        if n >= size:
            break
    return b"[" + b",".join(out) + b"]"


def sample_pieces(path: Path, size: int) -> list[bytes]:
    """The pieces of whole events (as load_trace cuts them) that ``sample`` joins."""
    from ridgeline.probes import json_chunks
    out, n = [], 0
    for piece in json_chunks.ArrayStream(path, "traceEvents", 8 << 20).pieces():
        out.append(bytes(piece))
        n += len(piece)
        if n >= size:
            break
    return out


def typed_columns(pieces) -> int:
    from ridgeline.probes import kineto_typed
    from ridgeline.probes.kineto_dicts import EventBuilder
    b = EventBuilder()
    names = kineto_typed._Names(b.names)
    return sum(len(kineto_typed._decode_piece(p, b, names)["kernels"]) for p in pieces)


def package_columns(pieces) -> int:
    """The package's native reader (probes.kineto_native, libridgeline_json.so) over the
    same pieces, up to its columns (names mapped, range kinds and causal flags set)."""
    from ridgeline.probes import kineto_native
    from ridgeline.probes.kineto_dicts import EventBuilder
    b = EventBuilder()
    r = kineto_native._Reader(kineto_native.library(), 1 << 30)
    try:
        return sum(len(r.piece(p, b, Path("sample"))["kernels"]) for p in pieces)
    finally:
        r.close()


def simdjson_touch(parser, body: bytes) -> int:
    n = 0
    for e in parser.parse(body):
        if e.get("cat") == "kernel":
            n += e.get("ts") is not None
    return n


def isal_rate(path: Path) -> float:
    """Inflated bytes per CPU second of ISA-L on the whole file."""
    from isal import igzip
    t0, n = time.process_time(), 0
    with igzip.open(path, "rb") as f:
        while True:
            b = f.read(1 << 22)
            if not b:
                break
            n += len(b)
    return n / (time.process_time() - t0)


def native_columns():
    """A callable running bench/simdjson_columns.cpp over a JSON array text, or None
    where g++ or simdjson.h is missing (reported as not available)."""
    import ctypes
    import shutil
    import tempfile

    import numpy as np
    src = ROOT / "bench" / "simdjson_columns.cpp"
    if not shutil.which("g++") or not Path("/usr/include/simdjson.h").exists():
        return None
    lib = Path(tempfile.gettempdir()) / "ridgeline-bench-simdjson_columns.so"
    if not lib.exists() or lib.stat().st_mtime < src.stat().st_mtime:
        subprocess.run(["g++", "-O3", "-shared", "-fPIC", str(src), "-lsimdjson", "-o", str(lib)], check=True)
    so = ctypes.CDLL(str(lib))
    so.columns.restype = ctypes.c_long
    so.columns.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t] + [ctypes.c_void_p] * 4

    def run(body: bytes) -> int:
        cap = body.count(b"{") + 1   # at least one per event
        padded = body + b" " * 64          # SIMDJSON_PADDING
        cat = np.empty(cap, np.int32)
        nid = np.empty(cap, np.int32)
        ints = np.empty((cap, 8), np.int64)
        dims = np.empty((cap, 6), np.int64)
        n = so.columns(padded, len(body), cap, cat.ctypes.data, nid.ctypes.data, ints.ctypes.data,
                       dims.ctypes.data)
        if n < 0:
            raise RuntimeError(f"simdjson_columns failed: {n}")
        return int((cat[:n] == 0).sum())
    return run


def best_cpu(fn, repeat=3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        r = fn()
        best = min(best, time.process_time() - t0)
        del r
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=SHARED_A100,
                    help="a Kineto trace, .json.gz (default: the shared A100 training trace; a "
                         "bench/make_big_trace.py output gives steadier figures)")
    ap.add_argument("--sample-mib", type=int, default=64)
    ap.add_argument("--one-cpu", action="store_true", help="pin to CPU 0, children too")
    args = ap.parse_args(argv)
    if args.one_cpu:
        os.sched_setaffinity(0, {0})
    load0 = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    lines = [f"Trace `{args.trace.name}`; load average at start {load0}.", "",
             "| decompress the whole file | wall s | CPU s | status |", "|---|---:|---:|---|"]
    for name, code in DECOMPRESSORS.items():
        if code is None:
            wall, cpu, rc = child(f"zcat '{args.trace}' > /dev/null", shell=True)
        else:
            wall, cpu, rc = child([PY, "-c", code, str(args.trace)])
        lines.append(f"| {name} | {wall:.2f} | {cpu:.2f} | {'ok' if rc == 0 else f'FAILED rc={rc} (not installed?)'} |")

    lines += ["", "| import the whole file, one process | wall s | CPU s | status |", "|---|---:|---:|---|"]
    for name, code in IMPORTERS.items():
        wall, cpu, rc = child([PY, "-c", code, str(args.trace)])
        lines.append(f"| {name} | {wall:.2f} | {cpu:.2f} | {'ok' if rc == 0 else f'FAILED rc={rc}'} |")

    import numpy as np  # noqa: F401
    import orjson

    from ridgeline.probes import json_chunks, kineto_typed
    body = sample(args.trace, args.sample_mib << 20)
    mb = len(body) / 1e6
    parsers = [("orjson.loads into dicts", lambda: orjson.loads(body)),
               ("msgspec typed decoding (importer structs)", lambda: kineto_typed._DECODER.decode(body))]
    try:
        import simdjson
        p = simdjson.Parser()
        parsers.append(("pysimdjson parse (lazy document)", lambda: p.parse(body)))
    except ImportError:
        parsers.append(("pysimdjson parse", None))
    inner = body[1:-1] + b" " * json_chunks.PAD
    parsers.append(("numpy structural scan only (json_chunks.scan)",
                    lambda: json_chunks.scan(inner, len(inner) - json_chunks.PAD)))
    pieces = [memoryview(b) for b in sample_pieces(args.trace, args.sample_mib << 20)]
    parsers.append(("typed path per piece, up to its columns (kineto_typed._decode_piece)",
                    lambda: typed_columns(pieces)))
    try:
        import simdjson
        p2 = simdjson.Parser()
        parsers.append(("pysimdjson parse + every event's cat and ts read",
                        lambda: simdjson_touch(p2, body)))
    except ImportError:
        parsers.append(("pysimdjson parse + cat, ts", None))
    parsers.append(("the package's native reader per piece, up to its columns (kineto_native, simdjson DOM)",
                    lambda: package_columns(pieces)))
    native = native_columns()
    parsers.append(("simdjson on-demand, native columns (bench/simdjson_columns.cpp)",
                    None if native is None else lambda: native(body)))
    rate = isal_rate(args.trace)
    lines += ["", f"ISA-L inflate (isal.igzip, this process, whole file): {rate / 1e6:,.0f} MB/s of "
                  f"inflated JSON = {mb / rate * 1e6:.3f} CPU s for the sample.",
              "", f"| parse {mb:.0f} MB of events (CPU, best of 3, gc off) | CPU s | MB/s | x ISA-L inflate |",
              "|---|---:|---:|---:|"]
    gc.disable()
    for name, fn in parsers:
        if fn is None:
            lines.append(f"| {name} | not available | | |")
            continue
        cpu = best_cpu(fn)
        lines.append(f"| {name} | {cpu:.2f} | {mb / cpu:,.0f} | {cpu / (mb * 1e6 / rate):.1f} |")
    gc.enable()
    load1 = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    lines += ["", f"Load average at end {load1}."]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
