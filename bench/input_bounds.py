"""What `ridgeline analyze` does with each hostile or broken input of issue 14.1 (and the
formats of issue 13.3): exit code, peak RSS of the analyzing process, wall time, the
last line it printed on stderr. A table, not a test (tests/test_input_bounds.py asserts
the bounds without timing).

    .venv/bin/python bench/input_bounds.py [--python OTHER/.venv/bin/python] [--recording F.rlrec]

``--python`` runs another checkout's interpreter on the same inputs (side by side with
a previous version); ``--recording`` adds a long recording (tests/support/recording_synth.py
writes one). Each case runs under a 4 GiB address-space limit and a 300 s timeout.
"""
from __future__ import annotations

import argparse
import gzip
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import msgpack

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from support.third_party_files import third_party_missing, third_party_path  # noqa: E402  (the tests' lookup, without pytest)

LEGACY = "kineto_legacy/kineto_tb_plugin_gpu_metrics_input.json"
CLOVERLEAF = "nsys/pipit_cloverleaf_cuda_perlmutter.sqlite.gz"

_LAUNCHER = """
import os, resource, subprocess, sys
limit, out = int(sys.argv[1]), sys.argv[2]
def pre():
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
p = subprocess.Popen(sys.argv[3:], preexec_fn=pre, stdout=subprocess.DEVNULL)
_, status, ru = os.wait4(p.pid, 0)
open(out, "w").write(str(ru.ru_maxrss * 1024))
sys.exit(min(max(os.waitstatus_to_exitcode(status), 0), 255))
"""


def _gz_members(path: Path, head: bytes, block: bytes, copies: int, tail: bytes) -> Path:
    z = gzip.compress(block, compresslevel=9)
    with open(path, "wb") as f:
        f.write(gzip.compress(head))
        for _ in range(copies):
            f.write(z)
        f.write(gzip.compress(tail))
    return path


def _kev(i: int, ts: str | None = None, dur: str = "5") -> str:
    ts = str(1_700_000_000_000_000 + 10 * i) if ts is None else ts
    return ('{"ph":"X","cat":"kernel","name":"void gemm_kernel<128>(P)","pid":0,"tid":7,"ts":%s,"dur":%s,'
            '"args":{"device":0,"stream":7,"correlation":%d,"grid":[8,1,1],"block":[128,1,1]}}' % (ts, dur, i))


def _rlrec(path: Path, payload: bytes) -> Path:
    sys.path.insert(0, str(ROOT))
    from ridgeline.agent.recording import RecordingWriter
    from ridgeline.aggregator import wire
    with RecordingWriter(path) as w:
        w.write(wire.encode_envelope("events", 0, payload, "h", 1), 1)
    return path


def build(d: Path) -> dict[str, Path]:
    """The cases by name. The two third-party files (tests/THIRD_PARTY.md) are looked for as
    the tests look for them; an absent one is left out with a line on stderr saying why."""
    c: dict[str, Path] = {}
    c["200 MB of whitespace between events (204 kB .json.gz)"] = _gz_members(
        d / "ws.json.gz", b'{"traceEvents":[' + _kev(1).encode() + b",", b" " * (8 << 20), 25, _kev(2).encode() + b"]}")
    c["4.3 GB of whitespace between events (4.4 MB .json.gz)"] = _gz_members(
        d / "ws4g.json.gz", b'{"traceEvents":[' + _kev(1).encode() + b",", b" " * (8 << 20), 540,
        _kev(2).encode() + b"]}")
    c["200 MB of whitespace before traceEvents"] = _gz_members(
        d / "wsh.json.gz", b"{", b" " * (8 << 20), 25, b'"traceEvents":[' + _kev(1).encode() + b"]}")
    c["200 MB of whitespace inside one event"] = _gz_members(
        d / "wse.json.gz", b'{"traceEvents":[{"ph":"X",', b" " * (8 << 20), 25, b'"cat":"kernel","name":"k","ts":1,"dur":1}]}')
    c["4.3 MB gzip of 1 GB of kernel events (6M)"] = _gz_members(
        d / "bomb.json.gz", b'{"traceEvents":[', ((_kev(7) + ",") * 50_000).encode(), 120, _kev(0).encode() + b"]}")
    good = [_kev(i) for i in range(1, 40)]
    for name, ts, dur in (("ts NaN", "NaN", "5"), ("ts a string", '"abc"', "5"), ("ts 1e300", "1e300", "5"),
                          ("dur negative", None, "-500"), ("dur NaN", None, "NaN")):
        f = d / (name.replace(" ", "_") + ".json")
        f.write_text('{"schemaVersion":1,"traceEvents":[' + ",".join(good + [_kev(99, ts, dur)]) + "]}")
        c[name + " (1 of 40 kernels)"] = f
    cols = [[0, 1, 0, 1000, 0], [1, 1, 0, 5, 3], [2, 1, 0, 0, 0], [15, 1, 0, 0, 0]]
    for rows in (5_000_000, 50_000_000):
        p = msgpack.packb({0: 1, 2: 0, 3: ["k"], 4: 1, 5: True, 6: {}, 7: [],
                           8: {1: rows, 2: cols, 3: zlib.compress(b""), 4: 0}}, use_bin_type=True)
        c[f"forged .rlrec: {rows:,} constant-coded rows"] = _rlrec(d / f"rows{rows}.rlrec", p)
    p = msgpack.packb({0: 1, 2: 0, 3: ["k"], 4: 300_000_000, 5: True, 6: {}, 7: [],
                       8: {1: 0, 2: [], 3: zlib.compress(b""), 4: 0}}, use_bin_type=True)
    c["forged .rlrec: 3e8 names claimed"] = _rlrec(d / "names.rlrec", p)
    fifo = d / "fifo.json"
    os.mkfifo(fifo)
    c["a FIFO"] = fifo
    legacy, cloverleaf = third_party_path(LEGACY), third_party_path(CLOVERLEAF)
    if legacy:
        c["pre-1.10 Kineto trace (third-party)"] = legacy
    else:
        print(f"skipped case pre-1.10 Kineto trace: {third_party_missing(LEGACY)}", file=sys.stderr)
    if cloverleaf:
        nsys = d / "cloverleaf.sqlite"
        nsys.write_bytes(gzip.decompress(cloverleaf.read_bytes()))
        c["Nsight Systems SQLite export (third-party)"] = nsys
    else:
        print(f"skipped case Nsight Systems SQLite export: {third_party_missing(CLOVERLEAF)}", file=sys.stderr)
    return c


def run(python: str, path: Path, as_limit: int = 4 << 30, timeout: float = 300) -> tuple:
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as rss:
        t0 = time.monotonic()
        p = subprocess.Popen([python, "-c", _LAUNCHER, str(as_limit), rss.name, python, "-m", "ridgeline",
                              "analyze", str(path), "--json"], stderr=subprocess.PIPE, start_new_session=True,
                             cwd=tempfile.gettempdir())
        try:
            _, err = p.communicate(timeout=timeout)
            code = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            _, err = p.communicate()
            code = "timeout"
        wall = time.monotonic() - t0
        peak = int(rss.read() or 0)
    lines = err.decode(errors="replace").strip().splitlines()
    return code, peak, wall, len(lines), (lines[-1] if lines else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--recording", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cases = build(Path(tmp))
        if a.recording:
            cases[f"recording {a.recording.name}"] = a.recording
        print("| input | exit | peak RSS | wall | stderr lines | last stderr line |")
        print("|---|---|---|---|---|---|")
        for name, path in cases.items():
            code, peak, wall, n, last = run(a.python, path)
            print(f"| {name} | {code} | {peak / 2**20:,.0f} MiB | {wall:.1f} s | {n} | {last[:110]} |", flush=True)


if __name__ == "__main__":
    main()
