"""Agent cost while streaming: CPU (% of one core), RSS, records/s, drops and window
publish latency (window close -> subscriber), for a replayed real trace at a few speeds.

    .venv/bin/python bench/bench_agent.py [--seconds 30] [--speeds 0.25,1,2] [--sched]

Each row is one agent process (``ridgeline agent`` with the replay probe, Prometheus on)
measured from outside: CPU from /proc/<pid>/stat (utime+stime over the run, after a
warm-up), RSS from /proc/<pid>/status, latency from the envelope's window end to the
subscriber's receive time. Numbers on a shared machine are noisy; the table prints the
load average next to them.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TRACE = Path(os.environ.get("RIDGELINE_SHARED", ROOT.parent / "shared")) / "traces" / \
    "nvidia-inference/tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz"
TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_s(pid: int) -> float:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TICK


def rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def run(speed: float, seconds: float, sched: bool) -> dict:
    from ridgeline.agent.subscriber import Subscriber
    port = free_port()
    d = tempfile.mkdtemp()
    cfg = Path(d) / "agent.toml"
    probes = '["sched", "replay"]' if sched else '["replay"]'
    cfg.write_text(f'[publisher]\nendpoint = "tcp://127.0.0.1:{port}"\n[prometheus]\nlisten = "127.0.0.1:{free_port()}"\n'
                   f'[probes]\nenabled = {probes}\npids = [{os.getpid()}]\n[probes.replay]\npath = "{TRACE}"\nspeed = {speed}\n')
    p = subprocess.Popen([sys.executable, "-m", "ridgeline", "agent", "--config", str(cfg)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sub = Subscriber(f"tcp://127.0.0.1:{port}", topics=("window",))
    lat, kernels, drops = [], 0, 0
    try:
        warm_end = time.monotonic() + 5
        while time.monotonic() < warm_end:
            sub.receive(0.2)
        c0, t0 = cpu_s(p.pid), time.monotonic()
        peak = 0
        while time.monotonic() - t0 < seconds:
            m = sub.receive(0.2)
            peak = max(peak, rss(p.pid))
            if m is None:
                continue
            lat.append(time.time_ns() - m.payload["end_ns"])
            kernels += sum(g["kernels"] for g in m.payload["gpus"])
            a = m.payload["agent"]
            drops = a.get("drops", 0) + a.get("publisher_drops", 0) + a.get("window_drops", 0)
        c1, t1 = cpu_s(p.pid), time.monotonic()
    finally:
        sub.close()
        p.send_signal(signal.SIGTERM)
        p.wait(30)
    lat.sort()
    q = (lambda f: lat[min(len(lat) - 1, int(f * len(lat)))] / 1e6) if lat else (lambda f: float("nan"))
    return {"speed": speed, "kernels_per_s": kernels / (t1 - t0), "cpu_pct": 100 * (c1 - c0) / (t1 - t0),
            "rss_mib": rss_end(peak), "p50_ms": q(0.5), "p99_ms": q(0.99), "drops": drops,
            "load": os.getloadavg()[0], "sched": sched}


def rss_end(peak: int) -> float:
    return peak / 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--speeds", default="0.25,1")
    ap.add_argument("--sched", action="store_true", help="also start the eBPF sched probe (needs root + bcc)")
    args = ap.parse_args()
    if not TRACE.exists():
        print(f"bench_agent: trace not found: {TRACE}", file=sys.stderr)
        return 2
    rows = [run(float(s), args.seconds, args.sched) for s in args.speeds.split(",")]
    print(f"agent streaming a replay of {TRACE.name}, {args.seconds:g} s per row"
          + (" (+ eBPF sched probe)" if args.sched else ""))
    print(f"{'speed':>6} {'kernels/s':>10} {'CPU % core':>10} {'peak RSS MiB':>12} {'publish p50 ms':>14} "
          f"{'p99 ms':>8} {'drops':>6} {'loadavg':>8}")
    for r in rows:
        print(f"{r['speed']:>6g} {r['kernels_per_s']:>10,.0f} {r['cpu_pct']:>10.1f} {r['rss_mib']:>12.0f} "
              f"{r['p50_ms']:>14.1f} {r['p99_ms']:>8.1f} {r['drops']:>6} {r['load']:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
