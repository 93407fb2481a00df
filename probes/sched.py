"""Scheduling probe: on-CPU, run-queue wait and blocked time of every thread of the target processes.

Why: a decode step stalls when the thread that launches kernels is not running,
preempted and waiting in the run queue or blocked; the GPU trace cannot show it, the
scheduler can.

Kernel side (``sched_bpf.c``, bcc): raw tracepoints ``sched_switch``, ``sched_wakeup``,
``sched_wakeup_new``, ``sched_process_exit``; targets (tgids) in a bitmap map that the
agent changes at run time (:meth:`SchedProbe.add_target` / :meth:`remove_target`); per
thread, cumulative totals aggregated in the kernel; thread exits, forks (with
``follow_forks``) and optional slow run-queue events through the BPF ring buffer. Only
raw tracepoint arguments and task_struct offsets from the running kernel's BTF are used
(the distro headers may belong to another kernel). Time the BPF side could not see (an
event hidden from tracing, e.g. switches to and from threads of a VM agent that the
sandbox kernel never traces) is reported as ``unattributed_ns`` and counted in ``gaps``.

User side: :meth:`SchedProbe.poll` (non-blocking) reads the slot table (``slot_task``: the
task pointer of each slot, 0 when free; ``threads``: its totals) straight from memory (both
arrays are mmapped, no system call), drains the ring buffer, and returns one window of per-thread rows
(:data:`probes.sched_accounting.WINDOW_DTYPE`) computed by the pure accounting in
:mod:`probes.sched_accounting`. The slots user space frees itself (removed targets, threads
gone unseen) are freed by a compare-and-swap on the mapped words, the one the BPF side frees
with, in ``probes/sched_native/libridgeline_sched.so`` (Python cannot compare-and-swap a
mapped word; :func:`slot_library`).
"""
from __future__ import annotations

import ctypes as ct
import mmap
import os
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

from . import bpf as bpfmod
from . import btf, native_library, proc
from .errors import RuntimeFailure
from .probe import Availability, Probe
from .sched_accounting import EV_EXIT, EV_FORK, EV_SLOW_RUNQ, EVENT_DTYPE, THREAD_DTYPE, WindowAccountant, hist_by_tgid
from .targets import TargetSet

BPF_SOURCE = Path(__file__).with_name("sched_bpf.c")
# Raw tracepoint argument layouts the program relies on (checked against BTF before loading).
RAW_LAYOUT = {
    "sched_switch": ["_Bool", "task_struct*", "task_struct*", "unsigned int"],
    "sched_wakeup": ["task_struct*"],
    "sched_wakeup_new": ["task_struct*"],
    "sched_process_exit": ["task_struct*"],
}
CFG_SLOW_RUNQ_NS, CFG_FOLLOW_FORKS, CFG_DISCOVER, CFG_RB_FLAGS = range(4)
C_EVENTS_LOST, C_THREADS_LOST, C_GAPS, C_EVENTS = range(4)
L_FREED_USER = 2          # `live` counter that user space alone writes (slots it freed)
_MAX_PENDING_EVENTS = 65536   # ring-buffer records held between two polls; beyond: dropped, counted
SLOT_LIB_NAME = "libridgeline_sched.so"
_NATIVE_DIR = Path(__file__).resolve().parent / "sched_native"
SLOT_LIB_ABI = 1                 # rl_sched_abi(): the argument list of rl_sched_free passed below
# rl_sched_free compares and clears the tid within the row's first 64-bit word (ev_type, tid)
assert THREAD_DTYPE.fields["ev_type"][1] == 0 and THREAD_DTYPE.fields["tid"][1] == 4
assert THREAD_DTYPE.itemsize % 8 == 0


class SlotLibraryMissing(RuntimeFailure):
    """The native slot-free library is not built or cannot be loaded (the message says what to do)."""


def slot_library_path() -> Path:
    """The built library (``RIDGELINE_SCHED_LIB`` overrides)."""
    return native_library.path_of("RIDGELINE_SCHED_LIB", _NATIVE_DIR, SLOT_LIB_NAME)


@lru_cache(maxsize=1)
def slot_library() -> ct.CDLL:
    """``libridgeline_sched.so`` (probes/sched_native), its ABI checked; :class:`SlotLibraryMissing`
    when it is not there (no fallback: a plain check-then-store free races the BPF side)."""
    lib = native_library.open_library(slot_library_path(), "scheduling slot", native_library.build_hint(_NATIVE_DIR),
                                      SlotLibraryMissing)
    lib.rl_sched_abi.restype = ct.c_int64
    lib.rl_sched_abi.argtypes = ()
    if lib.rl_sched_abi() != SLOT_LIB_ABI:
        raise SlotLibraryMissing(f"ridgeline: {slot_library_path()} has ABI {lib.rl_sched_abi()}, this code "
                                 f"passes {SLOT_LIB_ABI}: {native_library.build_hint(_NATIVE_DIR)}")
    v, i64 = ct.c_void_p, ct.c_int64
    lib.rl_sched_free.restype = i64
    lib.rl_sched_free.argtypes = (v, v, i64, i64, v, v, v, i64, v)
    return lib


def raw_layout_problem(types=None) -> str | None:
    """None when the running kernel's raw sched tracepoints have the layouts the program reads."""
    try:
        for tp, want in RAW_LAYOUT.items():
            got = btf.tracepoint_params(tp, types)
            if got[:len(want)] != want:
                return f"raw tracepoint {tp} has arguments {got}, expected {want}"
        btf.member_offset("task_struct", "pid", types)
        btf.member_offset("task_struct", "tgid", types)
    except btf.BTFError as exc:
        return str(exc)
    return None


def slot_bits(max_threads: int) -> int:
    """log2 of the slot table size: at least 4 x ``max_threads``, 1024 or more. The table is then
    at most a quarter full, where a thread finds the 2 x 4 slots of its two buckets all taken
    about never (simulated with slab-spaced pointers: 0 of 3 x 4096 in 32768 slots; at half
    full ~1 in 10,000, at the full cap of 2 x ``max_threads`` slots ~0.6 %)."""
    return max(10, (4 * int(max_threads) - 1).bit_length())


def bpf_cflags(max_threads: int, rb_pages: int) -> list[str]:
    """The -D flags ``sched_bpf.c`` is compiled with (see its header); also used by the bench to
    load another revision of the program under the same conditions."""
    return [f"-DTS_PID={btf.member_offset('task_struct', 'pid')}",
            f"-DTS_TGID={btf.member_offset('task_struct', 'tgid')}",
            f"-DTARGET_WORDS={bpfmod.target_words()}", f"-DMAX_THREADS={max_threads}",
            f"-DSLOT_BITS={slot_bits(max_threads)}", f"-DRB_PAGES={rb_pages}", "-w"]


def _map_array(table, dtype: np.dtype, n: int) -> tuple[mmap.mmap, np.ndarray]:
    """A BPF_F_MMAPABLE array map as a writable numpy array of ``n`` elements (no copy)."""
    size = -(-n * dtype.itemsize // mmap.PAGESIZE) * mmap.PAGESIZE
    m = mmap.mmap(table.map_fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    return m, np.frombuffer(m, dtype=dtype, count=n)


class SchedProbe(Probe):
    """Per-thread scheduling accounting for a run-time-changeable set of processes.

    ``pids``: initial targets. ``discover``: each poll also adds processes with a
    ``/dev/nvidia*`` file open and processes announced through :func:`probes.targets.announce`,
    and drops exited ones (:class:`probes.targets.TargetSet`); without it, targets come only
    from ``pids`` and :meth:`add_target`. ``follow_forks``: children of targets become targets.
    ``slow_runq_ns``: also report each run-queue wait at least this long as an event.
    ``seed_s``: after a target is added, threads met at a wakeup or switch-in are
    recognised by reading their tgid for this long (afterwards, only at their own
    switch-out, which costs the untracked hot path nothing).
    """

    name = "sched"
    optional = True

    def __init__(self, pids=(), *, discover: bool = True, follow_forks: bool = False, slow_runq_ns: int = 0,
                 max_threads: int = 16384, rb_pages: int = 64, seed_s: float = 1.0):
        super().__init__()
        self._initial = [int(p) for p in pids]
        # Targets found by poll(): GPU processes, announced ones, `pids` (probes.targets).
        self._tset = TargetSet(pids) if discover else None
        self.follow_forks = follow_forks
        self.slow_runq_ns = int(slow_runq_ns)
        self.max_threads = max_threads
        self.rb_pages = rb_pages
        self.seed_s = seed_s
        self.bpf = None
        self._maps: list[mmap.mmap] = []
        self.compile_s = 0.0
        self._targets: set[int] = set()
        self._acct = WindowAccountant()
        self._pending: list[bytes] = []
        self._discover_until = 0.0
        self._last_read_ns = 0
        self._polls = 0
        self._forks: list[int] = []

    # ------------------------------------------------------------------ lifecycle
    def check(self) -> Availability:
        a = bpfmod.availability()
        if not a.ok:
            return a
        problem = raw_layout_problem()
        if problem:
            return Availability(False, problem, "this kernel's scheduler tracepoints differ; please report it")
        try:
            slot_library()
        except SlotLibraryMissing as exc:
            return Availability(False, str(exc), "the scheduling probe frees the slots of gone threads with it")
        return Availability(True)

    def start(self) -> None:
        if self.bpf is not None:
            return
        bcc = bpfmod.import_bcc()
        lib = slot_library()           # before loading: without it the probe must not run
        t0 = time.perf_counter()
        bpf = bcc.BPF(text=BPF_SOURCE.read_bytes(),        # RAW_TRACEPOINT_PROBE auto-attaches
                      cflags=bpf_cflags(self.max_threads, self.rb_pages))
        self.compile_s = time.perf_counter() - t0
        self._open(bpf, lib)

    def _open(self, bpf, lib: ct.CDLL) -> None:
        """Take over a loaded program ``bpf`` (compiled with :func:`bpf_cflags` of this probe's
        ``max_threads``): map its tables, open its ring buffer, set its configuration, add the
        initial targets. The tests hand it an instance whose programs are not attached and
        that they run themselves (BPF_PROG_TEST_RUN), to drive interleavings one step at a time."""
        self.bpf = bpf
        self._lib = lib
        nslots = 1 << slot_bits(self.max_threads)
        (m1, self._slot_task), (m2, self._slots) = (_map_array(self.bpf[b"slot_task"], np.dtype("<u8"), nslots),
                                                    _map_array(self.bpf[b"threads"], THREAD_DTYPE, nslots))
        self._maps = [m1, m2]
        self._live = self.bpf[b"live"]
        self._freed_user = 0
        self._bits = self.bpf[b"targets"]
        self._config = self.bpf[b"config"]
        self._counters = self.bpf[b"counters"]
        self.bpf[b"events"].open_ring_buffer(lambda ctx, data, size: self._on_event(ctx, data, size))
        self._set(CFG_SLOW_RUNQ_NS, self.slow_runq_ns)
        self._set(CFG_FOLLOW_FORKS, 1 if self.follow_forks else 0)
        self._last_read_ns = time.monotonic_ns()
        for pid in self._initial:
            self.add_target(pid)

    def stop(self) -> None:
        """Detach and free everything; idempotent. A later start() resumes the same targets."""
        if self.bpf is None:
            return
        try:
            self._slot_task = self._slots = None
            for m in self._maps:
                try:
                    m.close()
                except BufferError:
                    # a view is still referenced (e.g. by a traceback): the mapping goes with it
                    pass
            self._maps = []
            self.bpf.cleanup()
        finally:
            self.bpf = None
            self._initial = sorted(set(self._initial) | self._targets)
            self._targets = set()
            self._acct = WindowAccountant()
            self._pending = []

    # ------------------------------------------------------------------ targets
    def _set(self, idx: int, val: int) -> None:
        self._config[ct.c_int(idx)] = ct.c_uint64(int(val))

    def _set_bit(self, tgid: int, on: bool) -> None:
        bpfmod.set_target_bit(self._bits, tgid, on)

    @property
    def targets(self) -> set[int]:
        return set(self._targets)

    def set_slow_runq_ns(self, ns: int) -> None:
        """Report every run-queue wait of at least ``ns`` as an event in ``poll()["slow_runq"]`` (0: off)."""
        self.slow_runq_ns = int(ns)
        if self.bpf is not None:
            self._set(CFG_SLOW_RUNQ_NS, self.slow_runq_ns)

    def set_follow_forks(self, on: bool) -> None:
        """Make child processes of targets targets too (from their creation)."""
        self.follow_forks = bool(on)
        if self.bpf is not None:
            self._set(CFG_FOLLOW_FORKS, 1 if on else 0)

    def add_target(self, tgid: int) -> None:
        """Track every thread of process ``tgid`` from its next scheduler event on."""
        tgid = int(tgid)
        if self.bpf is None:
            self._initial.append(tgid)
            return
        if tgid in self._targets or tgid <= 0:
            return
        if self._tset is not None:
            self._tset.add(tgid)     # so that its exit is noticed
        self._targets.add(tgid)
        self._set_bit(tgid, True)
        self._set(CFG_DISCOVER, 1)
        self._discover_until = time.monotonic() + self.seed_s

    def remove_target(self, tgid: int) -> None:
        """Stop tracking ``tgid`` and delete its threads' entries (their partial window is dropped)."""
        tgid = int(tgid)
        if self.bpf is None or tgid not in self._targets:
            return
        if self._tset is not None:
            self._tset.forget(tgid)
        self._targets.discard(tgid)
        self._set_bit(tgid, False)
        slots, tasks, vals = self._read()
        mine = vals["tgid"] == tgid
        self._release(slots[mine], tasks[mine], vals["tid"][mine])
        self._acct.forget_tgid(tgid)

    # ------------------------------------------------------------------ reading
    def _on_event(self, _ctx, data, size):
        # Ring-buffer callback: copy and return (decoding happens in poll, columnar).
        if len(self._pending) >= _MAX_PENDING_EVENTS:
            self.drops += 1
            return
        self._pending.append(ct.string_at(data, size))

    def _read(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(slot numbers, each slot's task, THREAD_DTYPE rows) of the tracked threads, copied
        out of the mapped table (the tasks and tids are what :meth:`_release` frees against).

        A row is kept only if its slot still holds the same task after the copy and its tid is
        set (tid is 0 while the BPF side fills a slot, and cleared right after a slot is freed:
        a row copied after a free fails the second look at ``slot_task`` instead)."""
        keys = self._slot_task.copy()        # a snapshot: the BPF side changes it meanwhile
        slots = np.flatnonzero(keys)
        keys = keys[slots]
        rows = self._slots[slots]            # fancy indexing: a copy
        ok = (self._slot_task[slots] == keys) & (rows["tid"] != 0)
        return slots[ok], keys[ok], rows[ok]

    def _release(self, slots: np.ndarray, tasks: np.ndarray, tids: np.ndarray) -> np.ndarray:
        """Free slots from user space (removed targets, threads gone unseen); returns which of
        them this call freed (bool, aligned with ``slots``).

        Each slot is freed by a compare-and-swap of its task pointer, ``tasks[i]`` -> 0, and
        only while its row still carries ``tids[i]`` (rl_sched_free, probes/sched_native): one
        the BPF side freed meanwhile (and counted), perhaps claimed again by a new thread, even
        one at the same task address, is left alone, and only the frees made here are counted
        in L_FREED_USER, so each claim is counted freed once. A check followed by a store
        could not be: the BPF side's free fell between the two, both counted it, and ``live``
        drifted below the slots held (the MAX_THREADS cap loosened); a slot claimed again in
        that gap lost its new owner. A target's bit is cleared before its slots are freed, so
        the BPF side frees them at the same time only in its stale-entry paths."""
        n = len(slots)
        freed = np.zeros(n, np.uint8)
        if not n:
            return freed.view(bool)
        slots = np.ascontiguousarray(slots, np.int64)
        tasks = np.ascontiguousarray(tasks, np.uint64)
        tids = np.ascontiguousarray(tids, np.uint32)
        count = self._lib.rl_sched_free(self._slot_task.ctypes.data, self._slots.ctypes.data, THREAD_DTYPE.itemsize,
                                        len(self._slot_task), slots.ctypes.data, tasks.ctypes.data, tids.ctypes.data,
                                        n, freed.ctypes.data)
        if count:
            self._freed_user += int(count)
            self._live[ct.c_int(L_FREED_USER)] = ct.c_uint64(self._freed_user)
        return freed.view(bool)

    def _counter(self, i: int) -> int:
        return int(sum(v for v in self._counters[ct.c_int(i)]))

    def poll(self) -> dict | None:
        """One window since the previous poll: per-thread rows, histograms, events. Never blocks."""
        if self.bpf is None:
            return None
        self._polls += 1
        removed = []
        if self._tset is not None:
            added, removed = self._tset.poll()
            for pid in added:
                self.add_target(pid)
        elif self._polls % 8 == 0:
            removed = [t for t in self._targets if not proc.alive(t)]
        self.bpf.ring_buffer_consume()
        pending, self._pending = self._pending, []
        keys, tasks, rows = self._read()
        now_ns = time.monotonic_ns()
        exits = [p for p in pending if len(p) == THREAD_DTYPE.itemsize]
        evs = [p for p in pending if len(p) == EVENT_DTYPE.itemsize]
        exit_rows = np.frombuffer(b"".join(exits), dtype=THREAD_DTYPE) if exits else np.zeros(0, THREAD_DTYPE)
        exit_rows = exit_rows[exit_rows["ev_type"] == EV_EXIT]
        ev_rows = np.frombuffer(b"".join(evs), dtype=EVENT_DTYPE) if evs else np.zeros(0, EVENT_DTYPE)
        # Threads whose last switch was never seen (hidden) but that are gone: finalise them.
        # Only threads without an event for 5 s are looked up in /proc: an exiting thread's
        # last switch comes microseconds after sched_process_exit marks it, and the BPF side
        # then sends its row and frees its slot itself (freeing it here too counted one
        # thread's exit twice, and its slot twice: live drifted below the slots held).
        if self._polls % 8 == 0 and len(rows):
            stale = rows["ts"].astype(np.int64) < now_ns - 5_000_000_000
            gone = np.zeros(len(rows), bool)
            for i in np.flatnonzero(stale):
                gone[i] = not os.path.exists(f"/proc/{int(rows[i]['tgid'])}/task/{int(rows[i]['tid'])}")
            if len(exit_rows):
                gone &= ~np.isin(rows["tid"], exit_rows["tid"])    # its last row came already
            if gone.any():
                # Only the threads whose slot this free took end here. Where the BPF side
                # freed it first (at the thread's last switch, whose exit record may come with
                # the next poll, or as a dead task's stale entry) the row stays a live one this
                # window: a later exit record is differenced against it, not counted again.
                idx = np.flatnonzero(gone)
                ended = idx[self._release(keys[idx], tasks[idx], rows["tid"][idx])]
                exit_rows = np.concatenate([exit_rows, rows[ended]])
                rows = np.delete(rows, ended)
        window = self._acct.window(rows, exit_rows, now_ns)
        forks = ev_rows[ev_rows["ev_type"] == EV_FORK]
        for f in forks:   # children of targets (follow_forks): the BPF side already set their bit
            self._targets.add(int(f["tgid"]))
        if self._discover_until and time.monotonic() >= self._discover_until:
            self._set(CFG_DISCOVER, 0)
            self._discover_until = 0.0
        # Exited targets go after this window, which holds their threads' last figures; a
        # reused pid must not inherit the target bit.
        for pid in removed:
            self.remove_target(pid)
        start_ns, self._last_read_ns = self._last_read_ns, now_ns
        self.records += len(window) + len(ev_rows)
        return {
            "kind": "sched",
            "window_start_ns": start_ns,
            "window_end_ns": now_ns,
            "threads": window,
            "runq_hist": hist_by_tgid(window),
            "slow_runq": ev_rows[ev_rows["ev_type"] == EV_SLOW_RUNQ],
            "forks": forks,
            "counters": self._counts(),
        }

    def _counts(self) -> dict:
        c = super().counters()
        if self.bpf is not None:
            c["events_lost"] = self._counter(C_EVENTS_LOST)
            c["threads_lost"] = self._counter(C_THREADS_LOST)
            c["gaps"] = self._counter(C_GAPS)
            c["events"] = self._counter(C_EVENTS)
            c["drops"] = self.drops + c["events_lost"] + c["threads_lost"]
        return c

    def counters(self) -> dict:
        """records, drops (ring buffer full + thread map full + held events), errors, gaps, and
        per-program BPF run time (``bpf_programs``; non-zero while kernel.bpf_stats_enabled=1)."""
        return bpfmod.with_prog_stats(self._counts(), self.bpf)
