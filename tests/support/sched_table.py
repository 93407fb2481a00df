"""The scheduling probe over a private instance of probes/sched_bpf.c whose programs are not
attached: the test runs them itself, one event at a time, with BPF_PROG_TEST_RUN (raw
tracepoint programs take their arguments from the call, Linux 5.10 and later; bpf(2),
``BPF_PROG_TEST_RUN``). So the BPF side's claims and frees of slots happen exactly when a test
says, between the user-space steps it wants to interleave them with, on the real program and
the real mmapped table, and no other thread's scheduling touches that table.

The program's `sched_switch` runs in the calling thread's context (``bpf_get_current_task_btf``
is that thread): its tid is the row's tid, its process (the test's, a target here) is the
row's tgid, and ``prev`` is whatever task address the test passes (a fabricated one: the table
only compares them). ``rl_test_release`` calls the program's own release() on a slot.
"""
from __future__ import annotations

import ctypes as ct
import os
import platform
import threading

import numpy as np

_PRE = (b"#undef RAW_TRACEPOINT_PROBE\n"      # renamed: bcc attaches raw_tracepoint__* itself
        b"#define RAW_TRACEPOINT_PROBE(event) int rl_test_##event(struct bpf_raw_tracepoint_args *ctx)\n")
_POST = b"""
int rl_test_release(struct bpf_raw_tracepoint_args *ctx) {
    int idx = (int)ctx->args[1];
    struct thread_t *s = threads.lookup(&idx);
    if (s)
        release(ctx->args[0], idx, s);
    return 0;
}
"""
SYS_BPF = {"x86_64": 321, "aarch64": 280}[platform.machine()]
BPF_PROG_TEST_RUN = 10
TASK_DEAD = 0x80            # prev_state of an exiting thread's last switch (include/linux/sched.h)
TASK_INTERRUPTIBLE = 0x1
NEXT = 0xFFFF8880DEAD0000   # the switch's `next`: a task never tracked here
_libc = ct.CDLL(None, use_errno=True)


class _TestRunAttr(ct.Structure):
    """union bpf_attr, the BPF_PROG_TEST_RUN member (include/uapi/linux/bpf.h)."""
    _fields_ = [("prog_fd", ct.c_uint32), ("retval", ct.c_uint32), ("data_size_in", ct.c_uint32),
                ("data_size_out", ct.c_uint32), ("data_in", ct.c_uint64), ("data_out", ct.c_uint64),
                ("repeat", ct.c_uint32), ("duration", ct.c_uint32), ("ctx_size_in", ct.c_uint32),
                ("ctx_size_out", ct.c_uint32), ("ctx_in", ct.c_uint64), ("ctx_out", ct.c_uint64),
                ("flags", ct.c_uint32), ("cpu", ct.c_uint32), ("batch_size", ct.c_uint32), ("pad", ct.c_uint32)]


def test_run(fd: int, *args: int) -> None:
    """Run raw-tracepoint program ``fd`` once in this thread with ``args`` as its arguments."""
    a = (ct.c_uint64 * len(args))(*args)
    attr = _TestRunAttr(prog_fd=fd, ctx_size_in=8 * len(args), ctx_in=ct.addressof(a))
    if _libc.syscall(SYS_BPF, BPF_PROG_TEST_RUN, ct.byref(attr), ct.sizeof(attr)) != 0:
        err = ct.get_errno()
        raise OSError(err, f"BPF_PROG_TEST_RUN: {os.strerror(err)}")


def task(k: int) -> int:
    """A fabricated task address (slab-like spacing)."""
    return 0xFFFF888100000000 + k * 0x2C00


class UnattachedSched:
    """A :class:`SchedProbe` (``.probe``) over an unattached instance of the program."""

    def __init__(self, max_threads: int = 64):
        from bcc import BPF

        from ridgeline.probes import sched
        self.bpf = BPF(text=_PRE + sched.BPF_SOURCE.read_bytes() + _POST,
                       cflags=sched.bpf_cflags(max_threads, 16))
        self.probe = sched.SchedProbe(discover=False, max_threads=max_threads)
        self.probe._open(self.bpf, sched.slot_library())
        self.probe.add_target(os.getpid())
        self.probe._set(sched.CFG_DISCOVER, 0)      # only the prev path tracks: nothing is read from `next`
        self.switch_fd = self.bpf.load_func(b"rl_test_sched_switch", BPF.RAW_TRACEPOINT).fd
        self.release_fd = self.bpf.load_func(b"rl_test_release", BPF.RAW_TRACEPOINT).fd
        self.bucket_bits = sched.slot_bits(max_threads) - 2

    def close(self) -> None:
        self.probe.stop()

    # -- the BPF side, run now, in the calling thread
    def switch_out(self, prev: int, dead: bool = False) -> None:
        """sched_switch(preempt=0, prev, NEXT, prev_state): a voluntary switch-out of ``prev``
        by the calling thread, or its last one (TASK_DEAD: the exit record, then the free)."""
        test_run(self.switch_fd, 0, prev, NEXT, TASK_DEAD if dead else TASK_INTERRUPTIBLE)

    def release(self, prev: int, slot: int) -> None:
        """The program's release(prev, slot)."""
        test_run(self.release_fd, prev, slot)

    def in_new_thread(self, fn, *args) -> int:
        """Run ``fn(*args)`` in a new thread (another tid); return that tid."""
        out = {}

        def body():
            out["tid"] = threading.get_native_id()
            fn(*args)
        t = threading.Thread(target=body)
        t.start()
        t.join()
        return out["tid"]

    # -- the table
    def bucket(self, prev: int) -> int:
        """sched_bpf.c bucket(task, HASH1): the first bucket a task's slot is looked for in."""
        return ((prev * 0x9E3779B97F4A7C15) % (1 << 64)) >> (64 - self.bucket_bits)

    def counts(self) -> tuple[int, int, int]:
        """live's (claimed, freed by BPF, freed by user space)."""
        return tuple(int(self.probe._live[ct.c_int(i)].value) for i in range(3))

    def live(self) -> int:
        c, fb, fu = self.counts()
        return c - fb - fu

    def held(self) -> int:
        return int(np.count_nonzero(self.probe._slot_task.copy()))

    def slot_of(self, prev: int) -> int:
        (s,) = np.flatnonzero(self.probe._slot_task == prev)
        return int(s)

    def tid_at(self, slot: int) -> int:
        return int(self.probe._slots["tid"][slot])
