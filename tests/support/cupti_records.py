"""CUPTI activity buffers laid out exactly as CUPTI lays them out, for tests and bench.

Records are built with cupti-python's numpy dtypes (``activity_kernel13_dtype`` ...,
the byte layout of the C structs), concatenated in CUPTI's order (mixed kinds, back
to back), with ``name`` fields pointing at real NUL-terminated strings in this process
(ctypes buffers kept alive by :class:`CuptiBuffer`), as CUPTI's name pointers do.
Used by tests/test_native_cupti.py, tests/test_cupti_*.py and bench/bench_cupti_decode.py.

The second half fetches real CUPTI header sets (nvidia-cuda-cupti wheels of several CUDA
releases) and writes records laid out by each (tests/support/cupti_header_records.c).
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from cupti import cupti as C

KERNEL = C.activity_kernel13_dtype
MEMCPY = C.activity_memcpy7_dtype
MEMSET = C.activity_memset5_dtype
API = C.activity_api_dtype
MARKER = C.activity_marker2_dtype
EXTCORR = C.activity_external_correlation_dtype

KIND_MEMCPY, KIND_MEMSET, KIND_DRIVER, KIND_RUNTIME = 1, 2, 4, 5
KIND_CONCURRENT_KERNEL, KIND_MARKER, KIND_EXTCORR = 10, 12, 39
CBID_CUDA_LAUNCH_KERNEL = 211     # CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000
CBID_CUDA_GRAPH_LAUNCH = 311      # cudaGraphLaunch_v10000
CBID_CUDA_STREAM_SYNC = 131       # cudaStreamSynchronize_v3020

KERNEL_NAMES = [
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>(Params)",
    "void vllm::rms_norm_kernel<c10::BFloat16>(c10::BFloat16*, c10::BFloat16 const*, float, int, int)",
    "void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>, true>(Flash_fwd_params)",
    "void at::native::elementwise_kernel<128, 2>(int, at::native::gpu_kernel_impl_nocast)",
    "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn",
]


@dataclass
class CuptiBuffer:
    """One activity buffer and the records it was made from (the expected values)."""
    data: bytes
    kernels: np.ndarray
    copies: np.ndarray          # memcpy records
    memsets: np.ndarray
    api: np.ndarray
    markers: np.ndarray
    extcorr: np.ndarray
    names: dict[int, str]       # pointer -> string, for every pointer used
    keepalive: list = field(default_factory=list)


def _strings(names: list[str]) -> tuple[list, list[int]]:
    bufs = [ctypes.create_string_buffer(s.encode()) for s in names]
    return bufs, [ctypes.addressof(b) for b in bufs]


def make_buffer(n_kernels: int = 200, seed: int = 0, t0_ns: int = 1_700_000_000_000_000_000,
                with_markers: bool = True, interleave: bool = True, corr0: int = 1) -> CuptiBuffer:
    """A buffer with ``n_kernels`` kernels, each launched by one runtime API record,
    plus memcpys, memsets, external correlations and NVTX markers."""
    rng = np.random.default_rng(seed)
    keep, ptrs = _strings(KERNEL_NAMES)
    mkeep, mptrs = _strings(["step[DECODE bs=8]", "layer"])
    dkeep, dptrs = _strings(["vllm"])
    names = {p: s for p, s in zip(ptrs, KERNEL_NAMES)}
    names.update({mptrs[0]: "step[DECODE bs=8]", mptrs[1]: "layer", dptrs[0]: "vllm"})

    n = n_kernels
    corr = np.arange(corr0, corr0 + n, dtype=np.uint32)
    launch = t0_ns + np.cumsum(rng.integers(2_000, 9_000, n)).astype(np.uint64)
    k = np.zeros(n, KERNEL)
    k["kind"] = KIND_CONCURRENT_KERNEL
    k["start"] = launch + rng.integers(3_000, 40_000, n).astype(np.uint64)
    k["end"] = k["start"] + rng.integers(1_000, 500_000, n).astype(np.uint64)
    k["completed"] = k["end"]
    k["device_id"] = rng.integers(0, 2, n)
    k["context_id"] = 1
    k["stream_id"] = rng.choice([7, 13, 21], n)
    for f, hi in (("grid_x", 4096), ("grid_y", 8), ("grid_z", 2), ("block_x", 1024), ("block_y", 4), ("block_z", 2)):
        k[f] = rng.integers(1, hi, n)
    k["registers_per_thread"] = rng.integers(16, 255, n)
    k["static_shared_memory"] = rng.integers(0, 48 << 10, n)
    k["dynamic_shared_memory"] = rng.integers(0, 160 << 10, n)
    k["correlation_id"] = corr
    k["name"] = np.array(ptrs, dtype=np.int64)[rng.integers(0, len(ptrs), n)]
    in_graph = rng.random(n) < 0.5
    k["graph_id"] = np.where(in_graph, rng.integers(1, 5, n), 0)
    k["graph_node_id"] = np.where(in_graph, rng.integers(1, 10_000, n), 0)

    a = np.zeros(n, API)
    a["kind"] = KIND_RUNTIME
    a["cbid"] = np.where(in_graph, CBID_CUDA_GRAPH_LAUNCH, CBID_CUDA_LAUNCH_KERNEL)
    a["start"] = launch
    a["end"] = launch + rng.integers(1_000, 5_000, n).astype(np.uint64)
    a["process_id"] = 4242
    a["thread_id"] = rng.choice([1001, 1002, 1003], n)
    a["correlation_id"] = corr

    nc = max(1, n // 10)
    cc = np.arange(corr0 + n, corr0 + n + nc, dtype=np.uint32)
    c = np.zeros(nc, MEMCPY)
    c["kind"] = KIND_MEMCPY
    c["copy_kind"] = rng.choice([1, 2, 8], nc)
    c["bytes"] = rng.integers(1, 1 << 30, nc)
    c["start"] = t0_ns + rng.integers(0, 10**9, nc).astype(np.uint64)
    c["end"] = c["start"] + rng.integers(1_000, 100_000, nc).astype(np.uint64)
    c["device_id"] = rng.integers(0, 2, nc)
    c["stream_id"] = 7
    c["correlation_id"] = cc
    c["graph_id"] = 0

    ms = np.zeros(nc, MEMSET)
    ms["kind"] = KIND_MEMSET
    ms["bytes"] = rng.integers(1, 1 << 20, nc)
    ms["start"] = t0_ns + rng.integers(0, 10**9, nc).astype(np.uint64)
    ms["end"] = ms["start"] + 2_000
    ms["device_id"] = 0
    ms["stream_id"] = 13
    ms["correlation_id"] = cc + nc
    ms["graph_id"] = rng.integers(0, 3, nc)

    ex = np.zeros(n, EXTCORR)
    ex["kind"] = KIND_EXTCORR
    ex["external_kind"] = 5          # CUSTOM2
    ex["external_id"] = 900_000 + np.arange(n)
    ex["correlation_id"] = corr

    if with_markers:
        m = np.zeros(4, MARKER)
        m["kind"] = KIND_MARKER
        m["flags_"] = [2, 2, 4, 4]          # START, START, END, END
        m["id"] = [seed * 10 + 1, seed * 10 + 2, seed * 10 + 2, seed * 10 + 1]
        m["timestamp"] = [t0_ns + 10, t0_ns + 20, t0_ns + 500, t0_ns + 900]
        m["object_kind"] = int(C.ActivityObjectKind.THREAD)   # cupti-python's enum, from the header
        m["object_id"]["pt"]["process_id"] = 4242
        m["object_id"]["pt"]["thread_id"] = [1001, 1001, 1001, 1001]
        m["name"] = [mptrs[0], mptrs[1], 0, 0]
        m["domain"] = [dptrs[0], dptrs[0], 0, 0]
    else:
        m = np.zeros(0, MARKER)

    # CUPTI's order: records of different kinds interleaved, back to back
    pieces: list[bytes] = []
    if interleave:
        for i in range(n):
            pieces.append(a[i].tobytes())
            pieces.append(ex[i].tobytes())
            pieces.append(k[i].tobytes())
            if i < nc:
                pieces.append(c[i].tobytes())
                pieces.append(ms[i].tobytes())
            if i < len(m):
                pieces.append(m[i].tobytes())
        data = b"".join(pieces)
    else:
        data = b"".join(x.tobytes() for x in (k, a, ex, c, ms, m))
    return CuptiBuffer(data, k, c, ms, a, m, ex, names, [keep, mkeep, dkeep])


def split_by_pid(out: dict) -> list[dict]:
    """CuptiProbe.poll() output -> one ``{"pid", "trace", "launch_latency_ns"}`` per process
    (the trace's meta is that process's entry of ``meta["processes"]``)."""
    from ridgeline.probes.events import Trace
    if "trace" not in out:
        return []
    t, lat = out["trace"], out["launch_latency_ns"]
    res = []
    for pid, meta in t.meta["processes"].items():
        sel = lambda a: a[a["pid"] == pid]  # noqa: E731
        km = t.kernels["pid"] == pid
        res.append({"pid": pid, "launch_latency_ns": lat[km],
                    "trace": Trace(t.kernels[km], sel(t.copies), sel(t.api), sel(t.ranges), names=t.names,
                                   meta=meta)})
    return res


# ------------------------------------------------------------------------------------------
# Real CUPTI header sets (the nvidia-cuda-cupti wheels) and buffers laid out by them

#: Header sets checked: the oldest CUDA 12 Ridgeline supports, the 12.x vLLM hosts run,
#: the 13.0 of the H200 hosts, and the newest 13.x (whatever the cache or registry has).
HEADER_SETS = {
    "12.4": "nvidia-cuda-cupti-cu12==12.4.*",
    "12.8": "nvidia-cuda-cupti-cu12==12.8.*",
    "13.0": "nvidia-cuda-cupti==13.0.*",
    "13.x": "nvidia-cuda-cupti>=13.1,<14",
}
WHEEL_CACHE = Path(os.environ.get("RIDGELINE_CUPTI_WHEELS", Path.home() / ".cache" / "ridgeline-cupti"))
HEADER_RECORDS_C = Path(__file__).with_name("cupti_header_records.c")
COMPAT_INCLUDE = Path(__file__).resolve().parents[2] / "probes" / "native" / "compat"


def _wheel_matches(path: Path, spec: str) -> bool:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
    req = Requirement(spec)
    name, version, _, _ = parse_wheel_filename(path.name)
    return canonicalize_name(name) == canonicalize_name(req.name) and req.specifier.contains(version)


def cupti_wheel(spec: str) -> Path:
    """The newest cached wheel satisfying ``spec``, downloaded into the cache when none is.

    Skips the calling test (with pip's own reason) only when the package registry
    cannot be reached; any other failure is an error.
    """
    import pytest
    from packaging.utils import parse_wheel_filename
    hits = sorted((p for p in WHEEL_CACHE.glob("*.whl") if _wheel_matches(p, spec)),
                  key=lambda p: parse_wheel_filename(p.name)[1])
    if hits:
        return hits[-1]
    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=WHEEL_CACHE) as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "-d", tmp, spec], capture_output=True, text=True, timeout=600)
        got = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not got:
            tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
            if any(w in r.stderr for w in ("Network is unreachable", "Temporary failure in name resolution",
                                           "Max retries exceeded", "ConnectionError", "Could not fetch URL")):
                pytest.skip(f"{spec}: not cached in {WHEEL_CACHE} and the package registry is unreachable ({tail})")
            raise RuntimeError(f"pip download {spec} failed: {tail}")
        dest = WHEEL_CACHE / got[0].name
        os.replace(got[0], dest)          # atomic: a concurrent run sees all or nothing
    return dest


def header_dir(wheel: Path) -> Path:
    """The wheel's CUPTI include folder, extracted once next to the cache."""
    root = WHEEL_CACHE / "extracted" / wheel.name[:-4]
    if not root.exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root.parent))
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tmp, [n for n in z.namelist() if "/include/" in n])
        try:
            os.rename(tmp, root)
        except OSError:                    # extracted meanwhile by another run
            shutil.rmtree(tmp, ignore_errors=True)
    return next(root.rglob("cupti_activity.h")).parent


def newest_struct(include: Path, family: str) -> str:
    """The newest numbered ``CUpti_Activity<family>N`` the headers define: the one that
    release's libcupti writes."""
    text = "".join(p.read_text(errors="replace") for p in include.glob("cupti_activity*.h"))
    found = [int(n) for n in re.findall(rf"}}\s*CUpti_Activity{family}(\d+)\s*;", text)]
    if not found:
        raise RuntimeError(f"no CUpti_Activity{family}N in {include}")
    return f"CUpti_Activity{family}{max(found)}"


@dataclass
class HeaderSet:
    label: str
    wheel: Path
    include: Path
    structs: dict[str, str]
    program: Path
    api_version: int = 0

    def write(self, lines: list[str], tmp: Path) -> tuple[list[tuple[int, int, bytes]], int]:
        """Run the compiled program on ``lines``; returns ``([(kind, record_size, bytes)], api_version)``."""
        out = tmp / f"records-{self.label}.bin"
        r = subprocess.run([str(self.program), str(out)], input="\n".join(lines) + "\n", capture_output=True,
                           text=True, timeout=60, check=True)
        api = int(r.stdout.split()[1])
        raw = out.read_bytes()
        sections, pos = [], 0
        while pos < len(raw):
            kind, size, count = np.frombuffer(raw, "<u4", 3, pos)
            pos += 12
            sections.append((int(kind), int(size), raw[pos:pos + int(size) * int(count)]))
            pos += int(size) * int(count)
        return sections, api


def build_header_set(label: str, workdir: Path) -> HeaderSet:
    """Download (if needed) the wheel of ``label``, and compile tests/support/cupti_header_records.c
    against its headers with the struct versions that release writes."""
    wheel = cupti_wheel(HEADER_SETS[label])
    inc = header_dir(wheel)
    structs = {f: newest_struct(inc, f) for f in ("Kernel", "Memcpy", "Memset")}
    exe = workdir / f"cupti_header_records-{label}"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        import pytest
        pytest.skip("no C compiler (cc/gcc) to compile against the CUPTI headers")
    subprocess.run([cc, "-O0", "-Wall", "-Werror", "-Wno-missing-field-initializers", f"-I{inc}",
                    f"-I{COMPAT_INCLUDE}", f"-DKERNEL_T={structs['Kernel']}", f"-DMEMCPY_T={structs['Memcpy']}",
                    f"-DMEMSET_T={structs['Memset']}", str(HEADER_RECORDS_C), "-o", str(exe)],
                   check=True, capture_output=True, text=True, timeout=120)
    return HeaderSet(label, wheel, inc, structs, exe)


# ------------------------------------------------------------------------------------------
# The library's side of the socket, for tests that drive the real server

def _pad(b: bytes) -> bytes:
    return b + b"\0" * (-len(b) % 8)


def hello_frame(pid: int | None = None, cupti_version: int = 130500, comm: bytes = b"python",
                status: bytes = b"", cbids=((1, CBID_CUDA_LAUNCH_KERNEL, 1, b"cudaLaunchKernel_v7000"),)) -> bytes:
    """A framed HELLO as libridgeline_cupti.so sends it (``pid`` defaults to this process)."""
    from ridgeline.probes.cupti import protocol as P
    h = np.zeros(1, P.HELLO_DTYPE)
    h["pid"] = os.getpid() if pid is None else pid
    h["cupti_version"], h["comm_len"], h["status_len"], h["n_cbids"] = cupti_version, len(comm), len(status), len(cbids)
    body = h.tobytes() + _pad(comm) + _pad(status)
    for domain, cbid, category, name in cbids:
        c = np.zeros(1, P.CBID_DTYPE)
        c["domain"], c["cbid"], c["category"], c["name_len"] = domain, cbid, category, len(name)
        body += c.tobytes() + _pad(name)
    return P.encode_frame(P.MSG_HELLO, body)


def batch_frame(sections, names: dict[int, str] | None = None, pid: int | None = None,
                cupti_version: int = 130500, devices=(0,)) -> bytes:
    """A framed BATCH: ``sections`` is ``[(kind, record_size, bytes)]``."""
    from ridgeline.probes.cupti import protocol as P
    names = names or {}
    b = np.zeros(1, P.BATCH_DTYPE)
    b["pid"] = os.getpid() if pid is None else pid
    b["cupti_version"], b["n_names"], b["n_sections"] = cupti_version, len(names), len(sections)
    b["records"] = sum(len(data) // size for _, size, data in sections)
    b["n_devices"] = len(devices)
    b["device_ids"][0, :len(devices)] = devices
    body = b.tobytes()
    for ptr, s in names.items():
        raw = s.encode()
        n = np.zeros(1, P.NAME_DTYPE)
        n["ptr"], n["len"] = ptr, len(raw)
        body += n.tobytes() + _pad(raw)
    for kind, size, data in sections:
        s = np.zeros(1, P.SECTION_DTYPE)
        s["kind"], s["record_size"], s["count"] = kind, size, len(data) // size
        body += s.tobytes() + data
    return P.encode_frame(P.MSG_BATCH, body)


def poll_until(probe, want, timeout_s: float = 10.0) -> list[dict]:
    """Poll a started CuptiProbe until ``want(results)`` is true; returns every poll result."""
    import time
    got, end = [], time.monotonic() + timeout_s
    while time.monotonic() < end:
        r = probe.poll()
        if r:
            got.append(r)
        if want(got):
            return got
        time.sleep(0.02)
    return got


#: Kernel names exactly as CUPTI reports them (Itanium-mangled device symbols), as they
#: appear in public repositories (symbol tables of vLLM's _C extension, profiles of
#: PyTorch 2.5 SDPA flash attention, CUTLASS GEMM kernels, flashinfer sampling), found with
#: code search. Each with the signature-table phase class its demangled name must land in
#: (aggregator/data/kernel_signatures.toml), and whether the mangled spelling alone misses it.
MANGLED_KERNELS = [
    # (mangled, signature id, phase hint, missed while mangled)
    ("_ZN13pytorch_flash16flash_fwd_kernelINS_23Flash_fwd_kernel_traitsILi64ELi128ELi128ELi4ELb0ELb0EN7cutlass6half_"
     "tENS_19Flash_kernel_traitsILi64ELi128ELi128ELi4ES3_EEEELb0ELb1ELb0ELb0ELb1ELb1ELb0EEEvNS_16Flash_fwd_paramsE",
     "fa2_fwd", "prefill", False),
    ("_ZN4vllm25paged_attention_v2_kernelIttLi128ELi16ELi128ELb0ELi512EEEvPfS1_PT_PKS2_PKT0_S8_ifPKiSA_iPKfiii",
     "vllm_paged_attention", "decode", False),
    ("_ZN4vllm25fused_add_rms_norm_kernelIN3c108BFloat16EEEvPT_S4_PKS3_fii", "vllm_norm_rotary", "neutral", True),
    ("_ZN4vllm23rotary_embedding_kernelIN3c108BFloat16ELb1EEEvPKlPT_S6_PKS5_illliii", "vllm_norm_rotary", "neutral",
     True),
    ("_ZN4vllm24reshape_and_cache_kernelIttLb0EEEvPKT_S3_PT0_S5_PKliiiiii", "kv_cache_write", "neutral", False),
    ("_ZN7cutlass7Kernel2I66cutlass_80_wmma_tensorop_f16_s161616gemm_f16_16x16_128x1_tn_align8EEvNT_6ParamsE",
     "gemm", "neutral", False),
    ("_ZN10flashinfer8sampling30TopKTopPSamplingFromProbKernelILj1024ELN3cub39_V_300200_SM_800_860_900_1000_1100_"
     "120018BlockScanAlgorithmE2ELNS3_20BlockReduceAlgorithmE2ELj4ELb1EfiEEvPT4_PT5_PfS9_S9_S8_fjmm",
     "sampling", "neutral", False),
    ("_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIN3c108BFloat16EEESt5arrayIPcLm1EEEEviT0_T1_",
     None, "neutral", False),
]
