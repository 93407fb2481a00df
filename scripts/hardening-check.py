#!/usr/bin/env python3
"""Issue 14, case by case, as the issue tried it: what the agent and `analyze` do now.

Every case runs the real CLI (`python -m ridgeline ...`) as a child in its own memory
cgroup (cgroup v2 ``memory.max``, or v1 ``memory.limit_in_bytes`` on a hybrid host) set to
``--memory-max`` (384M stands in for the unit's MemoryHigh, 512M is its MemoryMax; both
by default), and the attacks run as the user ``nobody``. For each case it prints the exit
code, the child's peak RSS (``ru_maxrss`` of the process tree), the cgroup's peak charge
(RSS plus page cache), OOM kills, wall time and what happened, then a verdict: ``ok`` or
``DEFECT`` (a traceback, an exit code outside 0/1/2, an OOM kill, a hang, a forged log
line, windows lost without a counted gap). A table for docs/hardening.md, not a test:
the tests named in that document assert each bound without timing.

    sudo .venv/bin/python scripts/hardening-check.py [--memory-max 384M,512M] [--only WORD]
        [--long-recording]      # add the 30-minute recording (written by tests/support/recording_synth.py)

Needs root (cgroups, setuid nobody). Takes about 10 minutes per memory bound on 2 cores.
"""
from __future__ import annotations

import argparse
import gzip
import http.server
import json
import os
import pwd
import re
import signal
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
NOBODY = pwd.getpwnam("nobody").pw_uid
ROWS: list[dict] = []
CHILDREN: list = []        # every process group started, ended at exit whatever happened
CGROUPS: list = []         # and every cgroup made, removed then


# ------------------------------------------------------------------------------ cgroups

class Cgroup:
    """A fresh memory cgroup (and optionally a pids one) for one case."""

    def __init__(self, name: str, memory_max: int, pids_max: int | None = None):
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        self.v2 = v2.exists() and "memory" in v2.read_text().split()
        base = Path("/sys/fs/cgroup") if self.v2 else Path("/sys/fs/cgroup/memory")
        self.mem = base / f"rl-hardening-{name}-{os.getpid()}"
        self.mem.mkdir()
        CGROUPS.append(self)
        if self.v2:
            (self.mem / "memory.max").write_text(str(memory_max))
            (self.mem / "memory.swap.max").write_text("0")
        else:
            (self.mem / "memory.limit_in_bytes").write_text(str(memory_max))
            try:
                (self.mem / "memory.memsw.limit_in_bytes").write_text(str(memory_max))
            except OSError:
                pass
        self.pids = None
        if pids_max is not None:
            self.pids = self.mem if self.v2 else Path("/sys/fs/cgroup/pids") / self.mem.name
            self.pids.mkdir(exist_ok=True)
            (self.pids / "pids.max").write_text(str(pids_max))

    def enter(self) -> None:
        """In the child before exec."""
        (self.mem / "cgroup.procs").write_text(str(os.getpid()))
        if self.pids is not None and self.pids != self.mem:
            (self.pids / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int:
        f = self.mem / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")
        return int(f.read_text()) if f.exists() else 0

    def oom_kills(self) -> int:
        f = self.mem / ("memory.events" if self.v2 else "memory.oom_control")
        m = re.search(r"oom_kill (\d+)", f.read_text())
        return int(m.group(1)) if m else 0

    def close(self) -> None:
        if self in CGROUPS:
            CGROUPS.remove(self)
        for d in {self.mem, self.pids} - {None}:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


def as_nobody() -> None:
    import resource
    resource.setrlimit(resource.RLIMIT_NOFILE, (4096, max(4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1])))
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


# The command is forked from this small launcher, not from the checker: a child's
# ru_maxrss starts at the RSS of the process it was forked from (Linux keeps the
# high-water mark across exec), and the checker holds numpy and zmq.
LAUNCHER = r"""
import os, signal, subprocess, sys
p = subprocess.Popen(sys.argv[2:])
for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
    signal.signal(s, lambda n, f: p.send_signal(n))
while True:
    try:
        _, status, ru = os.wait4(p.pid, 0)
        break
    except InterruptedError:
        continue
open(sys.argv[1], "w").write(str(ru.ru_maxrss * 1024))
code = os.waitstatus_to_exitcode(status)
sys.exit(128 - code if code < 0 else code)
"""


class Child:
    """A command in a cgroup; ``finish()`` gives exit code, ru_maxrss, wall time, stderr."""

    def __init__(self, argv, cg: Cgroup, nofile: int | None = None, nobody: bool = False, stdout=None,
                 env: dict | None = None):
        self.cg, self.t0 = cg, time.monotonic()
        self.err = tempfile.TemporaryFile()

        def pre():
            import resource
            os.setsid()
            cg.enter()
            if nofile:
                hard = max(nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))
            if nobody:
                as_nobody()
        fd, self.rss_file = tempfile.mkstemp(suffix=".rss")
        os.close(fd)
        os.chmod(self.rss_file, 0o666)
        self.p = subprocess.Popen(["/usr/bin/python3", "-c", LAUNCHER, self.rss_file, *argv], preexec_fn=pre,
                                  stdout=stdout or subprocess.DEVNULL, stderr=self.err,
                                  cwd=tempfile.gettempdir(),     # the installed ridgeline, not the stub at ROOT
                                  env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        CHILDREN.append(self.p)

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read().decode(errors="replace")

    def finish(self, timeout: float, sig=None) -> dict:
        if sig is not None and self.p.poll() is None:
            self.p.send_signal(sig)
        end, status, ru = time.monotonic() + timeout, None, None
        while time.monotonic() < end:
            pid, status, ru = os.wait4(self.p.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(0.05)
        hung = not status and ru is not None and not pid
        if hung:
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, status, ru = os.wait4(self.p.pid, 0)
        self.p.returncode = os.waitstatus_to_exitcode(status)
        err = self.stderr()
        try:
            rss = int(Path(self.rss_file).read_text() or 0)
        except (OSError, ValueError):
            rss = 0
        os.unlink(self.rss_file)
        return {"exit": "hang" if hung else self.p.returncode, "rss": rss,
                "cg": self.cg.peak_bytes(), "oom": self.cg.oom_kills(), "time": time.monotonic() - self.t0,
                "stderr": err, "tracebacks": err.count("Traceback (most recent call last)")}


def row(item: str, case: str, r: dict, what: str, ok: bool, bound: int) -> None:
    bad = [] if ok else ["behaviour"]
    if r.get("tracebacks"):
        bad.append(f"{r['tracebacks']} tracebacks")
    if r["exit"] not in (0, 1, 2):
        bad.append(f"exit {r['exit']}")
    if r.get("oom"):
        bad.append("OOM kill")
    if r["rss"] > bound:
        bad.append("RSS over the bound")
    d = {"item": item, "case": case, "exit": r["exit"], "rss_mib": r["rss"] / 2**20, "cg_mib": r["cg"] / 2**20,
         "time_s": r["time"], "what": what, "verdict": "ok" if not bad else "DEFECT: " + ", ".join(bad)}
    ROWS.append(d)
    print(f"| {item} | {case} | {d['exit']} | {d['rss_mib']:.0f} | {d['cg_mib']:.0f} | {d['time_s']:.1f} | "
          f"{what} | {d['verdict']} |", flush=True)


# ------------------------------------------------------------------------------ the agent

class Agent:
    """`ridgeline agent` with its sockets in a private folder, in a cgroup."""

    def __init__(self, tmp: Path, cg: Cgroup, extra: str = "", probes=("cupti",), nofile: int = 8192,
                 engine_url: str = "http://127.0.0.1:1/metrics", port: int = 0, env: dict | None = None):
        self.dir = tmp / f"run{time.monotonic_ns()}"
        self.dir.mkdir(mode=0o750)
        os.chmod(self.dir, 0o751)
        self.port = port or free_port()
        self.endpoint = f"ipc://{self.dir}/stream.sock"
        self.cupti = f"{self.dir}/cupti.sock"
        self.conf = self.dir / "agent.toml"
        self.base = {"agent": {"window_s": "1.0"}, "publisher": {"endpoint": f'"{self.endpoint}"'},
                     "prometheus": {"listen": f'"127.0.0.1:{self.port}"'},
                     "probes": {"enabled": json.dumps(list(probes))},
                     "probes.engine": {"url": f'"{engine_url}"'}, "probes.cupti": {"socket": f'"{self.cupti}"'}}
        self.write(extra)
        self.child = Child([PY, "-m", "ridgeline", "agent", "--config", str(self.conf)], cg, nofile=nofile, env=env)
        end = time.monotonic() + 30
        while time.monotonic() < end and not (os.path.exists(f"{self.dir}/stream.sock") and self.metrics_ok()):
            time.sleep(0.2)

    def write(self, extra: str) -> None:
        """The base configuration with ``extra`` ("[section]\nkey = value" lines) laid over it."""
        conf = {k: dict(v) for k, v in self.base.items()}
        sect = None
        for line in extra.splitlines():
            if line.startswith("["):
                sect = line.strip("[] ")
            elif "=" in line:
                k, v = line.split("=", 1)
                conf.setdefault(sect, {})[k.strip()] = v.strip()
        self.conf.write_text("".join(f"[{s}]\n" + "".join(f"{k} = {v}\n" for k, v in kv.items())
                                     for s, kv in conf.items()))

    def metrics(self, timeout=5.0) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=timeout).read().decode()

    def metrics_ok(self, timeout=2.0) -> bool:
        try:
            return "ridgeline" in self.metrics(timeout)
        except OSError:
            return False

    def counter(self, name: str) -> float:
        try:
            text = self.metrics()
        except OSError:
            return float("nan")
        return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    def stop(self, timeout: float = 20) -> dict:
        return self.child.finish(timeout, signal.SIGTERM)


class Windows:
    """`ridgeline tail --topic window`: when each window arrived and whether gaps were counted."""

    def __init__(self, endpoint: str, topic: str = "window"):
        self.p = subprocess.Popen([PY, "-m", "ridgeline", "tail", "--endpoint", endpoint, "--topic", topic, "--json"],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=str(ROOT))
        CHILDREN.append(self.p)
        self.arrivals: list[tuple[float, int, int]] = []
        self.payloads: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            try:
                m = json.loads(line)
            except ValueError:
                continue
            self.arrivals.append((time.monotonic(), m.get("seq", -1), m.get("gap", 0)))
            self.payloads.append(m.get("payload") or {})

    def stop(self) -> dict:
        self.p.kill()
        self.p.wait()
        a = self.arrivals
        worst = max((b[0] - x[0] for x, b in zip(a, a[1:])), default=float("inf"))
        return {"n": len(a), "worst_s": worst, "gaps": sum(x[2] for x in a),
                "seq_holes": sum(1 for x, b in zip(a, a[1:]) if b[1] != x[1] + 1 and b[2] == 0)}


def cupti_health(h: Windows) -> dict:
    """The CUPTI probe's counters in the newest health record."""
    for p in reversed(h.payloads):
        cu = (p.get("probes") or {}).get("cupti")
        if cu:
            return cu
    return {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ hostile engine

class HostileEngine(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, mode: str):
        self.mode = mode
        self.body = b"# TYPE vllm:x gauge\n" + b"vllm:num_requests_running 1\n" * (50_000_000 // 28)
        self.gz = gzip.compress(self.body, compresslevel=9) if mode == "gzip" else b""
        if mode == "bomb":                  # 1 GiB of text in about 1 MB of gzip
            z = zlib.compressobj(9, zlib.DEFLATED, 31)
            block = b"vllm:num_requests_running 1\n" * (8 << 20 >> 5)
            self.gz = b"".join(z.compress(block) for _ in range(128)) + z.flush()

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(h):
                try:
                    if mode == "trickle":
                        h.send_response(200)
                        h.send_header("Content-Length", "100000")
                        h.end_headers()
                        for _ in range(100000):
                            h.wfile.write(b"#")
                            h.wfile.flush()
                            time.sleep(1.5)
                        return
                    data = self.gz if mode in ("gzip", "bomb") else self.body
                    h.send_response(200)
                    if mode in ("gzip", "bomb"):
                        h.send_header("Content-Encoding", "gzip")
                    if mode != "nolength":          # else the body ends when the server closes
                        h.send_header("Content-Length", str(len(data)))
                    h.end_headers()
                    h.wfile.write(data)
                except OSError:
                    pass

            def log_message(h, *a):
                pass
        super().__init__(("127.0.0.1", 0), H)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/metrics"


# ------------------------------------------------------------------------------ nobody's clients

# Stdlib-only clients run by /usr/bin/python3 as nobody (argv[1] is a JSON job).
NOBODY_CLIENT = r"""
import json, os, socket, struct, sys, time
job = json.loads(sys.argv[1]); res = {"uid": os.getuid(), "pid": os.getpid()}
if job["do"] == "flood":
    held = []
    for _ in range(job["n"]):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.setblocking(False)
        end = time.monotonic() + 20
        while True:
            try:
                s.connect(job["path"]); break
            except BlockingIOError:
                if time.monotonic() > end: break
                time.sleep(0.005)
            except OSError as e:
                res["error"] = type(e).__name__; break
        held.append(s)
    res["opened"] = len(held); print(json.dumps(res), flush=True)
    time.sleep(job["hold_s"])
elif job["do"] == "slow_http":
    held = []
    for _ in range(job["n"]):
        s = socket.create_connection(("127.0.0.1", job["port"])); s.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        held.append(s)
    res["opened"] = len(held); print(json.dumps(res), flush=True)
    end = time.monotonic() + job["hold_s"]
    while time.monotonic() < end:          # and keep coming: 50 more half-sent requests a second
        for _ in range(50):
            try:
                s = socket.create_connection(("127.0.0.1", job["port"]), timeout=1)
                s.send(b"GET /metrics HTTP/1.1\r\n"); held.append(s)
            except OSError:
                pass
        time.sleep(1)
elif job["do"] == "frames":
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.connect(job["path"])
        pid = os.getpid() if job["claim"] == "self" else int(job["claim"])
        for f in job["frames"]:
            f = bytearray(bytes.fromhex(f)); struct.pack_into("<I", f, 16, pid); s.sendall(bytes(f))
        time.sleep(job.get("hold_s", 2)); res["sent"] = "ok"
    except OSError as e:
        res["sent"] = type(e).__name__
    print(json.dumps(res), flush=True)
"""


def nobody(job: dict, wait: bool = True):
    p = subprocess.Popen(["/usr/bin/python3", "-c", NOBODY_CLIENT, json.dumps(job)], preexec_fn=as_nobody,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
    CHILDREN.append(p)
    if wait:
        out, err = p.communicate(timeout=120)
        return json.loads(out.strip().splitlines()[-1]) if out.strip() else {"error": err[-300:]}
    return p


def cupti_frames():
    sys.path.insert(0, str(ROOT / "tests"))
    from support import cupti_records as R
    return R


# ------------------------------------------------------------------------------ cases

def watched_cupti_agent(tmp: Path, cg):
    """An agent with the CUPTI probe and a 2 s systemd watchdog, and the notify socket that
    hears its pings (non-blocking, read between checks)."""
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    npath = str(tmp / f"notify{time.monotonic_ns()}")
    notify.bind(npath)
    notify.setblocking(False)
    return notify, Agent(tmp, cg, probes=("cupti",), env={"NOTIFY_SOCKET": npath, "WATCHDOG_USEC": "2000000"})


def agent_cases(tmp: Path, mem: int, only: str) -> None:
    tag = f"{mem >> 20}M"

    def want(name):
        return only in name

    # -- item 2: engine scrapes
    for mode in ("plain", "nolength", "gzip", "bomb", "trickle"):
        name = {"plain": "/metrics body 50 MB plain", "gzip": "/metrics body 50 MB gzip-encoded",
                "nolength": "/metrics body 50 MB plain, no Content-Length",
                "bomb": "/metrics gzip bomb (1 GiB in 1 MB)",
                "trickle": "engine trickling 1 byte / 1.5 s"}[mode]
        if not want(name):
            continue
        eng = HostileEngine(mode)
        cg = Cgroup(f"eng{mode}", mem)
        a = Agent(tmp, cg, probes=("engine",), engine_url=eng.url)
        w = Windows(a.endpoint)
        time.sleep(15)
        failures = a.counter("ridgeline_agent_engine_scrape_failures_total")
        text = a.metrics() if a.metrics_ok() else ""
        kinds = sorted({k for k, v in re.findall(
            r'ridgeline_agent_engine_scrape_failures_total\{[^}]*kind="(\w+)"[^}]*\} (\S+)', text)
                        if float(v) > 0})
        ws = w.stop()
        r = a.stop()
        eng.shutdown()
        ok = ws["n"] >= 12 and ws["worst_s"] < 2.5 and failures > 0
        row("2", f"{name} (agent, {tag})", r, f"{ws['n']} windows in 15 s, worst interval {ws['worst_s']:.2f} s; "
            f"{failures:.0f} failed scrapes counted (with back-off), kinds {kinds}", ok, mem)
        cg.close()
        # the one-shot command on the same server
        eng = HostileEngine(mode)
        cg = Cgroup(f"scr{mode}", mem)
        c = Child([PY, "-m", "ridgeline", "scrape", eng.url], cg)
        r = c.finish(60)
        eng.shutdown()
        last = (r["stderr"].strip().splitlines() or [""])[-1][:90]
        row("2", f"{name} (`ridgeline scrape`, {tag})", r, f"`{last}`", r["exit"] in (1, 2), mem)
        cg.close()

    # -- item 3: 1,200 CUPTI connections as nobody, with the unit's LimitNOFILE and the default 1024
    for nofile in (8192, 1024):
        name = f"1,200 CUPTI socket connections as nobody (LimitNOFILE {nofile})"
        if not want(name):
            continue
        cg = Cgroup("flood", mem)
        a = Agent(tmp, cg, probes=("cupti",), nofile=nofile)
        h = Windows(a.endpoint, topic="health")
        fl = nobody({"do": "flood", "path": a.cupti, "n": 1200, "hold_s": 25}, wait=False)
        opened = json.loads(fl.stdout.readline() or "{}").get("opened", 0)
        time.sleep(3)
        answers = sum(a.metrics_ok(5) for _ in range(20))
        time.sleep(1.5)
        h.stop()
        cu = cupti_health(h)
        conns = cu.get("connections", -1)
        refused = {k[len("server_"):]: v for k, v in cu.items() if k.startswith("server_refused_connections")}
        fl.kill()
        fl.wait()
        r = a.stop()
        row("3", f"{name}, {tag}", r, f"nobody opened {opened}; /metrics answered {answers}/20 during the flood; "
            f"agent holds {conns}, refused and counted (health): {refused}",
            answers == 20 and opened == 1200 and conns + sum(refused.values()) == 1200, mem)
        cg.close()

    # -- item 3: slow HTTP clients under TasksMax=64
    name = "200 slow /metrics clients as nobody, pids.max 64 (TasksMax)"
    if want(name):
        cg = Cgroup("slow", mem, pids_max=64)
        a = Agent(tmp, cg, probes=("cupti",))
        sl = nobody({"do": "slow_http", "port": a.port, "n": 200, "hold_s": 20}, wait=False)
        opened = json.loads(sl.stdout.readline() or "{}").get("opened", 0)
        answers, worst = 0, 0.0
        for _ in range(10):                   # a real scraper, once every 0.8 s for 8 s
            t0 = time.monotonic()
            answers += a.metrics_ok(6)
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.8)
        text = a.metrics() if a.metrics_ok() else ""
        ev = {k: float(v) for k, v in re.findall(
            r'ridgeline_agent_metrics_server_events_total\{[^}]*event="(\w+)"[^}]*\} (\S+)', text) if float(v)}
        sl.kill()
        sl.wait()
        r = a.stop()
        thread_err = r["stderr"].count("can't start new thread")
        row("3", f"{name}, {tag}", r, f"nobody opened {opened} half-sent requests, then 50 more a second; "
            f"a real scrape answered {answers}/10 "
            f"over 8 s (slowest {worst:.2f} s); server events {ev}; 'can't start new thread' x{thread_err}",
            answers == 10 and not thread_err, mem)
        cg.close()

    # -- item 4: reloads that must not silence the agent
    for key, bad in (("sndhwm", '[publisher]\nsndhwm = 99999999999999999999\n'),
                     ("listen", '[prometheus]\nlisten = "127.0.0.1:99999"\n')):
        name = f"SIGHUP with {key} = {'99999999999999999999' if key == 'sndhwm' else '127.0.0.1:99999'}"
        if not want(name):
            continue
        cg = Cgroup("hup", mem)
        notify, a = watched_cupti_agent(tmp, cg)
        w = Windows(a.endpoint)
        time.sleep(3)
        while True:
            try:
                notify.recv(4096)
            except BlockingIOError:
                break
        a.write(bad)
        a.child.p.send_signal(signal.SIGHUP)
        time.sleep(8)
        alive = a.metrics_ok()
        fed = 0
        while True:
            try:
                fed += notify.recv(4096).count(b"WATCHDOG=1")
            except BlockingIOError:
                break
        notify.close()
        ws = w.stop()
        r = a.stop()
        err = r["stderr"]
        lines = [x for x in err.splitlines() if "reload" in x.lower() or key in x]
        row("4", f"{name}, {tag}", r, f"{ws['n']} windows in 11 s (uncounted seq holes {ws['seq_holes']}), "
            f"/metrics {'up' if alive else 'DOWN'}, watchdog fed {fed}x in the 8 s after; "
            f"log: `…{(lines or [''])[0].split('agent.toml:')[-1][:110]}`",
            alive and ws["n"] >= 9 and ws["seq_holes"] == 0 and len(lines) <= 2, mem)
        cg.close()

    # -- items 6, 7: nobody on the stream and the CUPTI socket
    R = cupti_frames()
    b = R.make_buffer(4, seed=3, with_markers=False)
    kern = [(10, R.KERNEL.itemsize, b.kernels.tobytes())]
    name = "as nobody: read the stream, feed own/forged kernels, HELLO status with newlines"
    if want(name):
        cg = Cgroup("nobody", mem)
        a = Agent(tmp, cg, probes=("cupti",))
        h = Windows(a.endpoint, topic="health")
        # the system interpreter (the venv's may sit where nobody cannot enter) with this checkout's packages
        import site
        sp = [p for p in site.getsitepackages() if p.startswith(sys.prefix)][0]
        code = (f"import site, sys; site.addsitedir({sp!r}); from ridgeline.agent.cli import main; "
                f"sys.exit(main(['tail', '--endpoint', {a.endpoint!r}, '--count', '1', '--timeout', '5']))")
        tail = subprocess.run(["/usr/bin/python3", "-c", code], preexec_fn=as_nobody, capture_output=True, text=True,
                              cwd="/tmp",
                              timeout=60)
        tail_line = (tail.stderr.strip().splitlines() or [""])[-1].replace(a.endpoint, "ipc://…/stream.sock")[:90]
        frames = [R.hello_frame(pid=0).hex(), R.batch_frame(kern, b.names, pid=0).hex()]
        nobody({"do": "frames", "path": a.cupti, "claim": "self", "frames": frames})
        forged = nobody({"do": "frames", "path": a.cupti, "claim": "1", "frames": frames})
        evil = R.hello_frame(pid=0, comm=b"vllm\nFAKE", status=b"x\n2026-01-01 CRITICAL agent: forged line\x1b[2J")
        ev = bytearray(evil)
        from ridgeline.probes.cupti import protocol as P
        at = 16 + P.HELLO_DTYPE.fields["flags"][1]
        ev[at:at + 4] = P.FLAG_CONFLICT.to_bytes(4, "little")
        nobody({"do": "frames", "path": a.cupti, "claim": "self", "frames": [bytes(ev).hex()]})
        time.sleep(2.5)
        h.stop()
        cu = cupti_health(h)
        rejected = cu.get("server_rejected_peers", -1)
        r = a.stop()
        forged_lines = [x for x in r["stderr"].splitlines() if x.startswith("2026-01-01") or x.startswith("FAKE")]
        escaped = sum('forged line' in x for x in r['stderr'].splitlines())
        row("6", f"{name}, {tag}", r, f"tail as nobody: exit {tail.returncode} `{tail_line}`; own-pid kernels "
            f"sent, {cu.get('records')} records accepted for nobody's own pid; claiming pid 1: {forged.get('sent')}, "
            f"rejected peers {rejected}; forged log lines: "
            f"{len(forged_lines)} (the status logged escaped, each time on one line: {escaped}x)",
            tail.returncode == 1 and not forged_lines, mem)
        cg.close()

    name = "kernel records start/end 2^64-1, device 0xFFFFFFFF"
    if want(name):
        cg = Cgroup("records", mem)
        a = Agent(tmp, cg, probes=("cupti",))
        h = Windows(a.endpoint, topic="health")
        k = b.kernels.copy()
        k["start"][:2] = 2**64 - 1
        k["end"][:2] = 2**64 - 1
        k["device_id"][2:] = 0xFFFFFFFF
        frames = [R.hello_frame(pid=0).hex(), R.batch_frame([(10, R.KERNEL.itemsize, k.tobytes())], b.names,
                                                           pid=0, devices=(0xFFFFFFFF,)).hex()]
        nobody({"do": "frames", "path": a.cupti, "claim": "self", "frames": frames})
        time.sleep(2.5)
        text = a.metrics() if a.metrics_ok() else ""
        negative = [x for x in text.splitlines() if not x.startswith("#") and re.search(r" -\d", x)]
        minus_dev = [x for x in text.splitlines() if re.search(r'(gpu|device)="-1"', x)]
        time.sleep(1.5)
        h.stop()
        cu = cupti_health(h)
        rejected = cu.get("rejected_records", -1)
        r = a.stop()
        row("7", f"{name}, {tag}", r, f"4 records sent; rejected and counted {rejected} (health: timestamps "
            f"{cu.get('rejected_timestamps')}, device {cu.get('rejected_device')}; accepted {cu.get('records')}); "
            f"negative samples "
            f"{len(negative)}; device -1 series {len(minus_dev)}", rejected >= 4 and not negative and not minus_dev,
            mem)
        cg.close()

    # -- item 8: one stalled subscriber
    name = "one stalled subscriber beside a healthy one"
    if want(name):
        cg = Cgroup("stall", mem)
        a = Agent(tmp, cg, probes=("simulator",),
                  extra='[publisher]\nsndhwm = 20\npublish_events = true\n[probes.simulator]\nspeed = 4.0\n'
                        'rate_per_s = 40.0\n')
        import zmq
        ctx = zmq.Context()
        stalled = ctx.socket(zmq.SUB)
        stalled.setsockopt(zmq.RCVHWM, 1)
        stalled.setsockopt(zmq.RCVBUF, 4096)
        stalled.connect(a.endpoint)
        stalled.setsockopt(zmq.SUBSCRIBE, b"")          # subscribes to everything, never reads
        w = Windows(a.endpoint, topic="events")
        time.sleep(20)
        ws = w.stop()
        drops = a.counter("ridgeline_agent_publisher_drops_total")
        stalled.close(0)
        ctx.term()
        r = a.stop()
        row("8", f"{name}, {tag}", r, f"healthy subscriber: {ws['n']} events batches, counted gaps {ws['gaps']}, "
            f"uncounted holes {ws['seq_holes']}; sends dropped for the stalled one, counted: {drops:.0f}",
            ws["n"] >= 10 and ws["gaps"] == 0 and ws["seq_holes"] == 0, mem)
        cg.close()


CONFIG_CASES = [
    ("window_s = nan", "[agent]\nwindow_s = nan\n", "agent.window_s"),
    ("window_s = inf", "[agent]\nwindow_s = inf\n", "agent.window_s"),
    ("prometheus.listen port 70000", '[prometheus]\nlisten = "127.0.0.1:70000"\n', "prometheus.listen"),
    ("publisher tcp port 99999", '[publisher]\nendpoint = "tcp://127.0.0.1:99999"\n', "publisher.endpoint"),
    ("sndhwm = 99999999999999999999", "[publisher]\nsndhwm = 99999999999999999999\n", "sndhwm"),
    ("engine interval_s = 0", "[probes.engine]\ninterval_s = 0\n", "interval_s"),
    ("engine interval_s = -1", "[probes.engine]\ninterval_s = -1\n", "interval_s"),
    ("engine interval_s = 0.05", "[probes.engine]\ninterval_s = 0.05\n", "interval_s"),
    ('pids = ["abc", -1]', '[probes]\npids = ["abc", -1]\n', "pids"),
    ("probes.cupti.socket in /etc", '[probes.cupti]\nsocket = "/etc/ridgeline-test/c.sock"\n', "socket"),
    ("prometheus.listen 0.0.0.0", '[prometheus]\nlisten = "0.0.0.0:9464"\n', "listen"),
]


def config_cases(tmp: Path, mem: int, only: str) -> None:
    for name, text, key in CONFIG_CASES:
        if only not in f"config: {name}":
            continue
        f = tmp / "bad.toml"
        f.write_text(text)
        cg = Cgroup("conf", mem)
        r = Child([PY, "-m", "ridgeline", "agent", "--config", str(f), "--run-for", "2", "--probes", "cupti",
                   "--no-prometheus", "--endpoint", f"ipc://{tmp}/conf.sock"], cg).finish(30)
        lines = r["stderr"].strip().splitlines()
        made = os.path.exists("/etc/ridgeline-test")
        last = (lines or [''])[-1].replace(str(f), 'bad.toml')[:130]
        row("5", f"config: {name}", r, f"`{last}`" + (" - made /etc/ridgeline-test" if made else ""),
            r["exit"] == 2 and len(lines) == 1 and key in lines[0] and not made, mem)
        cg.close()


def analyze_cases(tmp: Path, mem: int, only: str, long_recording: bool, inputs_from: Path = ROOT) -> None:
    """Issue 14.1's inputs, built by bench/input_bounds.py (the analyze-input engineer's
    generators), analysed in the cgroup."""
    sys.path.insert(0, str(inputs_from / "bench"))
    sys.path.insert(0, str(inputs_from / "tests"))
    try:
        import input_bounds
    except ImportError:
        print("| 1 | (bench/input_bounds.py is not in this checkout: item 1 not measured) |", flush=True)
        return
    d = tmp / "inputs"
    if not d.exists():
        d.mkdir()
        cases = input_bounds.build(d)
        if long_recording:
            from support import recording_synth
            rec = d / "long.rlrec"
            t0 = time.monotonic()
            recording_synth.write_recording(rec, recording_synth.simulated_trace(d / "sim.json"), minutes=30,
                                            restart_at_s=900)
            print(f"# 30-minute recording with a restart: {rec.stat().st_size / 1e6:.0f} MB, written in "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
            cases["30-minute recording with an agent restart"] = rec
        analyze_cases.cases = cases
    for name, path in analyze_cases.cases.items():
        if only not in f"analyze: {name}":
            continue
        cg = Cgroup("analyze", mem)
        size = path.stat().st_size if path.is_file() else 0
        r = Child([PY, "-m", "ridgeline", "analyze", str(path), "--json"], cg).finish(300 if "FIFO" not in name else 60)
        lines = r["stderr"].strip().splitlines()
        row("1", f"analyze: {name}" + (f" [{size / 1e6:.1f} MB]" if size else ""), r,
            f"`{(lines or [''])[-1][:110]}`", r["exit"] in (0, 2), 1 << 30)
        cg.close()


# ------------------------------------------------------------------------------ issue 18 (items 1, 2, 5)

def issue18_names_cases(tmp: Path, mem: int, only: str) -> None:
    """Issue 18.1/18.5 as an attacker tries them: adversarial kernel names (tests/support/adversarial_names.py)
    through `analyze` and through the CUPTI socket as nobody, and one bad frame per connection."""
    sys.path.insert(0, str(ROOT / "tests"))
    from support import adversarial_names as A

    from ridgeline.aggregator.signatures import load_signatures
    sigs = load_signatures()
    names = [n for s in sigs if s.id.startswith("trtllm_gen_fmha") for n in A.names_for(s.pattern, 4096)]
    tag = f"{mem >> 20}M"
    name = "18.1 analyze: Kineto trace of adversarial 4 kB kernel names"
    if only in name:
        f = tmp / "adversarial-names.json"
        f.write_text(A.kineto_trace(names))
        cg = Cgroup("adv", mem)
        r = Child([PY, "-m", "ridgeline", "analyze", str(f), "--json"], cg).finish(300)
        row("18.1", f"{name} [{f.stat().st_size / 1e3:.0f} kB], {tag}", r, f"{r['time']:.1f} s", r["exit"] == 0
            and r["time"] < 60, mem)
        cg.close()
    name = "18.1 agent: nobody sends adversarial kernel names over the CUPTI socket"
    if only in name:
        R = cupti_frames()
        cg = Cgroup("advagent", mem)
        notify, a = watched_cupti_agent(tmp, cg)
        w = Windows(a.endpoint)
        h = Windows(a.endpoint, topic="health")
        b = R.make_buffer(4, seed=3, with_markers=False)
        frames = [R.hello_frame(pid=0).hex()]
        # new names every frame (the table grows each batch); 8 names: the job is one argv
        # string, at most 128 kB (MAX_ARG_STRLEN) in hex
        for i in range(0, 8, 4):
            chunk = {k: names[(i + j) % len(names)] + str(i) for j, k in enumerate(list(b.names)[:4])}
            frames.append(R.batch_frame([(10, R.KERNEL.itemsize, b.kernels.tobytes())], chunk, pid=0).hex())
        feeds, t0, last, worst = 0, time.monotonic(), time.monotonic(), 0.0
        p = nobody({"do": "frames", "path": a.cupti, "claim": "self", "frames": frames, "hold_s": 20}, wait=False)
        while time.monotonic() - t0 < 25:
            try:
                if notify.recv(4096).count(b"WATCHDOG=1"):
                    now = time.monotonic()
                    worst, last = max(worst, now - last), now
                    feeds += 1
            except BlockingIOError:
                time.sleep(0.05)
        worst = max(worst, time.monotonic() - last)
        answers = sum(a.metrics_ok(5) for _ in range(5))
        p.kill()
        p.wait()
        notify.close()
        ws = w.stop()
        h.stop()
        cu = cupti_health(h)
        r = a.stop()
        row("18.1", f"{name}, {tag}", r, f"{ws['n']} windows in 25 s, worst window interval {ws['worst_s']:.1f} s, "
            f"watchdog fed {feeds}x, worst watchdog gap {worst:.1f} s, /metrics {answers}/5; names matched on "
            f"the pump thread in {cu.get('classify_seconds')} s CPU, {cu.get('names_not_classified')} left "
            f"unmatched (budget)",
            ws["n"] >= 15 and worst < 3 and answers == 5 and r["exit"] == 0, mem)
        cg.close()
    name = "18.5 log flood: 300 connections as nobody, one bad frame each"
    if only in name:
        cg = Cgroup("logflood", mem)
        a = Agent(tmp, cg, probes=("cupti",))
        t0 = time.monotonic()
        for _ in range(300):
            nobody({"do": "frames", "path": a.cupti, "claim": "self", "frames": [(b"\0" * 32).hex()],
                    "hold_s": 0}, wait=False)
        time.sleep(10)
        r = a.stop()
        lines = r["stderr"].count("connection closed")
        row("18.5", f"{name}, {tag}", r, f"{lines} 'connection closed' lines in {time.monotonic() - t0:.0f} s "
            f"(limit: 10 per peer, 30 + 1/s per kind)", lines <= 60 and r["exit"] == 0, mem)
        cg.close()


# ------------------------------------------------------------------------------ issue 18 (items 3, 4)

def as_uid(uid: int):
    def drop():
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (4096, max(4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1])))
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    return drop


# argv[1] a JSON job; every HELLO/batch frame gets this process's pid at byte 16
PEER_CLIENT = r"""
import json, os, socket, struct, sys, time
job = json.loads(sys.argv[1])
def own(h):
    f = bytearray(bytes.fromhex(h)); struct.pack_into("<I", f, 16, os.getpid()); return bytes(f)
if job["do"] == "hold":               # n connections, each with a HELLO, held until stdin closes
    held = []
    for _ in range(job["n"]):
        s = socket.socket(socket.AF_UNIX); s.connect(job["path"])
        try:
            s.sendall(own(job["hello"])); held.append(s)
        except OSError:
            pass
    time.sleep(job.get("check_s", 0))
    def still_open(s):            # not closed by the agent (EOF or reset)
        s.setblocking(False)
        try:
            return s.recv(1) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False
    print(json.dumps({"uid": os.getuid(), "held": sum(map(still_open, held))}), flush=True)
    sys.stdin.read()
elif job["do"] == "hand_over":        # HELLO, then a child keeps the socket and the parent exits
    s = socket.socket(socket.AF_UNIX); s.connect(job["path"]); s.sendall(own(job["hello"]))
    batch = own(job["batch"])
    time.sleep(1.0)
    if os.fork() == 0:
        os.setsid()
        open(job["go"]).read()
        sent = 0
        try:
            for _ in range(job["n"]):
                s.sendall(batch); sent += 1
        except OSError:
            pass
        time.sleep(2)
        os._exit(0)
    print(json.dumps({"pid": os.getpid()}), flush=True)
    os._exit(0)
elif job["do"] == "connect_flood":    # connect and close as fast as possible
    end, n = time.monotonic() + job["s"], 0
    while time.monotonic() < end:
        s = socket.socket(socket.AF_UNIX); s.setblocking(False)
        try:
            s.connect(job["path"]); n += 1
        except OSError:
            pass
        s.close()
    print(json.dumps({"connects": n}), flush=True)
"""


def peer(uid: int, job: dict):
    p = subprocess.Popen(["/usr/bin/python3", "-c", PEER_CLIENT, json.dumps(job)], preexec_fn=as_uid(uid),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
    CHILDREN.append(p)
    return p


class Watchdog:
    """Reads the agent's notify socket in a thread: the worst gap between WATCHDOG=1 pings."""

    def __init__(self, notify: socket.socket):
        self.notify, self.last, self.worst, self.feeds, self.stop_ = notify, time.monotonic(), 0.0, 0, False
        notify.settimeout(0.1)
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while not self.stop_:
            try:
                if self.notify.recv(4096).count(b"WATCHDOG=1"):
                    now = time.monotonic()
                    self.worst, self.last = max(self.worst, now - self.last), now
                    self.feeds += 1
            except (socket.timeout, BlockingIOError):
                pass

    def stop(self) -> float:
        self.stop_ = True
        self.t.join()
        self.notify.close()
        return max(self.worst, time.monotonic() - self.last)


def watched_health(tmp: Path, cgroup: str, mem: int):
    """A CUPTI agent in a cgroup of its own: (cgroup, agent, its watchdog, its health stream)."""
    cg = Cgroup(cgroup, mem)
    notify, a = watched_cupti_agent(tmp, cg)
    return cg, a, Watchdog(notify), Windows(a.endpoint, topic="health")


def spawn_with_pid(pid: int, tries: int = 50):
    """A root process given exactly ``pid`` (ns_last_pid, as CRIU restores pids), or None."""
    for _ in range(tries):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        v = subprocess.Popen(["sleep", "60"])
        if v.pid == pid:
            CHILDREN.append(v)
            return v
        v.kill()
        v.wait()
    return None


def issue18_peer_cases(tmp: Path, mem: int, only: str) -> None:
    """18.3: a connection outliving its process under a reused pid; 18.4: 4 users x 256
    idle connections, then root's and a fifth user's libraries, and a connect flood."""
    R = cupti_frames()
    tag = f"{mem >> 20}M"
    hello = R.hello_frame(pid=0).hex()
    name = "18.3 nobody's forked child sends 10,000 kernels under a pid reused by root's process"
    if only in name:
        cg, a, wd, h = watched_health(tmp, "pidreuse", mem)
        b = R.make_buffer(200, seed=3, with_markers=False)
        batch = R.batch_frame([(10, R.KERNEL.itemsize, b.kernels.tobytes())], b.names, pid=0).hex()
        go = tmp / f"go{time.monotonic_ns()}"
        os.mkfifo(go, 0o666)
        os.chmod(go, 0o666)
        p = peer(NOBODY, {"do": "hand_over", "path": a.cupti, "hello": hello, "batch": batch, "n": 50,
                          "go": str(go)})
        pid = json.loads(p.stdout.readline() or "{}").get("pid", 0)
        p.wait(timeout=30)
        victim = spawn_with_pid(pid) if pid else None
        open(go, "w").close()
        time.sleep(6)
        h.stop()
        cu = cupti_health(h)
        gap = wd.stop()
        r = a.stop()
        if victim is not None:
            victim.kill()
        under_victim = cu.get("records", -1) if victim is not None else "n/a (pid not reused)"
        row("18.3", f"{name}, {tag}", r, f"victim got pid {pid}: {victim is not None}; records accepted "
            f"{under_victim}; pid_reused_cut {cu.get('server_pid_reused_cut')}, process_gone_cut "
            f"{cu.get('server_process_gone_cut')}, batches dropped {cu.get('server_identity_dropped_batches')}; "
            f"worst watchdog gap {gap:.1f} s", victim is not None and cu.get("records", 1) == 0 and gap < 3, mem)
        cg.close()
    name = "18.4 four users x 256 idle CUPTI connections, then root's and a fifth user's libraries"
    if only in name:
        cg, a, wd, h = watched_health(tmp, "starve", mem)
        holders = []
        for uid in (NOBODY, 60001, 60002, 60003):
            holders.append(peer(uid, {"do": "hold", "path": a.cupti, "hello": hello, "n": 256}))
        held = sum(json.loads(x.stdout.readline() or "{}").get("held", 0) for x in holders)
        time.sleep(2)
        fifth = peer(60004, {"do": "hold", "path": a.cupti, "hello": hello, "n": 1, "check_s": 3})
        root = socket.socket(socket.AF_UNIX)
        root.connect(a.cupti)
        root.sendall(R.hello_frame())
        fifth_held = json.loads(fifth.stdout.readline() or "{}").get("held", 0)     # after its 3 s
        root.setblocking(False)
        try:
            root_open = root.recv(1) != b""
        except BlockingIOError:
            root_open = True
        except OSError:                        # refused: the agent closed it at once
            root_open = False
        time.sleep(1.5)
        h.stop()
        cu = cupti_health(h)
        for x in holders + [fifth]:
            x.stdin.close()
        gap = wd.stop()
        r = a.stop()
        row("18.4", f"{name}, {tag}", r, f"held {held}/1024; root's connection kept: {root_open}, the fifth user's "
            f"kept {fifth_held}/1 after 3 s; evicted_fair_share {cu.get('server_evicted_fair_share')}, "
            f"refused {cu.get('server_refused_connections')}, per-user refused "
            f"{cu.get('server_refused_connections_uid')}; worst watchdog gap {gap:.1f} s",
            held == 1024 and root_open and fifth_held == 1 and cu.get("server_evicted_fair_share", 0) >= 2
            and gap < 3, mem)
        cg.close()
    for n_flood in (3, 12):
        name = f"18.4 connect flood from {n_flood} processes while a library connects"
        if only in name:
            cg = Cgroup("cflood", mem)
            notify, a = watched_cupti_agent(tmp, cg)
            wd = Watchdog(notify)
            floods = [peer(NOBODY, {"do": "connect_flood", "path": a.cupti, "s": 10}) for _ in range(n_flood)]
            time.sleep(2)
            # the real library (its test build, probes/native/build/libridgeline_cupti_test.so: the
            # shipped code plus the entry points tests/support/native_harness.py drives): a non-blocking
            # connect; EAGAIN (backlog full) retried 10 ms later, doubling to 250 ms
            lib = subprocess.Popen([PY, str(ROOT / "tests" / "support" / "native_harness.py"),
                                    str(ROOT / "probes" / "native" / "build" / "libridgeline_cupti_test.so")],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                   env=dict(os.environ, RIDGELINE_QUIET="1"))
            CHILDREN.append(lib)

            def ask(line, lib=lib):      # this iteration's library
                lib.stdin.write(line + "\n")
                lib.stdin.flush()
                return json.loads(lib.stdout.readline() or "{}")
            ask("counters")                  # the harness is up (its start is not the library's delay)
            t0, c = time.monotonic(), {}
            ask(f"init {a.cupti} 130500")
            while time.monotonic() - t0 < 15:
                c = ask("counters")
                if c.get("connects"):
                    break
                time.sleep(0.01)
            delay = time.monotonic() - t0
            ok, eagain = bool(c.get("connects")), c.get("connects_busy", -1)
            lib.kill()
            lib.wait()
            connects = sum(json.loads(x.stdout.readline() or "{}").get("connects", 0) for x in floods)
            gap = wd.stop()
            r = a.stop()
            row("18.4", f"{name}, {tag}", r, f"flood: {connects} connects in 10 s; the library connected after "
                f"{delay:.2f} s ({eagain} EAGAIN, retried 10-250 ms later); worst watchdog gap {gap:.1f} s",
                ok and delay < 1.0 and gap < 3, mem)
            cg.close()


# ------------------------------------------------------------------------------ issue 18 (i18b)

def redirect_cases(tmp: Path, mem: int, only: str) -> None:
    """18.6: an engine answering 302 to another loopback port's /admin?delete=all."""
    name = "18.6 engine 302 to another loopback port's /admin?delete=all"
    if only not in name:
        return
    hits: list = []

    class Victim(http.server.BaseHTTPRequestHandler):
        def do_GET(h):
            hits.append(h.path)
            body = b"# TYPE vllm:x gauge\nvllm:num_requests_running 7\n"
            h.send_response(200)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)

        def log_message(h, *a):
            pass
    victim = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Victim)
    threading.Thread(target=victim.serve_forever, daemon=True).start()
    vport = victim.server_address[1]

    class Redirector(http.server.BaseHTTPRequestHandler):
        def do_GET(h):
            h.send_response(302)
            h.send_header("Location", f"http://127.0.0.1:{vport}/admin?delete=all")
            h.send_header("Content-Length", "0")
            h.end_headers()

        def log_message(h, *a):
            pass
    red = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Redirector)
    threading.Thread(target=red.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{red.server_address[1]}/metrics"
    cg = Cgroup("redirect", mem)
    a = Agent(tmp, cg, probes=("engine",), engine_url=url)
    time.sleep(6)
    text = a.metrics() if a.metrics_ok() else ""
    refused = sum(float(v) for v in re.findall(
        r'ridgeline_agent_engine_scrape_failures_total\{[^}]*kind="redirect_refused"[^}]*\} (\S+)', text))
    r = a.stop()
    red.shutdown()
    victim.shutdown()
    row("18.6", f"{name}, {mem >> 20}M", r, f"other port GET {len(hits)}x ({hits[:1]}); refusals counted "
        f"{refused:.0f}", not hits and refused > 0, mem)
    cg.close()


def symlink_output_cases(tmp: Path, mem: int, only: str) -> None:
    """18.8: root's analyze --perfetto/--plot and record -o at a name nobody made a symlink."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from support.third_party_files import third_party_path
        trace = third_party_path("nvidia-inference/tracelens_b200_vllm_gptoss_tp8_prefill888.json.gz")
    except ImportError:      # the lookup module is absent: the analyze cases cannot run
        trace = None
    d = tmp / "nobody-dir"
    d.mkdir(exist_ok=True)
    os.chmod(d, 0o1777)
    for flag, fname in (("--perfetto", "p.json"), ("--plot", "p.png"), ("record -o", "r.rlrec")):
        name = f"18.8 root writes {flag} through nobody's symlink"
        if only not in name or (trace is None and flag != "record -o"):
            continue
        victim = tmp / f"victim-{fname}"
        victim.write_text("precious\n")
        link = d / fname
        link.unlink(missing_ok=True)
        subprocess.run(["/bin/ln", "-s", str(victim), str(link)], preexec_fn=as_nobody, check=True)
        cg = Cgroup("symlink", mem)
        if flag == "record -o":
            argv = [PY, "-m", "ridgeline", "record", "-o", str(link), "--endpoint", f"ipc://{tmp}/none.sock",
                    "--duration", "1"]
        else:
            argv = [PY, "-m", "ridgeline", "analyze", str(trace), flag, str(link), "--json"]
        r = Child(argv, cg).finish(300)
        lines = r["stderr"].strip().splitlines()
        kept = victim.read_text() == "precious\n"
        row("18.8", f"{name}, {mem >> 20}M", r, f"victim {'kept' if kept else 'OVERWRITTEN'}; "
            f"`{(lines or [''])[-1][:110]}`", kept and r["exit"] in (1, 2) and len(lines) == 1, mem)
        cg.close()


def analyze_bomb_cases(tmp: Path, mem: int, only: str) -> None:
    """18.7: analyze bombs, each one line, exit 2, bounded (inputs: tests/support/analyze_bombs.py)."""
    import gzip as gz
    import shutil
    sys.path.insert(0, str(ROOT / "tests"))
    from support import analyze_bombs
    from support.third_party_files import third_party_path
    d = tmp / "bombs"
    d.mkdir(exist_ok=True)
    cases = {
        "18.7 analyze: gzip of 1 GiB of '['": lambda: analyze_bombs.gzip_of_brackets(d / "brackets.json.gz"),
        "18.7 analyze: JSON nested a million deep": lambda: analyze_bombs.nested_json(d / "deep.json"),
        "18.7 analyze: JSON nested a million deep in an event's args":
            lambda: analyze_bombs.nested_json(d / "deep-args.json", inside_event=True),
    }
    export = third_party_path("nsys/pipit_saxpy_mpi_cuda_perlmutter0.sqlite.gz")

    def nsys_copy(name):
        f = d / name
        f.write_bytes(gz.decompress(export.read_bytes()))
        return f
    if export is not None:
        for kind in analyze_bombs.GENERATED:
            cases[f"18.7 analyze: Nsight export with a generated column ({kind})"] = \
                lambda kind=kind: analyze_bombs.nsys_generated_column(nsys_copy(f"gen-{kind}.sqlite"), kind)
        cases["18.7 analyze: Nsight export with int64 overflow (exit 0: values unknown, counted)"] = \
            lambda: analyze_bombs.nsys_int64_overflow(nsys_copy("overflow.sqlite"))
    for name, build in cases.items():
        if only not in name:
            continue
        path = build()
        cg = Cgroup("bomb", 1 << 30)
        r = Child([PY, "-m", "ridgeline", "analyze", str(path), "--json"], cg).finish(300)
        lines = r["stderr"].strip().splitlines()
        want = (0,) if "overflow" in name else (2,)
        row("18.7", name, r, f"`{(lines or [''])[-1][:110]}`", r["exit"] in want and len(lines) <= 1, 1 << 30)
        cg.close()
    shutil.rmtree(d, ignore_errors=True)


def record_full_disk_case(tmp: Path, mem: int, only: str) -> None:
    """18.9: `record` onto a full disk (a 256 KiB tmpfs), fed the golden window envelope."""
    name = "18.9 record onto a full disk (256 KiB tmpfs)"
    if only not in name:
        return
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    from support.golden_stream import golden_window_stream
    mnt = tmp / "small"
    mnt.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], check=True)
    ep = f"ipc://{tmp}/full-disk.sock"
    cg = Cgroup("fulldisk", mem)
    try:
        out = mnt / "r.rlrec"
        with golden_window_stream(ep):
            r = Child([PY, "-m", "ridgeline", "record", "-o", str(out), "--endpoint", ep, "--duration", "60"],
                      cg).finish(120)
        from ridgeline.agent.recording import iter_frames
        report: dict = {}
        frames = sum(1 for _ in iter_frames(out, report))
        lines = r["stderr"].strip().splitlines()
        row("18.9", f"{name}, {mem >> 20}M", r, f"{frames} frames readable, truncated tail: "
            f"{bool(report.get('truncated'))}; `{(lines or [''])[-1][:110]}`",
            r["exit"] == 1 and len(lines) == 1 and frames > 0 and not report.get("truncated"), mem)
    finally:
        cg.close()
        subprocess.run(["umount", str(mnt)], check=False)


def sighup_storm_case(tmp: Path, mem: int, only: str) -> None:
    """18.9: SIGHUP every 10 ms for 20 s while the config is rewritten (half the writes cut)."""
    import random
    name = "18.9 SIGHUP storm while the config file is rewritten"
    if only not in name:
        return
    d = tmp / "storm"
    d.mkdir(exist_ok=True)
    ports = [free_port(), free_port()]

    def text(port):
        return (f'[agent]\nwindow_s = 1.0\n[publisher]\nendpoint = "ipc://{d}/s.sock"\n'
                f'[prometheus]\nlisten = "127.0.0.1:{port}"\n[probes]\nenabled = ["cupti"]\n'
                f'[probes.cupti]\nsocket = "{d}/cupti.sock"\n')
    conf = d / "agent.toml"
    conf.write_text(text(ports[0]))
    cg = Cgroup("storm", mem)
    c = Child([PY, "-m", "ridgeline", "agent", "--config", str(conf)], cg)
    time.sleep(8)

    def rss_mib():
        kids = Path(f"/proc/{c.p.pid}/task/{c.p.pid}/children").read_text().split()
        return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{kids[0]}/status").read_text()).group(1)) / 1024
    rss0, peak, rng, n = rss_mib(), 0.0, random.Random(18), 0
    end = time.monotonic() + 20
    while time.monotonic() < end:
        n += 1
        t = text(ports[n % 2])
        with open(conf, "w") as f:
            f.write(t if n % 2 == 0 else t[:rng.randrange(len(t))])
        c.p.send_signal(signal.SIGHUP)
        time.sleep(0.01)
        peak = max(peak, rss_mib())
    conf.write_text(text(ports[1]))
    c.p.send_signal(signal.SIGHUP)
    ok_last = False
    for _ in range(60):
        try:
            ok_last = urllib.request.urlopen(f"http://127.0.0.1:{ports[1]}/metrics", timeout=1).status == 200
            break
        except OSError:
            time.sleep(0.5)
    r = c.finish(30, signal.SIGTERM)
    others = [ln for ln in r["stderr"].splitlines() if "probe " in ln and "started" in ln and "cupti" not in ln]
    row("18.9", f"{name}, {mem >> 20}M", r, f"{n} SIGHUPs; agent RSS {rss0:.0f} -> peak {peak:.0f} MiB; other probes "
        f"started {len(others)}; last file applied: {ok_last}", ok_last and not others and peak - rss0 < 30, mem)
    cg.close()


def reinstall_case(tmp: Path, only: str) -> None:
    """18.9: install.sh twice under --root: /etc/ridgeline's mode and an edited unit kept."""
    name = "18.9 install.sh over an install keeps /etc/ridgeline's mode and unit edits"
    if only not in name:
        return
    root = tmp / "install-root"
    t0 = time.monotonic()
    inst = ["bash", str(ROOT / "scripts" / "install.sh"), "--root", str(root), "--no-ebpf"]
    p = subprocess.run(inst, capture_output=True, text=True, timeout=1200)
    etc, unit = root / "etc/ridgeline", root / "etc/systemd/system/ridgeline.service"
    ok = p.returncode == 0
    if ok:
        os.chmod(etc, 0o700)
        unit.write_text(unit.read_text().replace("[Service]\n", "[Service]\nNice=5\n", 1))
        p = subprocess.run(inst, capture_output=True, text=True, timeout=1200)
    mode = oct(etc.stat().st_mode & 0o777) if etc.exists() else "-"
    kept = unit.exists() and "Nice=5" in unit.read_text()
    r = {"exit": p.returncode, "rss": 0, "cg": 0, "oom": 0, "time": time.monotonic() - t0, "tracebacks": 0}
    row("18.9", name, r, f"/etc/ridgeline {mode}, unit edit {'kept' if kept else 'LOST'}; "
        f"`{(p.stderr.strip().splitlines() or [''])[-1][:100]}`", p.returncode == 0 and mode == "0o700" and kept,
        1 << 30)


DEMANGLER_PROBE = r"""
import os, signal, sys
from ridgeline.probes.cupti import demangle as dm
w = dm._Worker()
ok = w.run([b"_ZN5flash3fwdIiEEvT_"], 5.0)
st = dict(l.split(":", 1) for l in open(f"/proc/{w.proc.pid}/status").read().splitlines() if ":" in l)
code = dm._LOCKDOWN_CODE + "\nlockdown()\nos.open('/etc/hostname', os.O_RDONLY)\n"
import subprocess
r = subprocess.run([sys.executable, "-I", "-S", "-c", code]).returncode
print(ok[0][0] == dm._OK, st["Uid"].split()[0], st["CapEff"].strip(), st["CapBnd"].strip(), st["CapAmb"].strip(),
      st["Seccomp"].strip(), r == -signal.SIGSYS)
w.kill()
"""


def demangler_privilege_case(tmp: Path, mem: int, only: str) -> None:
    """18.2: the demangler worker of a root agent: its uid, capabilities, seccomp mode, and
    a forbidden system call after the same lockdown."""
    name = "18.2 demangler worker of a root agent: uid, capabilities, seccomp"
    if only not in name:
        return
    cg = Cgroup("demangler", mem)
    out = tmp / "demangler.out"
    with open(out, "w") as f:
        r = Child([PY, "-c", DEMANGLER_PROBE], cg, stdout=f).finish(60)
    got = out.read_text().split()
    ok = len(got) == 7 and got[0] == "True" and got[1] == str(NOBODY) and set(got[2:5]) == {"0000000000000000"} \
        and got[5] == "2" and got[6] == "True"
    row("18.2", f"{name}, {mem >> 20}M", r, f"demangles {got[:1]}, uid {got[1:2]}, CapEff/Bnd/Amb {got[2:5]}, "
        f"Seccomp {got[5:6]}, open() after lockdown killed by SIGSYS {got[6:7]}", ok, mem)
    cg.close()


def install_help() -> None:
    t0 = time.monotonic()
    p = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), "--help"], capture_output=True, text=True,
                       timeout=30)
    recommends = [x for x in p.stdout.splitlines() if "--no-deps" in x or "--no-build-isolation" in x]
    # the old text recommended "--no-deps --no-build-isolation" together, which fails
    wrong = re.findall(r"--no-deps\W+--no-build-isolation", p.stdout)
    r = {"exit": p.returncode, "rss": 0, "cg": 0, "oom": 0, "time": time.monotonic() - t0, "tracebacks": 0}
    row("8", "install.sh --help", r, f"{len(recommends)} lines name --no-deps/--no-build-isolation, "
        f"{len(wrong)} recommend them together: `{' '.join(x.strip('# ') for x in recommends)[:150]}`",
        p.returncode == 0 and not wrong, 1 << 30)


def _end_children() -> None:
    for p in CHILDREN:
        if p.poll() is None:
            try:
                if os.getpgid(p.pid) == p.pid:
                    os.killpg(p.pid, signal.SIGKILL)
                else:
                    p.kill()
            except (ProcessLookupError, PermissionError):
                pass
    for cg in list(CGROUPS):
        cg.close()


def main() -> None:
    import atexit
    atexit.register(_end_children)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory-max", default="384M,512M", help="comma list of cgroup memory limits")
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--skip-analyze", action="store_true")
    ap.add_argument("--long-recording", action="store_true")
    ap.add_argument("--inputs-from", type=Path, default=ROOT,
                    help="checkout whose bench/input_bounds.py and tests/support/recording_synth.py build item 1's inputs")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("ridgeline: error: hardening-check needs root (cgroups, running attacks as nobody)")
    # the checkout whose code the children run (this interpreter's ridgeline), not this script's
    src = subprocess.run([PY, "-c",
                          "import os, ridgeline.agent as a; print(os.path.dirname(os.path.dirname(a.__file__)))"],
                         capture_output=True, text=True, cwd=tempfile.gettempdir()).stdout.strip()
    head = subprocess.run(["git", "log", "-1", "--format=%h %ad", "--date=format:%H:%M"], cwd=src or ROOT,
                          capture_output=True, text=True).stdout.strip()
    load = open('/proc/loadavg').read().split()[:3]
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {load}, "
          f"{os.cpu_count()} CPUs, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB, "
          f"code {src} at {head}")
    print("| item | case | exit | peak RSS MiB | cgroup peak MiB | time s | what happens | verdict |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory(prefix="rl-hardening-") as tmp:
        tmp = Path(tmp)
        os.chmod(tmp, 0o755)
        for m in a.memory_max.split(","):
            mem = int(m[:-1]) << {"K": 10, "M": 20, "G": 30}[m[-1].upper()]
            agent_cases(tmp, mem, a.only)
            config_cases(tmp, mem, a.only)
            issue18_names_cases(tmp, mem, a.only)
            issue18_peer_cases(tmp, mem, a.only)
            redirect_cases(tmp, mem, a.only)
            symlink_output_cases(tmp, mem, a.only)
            record_full_disk_case(tmp, mem, a.only)
            sighup_storm_case(tmp, mem, a.only)
            demangler_privilege_case(tmp, mem, a.only)
        if not a.skip_analyze:
            analyze_bomb_cases(tmp, 1 << 30, a.only)
        if not a.skip_analyze:
            # `analyze` is an operator's command, not the unit: its ceiling is 1 GiB (issue 14.1)
            analyze_cases(tmp, 1 << 30, a.only, a.long_recording, a.inputs_from)
        if "install" in "install.sh --help" and a.only in "install.sh --help":
            install_help()
        reinstall_case(tmp, a.only)
    print(f"# load average after: {open('/proc/loadavg').read().split()[:3]}")
    if a.json:
        a.json.write_text(json.dumps(ROWS, indent=1))
    sys.exit(1 if any(r["verdict"] != "ok" for r in ROWS) else 0)


if __name__ == "__main__":
    main()
