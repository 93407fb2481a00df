"""libridgeline_cupti.so against the real CUPTI of several CUDA releases, without a GPU.

For each release, the nvidia-cuda-cupti(-cu12) wheel (NVIDIA's own headers and
libcupti.so, no toolkit needed) is fetched with pip into a cache folder
(``RIDGELINE_CUPTI_WHEELS``, default ~/.cache/ridgeline-cupti; reruns reuse it), then:

* the library, the test app and the stub are built with that header set (no warnings);
* the record offsets the library reads (ridgeline_cupti_abi.h, reported by
  ``ridgeline_test_layout``) are compared with offsetof()/sizeof() compiled against that
  very header: nothing about the layouts is typed into this test;
* the build is loaded against that release's real libcupti.so by the stand-in application
  with no driver: the application runs untouched, the library says why CUPTI is off, on
  stderr and to a listening agent (HELLO with FLAG_NO_CUPTI);
* where that libcupti's own record walker works without a driver, a buffer laid out by the
  header goes through the library's walk with CUPTI's cuptiActivityGetNextRecord and comes
  out at the agent's parser with the header's record sizes and the kernel names.

A release whose wheel cannot be fetched (registry unreachable) is skipped with pip's reason.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from ridgeline.probes.cupti import protocol as P
from ridgeline.probes.cupti.server import CuptiServer

sys.path.insert(0, str(Path(__file__).parent))
from support.cupti_stub import Harness  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "probes" / "native"
CACHE = Path(os.environ.get("RIDGELINE_CUPTI_WHEELS") or Path.home() / ".cache" / "ridgeline-cupti")

# release id -> (distribution, version prefix; "" = the newest 13.x the registry has)
RELEASES = {
    "12.4": ("nvidia-cuda-cupti-cu12", "12.4"),
    "12.8": ("nvidia-cuda-cupti-cu12", "12.8"),
    "13.0": ("nvidia-cuda-cupti", "13.0"),
    "13-newest": ("nvidia-cuda-cupti", ""),
}


def _version(wheel: Path) -> tuple[int, ...]:
    return tuple(int(x) for x in wheel.name.split("-")[1].split("."))


def _cached(dist: str, prefix: str) -> list[Path]:
    stem = dist.replace("-", "_")
    found = [w for w in CACHE.glob(f"{stem}-*.whl") if w.name.split("-")[1].startswith(prefix or "13.")]
    return sorted(found, key=_version)


def _fetch(dist: str, prefix: str) -> Path:
    have = _cached(dist, prefix)
    if have and prefix:
        return have[-1]
    CACHE.mkdir(parents=True, exist_ok=True)
    spec = f"{dist}=={prefix}.*" if prefix else f"{dist}>=13,<14"
    # few retries: an unreachable registry should cost seconds, not pip's default minutes
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--retries", "1",
                        "--timeout", "20", "-d", str(CACHE), spec],
                       capture_output=True, text=True, timeout=600)
    have = _cached(dist, prefix)
    if not prefix:
        # "newest" stands for a release the pinned ones do not cover: a cached 13.0 (the
        # pinned "13.0" release) found when the registry cannot be asked is no such thing
        pinned = [p for _, p in RELEASES.values() if p]
        have = [w for w in have if not any(w.name.split("-")[1].startswith(p + ".") for p in pinned)]
    if r.returncode != 0 or not have:
        if have:          # the newest could not be checked: the newest we have
            return have[-1]
        reason = [x for x in (r.stderr or r.stdout).splitlines() if x.strip() and not x.startswith("WARNING")]
        why = reason[-1] if reason else f"pip exit status {r.returncode}"
        if not prefix and r.returncode == 0:
            why = "pip found only a pinned release (registry unreachable, or no newer 13.x published)"
        pytest.skip(f"cannot fetch {spec} with pip: {why}")
    return have[-1]


def _unpack(wheel: Path) -> dict:
    dest = CACHE / "unpacked" / wheel.stem
    if not (dest / ".done").exists():
        # the headers and libcupti only (it needs nothing else of the wheel): the profiler
        # host libraries (libnvperf_host, ~30 MB each) would triple the cache
        with zipfile.ZipFile(wheel) as z:
            z.extractall(dest, [m for m in z.namelist() if "/include/" in m or "/lib/libcupti.so" in m])
        (dest / ".done").write_text("")
    inc = next(dest.glob("nvidia/*/include/cupti_activity.h")).parent
    lib = next(dest.glob("nvidia/*/lib/libcupti.so.*"))
    text = (inc / "cupti_version.h").read_text()
    api = int(re.search(r"#define\s+CUPTI_API_VERSION\s+(\d+)", text).group(1))
    return {"wheel": wheel.name, "include": inc, "libcupti": lib, "api_version": api}


@pytest.fixture(scope="module", params=list(RELEASES))
def release(request, tmp_path_factory):
    dist, prefix = RELEASES[request.param]
    rel = _unpack(_fetch(dist, prefix))
    out = tmp_path_factory.mktemp(f"cupti-{request.param}")
    rel.update(lib=out / "libridgeline_cupti.so", app=out / "ridgeline_inject_app", stub=out / "libcupti_stub.so",
               testlib=out / "libridgeline_cupti_test.so", out=out)     # the Makefile puts TESTLIB beside STUB
    r = subprocess.run(["make", "-C", str(NATIVE), f"CUPTI_INCLUDE={rel['include']}", f"LIB={rel['lib']}",
                        f"TESTAPP={rel['app']}", f"STUB={rel['stub']}"], capture_output=True, text=True, timeout=300)
    rel["build"] = r
    return rel


def _header_layout(rel: dict, tmp: Path) -> dict:
    """offsetof/sizeof of the records the library reads, compiled against rel's header:
    the newest kernel/memcpy/memset struct the header declares, and every kernel struct."""
    text = (rel["include"] / "cupti_activity.h").read_text()

    def versions(base: str) -> list[int]:
        return sorted({int(n) for n in re.findall(rf"\}}\s*CUpti_Activity{base}(\d+)\s*;", text)})
    kernels, memcpys, memsets = versions("Kernel"), versions("Memcpy"), versions("Memset")
    lines = []
    for n in kernels:
        t = f"CUpti_ActivityKernel{n}"
        lines.append(f'printf("kernel{n} %zu %zu %zu\\n", sizeof({t}), offsetof({t}, name), offsetof({t}, deviceId));')
    for base, vs in (("Memcpy", memcpys), ("Memset", memsets)):
        t = f"CUpti_Activity{base}{vs[-1]}"
        lines.append(f'printf("{base.lower()} %zu 0 %zu\\n", sizeof({t}), offsetof({t}, deviceId));')
    t = "CUpti_ActivityMarker2"
    lines.append(f'printf("marker %zu %zu %zu\\n", sizeof({t}), offsetof({t}, name), offsetof({t}, domain));')
    lines.append('printf("api %zu 0 0\\n", sizeof(CUpti_ActivityAPI));')
    lines.append('printf("extcorr %zu 0 0\\n", sizeof(CUpti_ActivityExternalCorrelation));')
    src = tmp / "layout.c"
    src.write_text("#include <cuda.h>\n#include <cupti_result.h>\n#include <cupti_activity.h>\n"
                   "#include <stddef.h>\n#include <stdio.h>\nint main(void) {\n" + "\n".join(lines) + "\nreturn 0; }\n")
    exe = tmp / "layout"
    subprocess.run(["cc", "-std=c11", f"-I{NATIVE / 'compat'}", f"-I{rel['include']}", "-o", str(exe), str(src)],
                   check=True, capture_output=True, timeout=120)
    got = {}
    for line in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines():
        k, a, b, c = line.split()
        got[k] = (int(a), int(b), int(c))
    got["newest_kernel"] = got[f"kernel{kernels[-1]}"]
    return got


def test_builds_with_the_header_set(release):
    r = release["build"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warning" not in r.stderr, r.stderr[-3000:]
    assert release["lib"].exists() and release["app"].exists() and release["stub"].exists()
    assert release["testlib"].exists()
    shipped = subprocess.run(["nm", "-D", "--defined-only", str(release["lib"])], capture_output=True, text=True,
                             check=True).stdout
    assert "InitializeInjection" in shipped and "ridgeline_test_" not in shipped


def test_offsets_the_library_reads_are_the_headers(release, tmp_path):
    assert release["build"].returncode == 0
    h = _header_layout(release, tmp_path)
    so = ctypes.CDLL(str(release["testlib"]))      # no entry point runs: only the table is read
    so.ridgeline_test_layout.argtypes = [ctypes.c_char_p]
    so.ridgeline_test_layout.restype = ctypes.c_long

    def L(name: str) -> int:
        return so.ridgeline_test_layout(name.encode())
    assert L("header_api_version") == release["api_version"]
    size, name_off, dev_off = h["newest_kernel"]
    known = {L(f"kernel.known_size.{i}") for i in range(32)} - {0}
    assert size in known, f"{release['wheel']}: kernel record of {size} bytes not in the library's known sizes"
    assert (L("kernel.name"), L("kernel.deviceId")) == (name_off, dev_off)
    # every kernel layout the library would read a name from has its name where the library reads it
    by_size = {v[0]: v for k, v in h.items() if k.startswith("kernel") and k != "newest_kernel"}
    for s in known & set(by_size):
        assert by_size[s][1:] == (L("kernel.name"), L("kernel.deviceId")), s
    assert L("memcpy.deviceId") == h["memcpy"][2] and L("memset.deviceId") == h["memset"][2]
    assert (L("marker.name"), L("marker.domain"), L("marker.size")) == h["marker"][1:] + (h["marker"][0],)


def test_test_mode_sizes_are_the_headers_newest(release, tmp_path):
    assert release["build"].returncode == 0
    h = _header_layout(release, tmp_path)
    hs = _harness(release["testlib"])
    try:
        sizes = {int(k): v for k, v in hs(f"init {tmp_path / 'none.sock'} {release['api_version']}")["sizes"].items()}
    finally:
        hs.close()
    assert sizes[10] == h["newest_kernel"][0]
    assert sizes[1] == h["memcpy"][0] and sizes[2] == h["memset"][0]
    assert sizes[5] == sizes[4] == h["api"][0] and sizes[12] == h["marker"][0] and sizes[39] == h["extcorr"][0]


def _harness(lib: Path) -> Harness:
    env = dict(os.environ, RIDGELINE_QUIET="1")
    h = Harness.__new__(Harness)
    h.p = subprocess.Popen([sys.executable, str(Path(__file__).parent / "support" / "native_harness.py"), str(lib)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    return h


def _collect(srv: CuptiServer, pred, timeout: float = 8.0) -> list:
    got = []
    end = time.monotonic() + timeout
    while time.monotonic() < end and not pred(got):
        srv.pump(0.05)
        got += srv.drain()
    return got


def test_real_libcupti_without_driver_app_runs_untouched(release, tmp_path):
    assert release["build"].returncode == 0
    sock = tmp_path / "cupti.sock"
    srv = CuptiServer(str(sock))
    srv.open()
    try:
        env = dict(os.environ, CUDA_INJECTION64_PATH=str(release["lib"]), RIDGELINE_LIBCUPTI=str(release["libcupti"]),
                   RIDGELINE_SOCKET=str(sock), RIDGELINE_RECONNECT_MS="50")
        env.pop("LD_PRELOAD", None)
        p = subprocess.Popen([str(release["app"]), "10", "3000"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        msgs = _collect(srv, lambda g: any(m.kind == "hello" for m in g))
        out, err = p.communicate(timeout=30)
    finally:
        srv.close()
    assert p.returncode == 0 and "app: injection=1 sum=55" in out
    assert "CUPTI collection off" in err and "no usable CUDA driver" in err, err
    hello = next(m.body for m in msgs if m.kind == "hello")
    assert hello.flags & P.FLAG_NO_CUPTI and "CUPTI collection off" in hello.status
    assert hello.header_api_version == release["api_version"]
    if "using " in err:      # this libcupti answered cuptiGetVersion without a driver: it is the wheel's
        assert str(release["libcupti"]) in err
        assert hello.cupti_version == release["api_version"]


def test_buffer_walk_with_the_real_libcupti(release, tmp_path):
    """Records laid out by the header, walked by the library with that release's own
    cuptiActivityGetNextRecord (or sized by its cuptiActivityGetStructSize), reach the
    agent's parser with the header's sizes and the kernel names."""
    assert release["build"].returncode == 0
    h = _header_layout(release, tmp_path)
    sock = tmp_path / "cupti.sock"
    srv = CuptiServer(str(sock))
    srv.open()
    hs = _harness(release["testlib"])
    try:
        init = hs(f"initcupti {sock} {release['libcupti']}")
        if init["rc"] == -4:
            pytest.skip(f"{release['wheel']}: this libcupti answers nothing without a CUDA driver "
                        f"(cuptiGetVersion fails), so its record walker cannot be exercised here")
        assert init["rc"] == 0
        ksize, kname, kdev = h["newest_kernel"]
        names = ["void gemm_kernel<128, 64>(Params)", "rms_norm_kernel", "void gemm_kernel<128, 64>(Params)"]
        spec = []
        for i, nm in enumerate(names):
            spec.append({"kind": 5, "size": h["api"][0]})
            spec.append({"kind": 10, "size": ksize, "str": {str(kname): nm}, "u32": {str(kdev): i % 2}})
        spec.append({"kind": 1, "size": h["memcpy"][0], "u32": {str(h["memcpy"][2]): 3}})
        spec.append({"kind": 2, "size": h["memset"][0]})
        spec.append({"kind": 10, "size": ksize, "str": {str(kname): "last_kernel"}})   # the last record
        fed = hs("feedspec " + json.dumps(spec))
        msgs = _collect(srv, lambda g: any(m.kind == "batch" for m in g))
        counters = hs("counters")
    finally:
        hs.close()
        srv.close()
    batch = next(m.body for m in msgs if m.kind == "batch")
    sections = {s.kind: (s.record_size, s.count) for s in batch.sections}
    assert sections == {5: (h["api"][0], 3), 10: (ksize, 4), 1: (h["memcpy"][0], 1), 2: (h["memset"][0], 1)}
    # one name per pointer (each record has its own copy of the string here)
    assert sorted(batch.names.values()) == sorted(names + ["last_kernel"])
    assert set(batch.names) == set(fed["ptrs"])
    assert counters["walk_errors"] == 0 and counters["records_in"] == len(spec)
    if "cuptiActivityGetStructSize(" not in (release["include"] / "cupti_activity.h").read_text():
        assert batch.header["flags"] & P.FLAG_WALK_WITH_CUPTI     # sizes came from CUPTI's own walker
    assert set(int(d) for d in batch.header["device_ids"][:int(batch.header["n_devices"])]) == {0, 1, 3}


def test_walk_error_stops_cleanly_with_the_real_walker(release, tmp_path):
    """A record CUPTI's walker rejects (unknown kind) ends the walk there: the records
    before it are sent, the error is counted, and the rest of the buffer never becomes one
    oversized "record" (which the agent refuses, dropping the connection)."""
    assert release["build"].returncode == 0
    h = _header_layout(release, tmp_path)
    sock = tmp_path / "cupti.sock"
    srv = CuptiServer(str(sock))
    srv.open()
    hs = _harness(release["testlib"])
    try:
        init = hs(f"initcupti {sock} {release['libcupti']}")
        if init["rc"] == -4:
            pytest.skip(f"{release['wheel']}: this libcupti answers nothing without a CUDA driver")
        assert init["rc"] == 0
        ksize, kname, _ = h["newest_kernel"]
        good = [{"kind": 10, "size": ksize, "str": {str(kname): f"k{i}"}} for i in range(3)]
        bad = [{"kind": 60, "size": 64}]          # not a kind this CUPTI knows
        rest = [{"kind": 5, "size": h["api"][0]} for _ in range(5)]
        hs("feedspec " + json.dumps(good + bad + rest))
        hs("feedspec " + json.dumps(good))          # the connection is still good afterwards
        msgs = _collect(srv, lambda g: sum(m.kind == "batch" for m in g) >= 2)
        counters = hs("counters")
        errors = srv.stats["protocol_errors"]
    finally:
        hs.close()
        srv.close()
    batches = [m.body for m in msgs if m.kind == "batch"]
    assert len(batches) == 2 and not any(m.kind == "closed" for m in msgs)
    assert [(s.kind, s.record_size, s.count) for s in batches[0].sections] == [(10, ksize, 3)]
    assert counters["walk_errors"] == 1 and counters["records_in"] == 6 and errors == 0


def test_cupti_timestamps_are_clock_realtime(release):
    """docs/cupti.md and the library's clock watch rely on CUPTI's default timestamps being
    CLOCK_REALTIME nanoseconds: asked of the real library, next to each clock."""
    code = ("import ctypes, sys, time\n"
            "lib = ctypes.CDLL(sys.argv[1])\n"
            "t = ctypes.c_uint64(0)\n"
            "r = lib.cuptiGetTimestamp(ctypes.byref(t))\n"
            "print(r, t.value, time.clock_gettime_ns(time.CLOCK_REALTIME), time.clock_gettime_ns(time.CLOCK_MONOTONIC))")
    out = subprocess.run([sys.executable, "-c", code, str(release["libcupti"])], capture_output=True, text=True,
                         timeout=60)
    rc, cupti_ns, real_ns, mono_ns = (int(x) for x in out.stdout.split())
    if rc != 0:
        pytest.skip(f"{release['wheel']}: cuptiGetTimestamp needs a CUDA driver (returns {rc})")
    assert abs(real_ns - cupti_ns) < 10**9 < abs(mono_ns - cupti_ns)
