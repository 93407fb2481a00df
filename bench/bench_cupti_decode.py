"""CUPTI decode rate: raw kernel records -> columnar events, on one core.

Builds BATCH messages as libridgeline_cupti.so sends them (sections of raw
``CUpti_ActivityKernel13`` records from cupti-python's dtype, one per 4 MiB CUPTI
buffer, plus one runtime API record per kernel for the launch join), then times, side by
side in one run:

* ``parse+decode``: protocol.parse_batch + ProcessDecoder.add_batch (kernels only);
* ``parse+decode+join``: the same with API and external-correlation records and take()
  (launch thread, launch latency, external id), i.e. what CuptiProbe.poll does;
* ``cupti-python objects``: the per-record object path of cupti-python
  (``ActivityKernel13.from_ptr`` + reading the fields we use), for scale.

Usage: .venv/bin/python bench/bench_cupti_decode.py [--kernels 2000000] [--repeat 5]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import sys
import time

# CPU time of this (single-threaded) process: the cost on one core, robust to other load on
# a shared machine; wall time is reported too.
_clock = time.process_time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from support import cupti_records as R  # noqa: E402

from ridgeline.probes.cupti import protocol as P  # noqa: E402
from ridgeline.probes.cupti.decode import ProcessDecoder  # noqa: E402

BUFFER_BYTES = 4 << 20


def frames(n_kernels: int, with_api: bool, batch_kernels: int = 0) -> tuple[list[bytes], int, list]:
    """BATCH bodies of ``batch_kernels`` kernels each (0: as many as fill a 4 MiB buffer)."""
    per = batch_kernels or BUFFER_BYTES // (R.KERNEL.itemsize + (R.API.itemsize + R.EXTCORR.itemsize if with_api
                                                                 else 0))
    b = R.make_buffer(min(per, n_kernels), seed=1, with_markers=False, interleave=False)
    bodies, done, corr = [], 0, 1
    while done < n_kernels:
        n = min(per, n_kernels - done)
        k = b.kernels[:n].copy()
        k["correlation_id"] = np.arange(corr, corr + n)
        secs = [(10, R.KERNEL.itemsize, n, k.tobytes())]
        if with_api:
            a = b.api[:n].copy()
            a["correlation_id"] = k["correlation_id"]
            e = b.extcorr[:n].copy()
            e["correlation_id"] = k["correlation_id"]
            secs += [(5, R.API.itemsize, n, a.tobytes()), (39, R.EXTCORR.itemsize, n, e.tobytes())]
        hdr = np.zeros(1, P.BATCH_DTYPE)
        hdr["pid"], hdr["cupti_version"], hdr["n_sections"] = 1, 130500, len(secs)
        hdr["records"] = sum(s[2] for s in secs)
        names = b"" if bodies else b"".join(
            np.array([(p, len(s.encode()), 0)], P.NAME_DTYPE).tobytes() + s.encode() + b"\0" * (-len(s.encode()) % 8)
            for p, s in b.names.items())
        hdr["n_names"] = 0 if bodies else len(b.names)
        body = hdr.tobytes() + names + b"".join(
            np.array([(kd, sz, c, 0)], P.SECTION_DTYPE).tobytes() + d for kd, sz, c, d in secs)
        bodies.append(body)
        done += n
        corr += n
    return bodies, n_kernels, [b]


def run_decode(bodies, with_join: bool, per_poll: int) -> float:
    """Decode every body, handing on (take) every ``per_poll`` messages like CuptiProbe.poll."""
    dec = ProcessDecoder(1)
    hello = P.Hello(1, 130500, 130500, 0, 0, 1, "bench", "", {}, {(1, 211): (1, "cudaLaunchKernel_v7000")})
    dec.set_hello(hello)
    n = 0
    t, w = _clock(), time.perf_counter()
    for i, body in enumerate(bodies, 1):
        dec.add_batch(P.parse_batch(body))
        if i % per_poll == 0 or i == len(bodies):
            trace, lat = dec.take()
            n += len(trace.kernels)
            assert not with_join or (trace.kernels["tid"] >= 0).all()
    dt, wall = _clock() - t, time.perf_counter() - w
    assert n == sum(int(np.frombuffer(b, P.BATCH_DTYPE, 1)[0]["records"]) for b in bodies) // (3 if with_join else 1)
    return dt, wall


def run_probe(bodies, per_poll: int) -> tuple[float, float]:
    """The whole agent path after the socket: CuptiProbe.ingest (parse, decode) and
    collect (joins, names into the probe-wide table), as CuptiProbe.poll runs them."""
    from ridgeline.probes.cupti.probe import CuptiProbe
    from ridgeline.probes.cupti.server import Message
    probe = CuptiProbe("/nonexistent/bench.sock")
    hello = P.Hello(1, 130500, 130500, 0, 0, 1, "bench", "", {}, {(1, 211): (1, "cudaLaunchKernel_v7000")})
    probe.ingest([Message("hello", 1, 1, hello)])
    n = 0
    t, w = _clock(), time.perf_counter()
    for i, body in enumerate(bodies, 1):
        probe.ingest([Message("batch", 1, 1, P.parse_batch(body), len(body))])
        if i % per_poll == 0 or i == len(bodies):
            n += len(probe.collect()["trace"].kernels)
    return _clock() - t, time.perf_counter() - w


def run_objects(n: int) -> float:
    from cupti import cupti as C
    b = R.make_buffer(n, seed=2, with_markers=False, interleave=False)
    raw = ctypes.create_string_buffer(b.kernels.tobytes(), len(b.kernels.tobytes()))
    base, size = ctypes.addressof(raw), R.KERNEL.itemsize
    t, w = _clock(), time.perf_counter()
    for i in range(n):
        o = C.ActivityKernel13.from_ptr(base + i * size, True, raw)
        (o.start, o.end,  # noqa: B018  (reading each field is what is timed)
         o.device_id, o.stream_id, o.correlation_id, o.grid_x, o.block_x, o.registers_per_thread,
         o.graph_id, o.name)
    return _clock() - t, time.perf_counter() - w


def run_library(n_buffers: int = 30) -> tuple[float, int] | None:
    """In-process cost of the injection library's completed-buffer path (C): copy into the
    pool, group by kind, intern names. No agent listens: slots are dropped and counted."""
    lib_path = ROOT / "probes" / "native" / "build" / "libridgeline_cupti_test.so"   # with the test entry points
    if not lib_path.exists():
        return None
    lib = ctypes.CDLL(str(lib_path))
    lib.ridgeline_test_init.argtypes = [ctypes.c_char_p, ctypes.c_uint32]
    lib.ridgeline_test_buffer_completed.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    os.environ["RIDGELINE_POOL_SLOTS"] = "64"
    if lib.ridgeline_test_init(b"/nonexistent/ridgeline-bench.sock", 130500) != 0:
        return None
    # A buffer that fits one pool slot (4 MiB, as CUPTI's are): a larger one is counted and
    # dropped after the first pass, and only that count would be timed.
    per = BUFFER_BYTES // (R.KERNEL.itemsize + R.API.itemsize + R.EXTCORR.itemsize)
    while len((b := R.make_buffer(per, seed=3, with_markers=False)).data) > BUFFER_BYTES:
        per = per * BUFFER_BYTES // len(b.data) - 8
    n_rec = len(b.kernels) + len(b.api) + len(b.extcorr) + len(b.copies) + len(b.memsets)
    times = []
    for _ in range(n_buffers):
        t = time.perf_counter_ns()
        lib.ridgeline_test_buffer_completed(b.data, len(b.data))
        times.append(time.perf_counter_ns() - t)
        while not lib.ridgeline_test_pool_idle():
            time.sleep(0.001)
    lib.ridgeline_test_shutdown()
    return statistics.median(times) / n_rec, n_rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=2_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--per-poll", type=int, default=8,
                    help="messages (4 MiB CUPTI buffers) decoded between two polls (8 = ~135k kernels)")
    ap.add_argument("--objects", type=int, default=50_000, help="records for the cupti-python object path")
    ap.add_argument("--batch-kernels", type=int, default=0,
                    help="kernels per BATCH message (0: a 4 MiB CUPTI buffer's worth; live, the library "
                         "flushes every 50 ms: about 2,500 kernels at 50k kernels/s)")
    ap.add_argument("--only-probe", action="store_true", help="time only the CuptiProbe ingest+collect row")
    a = ap.parse_args()
    import gc
    gc.disable()
    rows = []
    for label, with_api in (("parse+decode (kernels)", False), ("parse+decode+join (kernels+API+extcorr)", True)):
        if a.only_probe and not with_api:
            continue
        bodies, n, keep = frames(a.kernels, with_api, a.batch_kernels)
        if not a.only_probe:
            times = [run_decode(bodies, with_api, a.per_poll) for _ in range(a.repeat)]
            med = statistics.median(t for t, _ in times)
            rows.append((label, n, med, n / med, statistics.median(w for _, w in times)))
        if with_api:
            times = [run_probe(bodies, a.per_poll) for _ in range(a.repeat)]
            med = statistics.median(t for t, _ in times)
            rows.append(("CuptiProbe ingest+collect (= poll after the socket)", n, med, n / med,
                         statistics.median(w for _, w in times)))
            print(f"# probe CPU s per run: min {min(t for t, _ in times):.4f} median {med:.4f} "
                  f"max {max(t for t, _ in times):.4f}; ns per kernel (min/median/max): "
                  f"{min(t for t, _ in times) / n * 1e9:.0f} / {med / n * 1e9:.0f} / "
                  f"{max(t for t, _ in times) / n * 1e9:.0f}", flush=True)
        del bodies, keep
    if a.only_probe:
        import ridgeline.probes.cupti.decode as D
        print(f"# decoder: {D.__file__} (native passes: {'yes' if hasattr(D, 'N') and not D.N.REFERENCE else 'no'}), "
              f"batch kernels {a.batch_kernels or 'a 4 MiB buffer'}, poll every {a.per_poll} batches, "
              f"load average {os.getloadavg()[0]:.2f}")
        for label, n, med, rate, wall in rows:
            print(f"| {label} | {n:,} | {med:.3f} | {rate:,.0f} | {wall:.3f} |")
        return 0
    try:
        times = [run_objects(a.objects) for _ in range(max(1, a.repeat // 2))]
        med = statistics.median(t for t, _ in times)
        rows.append(("cupti-python objects (from_ptr + 10 fields)", a.objects, med, a.objects / med,
                     statistics.median(w for _, w in times)))
    except Exception as e:  # noqa: BLE001  (cupti-python missing or failing: the table says so)
        rows.append((f"cupti-python objects: unavailable ({type(e).__name__})", 0, float("nan"), float("nan"),
                     float("nan")))
    libcost = run_library()
    base = rows[0][3]
    print(f"# bench_cupti_decode: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"python {platform.python_version()}, numpy {np.__version__}, one thread, median of {a.repeat}, "
          f"poll every {a.per_poll} buffers, load average {os.getloadavg()[0]:.1f}")
    print(f"# command: .venv/bin/python bench/bench_cupti_decode.py --kernels {a.kernels} --repeat {a.repeat} "
          f"--per-poll {a.per_poll} --batch-kernels {a.batch_kernels}")
    import ridgeline.probes.cupti.decode as D
    print(f"# decoder: {D.__file__} (native passes: {'yes' if hasattr(D, 'N') and not D.N.REFERENCE else 'no'})")
    print("| path | kernel records | median CPU s | kernel records/s (CPU) | median wall s | vs parse+decode |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, n, med, rate, wall in rows:
        print(f"| {label} | {n:,} | {med:.3f} | {rate:,.0f} | {wall:.3f} | {rate / base:.2f}x |")
    if libcost:
        print(f"\nIn the served process (libridgeline_cupti.so completed-buffer path, C, wall median over "
              f"30 buffers of {libcost[1]:,} mixed records): {libcost[0]:.1f} ns per record")
    return 0


if __name__ == "__main__":
    sys.exit(main())
