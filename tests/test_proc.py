"""/proc parsers with literal file contents, and the thin readers on this process."""
from __future__ import annotations

import os
import threading

import pytest

from ridgeline.probes import proc

MAPS = """\
7f0000000000-7f0000001000 r--p 00000000 fd:01 1234567                    /opt/venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12
7f0000001000-7f0000100000 r-xp 00001000 fd:01 1234567                    /opt/venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12
7f0000200000-7f0000300000 r-xp 00000000 fd:01 7654321                    /usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05
7f0000400000-7f0000500000 r-xp 00000000 fd:01 111                        /tmp/old/libcudart.so.11.0 (deleted)
7f0000600000-7f0000700000 rw-p 00000000 00:00 0                          [heap]
7f0000800000-7f0000900000 r-xp 00000000 fd:01 222                        /usr/lib/libcudart_static_helper.so
"""


def test_parse_maps():
    rt = proc.parse_maps(MAPS, r"^libcudart\.so")
    assert [(m.path.rsplit("/", 1)[1], m.inode, m.dev) for m in rt] == [("libcudart.so.12", 1234567, "fd:01")]
    drv = proc.parse_maps(MAPS, r"^libcuda\.so")
    assert [m.inode for m in drv] == [7654321]


def test_parse_schedstat_and_status():
    assert proc.parse_schedstat("123456 7890 12\n") == (123456, 7890, 12)
    with pytest.raises(ValueError):
        proc.parse_schedstat("1 2")
    status = "Name:\tpython\nTgid:\t42\nvoluntary_ctxt_switches:\t17\nnonvoluntary_ctxt_switches:\t3\n"
    assert proc.parse_ctxt_switches(status) == (17, 3)
    assert proc.parse_status_tgid(status) == 42
    with pytest.raises(ValueError):
        proc.parse_ctxt_switches("Name:\tx\n")


def test_parse_steal():
    stat = ("cpu  100 0 50 1000 0 0 0 7 0 0\n"
            "cpu0 50 0 25 500 0 0 0 3 0 0\n"
            "cpu1 50 0 25 500 0 0 0 4 0 0\n")
    assert proc.parse_steal_ns(stat) == 7 * 10_000_000
    assert proc.parse_steal_ns(stat, 1) == 4 * 10_000_000
    with pytest.raises(ValueError):
        proc.parse_steal_ns(stat, 5)


def test_readers_on_this_process():
    me = os.getpid()
    tid = threading.get_native_id()
    assert proc.alive(me) and me in proc.pids() and tid in proc.tids(me)
    assert proc.schedstat(me, tid)[0] > 0
    assert proc.ctxt_switches(me, tid) is not None
    assert proc.comm(me)
    assert proc.schedstat(me, 999999999) is None          # gone thread: None, no exception
    assert proc.tids(999999999) == [] and not proc.has_open_device(999999999)
