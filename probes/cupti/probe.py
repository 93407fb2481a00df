"""CuptiProbe: the agent-side CUPTI probe (probe interface of probes/probe.py).

The GPU-side events come from inside the served processes, through the injection
library (probes/native). This probe owns the local socket those libraries connect to:
a background thread moves bytes from the sockets into validated messages (bounded,
never blocking on a peer) and decodes them; :meth:`poll` hands on one
:class:`probes.events.Trace` with every process's events.

Readiness, not a timer (issue 21.1): the thread blocks on the sockets (and on a pipe that
wakes it for its stop, or when :meth:`poll` has made room in the decode-ahead bound) until
one is readable or the server's next timeout or identity check is due
(:meth:`CuptiServer.next_deadline_s`, at most ``max_wait_s`` away). When it has decoded
something it writes one byte to :meth:`ready_fd`, which the agent's loop waits on instead
of polling 20 times a second; :meth:`poll` reads that pipe empty.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from time import thread_time

import numpy as np

from ridgeline.probes import targets
from ridgeline.probes.cupti import decode_native
from ridgeline.probes.cupti import peer_time_budget as budget
from ridgeline.probes.cupti import protocol as P
from ridgeline.probes.cupti.decode import NAME_OVERHEAD_BYTES, ProcessDecoder, check_native
from ridgeline.probes.cupti.demangle import demangle_many, seccomp_kills
from ridgeline.probes.cupti.library import build_hint, library_path
from ridgeline.probes.cupti.name_classes import CHUNK_NAMES, NameClassifier, ProcessRows
from ridgeline.probes.cupti.peer_time_budget import PeerTimeBudget
from ridgeline.probes.cupti.server import DEFAULT_SOCKET, CuptiServer, escape
from ridgeline.probes.events import MISSING, NameTable, Trace
from ridgeline.probes.probe import Availability, Probe, drain_fd, poke, wake_pipe

log = logging.getLogger(__name__)

_DECODER_COUNTERS = ("undecodable_records", "unresolved_names", "unjoined_kernels", "rejected_records",
                     "rejected_timestamps", "rejected_device", "rejected_bytes", "rejected_sections",
                     "names_over_limit", "names_not_demangled", "demangle_deadlines", "demangling_stopped",
                     "demangle_budget_spent", "clock_disagreements")
#: pids remembered as having made the demangler run past its deadline (bounded)
_MAX_NO_DEMANGLE_PIDS = 4096
#: Message bytes the pump thread decodes ahead of :meth:`CuptiProbe.poll`; past it the
#: messages wait in the server's bounded queue (whose overflow is counted), so a stalled
#: main loop does not let decoded events grow without bound.
MAX_INGESTED_AHEAD_BYTES = 32 << 20
#: The longest the pump thread waits with nothing due (a wake-up a second; a timeout or an
#: identity check due sooner, data, a new peer or a stop end the wait earlier).
MAX_WAIT_S = 1.0
#: The NVIDIA kernel driver's version file: absent, no process on this host can run CUDA
#: (and so none loads the injection library). Present inside GPU containers too: the
#: NVIDIA container runtime mounts /proc/driver/nvidia.
DRIVER_VERSION_FILE = "/proc/driver/nvidia/version"
_SO_ACCEPTCON = 0x10000      # linux/net.h __SO_ACCEPTCON: the socket listens


def unix_listeners(proc_net_unix: str) -> set[str]:
    """Paths of listening Unix sockets in ``/proc/net/unix`` text (pure: tested with literals).
    Read passively: connecting to find out would reach the running agent as a client."""
    out = set()
    for line in proc_net_unix.splitlines()[1:]:
        parts = line.split(None, 7)
        if len(parts) == 8:
            try:
                flags = int(parts[3], 16)
            except ValueError:
                continue
            if flags & _SO_ACCEPTCON:
                out.add(parts[7])
    return out


def socket_listening(path: str, proc_net_unix: str = "/proc/net/unix") -> bool:
    """True when a process in this network namespace listens on the Unix socket ``path``."""
    try:
        with open(proc_net_unix, encoding="utf-8", errors="replace") as f:
            text = f.read(64 << 20)     # bounded: a host with very many sockets is read in part
    except OSError:
        return False
    return os.path.abspath(path) in unix_listeners(text)


def _announce_target(pid: int) -> None:
    """Tell the target discovery (``probes.targets.announce``) about a process that
    announced itself, so the eBPF probes watch its threads too (the pid also appears in
    ``poll()["new_pids"]``)."""
    targets.announce(pid)


class CuptiProbe(Probe):
    """Receives raw CUPTI buffers from injected processes and decodes them.

    ``poll()`` returns ``{}`` when nothing is new, else a dict with:

    * ``"trace"``: one :class:`Trace` with the events of every injected process since
      the last poll (the ``pid`` column tells them apart; ``names`` is this probe's
      table, shared by all processes, append-only; ``meta["processes"]`` maps each pid
      to its facts: comm, CUPTI version, layouts, mode, flags, library drop counters);
    * ``"launch_latency_ns"``: int64 aligned with ``trace.kernels`` (kernel start - launch
      API call start, -1 where no API record matched);
    * ``"new_pids"``: ``[(pid, comm)]`` of processes that said hello since the last poll
      (``comm`` escaped: it is the peer's text);
    * ``"closed_pids"``: pids whose connection ended;
    * ``"status"``: ``{pid: text}`` the library's own reasons (missing CUPTI, conflict
      with another CUPTI subscriber, takeover), new since the last poll, as one escaped
      line (newlines read ``\\n``).

    Kernel names are demangled; ``trace.meta["mangled_names"]`` maps a name id of the
    probe-wide table to the mangled name CUPTI reported (only for names that were
    mangled). Text from a peer (comm, status) is escaped before it reaches the log.
    """

    name = "cupti"
    optional = True

    def __init__(self, socket_path: str | None = None, max_wait_s: float = MAX_WAIT_S,
                 socket_group: str | None = None, max_name_bytes: int = 48 << 20, idle_peer_s: float = 300.0,
                 name_classifier: NameClassifier | None = None, **server_kw):
        super().__init__()
        server_kw["idle_peer_s"] = idle_peer_s
        #: bound on the probe-wide name table, which outlives the processes that sent the
        #: names (each process is bounded too: ProcessDecoder.max_name_bytes)
        self.max_name_bytes = max_name_bytes
        self._name_bytes = 0
        self.names_over_limit = 0
        self.socket_path = socket_path or os.environ.get("RIDGELINE_SOCKET", DEFAULT_SOCKET)
        self.max_wait_s = max_wait_s
        if socket_group:    # "" (the configuration's default): every local user may connect
            server_kw["socket_group"] = socket_group
        self._server_kw = server_kw
        self.server: CuptiServer | None = None
        self.decoders: dict[int, ProcessDecoder] = {}
        self.names = NameTable()                  # probe-wide: every process's names
        self.mangled_names: dict[int, str] = {}   # probe-wide name id -> mangled name
        self._remaps: dict[int, np.ndarray] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._new: list[tuple[int, str]] = []
        self._closed: list[int] = []
        self._conn_pid: dict[int, int] = {}       # connection -> pid, for connections that said hello
        self._retired: dict[str, int] = {}        # counters of processes whose decoder was released
        self._status: dict[int, str] = {}
        self.decode_errors = 0
        # processes whose names stopped being demangled: a reconnect does not start over
        self._no_demangle: dict[int, None] = {}
        #: demangler seconds per pid and per uid, whatever each call's outcome; kept here,
        #: not in a decoder or connection, so a reconnect does not reset it
        self.demangle_budget = PeerTimeBudget()
        #: matches each process's new names against the signatures on the pump thread
        #: (probes.cupti.name_classes), within a CPU budget per pid and per uid kept here
        #: for the same reason; None: the phase mapper matches names on the main loop
        self.name_classifier = name_classifier
        self.classify_budget = PeerTimeBudget(budget.CLASSIFY_PID_BURST_S, budget.CLASSIFY_PID_REFILL_PER_S,
                                              budget.CLASSIFY_UID_BURST_S, budget.CLASSIFY_UID_REFILL_PER_S)
        self._name_rows: dict[int, ProcessRows] = {}   # pid -> rows of its local name ids
        self.names_not_classified = 0     # names left unmatched: their process's or user's budget was spent
        self._pid_uid: dict[int, int] = {}
        self._pid_comm: dict[int, str] = {}       # escaped, cut to the kernel's 15 bytes (issue 18.3)
        # Decoding (and so demangling, which waits on the worker process) runs in the pump
        # thread, never in poll() on the agent's main loop; this lock guards the decoders,
        # and is let go while the demangler works, so poll() waits for neither.
        self._dec_lock = threading.Lock()
        self._ingested_ahead = 0
        self.driver_version_file = DRIVER_VERSION_FILE
        self.socket_in_use = False        # set by check(): a live listener holds socket_path
        # (read end, write end) of two non-blocking pipes while started: the agent's loop
        # waits on ``_ready``'s (see ready_fd), the pump thread on ``_waker``'s
        self._ready: tuple[int, int] | None = None
        self._waker: tuple[int, int] | None = None
        self._ready_set = False           # a byte is in the ready pipe, not yet read
        self.pump_rounds = 0              # the pump thread's rounds (its wake-ups), for tests

    def check(self) -> Availability:
        # Another agent's live socket: opening ours would unlink it and take its processes.
        self.socket_in_use = socket_listening(self.socket_path)
        if self.socket_in_use:
            return Availability(False, f"an agent already listens on {self.socket_path}",
                                "that agent serves the injected processes; stop it before starting another here")
        d = os.path.dirname(self.socket_path) or "."
        probe_dir = d
        while not os.path.isdir(probe_dir):
            probe_dir = os.path.dirname(probe_dir) or "/"
        if not os.access(probe_dir, os.W_OK):
            return Availability(False, f"cannot create the CUPTI socket in {d} (not writable)",
                                "run the agent as root, or set RIDGELINE_SOCKET to a writable path")
        try:
            check_native()
        except decode_native.DecodeLibraryMissing as exc:
            return Availability(False, str(exc), "the CUPTI probe decodes with it; build it, then restart the agent")
        lib = library_path()
        if not lib.exists():
            return Availability(True, f"listening is possible, but the injection library {lib} is not built",
                                build_hint())
        if not os.path.exists(self.driver_version_file):
            return Availability(True, f"will listen on {self.socket_path}, but this host has no NVIDIA driver "
                                f"({self.driver_version_file} absent): no process here runs CUDA, none will connect",
                                "run the agent on the GPU host, with the NVIDIA driver loaded")
        return Availability(True, f"will listen on {self.socket_path}", "")

    def start(self) -> None:
        if self.server is not None:
            return
        self.server = CuptiServer(self.socket_path, **self._server_kw)
        self.server.open()
        self._ready, self._waker = wake_pipe(), wake_pipe()
        self._ready_set = False
        self.server.add_waker(self._waker[0])
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="ridgeline-cupti", daemon=True)
        self._thread.start()

    def ready_fd(self) -> int | None:
        """A descriptor that becomes readable when :meth:`poll` has something to hand on
        (events, new or closed processes, status lines); None while not started."""
        return self._ready[0] if self._ready is not None else None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.pump_rounds += 1
            with self._lock:
                srv = self.server
                if srv is None:
                    return
                srv.pump(0)
                backlogged = srv.accept_backlogged
                msgs = srv.drain() if self._ingested_ahead < MAX_INGESTED_AHEAD_BYTES else []
                due = srv.next_deadline_s()
            if msgs:
                self._ingested_ahead += sum(m.nbytes for m in msgs)
                self.ingest(msgs)
                self._signal_ready()
            # Let go of the messages before the next round reads: a batch's body is the
            # connection's spare buffer, reused for the next frame only once nothing holds
            # it (server._reused); kept through the wait, every 4 MiB frame took fresh
            # pages, grown 1 -> 2 -> 4 MiB (33 of 33 frames at 50k kernels/s).
            msgs = None
            # wait for readiness outside the lock so poll()/set_mode() never wait long;
            # not while connections wait in the backlog (a flood must not delay a library)
            if not backlogged and not self._stop.is_set():
                srv.wait(self.max_wait_s if due is None else min(due, self.max_wait_s))

    def _signal_ready(self) -> None:
        """One byte in the ready pipe until poll() reads it (not one per batch)."""
        if self._ready is None or self._ready_set:
            return
        self._ready_set = True
        poke(self._ready[1])

    def stop(self) -> None:
        self._stop.set()
        if self._waker is not None:
            poke(self._waker[1])        # out of its wait at once
        if self._thread is not None:
            # a demangler call in the thread ends within its deadlines (two of DEADLINE_BASE_S)
            self._thread.join(timeout=5)
            self._thread = None
        with self._lock:
            if self.server is not None:
                self.server.close()
                self.server = None
            for p in (self._ready, self._waker):
                if p is not None:
                    os.close(p[0])
                    os.close(p[1])
            self._ready = self._waker = None

    def reclaim(self, pid: int | None = None) -> int:
        """Ask libraries whose CUPTI was taken over (legacy CUPTI) to take it back, for when
        the operator knows the other tool is done; returns how many got the request."""
        with self._lock:
            if self.server is None:
                return 0
            n = 0
            with self._dec_lock:
                modes = {d.pid: d.mode for d in self.decoders.values() if d.flags & P.FLAG_TAKEN_OVER}
            for p, mode in modes.items():
                if pid is None or p == pid:
                    n += self.server.send_control(mode, 0, p, P.CONTROL_RECLAIM)
            return n

    def taken_over_pids(self) -> set[int]:
        """Pids whose latest HELLO says another CUPTI client took the callbacks over."""
        return {d.pid for d in list(self.decoders.values()) if d.flags & P.FLAG_TAKEN_OVER}

    def taken_over_owners(self) -> dict[int, tuple[int, str]]:
        """``{pid: (uid, comm)}`` of the taken-over processes: the uid from the kernel
        (SO_PEERCRED), the comm the library sent (escaped, 15 characters at most)."""
        return {pid: (self._pid_uid.get(pid, -1), self._pid_comm.get(pid, "")) for pid in self.taken_over_pids()}

    def set_mode(self, mode: str | int, kernel_sample_every: int = 0, pid: int | None = None) -> int:
        """Switch libraries to ``"always-on"`` or ``"deep"`` (all, or one pid) without restarting them."""
        m = {"always-on": P.MODE_ALWAYS_ON, "deep": P.MODE_DEEP}.get(mode, mode) if isinstance(mode, str) else mode
        if m not in P.MODE_NAMES:
            raise ValueError(f"unknown mode {mode!r}")
        with self._lock:
            return self.server.send_control(int(m), kernel_sample_every, pid) if self.server else 0

    def ingest(self, messages) -> None:
        """Decode messages (from :meth:`CuptiServer.drain`); used by the pump thread and by tests."""
        with self._dec_lock:
            for m in messages:
                try:
                    self._ingest_one(m)
                except Exception as e:  # noqa: BLE001  (MemoryError included: one message, never the others; counted, logged)
                    self.decode_errors += 1
                    log.warning("cupti: pid %d: %s message not used: %s: %s", m.pid, m.kind, type(e).__name__,
                                escape(str(e)))
            if self.name_classifier is not None:
                for pid in dict.fromkeys(m.pid for m in messages if m.kind != "closed"):
                    self._classify_new(pid)

    def _classify_new(self, pid: int) -> None:
        """Match the process's names interned since the last call (issue 18.1: once per
        name, here on the pump thread, never on the main loop), CHUNK_NAMES at a time while
        its pid's and uid's CPU budget lasts; past it the rest are left unmatched (stand-in
        rows, counted in names_not_classified). Called with ``_dec_lock`` held, which is let
        go while a chunk is matched."""
        dec = self.decoders.get(pid)
        if dec is None:
            return
        rows = self._name_rows.setdefault(pid, ProcessRows())
        uid = self._pid_uid.get(pid, -1)
        while rows.n < len(dec.names):
            lo = rows.n
            if not self.classify_budget.allowed(pid, uid):
                n = len(dec.names) - lo
                rows.append(self.name_classifier.unclassified(n), provisional=True)
                self.names_not_classified += n
                return
            strings = [dec.names[i] for i in range(lo, min(len(dec.names), lo + CHUNK_NAMES))]
            self._dec_lock.release()
            t0 = thread_time()
            try:
                got = self.name_classifier.classify(strings)
            finally:
                spent = thread_time() - t0
                self._dec_lock.acquire()
                self.classify_budget.charge(pid, uid, spent)
            if self.decoders.get(pid) is not dec or self._name_rows.get(pid) is not rows:
                return                    # released while the lock was let go
            rows.append(got, provisional=False)
            # names collect() moved to the probe-wide table meanwhile got stand-ins: the real rows now
            remap = self._remaps.get(pid)
            if remap is not None and len(remap) > lo:
                self._store_rows(rows, remap, lo, min(len(remap), rows.n))

    def _store_rows(self, rows: ProcessRows, remap: np.ndarray, lo: int, hi: int) -> None:
        """Store the rows of local ids ``lo..hi-1`` under their probe-wide ids."""
        if hi <= lo:
            return
        r, prov = rows.take(lo, hi)
        ids = remap[lo:hi]
        ok = ids >= 0
        if not ok.all():
            r, prov, ids = {f: a[ok] for f, a in r.items()}, prov[ok], ids[ok]
        self.name_classifier.store(self.names, ids, r, prov)

    def _demangle(self, pid: int, raw: list[str]) -> tuple[list[str], dict[str, int]]:
        """A process's new names through the demangler, within its pid's and uid's time
        budget (charged whatever the outcome); called by its decoder with ``_dec_lock``
        held, which is let go while the worker runs."""
        uid = self._pid_uid.get(pid, -1)
        if not self.demangle_budget.allowed(pid, uid):
            return list(raw), {"too_long": 0, "deadline": 0, "budget": sum(1 for r in raw if r.startswith("_Z"))}
        self._dec_lock.release()
        t0 = time.monotonic()
        try:
            return demangle_many(raw)
        finally:
            spent = time.monotonic() - t0
            self._dec_lock.acquire()
            self.demangle_budget.charge(pid, uid, spent)

    def _ingest_one(self, m) -> None:
        if m.kind == "hello":
            dec = self.decoders.get(m.pid)
            if dec is None:
                dec = self.decoders[m.pid] = ProcessDecoder(m.pid)
                dec.demangler = lambda raw, pid=m.pid: self._demangle(pid, raw)
                if m.pid in self._no_demangle:
                    dec.counters["demangling_stopped"] = 1
            if m.uid >= 0:
                self._pid_uid.pop(m.pid, None)
                self._pid_uid[m.pid] = m.uid
                while len(self._pid_uid) > _MAX_NO_DEMANGLE_PIDS:
                    self._pid_uid.pop(next(iter(self._pid_uid)))
            self._pid_comm.pop(m.pid, None)
            self._pid_comm[m.pid] = escape(m.body.comm, 15)
            while len(self._pid_comm) > _MAX_NO_DEMANGLE_PIDS:
                self._pid_comm.pop(next(iter(self._pid_comm)))
            dec.set_hello(m.body)
            if m.conn_id not in self._conn_pid:    # a repeated HELLO only updates the state
                self._conn_pid[m.conn_id] = m.pid
                self._new.append((m.pid, escape(m.body.comm, 64)))
                _announce_target(m.pid)
            if m.body.status:
                # peer text: handed on escaped (one line, no control characters), so that
                # whoever logs it cannot be made to write lines of the peer's choosing
                self._status[m.pid] = escape(m.body.status.strip(), 4000)
                if m.body.flags & (P.FLAG_CONFLICT | P.FLAG_NO_CUPTI | P.FLAG_TAKEN_OVER):
                    # whose process it is (any user may flag its own process as taken over),
                    # and rate-limited per uid by the agent's log limiter (the peer)
                    log.warning("cupti: pid %d (%s, uid %d): %s", m.pid, escape(m.body.comm, 15), m.uid,
                                escape(m.body.status.strip()), extra={"peer": m.uid})
        elif m.kind == "batch":
            dec = self.decoders.get(m.pid)
            if dec is None:   # cannot happen: the server requires hello first
                return
            try:
                self.records += dec.add_batch(m.body, received_ns=time.time_ns())
            except Exception as e:  # noqa: BLE001  (a decoding bug must not take the agent down; counted, logged)
                self.decode_errors += 1
                log.warning("cupti: pid %d: batch not decoded: %s: %s", m.pid, type(e).__name__,
                            escape(str(e)))
        elif m.kind == "closed":
            if self._conn_pid.pop(m.conn_id, None) is not None:
                self._closed.append(m.pid)

    def poll(self) -> dict:
        if self.server is None:
            return {}
        if self._ready is not None and self._ready_set:
            # read before taking the data: what the thread decodes after this writes again
            self._ready_set = False
            drain_fd(self._ready[0])
        if self._thread is None:        # not started: nothing decodes in the background
            with self._lock:
                msgs = self.server.drain()
            self.ingest(msgs)
        return self.collect()

    def collect(self) -> dict:
        """Hand on what :meth:`ingest` decoded (the second half of :meth:`poll`)."""
        with self._dec_lock:
            full = self._ingested_ahead >= MAX_INGESTED_AHEAD_BYTES
            self._ingested_ahead = 0
            out = self._collect()
        srv = self.server
        if full and self._waker is not None and srv is not None and srv.queued():
            poke(self._waker[1])        # messages wait for the room just made: decode them now
        return out

    def _collect(self) -> dict:
        parts = []
        for pid, dec in self.decoders.items():
            if dec.pending():
                trace, latency = dec.take()
                self._to_shared_names(pid, dec, trace)
                parts.append((pid, trace, latency))
        out = {}
        if parts:
            out["trace"], out["launch_latency_ns"] = self._merge(parts)
        self._release_closed()
        if self._new:
            out["new_pids"], self._new = self._new, []
        if self._closed:
            out["closed_pids"], self._closed = self._closed, []
        if self._status:
            out["status"], self._status = self._status, {}
        return out

    def _release_closed(self) -> None:
        """Forget processes with no open connection once their events are handed on, so
        short-lived processes do not accumulate. Safe: a library that reconnects sends
        its hello and all its names again."""
        live = set(self._conn_pid.values())
        for pid in [p for p, d in self.decoders.items() if p not in live and not d.pending()]:
            dec = self.decoders.pop(pid)
            self._remaps.pop(pid, None)
            self._name_rows.pop(pid, None)
            if dec.counters["demangling_stopped"]:
                self._no_demangle.pop(pid, None)
                self._no_demangle[pid] = None
                while len(self._no_demangle) > _MAX_NO_DEMANGLE_PIDS:
                    self._no_demangle.pop(next(iter(self._no_demangle)))
            for k, v in dec.library_counters.items():
                self._retired[f"library_{k}"] = self._retired.get(f"library_{k}", 0) + v
            for k in _DECODER_COUNTERS:
                self._retired[k] = self._retired.get(k, 0) + dec.counters.get(k, 0)

    def _to_shared_names(self, pid: int, dec: ProcessDecoder, trace: Trace) -> None:
        """Rewrite a process's name ids into the probe-wide table (vectorised remap)."""
        remap = self._remaps.get(pid, np.empty(0, np.int32))
        if len(remap) < len(dec.names):
            first = len(remap)
            new = np.fromiter((self._intern_bounded(dec.names[i]) for i in range(first, len(dec.names))),
                              np.int32, len(dec.names) - first)
            remap = self._remaps[pid] = np.concatenate([remap, new])
            for i, mangled in dec.mangled.items():
                if i >= first and remap[i] >= 0 and int(remap[i]) not in self.mangled_names:
                    self.mangled_names[int(remap[i])] = mangled
                    self._name_bytes += len(mangled) + NAME_OVERHEAD_BYTES
            if self.name_classifier is not None:
                # the rows the pump thread matched; names it has not reached yet get
                # stand-ins now (replaced when it does), so the main loop matches none
                rows = self._name_rows.setdefault(pid, ProcessRows())
                have = max(first, min(rows.n, len(dec.names)))
                self._store_rows(rows, remap, first, have)
                if len(dec.names) > have:
                    ids = remap[have:]
                    ids = ids[ids >= 0]
                    self.name_classifier.store(self.names, ids, self.name_classifier.unclassified(len(ids)),
                                               np.ones(len(ids), bool))
        if len(remap) == 0:
            return
        for arr in (trace.kernels, trace.copies, trace.api, trace.ranges):
            if len(arr) and dec.native:
                decode_native.remap(arr, "name_id", remap)       # one pass, in place
            elif len(arr):
                ids = arr["name_id"]
                arr["name_id"] = np.where(ids >= 0, remap[np.maximum(ids, 0)], MISSING)

    def _intern_bounded(self, s: str) -> int:
        i = self.names.lookup(s)
        if i != MISSING:
            return i
        cost = len(s) + NAME_OVERHEAD_BYTES
        if self._name_bytes + cost > self.max_name_bytes:
            self.names_over_limit += 1
            return MISSING
        self._name_bytes += cost
        return self.names.intern(s)

    def _merge(self, parts) -> tuple[Trace, np.ndarray]:
        meta = {"source": "cupti", "processes": {pid: t.meta for pid, t, _ in parts},
                "mangled_names": self.mangled_names}
        for _, t, _ in parts:
            t.meta.pop("mangled_names", None)     # process-local ids; the probe-wide map replaces them
        if len(parts) == 1:
            _, t, lat = parts[0]
            return Trace(t.kernels, t.copies, t.api, t.ranges, names=self.names, meta=meta), lat
        cat = lambda f: np.concatenate([getattr(t, f) for _, t, _ in parts])  # noqa: E731
        return (Trace(cat("kernels"), cat("copies"), cat("api"), cat("ranges"), names=self.names, meta=meta),
                np.concatenate([lat for _, _, lat in parts]))

    def counters(self) -> dict:
        lib = {k: self._retired.get(f"library_{k}", 0) for k in P.LIBRARY_COUNTERS}
        dec = {k: self._retired.get(k, 0) for k in _DECODER_COUNTERS}
        with self._dec_lock:
            decoders = list(self.decoders.values())
            for d in decoders:
                for k in lib:
                    lib[k] += d.library_counters.get(k, 0)
                for k in dec:
                    dec[k] += d.counters.get(k, 0)
        stats = dict(self.server.stats) if self.server else {}
        lost = lib["dropped_cupti"] + lib["dropped_pool_full"] + lib["dropped_no_agent"] + lib["dropped_send"]
        # drops counts records; whole batches refused before decoding are a separate figure
        # (their record count is unknown), and a failed accept() is an error like any other.
        out = {"records": self.records,
               "drops": lost,
               "dropped_batches": stats.get("dropped_batches_queue_full", 0),
               "errors": (stats.get("protocol_errors", 0) + stats.get("accept_errors", 0)
                          + stats.get("rejected_batches", 0) + stats.get("rejected_peers", 0) + self.decode_errors
                          + dec["undecodable_records"] + dec["rejected_records"]),
               "processes": len(decoders),
               "processes_taken_over": sum(1 for d in decoders if d.flags & P.FLAG_TAKEN_OVER),
               "connections": self.server.connections if self.server else 0}
        out.update({f"library_{k}": v for k, v in lib.items()})
        out.update(dec)
        out["names_over_limit"] += self.names_over_limit
        from ridgeline.probes.log_limit import LIMIT
        out["log_lines_suppressed"] = LIMIT.total_suppressed()
        out["demangle_seconds"] = round(self.demangle_budget.spent_s, 6)
        out["demangle_budget_refused_calls"] = self.demangle_budget.refused_calls
        out["demangler_seccomp_kills"] = seccomp_kills()
        out["names_not_classified"] = self.names_not_classified
        out["classify_seconds"] = round(self.classify_budget.spent_s, 6)
        out["classify_budget_refused_calls"] = self.classify_budget.refused_calls
        out.update({f"server_{k}": v for k, v in stats.items()})
        return out
