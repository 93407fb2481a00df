"""Host cost of the CUPTI injection library per kernel launch, in the served process.

    .venv/bin/python bench/bench_served.py                    # 50k launches/s and a burst, 3 runs each
    .venv/bin/python bench/bench_served.py --launches 200000 --rates 50000,0 --runs 5

A stand-in served process (``bench/served_app.c``, built here with the project's CUPTI
headers) launches kernels and plays CUPTI writing each launch's records (one kernel record,
one cudaLaunchKernel runtime API record) through the stand-in libcupti of the tests
(``probes/native/tests/stub_cupti.c``: ``stub_record``, what CUPTI does when a kernel
completes: records go into the buffer the client handed out, completed when full or
flushed). Three modes, side by side in one run, alternating, same launches and rate:

* ``bare``: no CUPTI, no library (an uninjected process): the loop's own cost;
* ``cupti``: the stand-in libcupti with a minimal client made in the app (one recycled
  buffer, completion ignored): CUPTI's record writing without Ridgeline;
* ``inject``: ``libridgeline_cupti.so`` loaded as the driver does (``InitializeInjection``,
  ``CUDA_INJECTION64_PATH``), its buffers, completion handling, flush and sender threads
  running, sending to a real agent-side receiver (``probes.cupti.probe.CuptiProbe``, polled
  in this process, which is not the one measured).

Measured: the served process's CPU (all its threads, ``getrusage``) over the launch loop
and a linger that lets the library send what is left, per launch. The library's own cost
per launch is ``inject - cupti`` (medians); ``inject - bare`` adds what CUPTI itself costs.
The kernels the agent received are counted: a run that lost records does not hide its cost.
Target: <= 1 us of the library's own CPU per launch (the anchors: about 25 us of CPU per
launch reported for zymtrace; parcagpu's library cost vLLM 64% of its throughput). What the
stub cannot show: CUPTI's own cost on a real GPU and driver (a lent GPU's check gives that).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "probes" / "native"
LIB = NATIVE / "libridgeline_cupti.so"
STUB = NATIVE / "build" / "libcupti_stub.so"
APP_SRC = Path(__file__).resolve().parent / "served_app.c"


def cupti_include() -> Path:
    """The CUPTI header folder the native Makefile would use (the venv's wheel first)."""
    env = os.environ.get("CUPTI_INCLUDE")
    if env:
        return Path(env)
    for cand in sorted((ROOT / ".venv").glob("lib/python3*/site-packages/nvidia/*/include/cupti_activity.h")):
        return cand.parent
    for cand in (Path("/usr/local/cuda/extras/CUPTI/include"), Path("/usr/local/cuda/include")):
        if (cand / "cupti_activity.h").exists():
            return cand
    raise SystemExit("bench_served: CUPTI headers not found (install the nvidia-cuda-cupti wheel into .venv "
                     "or set CUPTI_INCLUDE)")


def build(out: Path) -> Path:
    r = subprocess.run(["make", "-s", "-C", str(NATIVE)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"bench_served: make -C probes/native failed: {r.stderr.strip()[-400:]}")
    app = out / "served_app"
    r = subprocess.run([os.environ.get("CC", "cc"), "-O2", "-std=c11", "-Wall", "-Wextra",
                        f"-I{NATIVE / 'compat'}", f"-I{cupti_include()}", "-o", str(app), str(APP_SRC), "-ldl"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise SystemExit(f"bench_served: building served_app failed: {r.stderr.strip()[-400:]}")
    return app


class Receiver:
    """The agent side: the real CUPTI probe's server, polled in a thread; counts kernels."""

    def __init__(self, sock: Path):
        from ridgeline.probes.cupti.probe import CuptiProbe
        self.probe = CuptiProbe(str(sock))
        self.probe.start()
        self.kernels = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            out = self.probe.poll()
            if "trace" in out:
                self.kernels += len(out["trace"].kernels)
            time.sleep(0.02)

    def wait_for(self, n: int, timeout_s: float) -> int:
        end = time.monotonic() + timeout_s
        while self.kernels < n and time.monotonic() < end:
            time.sleep(0.02)
        return self.kernels

    def drops(self) -> dict:
        """Cumulative record drops by cause (the library's counters as the agent received
        them) and batches the agent's bounded queue refused."""
        c = self.probe.counters()
        out = {k: c.get(f"library_{k}", 0) for k in ("dropped_cupti", "dropped_pool_full", "dropped_no_agent",
                                                     "dropped_send")}
        out["agent_batches_refused"] = c.get("dropped_batches", 0)
        return out

    def close(self):
        self._stop.set()
        self._t.join(5)
        self.probe.stop()


def run_app(app: Path, mode: str, launches: int, rate: int, linger_ms: int, sock: Path) -> dict:
    env = dict(os.environ, RIDGELINE_LIBCUPTI=str(STUB), CUDA_INJECTION64_PATH=str(LIB), RIDGELINE_SOCKET=str(sock),
               RIDGELINE_QUIET="1")
    for k in list(env):
        if k.startswith("STUB_CUPTI_"):
            del env[k]
    if mode != "inject":
        env.pop("CUDA_INJECTION64_PATH")
    r = subprocess.run([str(app), mode, str(launches), str(rate), str(linger_ms)], capture_output=True, text=True,
                       env=env, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"bench_served: served_app {mode} failed ({r.returncode}): {r.stderr.strip()[-400:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=100_000, help="kernel launches per run (default 100,000)")
    ap.add_argument("--rates", default="50000,0", help="launches/s, comma-separated; 0 = as fast as possible")
    ap.add_argument("--runs", type=int, default=3, help="runs per mode and rate (default 3)")
    ap.add_argument("--linger-ms", type=int, default=300, help="after the loop, for the library to send (default 300)")
    ap.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    try:
        rates = [int(x) for x in args.rates.split(",")]
    except ValueError:
        print(f"bench_served: bad --rates {args.rates!r} (launches/s, comma-separated)", file=sys.stderr)
        return 2
    if args.launches <= 0 or args.runs <= 0 or any(r < 0 for r in rates):
        print("bench_served: --launches and --runs must be positive, rates >= 0", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="ridgeline-bench-served-"))
    app = build(tmp)
    sock = tmp / "cupti.sock"
    recv = Receiver(sock)
    rows = []
    load0 = os.getloadavg()[0]
    try:
        for rate in rates:
            per = {"bare": [], "cupti": [], "inject": []}
            received, drops = [], []
            for _ in range(args.runs):
                for mode in ("bare", "cupti", "inject"):
                    before, d0 = recv.kernels, recv.drops()
                    r = run_app(app, mode, args.launches, rate, args.linger_ms, sock)
                    per[mode].append(r["cpu_ns"] / args.launches)
                    if mode == "inject":
                        received.append(recv.wait_for(before + args.launches, 10.0) - before)
                        time.sleep(0.5)          # the process's last counters reach the agent
                        d1 = recv.drops()
                        drops.append({k: d1[k] - d0[k] for k in d1 if d1[k] != d0[k]})
            med = {m: median(v) for m, v in per.items()}
            rows.append({"rate_per_s": rate, "launches": args.launches, "runs": args.runs,
                         "ns_per_launch": per, "median_ns_per_launch": med,
                         "library_ns_per_launch": med["inject"] - med["cupti"],
                         "with_cupti_ns_per_launch": med["inject"] - med["bare"],
                         "kernels_received": received, "drops": drops})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        recv.close()
    load1 = os.getloadavg()[0]
    cmd = "python bench/bench_served.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = [f"Command: `{cmd.strip()}`  ",
           f"Host: {platform.node() or 'host'}, {os.cpu_count()} CPUs, load average {load0:.1f} -> {load1:.1f}; "
           f"stand-in libcupti, {args.launches:,} launches per run, modes alternating, {args.runs} runs each.", "",
           "| launches/s | bare ns/launch (min / median / max) | cupti (stub + minimal client) | "
           "inject (stub + libridgeline_cupti) | library's own (inject - cupti, medians) | "
           "inject - bare | kernels at the agent (per run) | records dropped, by cause (per run) |",
           "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        def mmm(m):
            v = sorted(r["ns_per_launch"][m])
            return f"{v[0]:.0f} / {median(v):.0f} / {v[-1]:.0f}"
        out.append(f"| {r['rate_per_s'] or 'burst'} | {mmm('bare')} | {mmm('cupti')} | {mmm('inject')} | "
                   f"**{r['library_ns_per_launch']:.0f}** | {r['with_cupti_ns_per_launch']:.0f} | "
                   f"{', '.join(f'{k:,}' for k in r['kernels_received'])} | "
                   f"{'; '.join(', '.join(f'{k} {v:,}' for k, v in d.items()) or 'none' for d in r['drops'])} |")
    out.append("")
    out.append("Target: the library's own CPU <= 1,000 ns per launch. CPU of all the served process's threads "
               "(getrusage) over the loop and the linger, per launch.")
    print("\n".join(out))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
