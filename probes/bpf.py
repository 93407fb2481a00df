"""Access to bcc (the distro's python3-bpfcc) for the eBPF probes: import, availability, batch map reads.

* :func:`import_bcc` imports the distro bcc even into an interpreter whose site-packages
  lacks the link that ``scripts/link-bcc.sh`` makes (it loads the package from the distro
  path without touching ``sys.path``). PyPI's ``bcc`` is an unrelated project and is refused.
* :func:`availability` says, without loading anything into the kernel, whether eBPF
  probes can run here, with a reason and a hint.
* :func:`target_words` and :func:`set_target_bit` size and flip the per-pid target bitmap
  (a ``BPF_ARRAY`` of u64 words) that the sched and CUDA-uprobe programs test.
* :func:`read_map` reads a whole BPF hash map with ``BPF_MAP_LOOKUP_BATCH`` straight into
  numpy arrays (0.5 µs per entry instead of ~4 µs for per-key iteration), falling back to
  key iteration on kernels without batch ops.
"""
from __future__ import annotations

import ctypes as ct
import errno
import functools
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np

from .probe import Availability

DISTRO_BCC = "/usr/lib/python3/dist-packages/bcc"
SETUP_HINT = "run `sudo bash scripts/setup-ebpf.sh && bash scripts/link-bcc.sh .venv` (distro python3-bpfcc, headers, tracefs)"


def import_bcc():
    """Return the distro's ``bcc`` module; raises ImportError with a one-line reason."""
    try:
        import bcc  # linked into the venv by scripts/link-bcc.sh
        if hasattr(bcc, "BPF"):
            return bcc
        raise ImportError("the importable `bcc` is not BCC (PyPI's unrelated `bcc` package?)")
    except ImportError:
        if not os.path.isfile(os.path.join(DISTRO_BCC, "__init__.py")):
            raise ImportError("distro bcc (python3-bpfcc) is not installed") from None
    spec = importlib.util.spec_from_file_location("bcc", os.path.join(DISTRO_BCC, "__init__.py"),
                                                  submodule_search_locations=[DISTRO_BCC])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bcc"] = mod  # bcc's relative imports need the entry
    try:
        spec.loader.exec_module(mod)
    except Exception as exc:  # noqa: BLE001  (the distro's code: any failure to load it means no bcc, said as ImportError)
        del sys.modules["bcc"]
        raise ImportError(f"distro bcc failed to load: {exc}") from None
    return mod


@functools.lru_cache(maxsize=None)
def availability(need_tracefs: bool = True) -> Availability:
    """Can bcc programs be loaded here? Never raises."""
    if os.geteuid() != 0:
        return Availability(False, f"eBPF probes need root (euid {os.geteuid()})",
                            "run the agent as root (or with CAP_BPF, CAP_PERFMON and CAP_SYS_ADMIN)")
    if not os.path.exists("/sys/kernel/btf/vmlinux"):
        return Availability(False, "kernel has no BTF (/sys/kernel/btf/vmlinux missing)",
                            "use a kernel built with CONFIG_DEBUG_INFO_BTF=y")
    if need_tracefs and not (os.path.isdir("/sys/kernel/tracing/events")
                             or os.path.isdir("/sys/kernel/debug/tracing/events")):
        return Availability(False, "tracefs is not mounted", SETUP_HINT)
    if not os.path.isdir(f"/lib/modules/{os.uname().release}/build") and not os.environ.get("BCC_KERNEL_SOURCE"):
        return Availability(False, f"no kernel headers at /lib/modules/{os.uname().release}/build", SETUP_HINT)
    try:
        import_bcc()
    except ImportError as exc:
        return Availability(False, str(exc), SETUP_HINT)
    return Availability(True)


def target_words() -> int:
    """u64 words of a bitmap with one bit per possible pid (``kernel.pid_max``)."""
    try:
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        pid_max = 4194304   # the largest pid_max Linux allows
    return (pid_max + 63) // 64


def set_target_bit(table, tgid: int, on: bool) -> None:
    """Set (``on``) or clear ``tgid``'s bit in the bcc ``BPF_ARRAY`` bitmap ``table``."""
    w = ct.c_int(tgid >> 6)
    cur = table[w].value
    bit = 1 << (tgid & 63)
    table[w] = ct.c_uint64((cur | bit) if on else (cur & ~bit))


class _BatchUnsupported(Exception):
    pass


def read_map(table, key_dtype: np.dtype, value_dtype: np.dtype, max_entries: int) -> tuple[np.ndarray, np.ndarray]:
    """Read every entry of a bcc hash ``table`` into ``(keys, values)`` numpy arrays.

    ``value_dtype`` must have the C struct's exact size (``itemsize``). One
    ``BPF_MAP_LOOKUP_BATCH`` pass; entries updated concurrently are read as they are at
    that moment (each value is copied atomically per entry by the kernel).
    """
    try:
        return _read_map_batch(table, key_dtype, value_dtype, max_entries)
    except _BatchUnsupported:
        pass
    keys, vals = [], []
    for k, v in table.items():
        keys.append(bytes(k))
        vals.append(bytes(v))
    kk = np.frombuffer(b"".join(keys), dtype=key_dtype) if keys else np.empty(0, key_dtype)
    vv = np.frombuffer(b"".join(vals), dtype=value_dtype) if vals else np.empty(0, value_dtype)
    return kk.copy(), vv.copy()


_BUFFERS: dict = {}


def _buffers(table, key_dtype, value_dtype, max_entries):
    # One pair of buffers per map, reused across polls: allocating (and page-faulting) a
    # max_entries-sized buffer on every read would dominate a poll's cost.
    k = (table.map_fd, key_dtype.str, value_dtype.itemsize, max_entries)
    buf = _BUFFERS.get(k)
    if buf is None:
        if len(_BUFFERS) > 64:
            _BUFFERS.clear()
        buf = _BUFFERS[k] = (np.empty(max_entries, dtype=key_dtype), np.empty(max_entries, dtype=value_dtype))
    return buf


def _read_map_batch(table, key_dtype, value_dtype, max_entries):
    from bcc.libbcc import lib  # noqa: PLC0415  (bcc is optional at import time)
    keys, vals = _buffers(table, key_dtype, value_dtype, max_entries)
    out_batch = ct.c_uint64(0)   # large enough for any map's batch cursor
    cnt = ct.c_uint32(0)
    total = 0
    while total < max_entries:
        cnt.value = max_entries - total
        res = lib.bpf_lookup_batch(
            table.map_fd,
            ct.cast(ct.byref(out_batch), ct.POINTER(ct.c_uint32)) if total else None,
            ct.cast(ct.byref(out_batch), ct.POINTER(ct.c_uint32)),
            ct.c_void_p(keys.ctypes.data + total * key_dtype.itemsize),
            ct.c_void_p(vals.ctypes.data + total * value_dtype.itemsize),
            ct.byref(cnt))
        err = ct.get_errno()
        total += cnt.value
        if res != 0:
            if err == errno.ENOENT:
                break            # done
            if err in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP) and total == 0:
                raise _BatchUnsupported()
            raise OSError(err, f"BPF_MAP_LOOKUP_BATCH failed: {os.strerror(err)}")
        if cnt.value == 0:
            break
    return keys[:total].copy(), vals[:total].copy()


def prog_stats(bpf) -> dict[str, dict]:
    """Run count and run time of each loaded program of a ``BPF`` object, from /proc fdinfo.

    Non-zero only while ``kernel.bpf_stats_enabled`` is 1.
    """
    out = {}
    for name, fn in getattr(bpf, "funcs", {}).items():
        try:
            with open(f"/proc/self/fdinfo/{fn.fd}") as f:
                info = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        key = name.decode() if isinstance(name, bytes) else str(name)
        out[key] = {"run_cnt": int(info.get("run_cnt", "0").strip() or 0),
                    "run_time_ns": int(info.get("run_time_ns", "0").strip() or 0)}
    return out


def with_prog_stats(counts: dict, bpf) -> dict:
    """``counts`` with ``bpf_programs`` (:func:`prog_stats`) added while ``bpf`` is loaded."""
    if bpf is not None:
        counts["bpf_programs"] = prog_stats(bpf)
    return counts
