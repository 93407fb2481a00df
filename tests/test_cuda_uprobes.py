"""CUDA uprobes: pure window logic with literals; real uprobes (root + eBPF) on the pip
libcudart (loads without a driver: every call returns 35, but the probes see the real
arguments) and on a driver stub library built from tests/data/cuda_driver_stub.c."""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ridgeline.probes import cuda_uprobes as cu

DATA = Path(__file__).parent / "data"


# ---------------------------------------------------------------- pure

def _row(tgid, **kw):
    r = np.zeros((), dtype=cu.CSTAT_DTYPE)
    r["tgid"] = tgid
    for k, v in kw.items():
        r[k] = v
    return r


def test_window_differences_and_directions():
    prev = {}
    tids = np.array([10, 11], dtype="<u4")
    rows = np.array([_row(10, launches=5, bytes=[0, 100, 0, 0, 0, 0], copies=1),
                     _row(10, sync_calls=2, sync_ns=1500)], dtype=cu.CSTAT_DTYPE)
    w, prev = cu.cuda_window(prev, tids, rows)
    assert list(w["tid"]) == [10, 11]
    assert int(w[0]["launches"]) == 5 and int(w[0]["copy_htod_bytes"]) == 100
    assert int(w[1]["sync_ns"]) == 1500 and int(w[1]["sync_calls"]) == 2
    rows2 = np.array([_row(10, launches=8, bytes=[0, 100, 7, 0, 0, 0], copies=2),
                      _row(10, sync_calls=2, sync_ns=1500)], dtype=cu.CSTAT_DTYPE)
    w2, prev = cu.cuda_window(prev, tids, rows2)
    # thread 11 had nothing new: no row
    assert list(w2["tid"]) == [10]
    assert int(w2[0]["launches"]) == 3 and int(w2[0]["copy_dtoh_bytes"]) == 7 and int(w2[0]["copy_htod_bytes"]) == 0


def test_tid_reused_by_another_process_starts_from_zero():
    prev = {10: _row(1, launches=100)}
    w, _ = cu.cuda_window(prev, np.array([10], dtype="<u4"),
                          np.array([_row(2, launches=4)], dtype=cu.CSTAT_DTYPE))
    assert int(w[0]["launches"]) == 4 and int(w[0]["tgid"]) == 2


def test_every_handler_exists_in_the_bpf_program():
    src = cu.BPF_SOURCE.read_text()
    defined = set(re.findall(r"^int (\w+)\(struct pt_regs \*ctx\)", src, re.M))
    for layer in ("runtime", "driver"):
        for sym, entry, ret in cu.symbol_table(layer):
            assert entry in defined, (sym, entry)
            assert ret is None or ret in defined, (sym, ret)
    assert set(cu._TIMED_LAUNCH.values()) <= defined
    assert {"rt_return", "drv_return"} <= defined
    with pytest.raises(ValueError):
        cu.symbol_table("cublas")


def test_layout_matches_the_c_struct():
    # 4+4+8+8+1+1+6 + 3*8 + 6*8 + 5*8
    assert cu.CSTAT_DTYPE.itemsize == 144
    src = cu.BPF_SOURCE.read_text()
    body = src[src.index("struct cstat_t {"):src.index("};", src.index("struct cstat_t {"))]
    names = re.findall(r"^\s+u(?:8|32|64)\s+(\w+)", body, re.M)
    assert names == [n for n in cu.CSTAT_DTYPE.names]


# ---------------------------------------------------------------- real uprobes

def _cudart() -> str:
    import site
    for sp in site.getsitepackages():
        hits = glob.glob(os.path.join(sp, "nvidia", "*", "lib", "libcudart.so.1[0-9]"))
        if hits:
            return hits[0]
    pytest.skip("nvidia-cuda-runtime wheel (libcudart.so) not installed; pip install -e '.[test]'")


CALLER = r'''
import ctypes as ct, sys, threading
libs = [ct.CDLL(p) for p in sys.argv[1:]]
print("READY", flush=True); sys.stdin.readline()
class dim3(ct.Structure): _fields_ = [("x", ct.c_uint), ("y", ct.c_uint), ("z", ct.c_uint)]
rcs = set()
for l in libs:
    if hasattr(l, "cudaLaunchKernel"):
        l.cudaLaunchKernel.argtypes = [ct.c_void_p, dim3, dim3, ct.c_void_p, ct.c_size_t, ct.c_void_p]
        l.cudaMemcpy.argtypes = [ct.c_void_p, ct.c_void_p, ct.c_size_t, ct.c_int]
        l.cudaMemcpyAsync.argtypes = [ct.c_void_p, ct.c_void_p, ct.c_size_t, ct.c_int, ct.c_void_p]
        l.cudaMemcpy2D.argtypes = [ct.c_void_p, ct.c_size_t, ct.c_void_p, ct.c_size_t, ct.c_size_t, ct.c_size_t, ct.c_int]
        l.cudaMemcpyPeer.argtypes = [ct.c_void_p, ct.c_int, ct.c_void_p, ct.c_int, ct.c_size_t]
        l.cudaStreamSynchronize.argtypes = [ct.c_void_p]
        l.cudaGraphLaunch.argtypes = [ct.c_void_p, ct.c_void_p]
        for i in range(7): rcs.add(l.cudaLaunchKernel(0x1, dim3(3, 4, 5), dim3(64, 2, 1), None, 4096, 0x1234))
        l.cudaLaunchKernel_ptsz.argtypes = l.cudaLaunchKernel.argtypes
        for i in range(3): rcs.add(l.cudaLaunchKernel_ptsz(0x1, dim3(1, 1, 1), dim3(1, 1, 1), None, 0, None))
        for i in range(3): rcs.add(l.cudaMemcpy(0x1000, 0x2000, 1000, 1))          # HtoD
        rcs.add(l.cudaMemcpyAsync(0x1000, 0x2000, 8589934592, 2, 0x42))            # DtoH, 8 GiB
        rcs.add(l.cudaMemcpy2D(0x1000, 64, 0x2000, 64, 16, 10, 3))                # DtoD 160 B
        rcs.add(l.cudaMemcpyPeer(0x1000, 1, 0x2000, 0, 777))
        for i in range(2): rcs.add(l.cudaGraphLaunch(0x5, None))
        for i in range(4): rcs.add(l.cudaStreamSynchronize(None))
        rcs.add(l.cudaDeviceSynchronize())
    else:
        for i in range(5): rcs.add(l.cuLaunchKernel(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11))
        rcs.add(l.cuLaunchKernelEx(0, 0, 0, 0))
        rcs.add(l.cuGraphLaunch(1, 2))
        rcs.add(l.cuMemcpyHtoD_v2(ct.c_ulonglong(0x1000), None, ct.c_size_t(4096)))
        rcs.add(l.cuMemcpyDtoH_v2(None, ct.c_ulonglong(0x1000), ct.c_size_t(100)))
        rcs.add(l.cuMemcpyDtoDAsync_v2(ct.c_ulonglong(1), ct.c_ulonglong(2), ct.c_size_t(50), None))
        rcs.add(l.cuMemcpyPeer(ct.c_ulonglong(1), None, ct.c_ulonglong(2), None, ct.c_size_t(33)))
        for i in range(3): rcs.add(l.cuStreamSynchronize(None))
        rcs.add(l.cuCtxSynchronize()); rcs.add(l.cuEventSynchronize(None))
print("DONE", threading.get_native_id(), sorted(rcs), flush=True); sys.stdin.readline()
'''


@pytest.fixture(scope="module")
def uprobe():
    from ridgeline.probes import bpf as bpfmod
    miss = bpfmod.availability(need_tracefs=False)
    if not miss.ok:
        pytest.skip(f"ebpf: {miss.reason}")
    p = cu.CudaUprobeProbe(discover=False, rescan_s=0)
    p.start()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def driver_stub(tmp_path_factory):
    cc = shutil.which("gcc") or shutil.which("cc")
    if not cc:
        pytest.skip("no C compiler to build tests/data/cuda_driver_stub.c")
    out = tmp_path_factory.mktemp("stub") / "libcuda.so.1"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(out),
                    str(DATA / "cuda_driver_stub.c")], check=True)
    return str(out)


def _drive(probe, libs, target=True, late=False):
    c = subprocess.Popen([sys.executable, "-c", CALLER, *libs], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        c.stdout.readline()
        if target and not late:
            probe.add_target(c.pid)
        probe.poll()
        c.stdin.write("go\n"); c.stdin.flush()
        done = c.stdout.readline().split(maxsplit=2)
        w = probe.poll()
    finally:
        c.stdin.write("x\n"); c.stdin.flush(); c.wait(timeout=10)
    probe.remove_target(c.pid)
    rows = {int(r["tid"]): r for r in w["threads"] if int(r["tgid"]) == c.pid}
    return int(done[1]), rows, c.pid


@pytest.mark.ebpf
def test_runtime_uprobes_count_calls_with_their_arguments(uprobe):
    tid, rows, pid = _drive(uprobe, [_cudart()])
    r = rows[tid]
    assert int(r["launches"]) == 7 + 3                 # cudaLaunchKernel + cudaLaunchKernel_ptsz
    assert int(r["graph_launches"]) == 2
    assert int(r["copies"]) == 6
    assert int(r["copy_htod_bytes"]) == 3000
    assert int(r["copy_dtoh_bytes"]) == 8589934592
    assert int(r["copy_dtod_bytes"]) == 160            # 2D: width 16 x height 10, kind from the stack
    assert int(r["copy_peer_bytes"]) == 777
    assert int(r["sync_calls"]) == 5
    assert int(r["sync_ns"]) > 0 and int(r["copy_wait_ns"]) > 0   # return probes timed them
    assert int(r["nested_driver_calls"]) == 0


@pytest.mark.ebpf
def test_driver_uprobes_on_a_stub_library(uprobe, driver_stub):
    tid, rows, pid = _drive(uprobe, [driver_stub])
    r = rows[tid]
    assert int(r["launches"]) == 6
    assert int(r["graph_launches"]) == 1
    assert (int(r["copy_htod_bytes"]), int(r["copy_dtoh_bytes"]), int(r["copy_dtod_bytes"]),
            int(r["copy_peer_bytes"])) == (4096, 100, 50, 33)
    assert int(r["sync_calls"]) == 5 and int(r["sync_ns"]) > 0


@pytest.mark.ebpf
def test_both_layers_mapped_direct_driver_calls_are_not_nested(uprobe, driver_stub):
    # runtime calls first, then direct driver calls: the runtime's depth returns to 0
    tid, rows, pid = _drive(uprobe, [_cudart(), driver_stub])
    r = rows[tid]
    assert int(r["launches"]) == 10 + 6
    assert int(r["nested_driver_calls"]) == 0
    assert int(r["sync_calls"]) == 5 + 5
    assert uprobe.counters()["errors"] == 0, uprobe.last_error


@pytest.mark.ebpf
def test_untargeted_process_is_not_counted(uprobe):
    lib = _cudart()
    c = subprocess.Popen([sys.executable, "-c", CALLER, lib], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([sys.executable, "-c", CALLER, lib], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        c.stdout.readline(); other.stdout.readline()
        uprobe.add_target(c.pid)
        uprobe.poll()
        for p in (c, other):
            p.stdin.write("go\n"); p.stdin.flush(); p.stdout.readline()
        w = uprobe.poll()
    finally:
        for p in (c, other):
            p.stdin.write("x\n"); p.stdin.flush(); p.wait(timeout=10)
        uprobe.remove_target(c.pid)
    tg = set(int(x) for x in w["threads"]["tgid"])
    assert c.pid in tg and other.pid not in tg


@pytest.mark.ebpf
def test_process_without_cuda_gets_no_attachment(uprobe):
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)
    try:
        assert uprobe.add_target(p.pid) == [] and uprobe.libraries(p.pid) == []
    finally:
        p.stdin.close(); p.wait(timeout=10)
        uprobe.remove_target(p.pid)


@pytest.mark.ebpf
def test_library_loaded_after_the_target_was_added_is_picked_up(uprobe):
    code = CALLER.replace("libs = [ct.CDLL(p) for p in sys.argv[1:]]\nprint(\"READY\", flush=True); sys.stdin.readline()",
                          "print(\"READY\", flush=True); sys.stdin.readline()\nlibs = [ct.CDLL(p) for p in sys.argv[1:]]\n"
                          "print(\"LOADED\", flush=True); sys.stdin.readline()")
    c = subprocess.Popen([sys.executable, "-c", code, _cudart()], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        c.stdout.readline()
        assert uprobe.add_target(c.pid) == []          # nothing mapped yet
        c.stdin.write("go\n"); c.stdin.flush(); c.stdout.readline()
        uprobe.poll()                                  # rescan attaches the newly mapped libcudart
        assert any(a.layer == "runtime" for a in uprobe.libraries(c.pid))
        c.stdin.write("go\n"); c.stdin.flush()
        tid = int(c.stdout.readline().split()[1])
        w = uprobe.poll()
    finally:
        c.stdin.write("x\n"); c.stdin.flush(); c.wait(timeout=10)
        uprobe.remove_target(c.pid)
    rows = {int(r["tid"]): r for r in w["threads"]}
    assert int(rows[tid]["launches"]) == 10


@pytest.mark.ebpf
def test_driver_calls_inside_runtime_calls_are_counted_once(uprobe, driver_stub, tmp_path):
    cc = shutil.which("gcc") or shutil.which("cc")
    d = os.path.dirname(driver_stub)
    rt = tmp_path / "libcudart.so.99"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(rt), str(DATA / "cuda_runtime_stub.c"),
                    f"-L{d}", "-l:libcuda.so.1", f"-Wl,-rpath,{d}"], check=True)
    code = r'''
import ctypes as ct, sys, threading
l = ct.CDLL(sys.argv[1]); drv = ct.CDLL(sys.argv[2])
print("READY", flush=True); sys.stdin.readline()
class dim3(ct.Structure): _fields_ = [("x", ct.c_uint), ("y", ct.c_uint), ("z", ct.c_uint)]
l.cudaLaunchKernel.argtypes = [ct.c_void_p, dim3, dim3, ct.c_void_p, ct.c_size_t, ct.c_void_p]
for i in range(4): l.cudaLaunchKernel(1, dim3(1, 1, 1), dim3(1, 1, 1), None, 0, None)
for i in range(2): l.cudaStreamSynchronize(None)
for i in range(3): drv.cuLaunchKernel(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)   # direct driver calls
print("DONE", threading.get_native_id(), flush=True); sys.stdin.readline()
'''
    c = subprocess.Popen([sys.executable, "-c", code, str(rt), driver_stub], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        c.stdout.readline()
        uprobe.add_target(c.pid)
        uprobe.poll()
        c.stdin.write("go\n"); c.stdin.flush()
        tid = int(c.stdout.readline().split()[1])
        w = uprobe.poll()
    finally:
        c.stdin.write("x\n"); c.stdin.flush(); c.wait(timeout=10)
        uprobe.remove_target(c.pid)
    r = {int(x["tid"]): x for x in w["threads"]}[tid]
    assert int(r["launches"]) == 4 + 3           # not 4 + 4 + 3
    assert int(r["nested_driver_calls"]) == 4 + 2
    assert int(r["sync_calls"]) == 2 and int(r["sync_ns"]) > 0
