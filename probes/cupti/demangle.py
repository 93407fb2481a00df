"""C++ kernel names as people read them: CUPTI reports mangled names (``_ZN5flash...``).

torch.profiler (Kineto), Nsight and the signature tables show demangled names, so the
decoder demangles each name once, when it is first interned, with the C++ runtime's own
demangler (``__cxa_demangle`` from libstdc++, which every CUDA process already loads;
the same routine Kineto calls, so names match torch.profiler's byte for byte on a host).
The mangled name stays available next to it (``Trace.meta["mangled_names"]``).

A name that is not mangled (``extern "C"`` kernels such as Triton's, cuBLAS ``sm90_xmma``
names) or that the demangler rejects (a name cut at the library's length limit) is kept
as it came. Names are bounded (probes.cupti.protocol.MAX_NAME_BYTES) and the demangler
bounds its recursion, so a hostile name costs at most one failed call.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache


@lru_cache(maxsize=1)
def _demangler():
    """``(__cxa_demangle, free)`` from libstdc++ / libc, or None where there is none."""
    for name in ("libstdc++.so.6", ctypes.util.find_library("stdc++")):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
            fn = lib.__cxa_demangle
            break
        except (OSError, AttributeError):
            continue
    else:
        return None
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int)]
    fn.restype = ctypes.c_void_p
    libc = ctypes.CDLL(None)
    free = libc.free
    free.argtypes = [ctypes.c_void_p]
    free.restype = None
    return fn, free


def available() -> bool:
    """True when the C++ runtime's demangler could be loaded."""
    return _demangler() is not None


def demangle(name: str) -> str:
    """The demangled form of an Itanium-mangled ``name`` (``_Z...``), else ``name`` itself."""
    if not name.startswith("_Z"):
        return name
    d = _demangler()
    if d is None:
        return name
    fn, free = d
    status = ctypes.c_int(-1)
    try:
        raw = name.encode("utf-8", "surrogateescape")
    except UnicodeError:
        return name
    if b"\0" in raw:
        return name
    p = fn(raw, None, None, ctypes.byref(status))
    if not p:
        return name
    try:
        if status.value != 0:
            return name
        return ctypes.string_at(p).decode("utf-8", "replace")
    finally:
        free(p)
