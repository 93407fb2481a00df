"""What the test machine has: each check returns None when present, else the exact reason.

Used by conftest.py to skip (or, with ``--require``, fail) tests marked ``ebpf`` or ``gpu``.
"""
from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=None)
def ebpf_missing() -> str | None:
    if os.geteuid() != 0:
        return "eBPF tests need root (euid is %d)" % os.geteuid()
    if not os.path.exists("/sys/kernel/btf/vmlinux"):
        return "kernel has no BTF (/sys/kernel/btf/vmlinux missing)"
    if not (os.path.isdir("/sys/kernel/tracing/events") or os.path.isdir("/sys/kernel/debug/tracing/events")):
        return "tracefs is not mounted (/sys/kernel/tracing/events missing); run scripts/setup-ebpf.sh"
    try:
        import bcc  # noqa: F401  (the distro's python3-bpfcc, linked into the venv by setup)
    except Exception as exc:  # noqa: BLE001  (ImportError or a broken libbcc: the skip reason says which)
        return f"cannot import the distro bcc module (python3-bpfcc): {exc}"
    if not hasattr(bcc, "BPF"):
        return "the imported `bcc` module is not BCC (PyPI's unrelated `bcc` package?)"
    return None


@functools.lru_cache(maxsize=None)
def gpu_missing() -> str | None:
    try:
        import pynvml
    except ImportError as exc:
        return f"nvidia-ml-py (pynvml) not importable: {exc}"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return f"no NVIDIA GPU driver: NVML init failed: {exc}"
    try:
        count = pynvml.nvmlDeviceGetCount()
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    if count < 1:
        return "NVML reports no GPU devices"
    return None
