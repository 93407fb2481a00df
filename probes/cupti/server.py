"""The agent's end of the injection library's socket: accept, frame, validate, hand on.

One unix-domain listening socket, many injected processes. Everything is non-blocking
and bounded, so no peer (a slow one, a dead one, or a hostile one: the socket is
connectable by local users whose processes we profile) can crash or stall the agent:

* a frame header with a wrong magic, version, type or a body over the size limit, or
  a HELLO that does not parse (or names another process), is a protocol error: counted,
  and that connection is closed (a byte stream cannot be resynchronised);
* at most ``max_connections`` peers, always well below the process's descriptor limit
  (``RLIMIT_NOFILE``; the rest of the agent needs descriptors too); more are accepted
  and closed at once (counted as ``refused_connections``); one non-root user holds at
  most ``max_connections_per_uid`` of them (a quarter by default; ``refused_connections_uid``),
  so a local user flooding the socket leaves room for the served processes of others
  (root's peers are not limited: root needs no socket to disturb the agent);
* a complete frame whose body does not parse costs only that message
  (``rejected_batches``); the connection stays, as the framing is intact;
* queued, not yet decoded bytes are bounded; past the bound new batches are dropped
  and counted; half-received frames of all peers together are bounded too: past the
  bound the peer holding the most half-received bytes is cut (``partial_cap_cut``), so a
  peer that parks a large frame cannot make the next legitimate frame the one cut. The
  two bounds together (128 + 128 MiB by default), with the body buffers kept for reuse
  (``SPARE_TOTAL_BYTES``, 32 MiB), keep the agent inside the unit's ``MemoryMax`` (384 MiB)
  whatever local peers send;
* a frame must be complete ``idle_timeout_s`` after its first byte arrived (the agent
  reads as fast as the peer writes, so only a stalling or trickling peer is slower;
  ``idle_cut``): one byte per second, which progress-based timeouts never cut, holds a
  connection at most that long;
* a connection that has not sent its HELLO ``hello_timeout_s`` after it was accepted is
  cut (``hello_timeout_cut``): the library sends it at once, so only a peer that holds a
  connection slot without saying who it is waits that long;
* a connection that said HELLO and then sends nothing for ``idle_peer_s`` is cut
  (``idle_peer_cut``): a library with no GPU work reconnects when it has some (its HELLO
  and names are sent again), so an idle slot is not held for good (issue 18.4);
* when every slot is taken, a newcomer is not simply refused: a peer of root (uid 0) or of
  a user holding fewer connections than the user holding the most takes the slot of that
  user's longest-idle connection (``evicted_fair_share``; one not yet past HELLO first), so
  one user's connections never refuse another user's process, and root's processes are
  refused only when root's own connections fill every slot. The listen backlog is the
  system's largest and each round accepts up to ``ACCEPT_PER_ROUND`` (the probe's thread
  goes on at once while more wait), so a connect flood does not keep a real library's
  non-blocking ``connect()`` failing with EAGAIN.

The pid of a process is taken from the kernel (``SO_PEERCRED``), not from the message:
it is the pid in the agent's namespace, and it cannot be forged by the peer. The pid the
library reports must be that process's pid in its own pid namespace (``NSpid`` in
``/proc/<pid>/status``); a peer claiming another process is cut and counted
(``rejected_peers``), as is a peer the kernel cannot name (in a pid namespace the agent
does not see). So a process reports only for itself.

Who may connect: the socket is mode 0666 (or 0660 with ``socket_group``) and its folder
is made searchable (``o+x``, never listable or writable) so that served processes
running as unprivileged service users reach it; see docs/cupti.md, "Access".
"""
from __future__ import annotations

import collections
import errno
import grp
import logging
import math
import os
import resource
import selectors
import socket
import stat
import struct
import time
from dataclasses import dataclass, field

import numpy as np

from ridgeline.probes.buffer_reuse import unshared
from ridgeline.probes.cupti import peer_process
from ridgeline.probes.cupti import protocol as P
from ridgeline.probes.probe import drain_fd

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/run/ridgeline/cupti.sock"
#: counters of refused or cut peers, present from the start (``stats``)
EXPORTED_REFUSALS = ("refused_connections", "refused_connections_uid", "rejected_peers")
#: counters of connections cut for their peer's identity or for idling (issue 18.3/18.4),
#: also present from the start
EXPORTED_CUTS = ("process_gone_cut", "pid_reused_cut", "identity_dropped_batches", "idle_peer_cut",
                 "evicted_fair_share")
#: Connections accepted in one round at most; more waiting makes the round end with
#: ``accept_backlogged`` set, and the probe's thread pumps again at once.
ACCEPT_PER_ROUND = 1024
_RECV_CHUNK = 1 << 20
#: Memory a queued message costs beyond its body (the parsed objects): counted against
#: ``max_queued_bytes`` so that a flood of tiny messages is bounded like large ones.
MESSAGE_OVERHEAD_BYTES = 1024
#: Frames read from one peer in one round: a peer sending tiny frames cannot hold the
#: round (300,000 HELLOs of 64 bytes held one round for 9.7 s).
MAX_FRAMES_PER_ROUND = 1024
#: Repeated HELLOs (the library sends one on every takeover change): a burst, then one a
#: second; beyond that the peer is cut (each HELLO costs a /proc read and a queued message).
HELLO_BURST = 16
HELLO_PER_S = 1.0
#: Connections take at most this share of the descriptor limit.
NOFILE_SHARE = 4
MAX_CONNECTIONS_CAP = 1024


def connection_limit(requested: int | None = None) -> int:
    """Connections allowed: ``requested`` (or 1024) but at most a quarter of the soft
    ``RLIMIT_NOFILE``, so that a flood of peers leaves descriptors for ``/metrics``,
    the publisher, eBPF and files (a default limit of 1024 gives 256)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = MAX_CONNECTIONS_CAP if soft == resource.RLIM_INFINITY else max(8, soft // NOFILE_SHARE)
    want = MAX_CONNECTIONS_CAP if requested is None else int(requested)
    return max(1, min(want, ceiling))


def peer_cred(s: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process that connected ``s``, from the kernel (``SO_PEERCRED``);
    (0, -1) when it gives none."""
    try:
        cred = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return 0, -1
    pid, uid, _gid = struct.unpack("3i", cred)
    return pid, uid


def namespace_pids(pid: int) -> list[int]:
    """The pids of ``pid`` in each nested pid namespace, outermost first (``NSpid``)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return [pid]


def escape(text: str, limit: int = 300) -> str:
    """Peer text made safe for one log line: control characters and non-ASCII escaped, cut
    at ``limit`` characters (a peer must not be able to write lines into the agent's log)."""
    out = text[:limit].encode("unicode_escape", "backslashreplace").decode("ascii")
    return out + ("..." if len(text) > limit else "")


#: What a waiting round sleeps past its next deadline, so that the deadlines of many
#: connections falling close together are met in one round, not one round each (the
#: timeouts' comparisons are strict: a round exactly at a deadline would act on nothing).
DEADLINE_SLACK_S = 0.01
#: Selector data of a descriptor that only wakes :meth:`CuptiServer.wait` (``add_waker``).
_WAKER = object()


#: A frame body's first buffer; it doubles up to the frame's length as the bytes come.
FIRST_BODY_BYTES = 1 << 20
#: A body buffer kept for the connection's next frame at most this large (the library's
#: frames carry its 4 MiB activity buffers; a larger frame's buffer is given back), and all
#: connections' kept buffers together at most SPARE_TOTAL_BYTES: outside the two bounds
#: below, a peer sending one large frame on each of its connections would make the agent
#: keep them all for the connections' lives.
MAX_SPARE_BYTES = 8 << 20
SPARE_TOTAL_BYTES = 32 << 20


def _reused(c: "_Conn") -> np.ndarray | None:
    """The connection's spare buffer for a body of ``c.need`` bytes, when it is large
    enough and nothing made from the last body it held is still alive (the parsed batch's
    sections are views of it until the decoder has copied them out): its reference count
    is then the attribute's and this local's (``probes.buffer_reuse``)."""
    sp = c.spare
    if sp is None or len(sp) < c.need or not unshared(sp):
        return None
    c.spare = None
    return sp if len(sp) == c.need else sp[:c.need]


def _kept_len(c: "_Conn") -> int:
    return len(c.spare) if c.spare is not None else 0


def _grown(body: np.ndarray | None, got: int, need: int) -> np.ndarray:
    """A buffer for a frame body of ``need`` bytes holding the ``got`` received so far:
    twice the old one (FIRST_BODY_BYTES at first), at most ``need``. Receiving in place
    copies nothing; growing copies under one byte per byte of a 4 MiB batch, where
    recv() then appending copied each byte twice, and allocated twice."""
    cap = min(need, max(FIRST_BODY_BYTES, 2 * (len(body) if body is not None else 0)))
    new = np.empty(cap, np.uint8)
    if got:
        new[:got] = body[:got]
    return new


@dataclass
class Message:
    """One validated message: ``kind`` is "hello", "batch" or "closed"."""
    kind: str
    conn_id: int
    pid: int
    body: object = None   # Hello | Batch | None
    nbytes: int = 0
    uid: int = -1         # the peer's uid (SO_PEERCRED), on "hello": the demangler's budget is per user


@dataclass
class _Conn:
    sock: socket.socket
    conn_id: int
    pid: int
    uid: int
    buf: bytearray = field(default_factory=bytearray)   # the frame header being read
    need: int = 0             # body length of the frame being read, 0 while reading a header
    # The body being read, received in place (recv_into): its buffer doubles as the bytes
    # come (``_grown``), so what a peer makes the agent hold follows what it sent (``got``),
    # not what its header announced.
    body: np.ndarray | None = None
    got: int = 0
    # The last body's buffer, reused for the next frame once nothing holds it (its pages
    # are warm: fresh ones cost a page fault each, more than the copy they replace).
    spare: np.ndarray | None = None
    msg_type: int = 0
    last_progress: float = 0.0
    opened: float = 0.0
    frame_started: float = 0.0   # when the first byte of the frame being read arrived
    hello: P.Hello | None = None
    rejected: int = 0
    hello_tokens: float = HELLO_BURST
    hello_t: float = 0.0
    accepted_ticks: int = 0      # boot clock at accept, in the ticks of /proc/<pid>/stat
    start_ticks: int | None = None   # the peer process's start time, bound at HELLO
    checked: float = 0.0         # when the start time was last checked
    held: list = field(default_factory=list)   # batches waiting for a check after their arrival
    held_bytes: int = 0


class CuptiServer:
    """Listens on ``path``; :meth:`pump` moves bytes from sockets into :meth:`drain`'s queue."""

    def __init__(self, path: str = DEFAULT_SOCKET, max_connections: int | None = None,
                 max_queued_bytes: int = 128 << 20, idle_timeout_s: float = 30.0, socket_mode: int | None = None,
                 max_partial_bytes: int = 128 << 20, socket_group: str | int | None = None,
                 hello_timeout_s: float = 10.0, max_connections_per_uid: int | None = None,
                 idle_peer_s: float = 300.0, identity_check_s: float = 0.25, identity_sweep_s: float = 5.0,
                 proc_start=peer_process.read_start_ticks, boot_ticks=peer_process.boot_ticks,
                 peer_cred=peer_cred):
        self.path = str(path)
        self.requested_connections = max_connections
        self.max_connections = connection_limit(max_connections)
        self.socket_group = socket_group
        self.max_connections_per_uid = (max(1, self.max_connections // 4) if max_connections_per_uid is None
                                        else int(max_connections_per_uid))
        self._per_uid: collections.Counter = collections.Counter()
        self.max_queued_bytes = max_queued_bytes
        # the default holds one frame of the largest size (MAX_BODY_BYTES) and then some
        self.max_partial_bytes = max_partial_bytes
        self.hello_timeout_s = hello_timeout_s
        self._partial_bytes = 0
        self._spare_bytes = 0           # the connections' kept body buffers (MAX_SPARE_BYTES each)
        self.idle_timeout_s = idle_timeout_s
        self.idle_peer_s = float(idle_peer_s)
        self.identity_check_s = float(identity_check_s)
        self.identity_sweep_s = float(identity_sweep_s)
        # the boundary to /proc and the boot clock: a parameter, so tests can fake pid reuse
        self._proc_start = proc_start
        self._boot_ticks = boot_ticks
        self._peer_cred = peer_cred
        self._held_bytes = 0
        self.accept_backlogged = False
        # with a group, only its members (and root) may connect; else every local user
        self.socket_mode = socket_mode if socket_mode is not None else (0o660 if socket_group is not None else 0o666)
        self._sel: selectors.BaseSelector | None = None
        self._listener: socket.socket | None = None
        self._conns: dict[int, _Conn] = {}
        self._next_id = 1
        self._queue: collections.deque[Message] = collections.deque()
        self._queued_bytes = 0
        # The refusals /metrics exports (ridgeline_agent_cupti_refused_connections_total)
        # exist at 0 from the start: an alert on their increase needs a sample before the
        # first refusal, or the series appears at 1 and that one event is never seen.
        self.stats = collections.Counter(dict.fromkeys(EXPORTED_REFUSALS + EXPORTED_CUTS, 0))

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> None:
        """Bind and listen. Replaces a stale socket file; refuses to replace anything else."""
        d = os.path.dirname(self.path)
        if d:
            os.makedirs(d, mode=0o755, exist_ok=True)
            self._open_folder(d)
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(st.st_mode):
                raise OSError(f"{self.path} exists and is not a socket; refusing to replace it")
            os.unlink(self.path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        s.bind(self.path)
        # served processes run as other users: they must be able to connect
        if self.socket_group is not None:
            gid = self.socket_group if isinstance(self.socket_group, int) else grp.getgrnam(self.socket_group).gr_gid
            os.chown(self.path, -1, gid)
        os.chmod(self.path, self.socket_mode)
        # the system's largest backlog (net.core.somaxconn): a connect flood fills a small
        # one between two rounds, and a real library's non-blocking connect then fails
        s.listen(socket.SOMAXCONN)
        self._listener = s
        self._sel = selectors.DefaultSelector()
        self._sel.register(s, selectors.EVENT_READ, None)

    @staticmethod
    def _open_folder(d: str) -> None:
        """Let other users reach the socket through its folder (search bit only: they can
        neither list nor create anything there). Only a folder this process owns is
        changed; a folder that stays closed is reported once."""
        try:
            st = os.stat(d)
        except OSError:
            return
        want = st.st_mode & 0o7777 | 0o011
        if want != st.st_mode & 0o7777 and st.st_uid == os.geteuid():
            try:
                os.chmod(d, want)
                return
            except OSError:
                pass
        if not st.st_mode & 0o001:
            log.warning("cupti: %s is not searchable by other users: served processes that run as another "
                        "user cannot connect (make it mode 0711 or 0751)", d)

    def close(self) -> None:
        """Close every connection and the listener; idempotent."""
        for c in list(self._conns.values()):
            self._drop(c, reason=None)
        if self._sel is not None:
            self._sel.close()
            self._sel = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            try:
                if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                    os.unlink(self.path)
            except OSError:
                pass

    @property
    def connections(self) -> int:
        return len(self._conns)

    def add_waker(self, fd: int) -> None:
        """Let a write to ``fd`` (a non-blocking pipe's read end) end :meth:`wait`: the
        probe's thread waits on the sockets and is woken for its stop or a drained queue."""
        if self._sel is not None:
            self._sel.register(fd, selectors.EVENT_READ, _WAKER)

    def queued(self) -> int:
        """Validated messages waiting for :meth:`drain`."""
        return len(self._queue)

    def next_deadline_s(self, now: float | None = None) -> float | None:
        """Seconds until the first timeout or identity check that :meth:`pump`'s sweep acts
        on (the same conditions, in the same order), plus ``DEADLINE_SLACK_S``; None while
        no connection has one (only data or a new peer can then make work)."""
        now = time.monotonic() if now is None else now
        t = math.inf
        for c in self._conns.values():
            if c.buf or c.need:
                t = min(t, c.frame_started + self.idle_timeout_s)
            if c.hello is None:
                t = min(t, c.opened + self.hello_timeout_s)
            else:
                t = min(t, c.last_progress + self.idle_peer_s,
                        c.checked + (self.identity_check_s if c.held else self.identity_sweep_s))
        return None if t == math.inf else max(0.0, t - now) + DEADLINE_SLACK_S

    def wait(self, timeout: float | None) -> bool:
        """Block until a socket is readable, a connection waits to be accepted, a waker was
        written, or ``timeout`` s passed; reads nothing from a peer (that is :meth:`pump`'s,
        under the caller's lock: waiting needs none, so set_mode() and reclaim() never wait
        for a peer). True when something was ready."""
        sel = self._sel
        if sel is None:
            return False
        try:
            ready = sel.select(timeout)
        except (OSError, ValueError):
            return False        # closed by a stop meanwhile
        for key, _ in ready:
            if key.data is _WAKER:
                drain_fd(key.fd)
        return bool(ready)

    # -- I/O -------------------------------------------------------------------------------
    def pump(self, timeout: float = 0.0, budget_bytes: int = 64 << 20) -> int:
        """One round of accept/read, waiting at most ``timeout`` s; returns bytes read.

        Reads at most ``budget_bytes`` in this round so one busy peer cannot monopolise
        the caller.
        """
        if self._sel is None:
            return 0
        total = 0
        for key, _ in self._sel.select(timeout):
            if key.data is None:
                self._accept()
                continue
            if key.data is _WAKER:
                continue        # wait() reads it
            c: _Conn = key.data
            try:
                total += self._read(c, budget_bytes - total)
            except P.ProtocolError as e:
                self.stats["protocol_errors"] += 1
                log.warning("cupti: pid %d: %s; connection closed", c.pid, escape(str(e)), extra={"peer": c.uid})
                self._drop(c, reason="protocol error")
            except Exception as e:  # noqa: BLE001  (never let a peer crash the agent, MemoryError included; counted, logged)
                self.stats["protocol_errors"] += 1
                log.warning("cupti: pid %d: unexpected %s: %s; connection closed", c.pid, type(e).__name__,
                            escape(str(e)))
                self._drop(c, reason="error")
            if total >= budget_bytes:
                break
        now = time.monotonic()
        for c in list(self._conns.values()):
            if (c.buf or c.need) and now - c.frame_started > self.idle_timeout_s:
                self.stats["idle_cut"] += 1
                self._drop(c, reason="frame not complete in time")
            elif c.hello is None and now - c.opened > self.hello_timeout_s:
                self.stats["hello_timeout_cut"] += 1
                self._drop(c, reason="no hello in time")
            elif c.hello is not None and now - c.last_progress > self.idle_peer_s:
                self.stats["idle_peer_cut"] += 1
                self._drop(c, reason="no data in time")
            elif c.hello is not None and ((c.held and now - c.checked >= self.identity_check_s)
                                          or now - c.checked >= self.identity_sweep_s):
                self._verify(c, now)
        return total

    def _accept(self, max_round: int = ACCEPT_PER_ROUND) -> None:
        """Accept what is pending (at most ``max_round`` per round, so a flood cannot starve
        reads; ``accept_backlogged`` tells the caller that more wait)."""
        for _ in range(max_round):
            if not self._accept_one():
                self.accept_backlogged = False
                return
        self.accept_backlogged = True

    def _accept_one(self) -> bool:
        try:
            s, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as e:
            self.stats["accept_errors"] += 1
            if self.stats["accept_errors"] == 1 or e.errno not in (errno.EMFILE, errno.ENFILE):
                log.warning("cupti: accept failed: %s", e)
            return False
        s.setblocking(False)
        pid, uid = self._peer_cred(s)
        if uid != 0 and self._per_uid[uid] >= self.max_connections_per_uid:
            self.stats["refused_connections_uid"] += 1
            if self.stats["refused_connections_uid"] == 1:
                log.warning("cupti: uid %d holds %d connections (the per-user limit): its further peers are "
                            "refused and counted", uid, self._per_uid[uid])
            s.close()
            return True
        if len(self._conns) >= self.max_connections:
            victim = self._fair_share_victim(uid)
            if victim is None:
                self.stats["refused_connections"] += 1
                if self.stats["refused_connections"] == 1:
                    log.warning("cupti: %d connections (the limit, below the descriptor limit): further peers "
                                "are refused and counted", self.max_connections)
                s.close()
                return True
            self.stats["evicted_fair_share"] += 1
            log.info("cupti: pid %d (uid %d) gives its connection to a process of uid %d (every slot taken; "
                     "uid %d holds the most)", victim.pid, victim.uid, uid, victim.uid, extra={"peer": victim.uid})
            self._drop(victim, reason="evicted for another user's process")
        self._per_uid[uid] += 1
        now = time.monotonic()
        c = _Conn(s, self._next_id, pid, uid, last_progress=now, opened=now, accepted_ticks=self._boot_ticks())
        self._next_id += 1
        self._conns[c.conn_id] = c
        self._sel.register(s, selectors.EVENT_READ, c)
        self.stats["connections"] += 1
        return True

    def _fair_share_victim(self, uid: int) -> _Conn | None:
        """The connection a newcomer of ``uid`` takes when every slot is taken, or None.

        The user holding the most connections gives one if that leaves it at least as many
        as the newcomer's user then holds (root's newcomers take from any other user), so
        repeated rounds level users out and never turn one over another. Its connection
        not yet past HELLO, else the one idle longest, goes."""
        others = [(n, u) for u, n in self._per_uid.items() if u != uid and (uid == 0 or u != 0)]
        if not others:
            return None
        n, top = max(others)
        if uid != 0 and n <= self._per_uid[uid] + 1:
            return None
        return min((c for c in self._conns.values() if c.uid == top),
                   key=lambda c: (c.hello is not None, c.last_progress), default=None)

    def _read(self, c: _Conn, budget: int) -> int:
        got = 0
        frames0 = self.stats["messages"]
        while got < budget and self.stats["messages"] - frames0 < MAX_FRAMES_PER_ROUND:
            try:
                if c.need:
                    if c.body is None and c.spare is not None:
                        kept = len(c.spare)
                        c.body = _reused(c)
                        self._spare_bytes -= kept - _kept_len(c)
                    if c.body is None or c.got == len(c.body):
                        c.body = _grown(c.body, c.got, c.need)
                    n = c.sock.recv_into(memoryview(c.body)[c.got:c.got + min(len(c.body) - c.got, _RECV_CHUNK)])
                else:
                    chunk = c.sock.recv(P.FRAME_DTYPE.itemsize - len(c.buf))
                    n = len(chunk)
            except (BlockingIOError, InterruptedError):
                return got
            except OSError:
                self._drop(c, reason="reset")
                return got
            if not n:
                if c.buf or c.need:
                    self.stats["truncated_at_close"] += 1
                self._drop(c, reason="closed")
                return got
            got += n
            if not c.buf and not c.need:
                c.frame_started = time.monotonic()
            if c.need:
                c.got += n
            else:
                c.buf += chunk
            self._partial_bytes += n
            c.last_progress = time.monotonic()
            while self._partial_bytes > self.max_partial_bytes:
                # cut whoever holds the most: a peer parking a large frame, not the next sender
                victim = max(self._conns.values(), key=lambda x: (len(x.buf) + x.got, -x.frame_started))
                self.stats["partial_cap_cut"] += 1
                self._drop(victim, reason="too much half-received data")
                if victim is c:
                    return got
            if not c.need:
                if len(c.buf) < P.FRAME_DTYPE.itemsize:
                    continue
                c.msg_type, n = P.parse_frame_header(bytes(c.buf))
                self._partial_bytes -= len(c.buf)
                c.buf = bytearray()
                c.need = n
                if n == 0:
                    self._frame_done(c, b"")
                    if c.conn_id not in self._conns:     # cut for its identity
                        return got
                continue
            if c.got >= c.need:
                body, c.body, c.need, c.got = c.body[:c.need], None, 0, 0
                self._keep_spare(c, body.base if body.base is not None else body)
                self._partial_bytes -= len(body)
                self._frame_done(c, body)
                if c.conn_id not in self._conns:
                    return got
        return got

    def _keep_spare(self, c: _Conn, buf: np.ndarray) -> None:
        """Keep ``buf`` for the connection's next frame body, within MAX_SPARE_BYTES and the
        connections' SPARE_TOTAL_BYTES (in place of the one it keeps, if any)."""
        self._spare_bytes -= _kept_len(c)
        c.spare = None
        if len(buf) <= MAX_SPARE_BYTES and self._spare_bytes + len(buf) <= SPARE_TOTAL_BYTES:
            c.spare = buf
            self._spare_bytes += len(buf)

    def _frame_done(self, c: _Conn, body) -> None:
        self.stats["messages"] += 1
        if c.msg_type == P.MSG_HELLO:
            # a library sends HELLO again when its flags or status change (a takeover
            # detected or over): the newest is the state; the pid may not change
            if c.hello is not None:
                now = time.monotonic()
                c.hello_tokens = min(HELLO_BURST, c.hello_tokens + (now - c.hello_t) * HELLO_PER_S)
                c.hello_t = now
                if c.hello_tokens < 1:
                    self.stats["hello_flood_cut"] += 1
                    raise P.ProtocolError(f"more than {HELLO_BURST} repeated HELLOs at over {HELLO_PER_S:g}/s")
                c.hello_tokens -= 1
            hello = P.parse_hello(body)
            self._check_identity(c, hello.pid)
            # bind the connection to the process's start time (first HELLO), or check it
            # (a repeated one; what waits is handed on first, so the order stays)
            if not self._verify(c, time.monotonic()):
                return
            if c.hello is None:
                c.hello_t = time.monotonic()
            c.hello = hello
            n = len(body) + MESSAGE_OVERHEAD_BYTES
            self._queued_bytes += n         # counted, never dropped: a library's identity and state
            self._queue.append(Message("hello", c.conn_id, c.pid, hello, n, c.uid))
        elif c.msg_type == P.MSG_BATCH:
            if c.hello is None:
                raise P.ProtocolError("batch before hello")
            n = len(body) + MESSAGE_OVERHEAD_BYTES
            if self._queued_bytes + self._held_bytes + n > self.max_queued_bytes:
                self.stats["dropped_batches_queue_full"] += 1
                return
            try:
                batch = P.parse_batch(body)
                if int(batch.header["pid"]) != c.hello.pid:
                    raise P.ProtocolError(f"batch for pid {int(batch.header['pid'])} on the connection of "
                                          f"pid {c.hello.pid}")
            except P.ProtocolError as e:
                # the frame was complete, so the next one starts right after it: only
                # this message is lost
                self.stats["rejected_batches"] += 1
                c.rejected += 1
                if c.rejected == 1:
                    log.warning("cupti: pid %d: batch rejected (later ones counted only): %s", c.pid,
                                escape(str(e)))
                return
            # held until a check of the peer's start time made after its arrival
            c.held.append(Message("batch", c.conn_id, c.pid, batch, n))
            c.held_bytes += n
            self._held_bytes += n
            now = time.monotonic()
            if now - c.checked >= self.identity_check_s:
                self._verify(c, now)
        else:
            raise P.ProtocolError("control messages only flow from the agent to the library")

    def _check_identity(self, c: _Conn, claimed: int) -> None:
        """The kernel names the peer; its claimed pid must be that process (in its own
        pid namespace), else the peer is reporting for someone else."""
        if c.pid <= 0:
            self.stats["rejected_peers"] += 1
            raise P.ProtocolError("the kernel gives no pid for this peer (a pid namespace the agent does "
                                  "not see); refused")
        if claimed not in namespace_pids(c.pid):
            self.stats["rejected_peers"] += 1
            raise P.ProtocolError(f"peer pid {c.pid} claims to be pid {claimed}; refused")

    def _verify(self, c: _Conn, now: float) -> bool:
        """Check that the process behind ``c`` is the one that connected (binding its start
        time the first time); hand on its held batches, or cut it. True: still connected."""
        c.checked = now
        t = self._proc_start(c.pid)
        verdict = peer_process.judge(c.start_ticks, t, c.accepted_ticks)
        if verdict == peer_process.ALIVE:
            c.start_ticks = t
            self._release_held(c)
            return True
        if verdict == peer_process.REUSED:
            self.stats["identity_dropped_batches"] += len(c.held)
            self._held_bytes -= c.held_bytes
            c.held, c.held_bytes = [], 0
            self.stats["pid_reused_cut"] += 1
            log.warning("cupti: pid %d (uid %d) is another process than the one that connected (start time "
                        "%s, now %s): the connection is cut and its unchecked batches dropped", c.pid, c.uid,
                        c.start_ticks, t, extra={"peer": c.uid})
            self._drop(c, reason="pid reused")
        else:
            # gone: what it sent before is its own (no one else holds the pid yet)
            self._release_held(c)
            self.stats["process_gone_cut"] += 1
            self._drop(c, reason="process gone")
        return False

    def _release_held(self, c: _Conn) -> None:
        for m in c.held:
            self._queue.append(m)
        self._queued_bytes += c.held_bytes
        self._held_bytes -= c.held_bytes
        c.held, c.held_bytes = [], 0

    def _drop(self, c: _Conn, reason: str | None) -> None:
        if c.conn_id not in self._conns:
            return
        if c.held:
            # batches not checked yet (a close, an eviction): one last check decides
            self._verify(c, time.monotonic())
            if c.conn_id not in self._conns:
                return
        self._conns.pop(c.conn_id)
        self._partial_bytes -= len(c.buf) + c.got
        self._spare_bytes -= _kept_len(c)
        c.buf, c.body, c.got, c.spare = bytearray(), None, 0, None
        self._per_uid[c.uid] -= 1
        if self._per_uid[c.uid] <= 0:
            del self._per_uid[c.uid]
        try:
            if self._sel is not None:
                self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()
        if reason is not None:
            self._queue.append(Message("closed", c.conn_id, c.pid, reason))

    # -- consumers ---------------------------------------------------------------------
    def drain(self, max_messages: int | None = None) -> list[Message]:
        """Messages validated since the last call (oldest first)."""
        out = []
        while self._queue and (max_messages is None or len(out) < max_messages):
            m = self._queue.popleft()
            self._queued_bytes -= m.nbytes
            out.append(m)
        if not self._queue:
            self._queued_bytes = 0
        return out

    def send_control(self, mode: int, kernel_sample_every: int = 0, pid: int | None = None, flags: int = 0) -> int:
        """Switch the mode of every connected library (or of one pid); returns how many got it.

        Non-blocking: a library whose socket buffer is full misses this one message
        (counted) and keeps its mode; the caller may resend.
        """
        frame = P.encode_control(mode, kernel_sample_every, flags)
        n = 0
        for c in list(self._conns.values()):
            if pid is not None and c.pid != pid:
                continue
            try:
                if c.sock.send(frame) == len(frame):
                    n += 1
                else:
                    self.stats["control_partial"] += 1
                    self._drop(c, reason="control partial write")
            except (BlockingIOError, InterruptedError):
                self.stats["control_dropped"] += 1
            except OSError:
                self._drop(c, reason="reset")
        return n
