"""CUDA uprobes: kernel launches, graph launches, copies and synchronisation, per thread, for any process.

No injection and no code change: uprobes on the CUDA runtime (``libcudart.so*``) and
driver (``libcuda.so*``) that each target process actually maps (read from
``/proc/<pid>/maps``; every distinct copy of a library is a different inode and needs its
own attach), by plain symbol name (``sym@@libcudart.so.12`` does not resolve). Entry
probes count calls and read sizes and directions from the arguments; return probes time
the calls where the host blocks on the GPU (stream/device/event synchronisation and
synchronous copies) and, optionally (``launch_latency``), launch calls.

When a process maps both layers, the runtime's own calls into the driver are recognised
(a per-thread depth kept by extra entry/return probes on the runtime functions) and
counted as ``nested`` instead of twice.

Pure parts (symbol table, record layout, window differencing) are module-level and
tested with literals; :class:`CudaUprobeProbe` is the bcc glue.
"""
from __future__ import annotations

import ctypes as ct
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import bpf as bpfmod
from . import proc
from .probe import Availability, Probe
from .targets import TargetSet

BPF_SOURCE = Path(__file__).with_name("cuda_uprobes_bpf.c")

RUNTIME_RE = r"^libcudart\.so"
DRIVER_RE = r"^libcuda\.so"

# (symbol, entry handler, return handler or None). Handlers are functions of cuda_uprobes_bpf.c.
RUNTIME_SYMBOLS: list[tuple[str, str, str | None]] = (
    [(s, "rt_launch", None) for s in ("cudaLaunchKernel", "cudaLaunchKernel_ptsz", "cudaLaunchKernelExC",
                                      "cudaLaunchKernelExC_ptsz", "cudaLaunchCooperativeKernel",
                                      "cudaLaunchCooperativeKernel_ptsz")]
    + [(s, "rt_graph", None) for s in ("cudaGraphLaunch", "cudaGraphLaunch_ptsz")]
    + [(s, "rt_memcpy_sync", "rt_return") for s in ("cudaMemcpy", "cudaMemcpy_ptds")]
    + [(s, "rt_memcpy", None) for s in ("cudaMemcpyAsync", "cudaMemcpyAsync_ptsz")]
    + [(s, "rt_memcpy2d_sync", "rt_return") for s in ("cudaMemcpy2D", "cudaMemcpy2D_ptds")]
    + [(s, "rt_memcpy2d", None) for s in ("cudaMemcpy2DAsync", "cudaMemcpy2DAsync_ptsz")]
    + [(s, "rt_memcpy_peer", None) for s in ("cudaMemcpyPeer", "cudaMemcpyPeerAsync")]
    + [(s, "rt_memcpy_symbol", None) for s in ("cudaMemcpyToSymbol", "cudaMemcpyToSymbol_ptds",
                                               "cudaMemcpyToSymbolAsync", "cudaMemcpyToSymbolAsync_ptsz",
                                               "cudaMemcpyFromSymbol", "cudaMemcpyFromSymbol_ptds",
                                               "cudaMemcpyFromSymbolAsync", "cudaMemcpyFromSymbolAsync_ptsz")]
    + [(s, "rt_sync", "rt_return") for s in ("cudaStreamSynchronize", "cudaStreamSynchronize_ptsz",
                                             "cudaDeviceSynchronize", "cudaEventSynchronize")]
)
DRIVER_SYMBOLS: list[tuple[str, str, str | None]] = (
    [(s, "drv_launch", None) for s in ("cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx",
                                       "cuLaunchKernelEx_ptsz", "cuLaunchCooperativeKernel",
                                       "cuLaunchCooperativeKernel_ptsz")]
    + [(s, "drv_graph", None) for s in ("cuGraphLaunch", "cuGraphLaunch_ptsz")]
    + [("cuMemcpyHtoD_v2", "drv_copy_htod_sync", "drv_return"), ("cuMemcpyHtoD_v2_ptds", "drv_copy_htod_sync", "drv_return"),
       ("cuMemcpyDtoH_v2", "drv_copy_dtoh_sync", "drv_return"), ("cuMemcpyDtoH_v2_ptds", "drv_copy_dtoh_sync", "drv_return"),
       ("cuMemcpyDtoD_v2", "drv_copy_dtod_sync", "drv_return"), ("cuMemcpyDtoD_v2_ptds", "drv_copy_dtod_sync", "drv_return"),
       ("cuMemcpy", "drv_copy_other_sync", "drv_return"), ("cuMemcpy_ptds", "drv_copy_other_sync", "drv_return")]
    + [(s, "drv_copy_htod", None) for s in ("cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync_v2_ptsz")]
    + [(s, "drv_copy_dtoh", None) for s in ("cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync_v2_ptsz")]
    + [(s, "drv_copy_dtod", None) for s in ("cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync_v2_ptsz")]
    + [(s, "drv_copy_other", None) for s in ("cuMemcpyAsync", "cuMemcpyAsync_ptsz")]
    + [(s, "drv_copy_peer", None) for s in ("cuMemcpyPeer", "cuMemcpyPeerAsync")]
    + [(s, "drv_sync", "drv_return") for s in ("cuStreamSynchronize", "cuStreamSynchronize_ptsz",
                                               "cuCtxSynchronize", "cuEventSynchronize")]
)
_TIMED_LAUNCH = {"rt_launch": "rt_launch_timed", "drv_launch": "drv_launch_timed"}

DIRECTIONS = ("htoh", "htod", "dtoh", "dtod", "peer", "other")

# Layout of `struct cstat_t` in cuda_uprobes_bpf.c.
CSTAT_DTYPE = np.dtype([
    ("tgid", "<u4"), ("depth", "<u4"), ("rt_ts", "<u8"), ("drv_ts", "<u8"),
    ("rt_kind", "u1"), ("drv_kind", "u1"), ("pad", "u1", (6,)),
    ("launches", "<u8"), ("graph_launches", "<u8"), ("copies", "<u8"), ("bytes", "<u8", (6,)),
    ("sync_calls", "<u8"), ("sync_ns", "<u8"), ("copy_wait_ns", "<u8"), ("launch_call_ns", "<u8"),
    ("nested", "<u8"),
])
assert CSTAT_DTYPE.itemsize == 144

CUDA_WINDOW_DTYPE = np.dtype([
    ("tid", "<i4"), ("tgid", "<i4"),
    ("launches", "<i8"), ("graph_launches", "<i8"), ("copies", "<i8"),
    ("copy_htoh_bytes", "<i8"), ("copy_htod_bytes", "<i8"), ("copy_dtoh_bytes", "<i8"),
    ("copy_dtod_bytes", "<i8"), ("copy_peer_bytes", "<i8"), ("copy_other_bytes", "<i8"),
    ("sync_calls", "<i8"), ("sync_ns", "<i8"), ("copy_wait_ns", "<i8"), ("launch_call_ns", "<i8"),
    ("nested_driver_calls", "<i8"),
])
_SCALARS = {"launches": "launches", "graph_launches": "graph_launches", "copies": "copies",
            "sync_calls": "sync_calls", "sync_ns": "sync_ns", "copy_wait_ns": "copy_wait_ns",
            "launch_call_ns": "launch_call_ns", "nested_driver_calls": "nested"}


def cuda_window(prev: dict[int, np.ndarray], tids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, dict]:
    """Window rows from a map read (``tids`` keys, ``rows`` CSTAT_DTYPE) and the previous read.

    Returns ``(window, new_prev)``; threads with nothing new in the window are left out.
    A tid whose tgid changed (tid reuse after exit) starts from zero.
    """
    out = np.zeros(len(rows), dtype=CUDA_WINDOW_DTYPE)
    keep = np.zeros(len(rows), dtype=bool)
    new_prev = {}
    for i, (tid, r) in enumerate(zip(tids, rows)):
        tid = int(tid)
        p = prev.get(tid)
        if p is not None and int(p["tgid"]) != int(r["tgid"]):
            p = None
        o = out[i]
        o["tid"], o["tgid"] = tid, int(r["tgid"])
        for name, src in _SCALARS.items():
            o[name] = max(int(r[src]) - (int(p[src]) if p is not None else 0), 0)
        for d, name in enumerate(DIRECTIONS):
            o[f"copy_{name}_bytes"] = max(int(r["bytes"][d]) - (int(p["bytes"][d]) if p is not None else 0), 0)
        keep[i] = any(int(o[n]) for n in CUDA_WINDOW_DTYPE.names[2:])
        new_prev[tid] = r
    return out[keep], new_prev


@dataclass(frozen=True)
class Attachment:
    """One probed library file (inode), attached once for every process that maps it."""
    path: str            # as the agent reaches it (through /proc/<pid>/root when namespaced)
    layer: str           # "runtime" or "driver"
    symbols: tuple[str, ...]


class CudaUprobeProbe(Probe):
    """Per-thread CUDA launch/copy/sync counters of the target processes, from uprobes.

    Each library file a target maps is attached once (for all processes; the BPF side
    keeps only targets), so processes that come later with the same library are covered
    at once; libraries stay attached until :meth:`stop` (closing a uprobe costs ~80 ms in
    the kernel). Libraries a target loads later (e.g. on ``import torch``) are picked up
    by the rescans in :meth:`poll` (every ``rescan_s``). ``discover``: each poll also adds
    GPU and announced processes and drops exited ones (:class:`probes.targets.TargetSet`).
    ``launch_latency``: also time each launch call (a return probe per launch).
    """

    name = "cuda_uprobes"
    optional = True

    def __init__(self, pids=(), *, discover: bool = True, launch_latency: bool = False, max_threads: int = 16384,
                 rescan_s: float = 2.0):
        super().__init__()
        self._initial = [int(p) for p in pids]
        # Targets found by poll(): GPU processes, announced ones, `pids` (probes.targets).
        self._tset = TargetSet(pids) if discover else None
        self.launch_latency = launch_latency
        self.max_threads = max_threads
        self.rescan_s = rescan_s
        self.bpf = None
        self.compile_s = 0.0
        self.attachments: dict[tuple[str, int], Attachment] = {}   # (dev, inode) -> attachment
        self._pid_libs: dict[int, set] = {}                        # target -> its (dev, inode)s
        self._nest_libs: set = set()                               # runtime inodes with return probes everywhere
        self._prev: dict[int, np.ndarray] = {}
        self._last_scan = 0.0
        self._last_read_ns = 0
        self.missing_symbols = 0
        self.last_error = ""

    def check(self) -> Availability:
        a = bpfmod.availability(need_tracefs=False)
        if not a.ok:
            return a
        if not (os.path.exists("/sys/bus/event_source/devices/uprobe/type")
                or os.path.exists("/sys/kernel/tracing/uprobe_events")
                or os.path.exists("/sys/kernel/debug/tracing/uprobe_events")):
            return Availability(False, "kernel has no uprobes (no uprobe PMU, no uprobe_events)",
                                "use a kernel built with CONFIG_UPROBE_EVENTS=y")
        return Availability(True)

    def start(self) -> None:
        if self.bpf is not None:
            return
        bcc = bpfmod.import_bcc()
        t0 = time.perf_counter()
        words = bpfmod.target_words()
        self.bpf = bcc.BPF(text=BPF_SOURCE.read_bytes(),
                           cflags=[f"-DMAX_THREADS={self.max_threads}", f"-DTARGET_WORDS={words}", "-w"])
        self.compile_s = time.perf_counter() - t0
        self._stats = self.bpf[b"cstats"]
        self._bits = self.bpf[b"ctargets"]
        self._nest = self.bpf[b"cnest"]
        self._last_read_ns = time.monotonic_ns()
        for pid in self._initial:
            self.add_target(pid)

    def stop(self) -> None:
        if self.bpf is None:
            return
        try:
            self.bpf.cleanup()   # detaches every uprobe
        finally:
            self.bpf = None
            self._initial = sorted(set(self._initial) | set(self._pid_libs))   # a later start() resumes them
            self.attachments.clear()
            self._pid_libs.clear()
            self._nest_libs.clear()
            self._prev = {}

    @property
    def targets(self) -> set[int]:
        return set(self._pid_libs)

    def libraries(self, pid: int) -> list[Attachment]:
        """The probed libraries that process ``pid`` maps."""
        return [self.attachments[k] for k in self._pid_libs.get(int(pid), ()) if k in self.attachments]

    # ------------------------------------------------------------------ attaching
    def add_target(self, pid: int) -> list[Attachment]:
        """Count ``pid``'s CUDA calls; returns the libraries newly attached for it."""
        pid = int(pid)
        if self.bpf is None:
            self._initial.append(pid)
            return []
        if pid not in self._pid_libs:
            if self._tset is not None:
                self._tset.add(pid)   # so that its exit is noticed
            self._pid_libs[pid] = set()
            bpfmod.set_target_bit(self._bits, pid, True)
        return self._attach_new(pid)

    def remove_target(self, pid: int) -> None:
        """Stop counting ``pid`` (its libraries stay attached for other processes)."""
        pid = int(pid)
        if self.bpf is None or pid not in self._pid_libs:
            return
        if self._tset is not None:
            self._tset.forget(pid)
        del self._pid_libs[pid]
        bpfmod.set_target_bit(self._bits, pid, False)
        bpfmod.set_target_bit(self._nest, pid, False)

    def _attach_new(self, pid: int) -> list[Attachment]:
        new = []
        rt = proc.mapped_libraries(pid, RUNTIME_RE)
        drv = proc.mapped_libraries(pid, DRIVER_RE)
        mine = self._pid_libs[pid]
        for layer, maps, table in (("runtime", rt, RUNTIME_SYMBOLS), ("driver", drv, DRIVER_SYMBOLS)):
            for m in maps:
                key = (m.dev, m.inode)
                mine.add(key)
                if key in self.attachments:
                    continue
                path = proc.path_in_process(pid, m.path, m.inode)
                a = Attachment(path, layer, tuple(self._attach_lib(path, table)))
                self.attachments[key] = a
                new.append(a)
        if drv and rt:
            # Both layers: return probes on every runtime function of this process's
            # runtime, so driver calls made inside runtime calls are recognised.
            ok = True
            for m in rt:
                key = (m.dev, m.inode)
                if key not in self._nest_libs:
                    a = self.attachments[key]
                    for sym, entry, ret in RUNTIME_SYMBOLS:
                        if sym in a.symbols and ret is None and not (self.launch_latency and entry in _TIMED_LAUNCH):
                            ok &= self._attach_ret(a.path, sym, "rt_return")
                    if ok:
                        self._nest_libs.add(key)
            # Depth counting only with a return probe on every runtime function, else it would drift.
            bpfmod.set_target_bit(self._nest, pid, ok)
        return new

    def _attach_ret(self, path, sym, ret) -> bool:
        try:
            self.bpf.attach_uretprobe(name=path.encode(), sym=sym.encode(), fn_name=ret.encode())
            return True
        except Exception as exc:  # noqa: BLE001  (bcc raises plain Exception; counted, said in last_error)
            self.errors += 1
            self.last_error = f"return probe {sym} in {path}: {exc}"
            return False

    def _attach_lib(self, path, table) -> list[str]:
        attached = []
        for sym, entry, ret in table:
            if self.launch_latency and entry in _TIMED_LAUNCH:
                entry, ret = _TIMED_LAUNCH[entry], entry.split("_", 1)[0] + "_return"
            try:
                self.bpf.attach_uprobe(name=path.encode(), sym=sym.encode(), fn_name=entry.encode())
            except Exception as exc:  # noqa: BLE001  bcc raises plain Exception: symbol absent, or a load failure (counted)
                if "could not determine address" in str(exc):
                    self.missing_symbols += 1   # not exported by this library version
                else:
                    self.errors += 1
                    self.last_error = f"{sym} in {path}: {exc}"
                continue
            attached.append(sym)
            if ret:
                self._attach_ret(path, sym, ret)
        return attached

    # ------------------------------------------------------------------ reading
    def poll(self) -> dict | None:
        """Per-thread counters since the previous poll; rescans targets' maps every ``rescan_s``."""
        if self.bpf is None:
            return None
        if self._tset is not None:
            added, removed = self._tset.poll()
            for pid in added:
                self.add_target(pid)
            for pid in removed:
                self.remove_target(pid)
        now = time.monotonic()
        if now - self._last_scan >= self.rescan_s:
            self._last_scan = now
            for pid in list(self._pid_libs):
                if not proc.alive(pid):
                    self.remove_target(pid)
                else:
                    self._attach_new(pid)
        tids, rows = bpfmod.read_map(self._stats, np.dtype("<u4"), CSTAT_DTYPE, self.max_threads)
        now_ns = time.monotonic_ns()
        window, self._prev = cuda_window(self._prev, tids, rows)
        # Threads that are gone: their last counts are in this window; drop their entries.
        gone = [int(t) for t, r in zip(tids, rows)
                if not os.path.exists(f"/proc/{int(r['tgid'])}/task/{int(t)}")]
        for t in gone:
            try:
                del self._stats[ct.c_uint32(t)]
            except KeyError:
                pass
            self._prev.pop(t, None)
        start_ns, self._last_read_ns = self._last_read_ns, now_ns
        self.records += len(window)
        return {"kind": "cuda", "window_start_ns": start_ns, "window_end_ns": now_ns,
                "threads": window, "counters": self._counts()}

    def _counts(self) -> dict:
        c = super().counters()
        if self.bpf is not None:
            lost = int(sum(self.bpf[b"ccounters"][ct.c_int(0)]))
            c["threads_lost"] = lost
            c["drops"] = self.drops + lost
            c["attached_libraries"] = len(self.attachments)
            c["missing_symbols"] = self.missing_symbols
        return c

    def counters(self) -> dict:
        """records, drops (thread map full), errors, attached libraries, missing symbols, and
        per-program BPF run time (``bpf_programs``; non-zero while kernel.bpf_stats_enabled=1)."""
        return bpfmod.with_prog_stats(self._counts(), self.bpf)


def libraries_of(pid: int) -> dict[str, list[str]]:
    """CUDA runtime and driver libraries ``pid`` maps (paths), for reports."""
    return {"runtime": [m.path for m in proc.mapped_libraries(pid, RUNTIME_RE)],
            "driver": [m.path for m in proc.mapped_libraries(pid, DRIVER_RE)]}


def symbol_table(layer: str) -> list[tuple[str, str, str | None]]:
    """The probed symbols of ``layer`` ("runtime" or "driver") with their handlers."""
    if layer not in ("runtime", "driver"):
        raise ValueError(f"unknown CUDA layer {layer!r}")
    return RUNTIME_SYMBOLS if layer == "runtime" else DRIVER_SYMBOLS


