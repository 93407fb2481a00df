"""BTF reader: a hand-built BTF blob (struct with an anonymous union, a tracepoint
prototype), and the running kernel's BTF where present."""
from __future__ import annotations

import os
import struct

import pytest

from ridgeline.probes import btf


def _blob() -> bytes:
    strs = b"\0int\0task\0pid\0tgid\0se\0sched_entity\0sum_exec\0btf_trace_sched_wakeup\0"
    off = {s: strs.index(s.encode() + b"\0") for s in
           ["int", "task", "pid", "tgid", "se", "sched_entity", "sum_exec", "btf_trace_sched_wakeup"]}
    types = b""
    # 1: int (4 bytes)
    types += struct.pack("<III", off["int"], (btf.KIND_INT << 24), 4) + struct.pack("<I", 32)
    # 2: struct sched_entity { int pad@0; int sum_exec@64 bits }
    types += struct.pack("<III", off["sched_entity"], (btf.KIND_STRUCT << 24) | 1, 16)
    types += struct.pack("<III", off["sum_exec"], 1, 64)
    # 3: anonymous union { int tgid@0 }
    types += struct.pack("<III", 0, (btf.KIND_UNION << 24) | 1, 4)
    types += struct.pack("<III", off["tgid"], 1, 0)
    # 4: struct task { int pid@32; <anon union>@64; struct sched_entity se@128 }
    types += struct.pack("<III", off["task"], (btf.KIND_STRUCT << 24) | 3, 40)
    types += struct.pack("<III", off["pid"], 1, 32)
    types += struct.pack("<III", 0, 3, 64)
    types += struct.pack("<III", off["se"], 2, 128)
    # 5: ptr -> 4 ; 6: func_proto (void *ctx, struct task *p) ; 7: ptr -> 6 ; 8: typedef btf_trace_sched_wakeup -> 7
    types += struct.pack("<III", 0, (btf.KIND_PTR << 24), 4)
    types += struct.pack("<III", 0, (btf.KIND_FUNC_PROTO << 24) | 2, 0) + struct.pack("<II", 0, 0) + struct.pack("<II", 0, 5)
    types += struct.pack("<III", 0, (btf.KIND_PTR << 24), 6)
    types += struct.pack("<III", off["btf_trace_sched_wakeup"], (btf.KIND_TYPEDEF << 24), 7)
    hdr = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(types), len(types), len(strs))
    return hdr + types + strs


def test_offsets_and_prototype_from_a_literal_blob():
    types = btf.parse(_blob())
    assert btf.member_offset("task", "pid", types) == 4
    assert btf.member_offset("task", "tgid", types) == 8            # through the anonymous union
    assert btf.member_offset("task", "se.sum_exec", types) == 16 + 8
    assert btf.tracepoint_params("sched_wakeup", types) == ["task*"]
    with pytest.raises(btf.BTFError):
        btf.member_offset("task", "comm", types)
    with pytest.raises(btf.BTFError):
        btf.tracepoint_params("sched_switch", types)


def test_bad_blob():
    with pytest.raises(btf.BTFError):
        btf.parse(b"\0" * 30)
    with pytest.raises(btf.BTFError):
        btf.load("/nonexistent/vmlinux")


@pytest.mark.skipif(not os.path.exists(btf.VMLINUX), reason="kernel has no BTF (/sys/kernel/btf/vmlinux)")
def test_running_kernel_layouts():
    from ridgeline.probes.sched import raw_layout_problem
    assert raw_layout_problem() is None
    assert btf.member_offset("task_struct", "tgid") == btf.member_offset("task_struct", "pid") + 4
