"""Cost of writing Parquet recordings against the cost of publishing the same stream.

    .venv/bin/python bench/bench_parquet.py [--seconds 10] [--runs 3]

The simulator's vLLM stream (``ridgeline simulate``: ~47k kernels, ~47k launch calls per
second of GPU time), cut into the 1-second event batches the agent publishes. Measured
side by side in one run, the paths alternated within each round, min/median/max over
``--runs`` rounds (CPU time: ``process_time`` in this process, the child's rusage for the
sink):

* publish: what the agent pays per batch to publish it: the stateful wire encoder
  (``EventBatchEncoder.encode``) and the envelope (``encode_envelope``);
* sink child: the agent's sink as it runs (agent/sink_supervisor.py's command line:
  ``python -m ridgeline.agent record --format parquet --sink URL -o SPOOL``, zstd, its
  default 60 s roll and 500k-row roll), subscribed to a ZeroMQ PUB socket of this process
  that publishes the envelopes at one batch per second of stream (the agent's pace). Its
  CPU from the moment it has taken a first message (Python, pyarrow and the writer
  started: not a cost per second of stream) to its exit after SIGTERM (the last roll and
  upload included): its exit rusage less the sum of its threads' ``schedstat`` run time
  at that moment. Everything it does per message is in it: the ZeroMQ receive, the
  envelope and batch decode, the journal, the Parquet files, their copy to the
  destination (a folder: ``file://``). The same child left idle for as long (it receives
  nothing, then stops) is measured the same way; the "net" row is the difference (what
  the stream costs it, its polling and status file left out);
* rlrec: ``ridgeline record`` writing the published envelopes to a ``.rlrec`` file;
* parquet: ``ParquetRecordingWriter.add_message`` on the agent's decoded batches
  (structured rows) plus the flushes (files written every 1 M rows; the last flush
  included), with zstd and with lz4; and ``ParquetRecordingWriter.write`` from the
  envelopes (what ``export`` and the sink's journal replay pay; decoding too).

Removing the files is outside the timings (a fresh folder for each run). Prints one
markdown table: CPU seconds per second of stream (min, median, max), events per CPU
second and the ratio to publishing (medians), bytes on disk (or on the wire) per event,
and the load average before and after.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from support.recording_synth import _KINDS, _slices, simulated_trace  # noqa: E402

from ridgeline.agent.config import SinkSettings  # noqa: E402
from ridgeline.agent.parquet_recording import ParquetRecordingWriter  # noqa: E402
from ridgeline.agent.recording import RecordingWriter  # noqa: E402
from ridgeline.agent.sink_supervisor import command  # noqa: E402
from ridgeline.aggregator import wire  # noqa: E402
from ridgeline.probes.events import Trace  # noqa: E402


def _cpu(fn) -> tuple[float, object]:
    t = time.process_time()
    out = fn()
    return time.process_time() - t, out


def _threads_run_s(pid: int) -> float:
    """The process's threads' CPU time so far (schedstat: ns, not clock ticks)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:
            pass          # a thread that ended while listed: its time is in the exit rusage
    return total / 1e9


def _status(spool: Path) -> dict:
    try:
        return orjson.loads((spool / "status.json").read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        return {}


def _sink_child(envs: list[bytes], tmp: Path, pace_s: float, idle: bool) -> tuple[float, int]:
    """One run of the real sink child: (its CPU seconds after it took its first message,
    bytes it uploaded)."""
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    spool, dest = tmp / "spool", tmp / "dest"
    settings = SinkSettings(enabled=True, url=f"file://{dest}", spool_dir=str(spool), endpoint="", scheme="https",
                            region="", roll_s=60.0, spool_max_bytes=8 << 30, min_free_bytes=0, restart_max_s=60.0,
                            handoff_max_bytes=0)
    proc = subprocess.Popen(command(settings, f"tcp://127.0.0.1:{port}"), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # a first message until the child has taken one (its subscription in effect and
        # its writer ready): only then does the measured stretch begin
        seq = 0
        deadline = time.monotonic() + 120
        while _status(spool).get("messages", 0) < 1:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sink child did not start: {proc.stderr.read().decode()[-2000:]}")
            pub.send_multipart([b"health", wire.encode_envelope("health", seq, {"ok": True}, "bench-host",
                                                                time.time_ns())])
            seq += 1
            time.sleep(0.2)
        taken = _status(spool)["messages"]
        ready_s = _threads_run_s(proc.pid)
        start = time.monotonic()
        for i, e in enumerate(envs):
            if not idle:
                pub.send_multipart([b"events", e])
            time.sleep(max(0.0, start + (i + 1) * pace_s - time.monotonic()))
        want = taken + (0 if idle else len(envs))
        while _status(spool).get("messages", 0) < want:
            if proc.poll() is not None or time.monotonic() > deadline + 60:
                raise RuntimeError("sink child lost messages or died")
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, rc, ru = os.wait4(proc.pid, 0)
        proc.returncode = rc
        if rc != 0:
            raise RuntimeError(f"sink child exited {rc}: {proc.stderr.read().decode()[-2000:]}")
        cpu_s = ru.ru_utime + ru.ru_stime - ready_s
        uploaded = sum(p.stat().st_size for p in dest.rglob("*.parquet"))
        return cpu_s, uploaded
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.wait()
        pub.close(0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=10, help="seconds of the simulated stream (batches)")
    ap.add_argument("--runs", type=int, default=3, help="rounds, each path once a round")
    ap.add_argument("--pace", type=float, default=1.0, help="seconds between the batches sent to the sink child")
    ap.add_argument("--child-repeat", type=int, default=3,
                    help="the batches sent to the sink child this many times over (a fresh process's first "
                         "rolls pay first-use costs that a sink running for hours does not)")
    ap.add_argument("--no-child", action="store_true", help="leave out the sink child (in-process paths only)")
    ap.add_argument("--source", type=Path, default=Path(tempfile.gettempdir()) / "ridgeline-sim10.json.gz")
    a = ap.parse_args()
    src = simulated_trace(a.source)
    t0 = min(int(getattr(src, k)["start_ns"].min()) for k in _KINDS if len(getattr(src, k)))
    batches = [Trace(names=src.names, devices=src.devices, meta={"source": "simulated", "model": "llama-3-8b"},
                     **parts) for _, parts in _slices(src, t0)][:a.seconds]
    events = sum(len(b.kernels) + len(b.copies) + len(b.api) + len(b.ranges) for b in batches)
    recv = [1_796_119_200 * 10**9 + i * 10**9 for i in range(len(batches))]
    load_before = os.getloadavg()

    def publish():
        enc = wire.EventBatchEncoder()
        return [wire.encode_envelope("events", i, enc.encode(b), "bench-host", recv[i])
                for i, b in enumerate(batches)]
    publish()                                  # warm: the first call pays imports and caches
    _, envs = _cpu(publish)
    wire_bytes = sum(len(e) for e in envs)

    tmp = Path(tempfile.mkdtemp(prefix="ridgeline-bench-parquet-"))

    def clean():
        for d in tmp.iterdir():
            shutil.rmtree(d) if d.is_dir() else d.unlink()

    def rlrec():
        p = tmp / "run.rlrec"
        with RecordingWriter(p) as w:
            for i, e in enumerate(envs):
                w.write(e, recv[i])
        return p.stat().st_size

    def parquet_batches(compression="zstd"):
        with ParquetRecordingWriter(tmp / "run", recording="bench", compression=compression) as w:
            for i, b in enumerate(batches):
                w.add_message("events", i, "bench-host", recv[i], recv[i], b)
        return w.bytes

    def parquet_envelopes():
        with ParquetRecordingWriter(tmp / "run", recording="bench") as w:
            for i, e in enumerate(envs):
                w.write(e, recv[i])
        return w.bytes

    paths = [("publish (wire encode + envelope)", lambda: (publish(), wire_bytes)[1]),
             ("record .rlrec (framed envelopes)", rlrec),
             ("Parquet from the agent's batches", parquet_batches),
             ("Parquet from the agent's batches, lz4", lambda: parquet_batches("lz4")),
             ("Parquet from envelopes (decode + write)", parquet_envelopes)]
    cpu: dict[str, list[float]] = {name: [] for name, _ in paths}
    size: dict[str, float] = {}   # bytes per event
    child_rows = ("sink child, whole (its CPU after its first message)", "sink child, idle as long",
                  "sink child, net of idle")
    if not a.no_child:
        cpu.update({name: [] for name in child_rows})
    secs = len(batches)
    child_secs = secs * a.child_repeat
    try:
        for _, fn in paths:          # warm: each path's first call pays pyarrow's and numpy's first uses
            fn()
            clean()
        for _ in range(a.runs):
            for name, fn in paths:
                s, size[name] = _cpu(fn)
                cpu[name].append(s / secs)
                size[name] /= events
                clean()
            if a.no_child:
                continue
            whole, up = _sink_child(envs * a.child_repeat, tmp, a.pace, idle=False)
            clean()
            idle, _ = _sink_child(envs * a.child_repeat, tmp, a.pace, idle=True)
            clean()
            cpu[child_rows[0]].append(whole / child_secs)
            cpu[child_rows[1]].append(idle / child_secs)
            cpu[child_rows[2]].append((whole - idle) / child_secs)
            size[child_rows[0]] = size[child_rows[2]] = up / (events * a.child_repeat)
            size[child_rows[1]] = 0.0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    pub_s = statistics.median(cpu[paths[0][0]])
    rows = ["| path | CPU s per s of stream: min | median | max | events per CPU s | bytes per event | "
            "CPU vs publish |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name, v in cpu.items():
        med = statistics.median(v)
        rows.append(f"| {name} | {min(v):.4f} | {med:.4f} | {max(v):.4f} | "
                    f"{events / secs / max(med, 1e-9):,.0f} | {size[name]:.2f} | {med / max(pub_s, 1e-9):.2f}x |")
    print(f"{secs} s of the simulated vLLM stream: {events:,} events "
          f"({sum(len(b.kernels) for b in batches):,} kernels), one batch per second; {a.runs} rounds; "
          f"the sink child sent them {a.child_repeat} times over, a batch every {a.pace:g} s\n")
    print("\n".join(rows))
    print("\nload average (1, 5, 15 min) before: " + ", ".join(f"{x:.2f}" for x in load_before)
          + "; after: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(f"this process's peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB")
    print(f"\nReproduce: .venv/bin/python bench/bench_parquet.py --seconds {secs} --runs {a.runs} "
          f"--pace {a.pace:g} --child-repeat {a.child_repeat}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
