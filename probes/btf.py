"""Kernel BTF reader: struct member offsets and tracepoint prototypes of the *running* kernel.

The eBPF probes compile against whatever kernel headers the distro ships (on VM kernels
often another version: 6.1 headers on a 6.18 kernel put ``task_struct.pid`` at 2416
instead of 1264). So the probes never take a struct offset from the headers: offsets
they need come from ``/sys/kernel/btf/vmlinux`` through this module and are passed to
the BPF program as ``-D`` macros.

Dependency-free; parsing the ~6 MB vmlinux BTF takes ~0.2 s and is cached per process.
"""
from __future__ import annotations

import functools
import struct

VMLINUX = "/sys/kernel/btf/vmlinux"

KIND_INT, KIND_PTR, KIND_ARRAY, KIND_STRUCT, KIND_UNION = 1, 2, 3, 4, 5
KIND_TYPEDEF, KIND_VOLATILE, KIND_CONST, KIND_RESTRICT = 8, 9, 10, 11
KIND_FUNC_PROTO, KIND_TYPE_TAG = 13, 18
_MODIFIERS = (KIND_TYPEDEF, KIND_VOLATILE, KIND_CONST, KIND_RESTRICT, KIND_TYPE_TAG)
# Fixed bytes after the common 12-byte header, and bytes per vlen entry, per kind.
_EXTRA = {1: 4, 3: 12, 14: 4, 17: 4}
_PER_VLEN = {4: 12, 5: 12, 6: 8, 13: 8, 15: 12, 19: 12}


class BTFError(Exception):
    """The BTF is missing, malformed, or lacks the requested type or member."""


@functools.lru_cache(maxsize=4)
def load(path: str = VMLINUX) -> list:
    """Parse a BTF blob into a list indexed by type id: ``(kind, name, size_or_type, members)``.

    ``members`` is a list of ``(name, type_id, bit_offset)`` for structs and unions, a list
    of ``("", type_id, 0)`` parameters for function prototypes, else ``None``.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise BTFError(f"cannot read {path}: {exc.strerror}") from None
    return parse(data)


def parse(data: bytes) -> list:
    """Parse raw BTF bytes (see :func:`load`)."""
    if len(data) < 24:
        raise BTFError("BTF blob too short")
    magic, _ver, _flags, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from("<HBBIIIII", data, 0)
    if magic != 0xEB9F:
        raise BTFError("not BTF (bad magic)")
    tbase, sbase = hdr_len + type_off, hdr_len + str_off
    strs = data[sbase:sbase + str_len]

    def name(off: int) -> str:
        return strs[off:strs.index(b"\0", off)].decode() if off else ""

    types: list = [None]  # type id 0 is void
    pos, end = tbase, tbase + type_len
    while pos < end:
        name_off, info, size_or_type = struct.unpack_from("<III", data, pos)
        kind, vlen, kflag = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
        pos += 12
        members = None
        if kind in (KIND_STRUCT, KIND_UNION):
            members = []
            for i in range(vlen):
                m_name, m_type, m_off = struct.unpack_from("<III", data, pos + 12 * i)
                members.append((name(m_name), m_type, (m_off & 0xFFFFFF) if kflag else m_off))
        elif kind == KIND_FUNC_PROTO:
            members = [("", struct.unpack_from("<II", data, pos + 8 * i)[1], 0) for i in range(vlen)]
        pos += _EXTRA.get(kind, 0) + _PER_VLEN.get(kind, 0) * vlen
        types.append((kind, name(name_off), size_or_type, members))
    return types


def _strip(types: list, tid: int) -> int:
    while types[tid] is not None and types[tid][0] in _MODIFIERS:
        tid = types[tid][2]
    return tid


def member_offset(struct_name: str, path: str, types: list | None = None) -> int:
    """Byte offset of a dotted member path in a struct, e.g. ``("task_struct", "se.sum_exec_runtime")``.

    Anonymous unions/structs on the way are searched. Raises :class:`BTFError` when
    the struct or a member is absent.
    """
    types = load() if types is None else types
    tid = next((i for i, t in enumerate(types) if t and t[0] in (KIND_STRUCT, KIND_UNION)
                and t[1] == struct_name and t[3]), None)
    if tid is None:
        raise BTFError(f"struct {struct_name} not in BTF")

    def find(tid: int, want: str, base: int):
        for m_name, m_type, bit_off in types[tid][3]:
            t = _strip(types, m_type)
            if m_name == want:
                return t, base + bit_off
            if not m_name and types[t][0] in (KIND_STRUCT, KIND_UNION):
                hit = find(t, want, base + bit_off)
                if hit:
                    return hit
        return None

    bits = 0
    for part in path.split("."):
        hit = find(tid, part, bits)
        if hit is None:
            raise BTFError(f"{struct_name}.{path} not in BTF")
        tid, bits = hit
    return bits // 8


def tracepoint_params(tp: str, types: list | None = None) -> list[str]:
    """Parameter type names of raw tracepoint ``tp`` (from ``btf_trace_<tp>``), without the ctx.

    Pointers come out as ``"<name>*"`` (e.g. ``"task_struct*"``), so a caller can check
    the raw argument layout it relies on before loading a program.
    """
    types = load() if types is None else types
    tid = next((i for i, t in enumerate(types) if t and t[0] == KIND_TYPEDEF and t[1] == f"btf_trace_{tp}"), None)
    if tid is None:
        raise BTFError(f"raw tracepoint {tp} not in BTF")
    ptr = _strip(types, tid)
    if types[ptr][0] != KIND_PTR or types[_strip(types, types[ptr][2])][0] != KIND_FUNC_PROTO:
        raise BTFError(f"btf_trace_{tp} is not a function pointer")
    proto = types[_strip(types, types[ptr][2])]
    out = []
    for _, ptid, _ in proto[3][1:]:           # first parameter is the void *ctx
        t = _strip(types, ptid)
        if types[t] is None:
            out.append("void")
        elif types[t][0] == KIND_PTR:
            out.append((types[_strip(types, types[t][2])] or (0, "void"))[1] + "*")
        else:
            out.append(types[t][1])
    return out
