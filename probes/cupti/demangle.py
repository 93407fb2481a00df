"""C++ kernel names as people read them: CUPTI reports mangled names (``_ZN5flash...``).

torch.profiler (Kineto), Nsight and the signature tables show demangled names, so the
decoder demangles each name once, when it is first interned, with the C++ runtime's own
demangler (``__cxa_demangle`` from libstdc++, which every CUDA process already loads;
the same routine Kineto calls, so names match torch.profiler's byte for byte on a host).
The mangled name stays available next to it (``Trace.meta["mangled_names"]``).

A name that is not mangled (``extern "C"`` kernels such as Triton's, cuBLAS ``sm90_xmma``
names) or that the demangler rejects (a name cut at the library's length limit) is kept
as it came.

Why a separate process: names come from any local process that can reach the socket,
and the demangler is not safe on hostile input. Its output grows exponentially with
nested back-references (a 201-byte name demangles to 109 MB in 0.8 s, 250 bytes to
several GB), and deeply nested names have crashed it (stack overflows, the CVE class of
``d_print_comp``). So ``__cxa_demangle`` runs in a small worker process (the agent's own
interpreter, no imports beyond the standard library) with an address-space limit (128 MiB), an
answer limit of :data:`MAX_DEMANGLED_BYTES` per name and a deadline per call: a name that
takes too long, or crashes the worker, costs that call its deadline and a worker restart,
never the agent's memory or life. The names not demangled are reported to the caller,
which keeps them mangled and counts them.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import selectors
import signal
import struct
import subprocess
import sys
import threading
import time
from functools import lru_cache

#: Longest demangled name accepted (the longest real kernel names demangle to a few KiB;
#: the library cuts mangled names at 4096 bytes).
MAX_DEMANGLED_BYTES = 64 << 10
#: Address space of the worker process: the interpreter takes 15 MB, a real name a few KiB.
#: Small, because the worker shares the agent's memory budget (the unit's MemoryMax).
WORKER_ADDRESS_SPACE_BYTES = 128 << 20
#: Deadline of one call: a fixed part plus a part per name (real names take microseconds).
#: 0.5 s, not less: on a loaded 2-core host the worker may not be scheduled for a few hundred
#: milliseconds, and a real name that misses its deadline stays mangled; a hostile process
#: costs at most two deadlines before its names are no longer demangled.
DEADLINE_BASE_S = 0.5
#: How long a new worker may take to start (a loaded host at boot); not part of any deadline.
WORKER_START_S = 5.0
DEADLINE_PER_NAME_S = 1e-4

_OK, _FAILED, _TOO_LONG, _NO_DEMANGLER = 0, 1, 2, 3

# Before it reads a name, the worker gives up what it does not need to demangle (issue
# 18.2: it parsed hostile names as root with the unit's capabilities): as root it drops
# the capability bounding set and becomes the user nobody; then it clears the ambient
# capabilities, sets every capability set to empty (capset), sets no_new_privs and loads
# a seccomp filter that allows only what its loop calls (read, write, memory, exit,
# signal return) and kills the process on any other system call (SECCOMP_RET_KILL_PROCESS:
# the parent sees SIGSYS and counts it, :attr:`_Worker.seccomp_kills`). Unknown
# architecture or a failed step: the worker exits before reading names (names stay mangled).
_LOCKDOWN_CODE = r"""
import ctypes, os, platform, pwd, struct
_libc = ctypes.CDLL(None, use_errno=True)
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.syscall.restype = ctypes.c_long
# (audit arch, {name: number}) from the kernel's unistd tables (arch/x86/entry/syscalls/
# syscall_64.tbl, include/uapi/asm-generic/unistd.h for arm64)
_ARCH = {"x86_64": (0xC000003E, dict(read=0, write=1, close=3, mmap=9, munmap=11, brk=12, rt_sigaction=13,
                                     rt_sigprocmask=14, rt_sigreturn=15, mremap=25, madvise=28, exit=60,
                                     sigaltstack=131, futex=202, exit_group=231, getrandom=318, capset=126)),
         "aarch64": (0xC00000B7, dict(read=63, write=64, close=57, mmap=222, munmap=215, brk=214,
                                      rt_sigaction=134, rt_sigprocmask=135, rt_sigreturn=139, mremap=216,
                                      madvise=233, exit=93, sigaltstack=132, futex=98, exit_group=94,
                                      getrandom=278, capset=91))}
ALLOWED = ("read", "write", "close", "mmap", "munmap", "brk", "mremap", "madvise", "rt_sigaction",
           "rt_sigprocmask", "rt_sigreturn", "sigaltstack", "futex", "getrandom", "exit", "exit_group")
def _prctl(*a):
    a = a + (0,) * (5 - len(a))
    if _libc.prctl(*a) != 0:
        raise OSError(ctypes.get_errno(), "prctl %d" % a[0])
def lockdown():
    arch, nr = _ARCH[platform.machine()]
    if os.geteuid() == 0:
        for cap in range(64):                 # the bounding set: no exec can regain a capability
            if _libc.prctl(24, cap, 0, 0, 0) != 0 and cap < 41:    # PR_CAPBSET_DROP; EINVAL past the last
                raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP")
        u = pwd.getpwnam("nobody")
        os.setgroups([])
        os.setgid(u.pw_gid)
        os.setuid(u.pw_uid)                   # from root without keepcaps: permitted and effective cleared
    _prctl(47, 4)                             # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    head = struct.pack("<Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = bytes(24)                          # two (effective, permitted, inheritable) u32 triples
    hb, db = ctypes.create_string_buffer(head), ctypes.create_string_buffer(data)
    if _libc.syscall(nr["capset"], hb, db) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    _prctl(38, 1)                             # PR_SET_NO_NEW_PRIVS
    ld_w_abs, jeq_k, ret_k = 0x20, 0x15, 0x06
    kill, allow = 0x80000000, 0x7FFF0000      # SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ALLOW
    prog = [(ld_w_abs, 0, 0, 4), (jeq_k, 1, 0, arch), (ret_k, 0, 0, kill), (ld_w_abs, 0, 0, 0)]
    for name in ALLOWED:
        prog += [(jeq_k, 0, 1, nr[name]), (ret_k, 0, 0, allow)]
    prog.append((ret_k, 0, 0, kill))
    filt = ctypes.create_string_buffer(b"".join(struct.pack("<HBBI", *i) for i in prog))
    fprog = ctypes.create_string_buffer(struct.pack("<HxxxxxxQ", len(prog), ctypes.addressof(filt)))
    _prctl(22, 2, ctypes.addressof(fprog))    # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
"""

# The worker: reads (u32 length, bytes) requests, answers (u8 status, u32 length, bytes).
_WORKER_CODE = _LOCKDOWN_CODE + r"""
import ctypes, resource, struct, sys
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_AS, (%(as_bytes)d, %(as_bytes)d))
try:
    with open("/proc/self/oom_score_adj", "w") as f:   # if memory runs out, this process goes first
        f.write("1000")
except OSError:
    pass
fn = free = None
for name in ("libstdc++.so.6", "libstdc++.so"):
    try:
        fn = ctypes.CDLL(name).__cxa_demangle
        break
    except (OSError, AttributeError):
        pass
if fn is not None:
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    fn.restype = ctypes.c_void_p
    free = ctypes.CDLL(None).free
    free.argtypes = [ctypes.c_void_p]
    free.restype = None
rd, wr = sys.stdin.buffer, sys.stdout.buffer
try:
    lockdown()
except (OSError, KeyError) as exc:      # no user nobody, an architecture without a table, a refused step
    sys.exit(3)
wr.write(b"R")          # ready: the caller's deadlines start now, not during interpreter start-up
wr.flush()
def readn(n):
    b = rd.read(n)
    if b is None or len(b) != n:
        sys.exit(0)
    return b
while True:
    (n,) = struct.unpack("<I", readn(4))
    name = readn(n)
    out, st = b"", %(no_demangler)d
    if fn is not None:
        status = ctypes.c_int(-1)
        p = fn(name, None, None, ctypes.byref(status))
        st = %(failed)d
        if p:
            try:
                if status.value == 0:
                    out, st = ctypes.string_at(p), %(ok)d
            finally:
                free(p)
        if len(out) > %(max_out)d:
            out, st = b"", %(too_long)d
    wr.write(struct.pack("<BI", st, len(out)) + out)
    wr.flush()
""" % {"as_bytes": WORKER_ADDRESS_SPACE_BYTES, "max_out": MAX_DEMANGLED_BYTES, "ok": _OK, "failed": _FAILED,
       "too_long": _TOO_LONG, "no_demangler": _NO_DEMANGLER}


@lru_cache(maxsize=1)
def available() -> bool:
    """True when the C++ runtime's demangler exists here (loaded, never called, in this process)."""
    for name in ("libstdc++.so.6", ctypes.util.find_library("stdc++")):
        if not name:
            continue
        try:
            ctypes.CDLL(name).__cxa_demangle  # noqa: B018  (the lookup is the test: AttributeError when absent)
            return True
        except (OSError, AttributeError):
            continue
    return False


class _Worker:
    """One worker process, started on first use and again after it was killed."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.starts = 0
        self.seccomp_kills = 0    # workers killed by the seccomp filter (a forbidden system call)

    def _start(self) -> subprocess.Popen | None:
        try:
            self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WORKER_CODE], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        except OSError:
            self.proc = None
            return None
        self.starts += 1
        os.set_blocking(self.proc.stdin.fileno(), False)
        os.set_blocking(self.proc.stdout.fileno(), False)
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout.fileno(), selectors.EVENT_READ)
            ready = b""
            if sel.select(WORKER_START_S):
                try:
                    ready = os.read(self.proc.stdout.fileno(), 1)
                except OSError:
                    pass
        if ready != b"R":
            self.kill()
            return None
        return self.proc

    def kill(self) -> None:
        p, self.proc = self.proc, None
        if p is None:
            return
        try:
            p.kill()
        except OSError:
            pass
        for f in (p.stdin, p.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            code = p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return
        if code == -signal.SIGSYS:
            self.seccomp_kills += 1

    def run(self, names: list[bytes], timeout_s: float) -> list[tuple[int, bytes] | None]:
        """Answers for ``names`` in order; None for those not answered by the deadline (the
        worker is then killed: it is stuck on the first of them, or dead)."""
        answers: list[tuple[int, bytes] | None] = [None] * len(names)
        if self.proc is not None and self.proc.poll() is not None:
            self.kill()           # died since the last call: reaped, a seccomp kill counted
        p = self.proc if self.proc is not None else self._start()
        if p is None:
            return answers
        payload = memoryview(b"".join(struct.pack("<I", len(b)) + b for b in names))
        wfd, rfd = p.stdin.fileno(), p.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        sent, got, buf = 0, 0, bytearray()
        with selectors.DefaultSelector() as sel:
            sel.register(rfd, selectors.EVENT_READ)
            if payload:
                sel.register(wfd, selectors.EVENT_WRITE)
            while got < len(names):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                dead = False
                for key, _ in sel.select(left):
                    try:
                        if key.fd == wfd:
                            sent += os.write(wfd, payload[sent:sent + (1 << 16)])
                            if sent == len(payload):
                                sel.unregister(wfd)
                            continue
                        chunk = os.read(rfd, 1 << 20)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        dead = True
                        break
                    if not chunk:
                        dead = True
                        break
                    buf += chunk
                    while len(buf) >= 5:
                        st, n = struct.unpack_from("<BI", buf)
                        if n > MAX_DEMANGLED_BYTES:      # the worker is ours; anything else is a broken one
                            dead = True
                            break
                        if len(buf) < 5 + n:
                            break
                        answers[got] = (st, bytes(buf[5:5 + n]))
                        del buf[:5 + n]
                        got += 1
                if dead:
                    break
        if got < len(names):
            self.kill()
        return answers


_worker = _Worker()


def seccomp_kills() -> int:
    """Demangler workers the seccomp filter killed so far (SIGSYS: the worker made a call
    outside its allow list, which a parsed name should never cause), as counted when the
    dead worker is reaped; published on /metrics."""
    return _worker.seccomp_kills


def demangle_many(names: list[str], timeout_s: float | None = None) -> tuple[list[str], dict[str, int]]:
    """Demangled forms of ``names`` (each name itself where it is not mangled or the
    demangler rejects it), and how many mangled names could not be demangled safely, by
    reason: ``too_long`` (over :data:`MAX_DEMANGLED_BYTES`) and ``deadline`` (the worker
    ran past the deadline on it, or died on it).

    The worker is stuck on (or died of) the first name left unanswered: that name fails,
    and the names after it get one more call with a fresh worker. So a call costs at most
    two deadlines of ``timeout_s`` each (default :data:`DEADLINE_BASE_S` plus
    :data:`DEADLINE_PER_NAME_S` per name) whatever the names.
    """
    out = list(names)
    failed = {"too_long": 0, "deadline": 0}
    todo: list[int] = []
    raw: list[bytes] = []
    for i, s in enumerate(names):
        if not s.startswith("_Z"):
            continue
        try:
            b = s.encode("utf-8", "surrogateescape")
        except UnicodeError:
            continue
        if b"\0" in b:
            continue
        todo.append(i)
        raw.append(b)
    for attempt in range(2):
        if not todo:
            break
        t = timeout_s if timeout_s is not None else DEADLINE_BASE_S + DEADLINE_PER_NAME_S * len(raw)
        with _worker.lock:
            answers = _worker.run(raw, t)
        left = None
        for k, (i, a) in enumerate(zip(todo, answers)):
            if a is None:
                left = k
                break
            if a[0] == _OK:
                out[i] = a[1].decode("utf-8", "replace")
            elif a[0] == _TOO_LONG:
                failed["too_long"] += 1
        if left is None:
            break
        failed["deadline"] += 1                   # the name the worker was stuck on
        todo, raw = todo[left + 1:], raw[left + 1:]
        if attempt == 1:
            failed["deadline"] += len(todo)       # not tried again: the call's time is spent
    return out, failed


def demangle(name: str) -> str:
    """The demangled form of an Itanium-mangled ``name`` (``_Z...``), else ``name`` itself."""
    return demangle_many([name])[0][0]
