"""Cost of the eBPF probes, measured side by side in one run (configurations interleaved per round).

    sudo .venv/bin/python bench/bench_ebpf.py [--rounds 5] [--loops 200000] [--write docs/benchmarks-ebpf.md]

Workloads (built with gcc into bench/out/):
* pipe ping-pong: two processes pinned to one CPU bouncing a byte over two pipes (2 context
  switches and 2 wakeups per round trip): no probe / sched probe attached but the
  ping-pong not targeted / both processes targeted. Metric: ns per round trip (wall) and
  the workload's own CPU time per round trip (rusage; less sensitive to other load).
* CUDA launch loop: a C loop calling ``cudaLaunchKernel`` of the pip libcudart (no driver:
  each call fails in ~10 ns, so the probe's cost stands out): no uprobe / entry uprobes
  attached but the process not targeted / targeted / entry+return (``launch_latency``);
  and the same call from a Python ctypes loop (what a Python launcher pays, relatively).
  Each configuration uses its own copy of the library (uprobes attach per inode), so
  nothing is attached or detached between runs.
* mixed load: ``perf bench sched messaging`` (160 processes over sockets) with no probe /
  probe not targeting it / targeting it and its children (follow forks).
* agent CPU: the thread time spent in ``SchedProbe.poll()`` (batch map read, ring buffer,
  window accounting) during the targeted ping-pong, polled every second (the agent's
  window), per 1,000 target switches and per 100k events.
* kernel BPF run time per program invocation (``kernel.bpf_stats_enabled=1`` for one extra
  targeted and one untargeted ping-pong, restored afterwards; with ``--bpf-stats``, on for every
  round instead, and reported per configuration: min/median/max over rounds).

``--compare-source LABEL=FILE`` (repeatable) adds ping-pong configurations that load another
revision of the program under the probe's flags, e.g. main's for a before/after in the same run::

    git show main:probes/sched_bpf.c > /tmp/sched_main.c
    sudo .venv/bin/python bench/bench_ebpf.py --workloads pingpong --bpf-stats --compare-source main=/tmp/sched_main.c

Only its targets bitmap and attachment are driven (its config stays zero: no discovery, no forks,
no slow-run-queue events, as in the probe's targeted ping-pong after its first poll).

The sched probe stays loaded for the whole run; "no probe" detaches its raw tracepoints.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shutil
import statistics as st
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ridgeline.probes import bpf as bpfmod  # noqa: E402
from ridgeline.probes.cuda_uprobes import CudaUprobeProbe  # noqa: E402
from ridgeline.probes.sched import SchedProbe, bpf_cflags  # noqa: E402

OUT = ROOT / "bench" / "out" / "ebpf"

PINGPONG_C = r"""
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <sys/resource.h>
#include <sys/wait.h>
static void pin(int cpu) { cpu_set_t s; CPU_ZERO(&s); CPU_SET(cpu, &s); sched_setaffinity(0, sizeof s, &s); }
static long long now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000LL + t.tv_nsec; }
int main(int argc, char **argv) {
  long n = atol(argv[1]); int cpu = atoi(argv[2]);
  int a[2], b[2], go[2]; char c = 0;
  if (pipe(a) || pipe(b) || pipe(go)) return 1;
  pin(cpu);
  pid_t child = fork();
  if (child == 0) {
    if (read(go[0], &c, 1) != 1) return 1;
    for (long i = 0; i < n; i++) { if (read(a[0], &c, 1) != 1) return 1; if (write(b[1], &c, 1) != 1) return 1; }
    return 0;
  }
  printf("PIDS %d %d\n", getpid(), child); fflush(stdout);
  char line[16]; if (!fgets(line, sizeof line, stdin)) return 1;
  if (write(go[1], &c, 1) != 1) return 1;
  struct rusage r0; getrusage(RUSAGE_SELF, &r0);
  long long t0 = now();
  for (long i = 0; i < n; i++) { if (write(a[1], &c, 1) != 1) return 1; if (read(b[0], &c, 1) != 1) return 1; }
  long long t1 = now();
  struct rusage r1, rc; getrusage(RUSAGE_SELF, &r1);
  int st; wait4(child, &st, 0, &rc);
  long long cpu_ns = (r1.ru_utime.tv_sec - r0.ru_utime.tv_sec + r1.ru_stime.tv_sec - r0.ru_stime.tv_sec) * 1000000000LL
    + (r1.ru_utime.tv_usec - r0.ru_utime.tv_usec + r1.ru_stime.tv_usec - r0.ru_stime.tv_usec) * 1000LL
    + (rc.ru_utime.tv_sec + rc.ru_stime.tv_sec) * 1000000000LL + (rc.ru_utime.tv_usec + rc.ru_stime.tv_usec) * 1000LL;
  printf("RESULT %lld %lld\n", t1 - t0, cpu_ns); fflush(stdout);
  return 0;
}
"""

LAUNCH_C = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef struct { unsigned x, y, z; } dim3;
typedef int (*launch_t)(const void *, dim3, dim3, void **, size_t, void *);
static long long now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000LL + t.tv_nsec; }
int main(int argc, char **argv) {
  void *h = dlopen(argv[1], RTLD_NOW); if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
  launch_t f = (launch_t)dlsym(h, "cudaLaunchKernel");
  long n = atol(argv[2]); dim3 g = {1, 1, 1}, b = {32, 1, 1}; int r = 0;
  f((void *)1, g, b, 0, 0, 0);   /* the first call tries to load the driver */
  printf("READY\n"); fflush(stdout);
  char line[16]; if (!fgets(line, sizeof line, stdin)) return 1;
  long long t0 = now();
  for (long i = 0; i < n; i++) r |= f((void *)1, g, b, 0, 0, 0);
  long long t1 = now();
  printf("RESULT %lld %d\n", t1 - t0, r); fflush(stdout);
  return 0;
}
"""


def build(name: str, src: str, extra=()) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    c, exe = OUT / f"{name}.c", OUT / name
    c.write_text(src)
    subprocess.run(["gcc", "-O2", "-o", str(exe), str(c), *extra], check=True)
    return exe


def find_cudart() -> Path | None:
    import site
    for sp in site.getsitepackages():
        for p in sorted(Path(sp).glob("nvidia/*/lib/libcudart.so.1[0-9]")):
            return p
    return None


# ------------------------------------------------------------------ sched probe toggling
TPS = ("sched_switch", "sched_wakeup", "sched_wakeup_new", "sched_process_exit")


def detach(p: SchedProbe) -> None:
    for tp in getattr(p, "tps", TPS):
        if tp.encode() in p.bpf.raw_tracepoint_fds:
            p.bpf.detach_raw_tracepoint(tp=tp.encode())


def attach(p: SchedProbe) -> None:
    for tp in getattr(p, "tps", TPS):
        if tp.encode() not in p.bpf.raw_tracepoint_fds:
            p.bpf.attach_raw_tracepoint(tp=tp.encode(), fn_name=f"raw_tracepoint__{tp}".encode())


class SourceProgram:
    """Another revision of ``sched_bpf.c`` loaded with the probe's flags (``--compare-source``).

    Offers what the ping-pong runs call on a probe: targets go straight into its bitmap; no
    window is read (``poll`` does nothing), so only the kernel side is compared.
    """

    def __init__(self, path: Path, max_threads: int = 16384, rb_pages: int = 64):
        text = Path(path).read_bytes()
        self.tps = [tp for tp in TPS if f"RAW_TRACEPOINT_PROBE({tp})".encode() in text]   # the hooks it has
        self.bpf = bpfmod.import_bcc().BPF(text=text, cflags=bpf_cflags(max_threads, rb_pages))
        self._bits = self.bpf[b"targets"]

    def add_target(self, tgid: int) -> None:
        bpfmod.set_target_bit(self._bits, tgid, True)

    def remove_target(self, tgid: int) -> None:
        bpfmod.set_target_bit(self._bits, tgid, False)

    def poll(self) -> None:
        return None

    def stop(self) -> None:
        self.bpf.cleanup()


# ------------------------------------------------------------------ runs
def run_pingpong(exe, loops, cpu, probe=None, target=False, poll_every_s=None):
    """Returns (wall ns per round trip, workload CPU ns per round trip, agent stats or None)."""
    pp = subprocess.Popen([str(exe), str(loops), str(cpu)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    _, parent, child = pp.stdout.readline().split()
    pids = [int(parent), int(child)]
    if target:
        for pid in pids:
            probe.add_target(pid)
        probe.poll()
    result = {}

    def reader():
        result["line"] = pp.stdout.readline()

    th = threading.Thread(target=reader)
    th.start()
    pp.stdin.write("go\n"); pp.stdin.flush()
    agent = None
    if poll_every_s:
        cpu_s, switches, events, polls = 0.0, 0, 0, 0
        while th.is_alive():
            time.sleep(poll_every_s)
            t0 = time.thread_time()
            w = probe.poll()
            cpu_s += time.thread_time() - t0
            polls += 1
            rows = w["threads"]
            switches += int(rows["voluntary_switches"].sum() + rows["involuntary_switches"].sum())
            events += int(rows["voluntary_switches"].sum() + rows["involuntary_switches"].sum()
                          + rows["wakeups"].sum())
        agent = {"cpu_s": cpu_s, "switches": switches, "events": events, "polls": polls}
    th.join()
    pp.wait()
    if target:
        probe.poll()
        for pid in pids:
            probe.remove_target(pid)
    _, wall, cpu_ns = result["line"].split()
    return int(wall) / loops, int(cpu_ns) / loops, agent


def run_launch(exe, lib, n, probe=None, target=False):
    p = subprocess.Popen([str(exe), str(lib), str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    p.stdout.readline()
    if target:
        probe.add_target(p.pid)
    p.stdin.write("go\n"); p.stdin.flush()
    _, wall, _rc = p.stdout.readline().split()
    p.wait()
    if target:
        w = probe.poll()
        probe.remove_target(p.pid)
        launches = int(w["threads"]["launches"].sum()) if len(w["threads"]) else 0
        if launches < n:
            raise RuntimeError(f"uprobe counted {launches} launches of {n + 1}")
    return int(wall) / n


LAUNCH_PY = r"""
import ctypes as ct, sys, time
l = ct.CDLL(sys.argv[1]); n = int(sys.argv[2])
class dim3(ct.Structure): _fields_ = [("x", ct.c_uint), ("y", ct.c_uint), ("z", ct.c_uint)]
f = l.cudaLaunchKernel
f.argtypes = [ct.c_void_p, dim3, dim3, ct.c_void_p, ct.c_size_t, ct.c_void_p]
g, b = dim3(1, 1, 1), dim3(32, 1, 1)
f(1, g, b, None, 0, None)
print("READY", flush=True); sys.stdin.readline()
t0 = time.perf_counter_ns()
for _ in range(n):
    f(1, g, b, None, 0, None)
print("RESULT", time.perf_counter_ns() - t0, 0, flush=True)
"""


def run_launch_py(lib, n, probe=None, target=False):
    p = subprocess.Popen([sys.executable, "-c", LAUNCH_PY, str(lib), str(n)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    p.stdout.readline()
    if target:
        probe.add_target(p.pid)
    p.stdin.write("go\n"); p.stdin.flush()
    _, wall, _rc = p.stdout.readline().split()
    p.wait()
    if target:
        probe.poll()
        probe.remove_target(p.pid)
    return int(wall) / n


def run_messaging(probe=None, target=False, groups=4, loops=200):
    p = subprocess.Popen(["sh", "-c", f"read x; exec perf bench sched messaging -g {groups} -l {loops}"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if target:
        probe.add_target(p.pid)
    t0 = time.perf_counter()
    p.stdin.write("go\n"); p.stdin.close()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    out = p.stdout.read()
    p.returncode = 0
    m = re.search(r"Total time: ([\d.]+)", out)
    if target:
        probe.poll()
        for pid in list(probe.targets):
            probe.remove_target(pid)
    return (float(m.group(1)) if m else wall), ru.ru_utime + ru.ru_stime


THREADS_PY = r"""
import sys, threading, time
n = int(sys.argv[1])
def worker():
    while True:
        time.sleep(0.01)          # ~100 switches/s per thread
for _ in range(n):
    threading.Thread(target=worker, daemon=True).start()
print("UP", flush=True)
sys.stdin.readline()
"""


def poll_cost(probe, nthreads, seconds=5.0):
    """CPU per poll (1 s apart) with a target of ``nthreads`` threads switching ~100 times/s each."""
    p = subprocess.Popen([sys.executable, "-c", THREADS_PY, str(nthreads)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        p.stdout.readline()
        probe.add_target(p.pid)
        time.sleep(1.0)
        probe.poll()
        cpu, polls, switches, rows = 0.0, 0, 0, 0
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            time.sleep(1.0)
            t0 = time.thread_time()
            w = probe.poll()
            cpu += time.thread_time() - t0
            polls += 1
            rows = len(w["threads"])
            switches += int(w["threads"]["voluntary_switches"].sum() + w["threads"]["involuntary_switches"].sum())
    finally:
        p.stdin.write("x\n"); p.stdin.flush(); p.wait(timeout=10)
        probe.poll()
        probe.remove_target(p.pid)
    return {"threads": rows, "polls": polls, "ms_per_poll": cpu * 1e3 / max(polls, 1),
            "switches_per_s": switches / max(polls, 1), "us_per_1000_switches": cpu * 1e9 / max(switches, 1)}


def bpf_stats(probe, exe, loops, cpu):
    path = Path("/proc/sys/kernel/bpf_stats_enabled")
    old = path.read_text().strip()
    out = {}
    try:
        path.write_text("1")
        for label, target in (("not targeted", False), ("targeted", True)):
            before = bpfmod.prog_stats(probe.bpf)
            run_pingpong(exe, loops, cpu, probe, target=target)
            after = bpfmod.prog_stats(probe.bpf)
            for name, a in after.items():
                b = before.get(name, {"run_cnt": 0, "run_time_ns": 0})
                cnt = a["run_cnt"] - b["run_cnt"]
                if cnt:
                    out[(name.replace("raw_tracepoint__", ""), label)] = (cnt, (a["run_time_ns"] - b["run_time_ns"]) / cnt)
    finally:
        path.write_text(old)
    return out


def stats_delta(before: dict, after: dict) -> dict[str, tuple[int, float]]:
    """{program: (invocations, ns per invocation)} between two :func:`bpfmod.prog_stats` reads."""
    out = {}
    for name, a in after.items():
        b = before.get(name, {"run_cnt": 0, "run_time_ns": 0})
        cnt = a["run_cnt"] - b["run_cnt"]
        if cnt:
            out[name.replace("raw_tracepoint__", "")] = (cnt, (a["run_time_ns"] - b["run_time_ns"]) / cnt)
    return out


def med(xs):
    return st.median(xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--loops", type=int, default=300000, help="ping-pong round trips per run")
    ap.add_argument("--launches", type=int, default=200000, help="cudaLaunchKernel calls per run")
    ap.add_argument("--write", metavar="MD", help="write the table into this markdown file (between bench markers)")
    ap.add_argument("--workloads", default="pingpong,launch,messaging,agent",
                    help="comma-separated subset of pingpong,launch,messaging,agent (default: all)")
    ap.add_argument("--compare-source", action="append", default=[], metavar="LABEL=FILE",
                    help="also run the ping-pong with this revision of sched_bpf.c loaded instead (repeatable)")
    ap.add_argument("--bpf-stats", action="store_true",
                    help="kernel.bpf_stats_enabled=1 during every round; per-configuration ns per program run")
    a = ap.parse_args()
    wl = set(a.workloads.split(","))
    avail = bpfmod.availability()
    if not avail.ok:
        print(f"bench_ebpf: eBPF unavailable: {avail.reason} ({avail.hint})", file=sys.stderr)
        return 2
    if not shutil.which("gcc"):
        print("bench_ebpf: gcc is needed to build the workloads", file=sys.stderr)
        return 2
    cpu = (os.cpu_count() or 1) - 1
    os.sched_setaffinity(0, {0} if cpu > 0 else {0})   # the agent side off the workload's CPU
    pingpong = build("pingpong", PINGPONG_C)
    launch = build("launchloop", LAUNCH_C, ["-ldl"])
    have_perf = shutil.which("perf") is not None and "messaging" in wl
    cudart = find_cudart() if "launch" in wl else None

    sched = SchedProbe(discover=False, seed_s=0.0)
    sched.start()
    detach(sched)
    # The floor: programs that do nothing, on the same two hot hooks. What the probe costs
    # beyond this is its own work; this part is the kernel's raw-tracepoint dispatch.
    noop = bpfmod.import_bcc().BPF(text=b"RAW_TRACEPOINT_PROBE(sched_switch) { return 0; }\n"
                                        b"RAW_TRACEPOINT_PROBE(sched_wakeup) { return 0; }\n")
    noop_tps = ("sched_switch", "sched_wakeup")

    def noop_on(on):
        for tp in noop_tps:
            have = tp.encode() in noop.raw_tracepoint_fds
            if on and not have:
                noop.attach_raw_tracepoint(tp=tp.encode(), fn_name=f"raw_tracepoint__{tp}".encode())
            elif not on and have:
                noop.detach_raw_tracepoint(tp=tp.encode())
    noop_on(False)
    others = []
    for spec in a.compare_source:
        label, _, path = spec.partition("=")
        prog = SourceProgram(Path(path))
        detach(prog)
        others.append((label, prog))

    libs = {}
    cuda = cuda_timed = None
    if cudart:
        for name in ("base", "entry", "timed"):
            d = OUT / name
            d.mkdir(parents=True, exist_ok=True)
            shutil.copy2(cudart, d / cudart.name)
            libs[name] = d / cudart.name
        cuda = CudaUprobeProbe(discover=False, rescan_s=3600)
        cuda.start()
        cuda_timed = CudaUprobeProbe(discover=False, rescan_s=3600, launch_latency=True)
        cuda_timed.start()
        run_launch(launch, libs["entry"], 1000, cuda, target=True)        # attach once per inode
        run_launch(launch, libs["timed"], 1000, cuda_timed, target=True)

    res: dict[str, list] = {}

    def add(key, val):
        res.setdefault(key, []).append(val)

    stats_path = Path("/proc/sys/kernel/bpf_stats_enabled")
    stats_old = stats_path.read_text().strip()
    if a.bpf_stats:
        stats_path.write_text("1")
    run_stats: dict[str, list] = {}    # configuration -> per round {program: (invocations, ns)}

    def pingpong_run(label, bpfobj, probe=None, target=False, poll_every_s=None):
        before = bpfmod.prog_stats(bpfobj) if a.bpf_stats and bpfobj is not None else {}
        w, c, ag = run_pingpong(pingpong, a.loops, cpu, probe, target=target, poll_every_s=poll_every_s)
        if before:
            run_stats.setdefault(label, []).append(stats_delta(before, bpfmod.prog_stats(bpfobj)))
        add(("pingpong", label), (w, c))
        return ag

    agent_runs = []
    try:
        for r in range(a.rounds if "pingpong" in wl else 0):
            print(f"round {r + 1}/{a.rounds}", file=sys.stderr)
            detach(sched)
            pingpong_run("no probe", None)
            noop_on(True)
            pingpong_run("empty BPF programs on the 2 hooks (floor)", noop)
            noop_on(False)
            # this revision and the --compare-source ones, in reversed order every other round
            # (a load trend within a round then favours neither)
            for label, prog in (others + [("", sched)])[::1 if r % 2 == 0 else -1]:
                pre = f"{label}: " if label else ""
                attach(prog)
                pingpong_run(f"{pre}probe attached, not targeted", prog.bpf, prog)
                pingpong_run(f"{pre}probe attached, targeted", prog.bpf, prog, target=True)
                if not label and "agent" in wl:   # a run of its own: the rows above compare like with like
                    agent_runs.append(pingpong_run("probe attached, targeted, agent polling every 1 s", sched.bpf,
                                                   sched, target=True, poll_every_s=1.0))
                detach(prog)
            attach(sched)
    finally:
        if a.bpf_stats:
            stats_path.write_text(stats_old)
    for r in range(a.rounds if (cudart or have_perf) else 0):
        print(f"round {r + 1}/{a.rounds} (launch, messaging)", file=sys.stderr)
        if cudart:
            add(("launch", "no uprobe"), (run_launch(launch, libs["base"], a.launches), None))
            add(("launch", "entry uprobes, not targeted"), (run_launch(launch, libs["entry"], a.launches), None))
            add(("launch", "entry uprobes, targeted"), (run_launch(launch, libs["entry"], a.launches, cuda, True), None))
            add(("launch", "entry+return (launch_latency), targeted"),
                (run_launch(launch, libs["timed"], a.launches, cuda_timed, True), None))
            n_py = max(a.launches // 4, 1000)
            add(("ctypes launch loop", "no uprobe"), (run_launch_py(libs["base"], n_py), None))
            add(("ctypes launch loop", "entry uprobes, targeted"),
                (run_launch_py(libs["entry"], n_py, cuda, True), None))
        if have_perf:
            detach(sched)
            add(("messaging", "no probe"), run_messaging())
            attach(sched)
            add(("messaging", "probe attached, not targeted"), run_messaging(sched))
            sched.follow_forks = True
            sched._set(1, 1)
            add(("messaging", "probe attached, targeted (+forks)"), run_messaging(sched, target=True))
            sched._set(1, 0)
            sched.follow_forks = False
    attach(sched)
    pc = [poll_cost(sched, n) for n in (10, 200)] if "agent" in wl else []
    stats = bpf_stats(sched, pingpong, a.loops, cpu) if not a.bpf_stats and "pingpong" in wl else {}
    sched.stop()
    for _, prog in others:
        prog.stop()
    noop.cleanup()
    for p in (cuda, cuda_timed):
        if p:
            p.stop()

    agent_runs = [x for x in agent_runs if x]
    lines = render(res, agent_runs, pc, stats, a, have_perf, cudart, run_stats)
    text = "\n".join(lines)
    print(text)
    if a.write:
        write_doc(Path(a.write), text)
    return 0


def render(res, agent_runs, pc, stats, a, have_perf, cudart, run_stats=None) -> list[str]:
    L = []
    L.append(f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.node()} "
             f"(kernel {platform.release()}, {os.cpu_count()} CPUs, load average at start "
             f"{open('/proc/loadavg').read().split()[0]}), {a.rounds} interleaved rounds; "
             "ratios are medians over rounds against the first row of each workload; "
             "'best' compares the fastest run of each configuration (external load only ever adds time).")
    L.append("")
    L.append("| workload | configuration | median | ratio | best ratio | workload CPU ratio | samples |")
    L.append("|---|---|---|---|---|---|---|")
    for wl, unit in (("pingpong", "ns/round trip"), ("launch", "ns/call"), ("ctypes launch loop", "ns/call"),
                     ("messaging", "s")):
        keys = [k for k in res if k[0] == wl]
        if not keys:
            continue
        base = [x[0] for x in res[keys[0]]]
        base_cpu = [x[1] for x in res[keys[0]] if x[1] is not None]
        for k in keys:
            walls = [x[0] for x in res[k]]
            cpus = [x[1] for x in res[k] if x[1] is not None]
            cpu_ratio = f"x{med(cpus) / med(base_cpu):.3f}" if cpus and base_cpu else "-"
            extra = ""
            if "launch" in wl and k != keys[0]:
                extra = f" (+{med(walls) - med(base):.0f} ns)"
            fmt = (lambda v: f"{v:.3f}") if wl == "messaging" else (lambda v: f"{v:.0f}")
            L.append(f"| {wl} | {k[1]} | {fmt(med(walls))} {unit}{extra} | x{med(walls) / med(base):.3f} | "
                     f"x{min(walls) / min(base):.3f} | {cpu_ratio} | {', '.join(fmt(w) for w in walls)} |")
    if not have_perf and "messaging" in a.workloads:
        L.append("| messaging | skipped: `perf` is not installed | | | | | |")
    if not cudart and "launch" in a.workloads:
        L.append("| launch | skipped: no pip libcudart (`pip install -e '.[test]'`) | | | | | |")
    pp = [k for k in res if k[0] == "pingpong"]
    if pp:
        L.append("")
        L.append("Ping-pong workload CPU per round trip, each run against the no-probe run of the same round "
                 "(paired, so that the machine's load drifting between rounds cancels): ratio min / median / max "
                 "over rounds, and the CPU ns per round trip above the no-probe run (median).")
        L.append("")
        L.append("| configuration | paired CPU ratio (min / median / max) | CPU ns per round trip above no probe |")
        L.append("|---|---|---|")
        base = [x[1] for x in res[pp[0]]]
        for k in pp[1:]:
            cpus = [x[1] for x in res[k]]
            r = [c / b for c, b in zip(cpus, base)]
            d = [c - b for c, b in zip(cpus, base)]
            L.append(f"| {k[1]} | x{min(r):.3f} / x{med(r):.3f} / x{max(r):.3f} | {med(d):.0f} |")
    L.append("")
    if agent_runs:
        cpu_s = sum(x["cpu_s"] for x in agent_runs)
        sw = sum(x["switches"] for x in agent_runs)
        ev = sum(x["events"] for x in agent_runs)
        polls = sum(x["polls"] for x in agent_runs)
        L.append(f"Agent CPU (thread time in `SchedProbe.poll()`, polled every second during the targeted ping-pong): "
                 f"{cpu_s * 1e3:.1f} ms over {polls} polls for {sw} target switches and {ev} events: "
                 f"**{cpu_s * 1e6 / max(sw, 1) * 1000:.2f} µs per 1,000 switches**, "
                 f"{cpu_s * 1e6 / max(ev, 1) * 1e5:.0f} µs per 100k events "
                 f"({cpu_s * 1e3 / max(polls, 1):.2f} ms per poll). The per-event work happens in the kernel "
                 "(below); the agent reads one batch of per-thread totals per poll, whatever the event rate.")
        L.append("")
    if pc:
        L.append("Agent CPU per poll against the size of the target (a Python process whose threads each sleep "
                 "10 ms in a loop; one poll per second, 5 polls):")
        L.append("")
        L.append("| threads | switches/s | ms CPU per poll | µs per 1,000 switches |")
        L.append("|---|---|---|---|")
        for x in pc:
            L.append(f"| {x['threads']} | {x['switches_per_s']:.0f} | {x['ms_per_poll']:.2f} | {x['us_per_1000_switches']:.1f} |")
        L.append("")
    if stats:
        L.append("Kernel BPF run time per invocation (`kernel.bpf_stats_enabled=1`, one pinned ping-pong each):")
        L.append("")
        L.append("| program | ping-pong | invocations | ns per invocation |")
        L.append("|---|---|---|---|")
        for (name, label), (cnt, ns) in sorted(stats.items()):
            L.append(f"| {name} | {label} | {cnt} | {ns:.0f} |")
    if run_stats:
        L.append("")
        L.append("Kernel BPF run time per invocation in every round (`kernel.bpf_stats_enabled=1` throughout, "
                 "so every probe row above carries the stats' own clock reads too); min / median / max over "
                 "rounds, and runs per ping-pong round trip:")
        L.append("")
        L.append("| configuration | program | ns per invocation (min / median / max) | runs per round trip |")
        L.append("|---|---|---|---|")
        for label, rounds in run_stats.items():
            for name in sorted({n for r in rounds for n in r}):
                ns = [r[name][1] for r in rounds if name in r]
                per = med([r[name][0] for r in rounds if name in r]) / a.loops
                L.append(f"| {label} | {name} | {min(ns):.0f} / {med(ns):.0f} / {max(ns):.0f} | {per:.2f} |")
    return L


def write_doc(path: Path, table: str) -> None:
    begin, end = "<!-- bench:begin -->", "<!-- bench:end -->"
    text = path.read_text() if path.exists() else (
        "# eBPF probe cost\n\nReproduce: `sudo .venv/bin/python bench/bench_ebpf.py --write docs/benchmarks-ebpf.md`\n\n"
        f"{begin}\n{end}\n")
    if begin not in text:
        text += f"\n{begin}\n{end}\n"
    pre, rest = text.split(begin, 1)
    _, post = rest.split(end, 1)
    path.write_text(f"{pre}{begin}\n{table}\n{end}{post}")


if __name__ == "__main__":
    sys.exit(main())
