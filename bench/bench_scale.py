"""Scale and cost of the agent fed simulated kernel streams (1 GPU at 50k kernels/s, 8 GPUs at 100k each).

    .venv/bin/python bench/bench_scale.py                      # both scenarios, 60 s each
    .venv/bin/python bench/bench_scale.py --duration 20 --scenarios 1x50000

Three processes per scenario, launched side by side in one run:

* generator (its own process, so its cost is not the agent's): builds one simulated
  decode step per GPU (``agent.simulator``, vLLM conventions, Llama-3-8B on H100, 324
  kernels), runs whole steps at the target kernel rate (:class:`StepStream`: short steps
  with idle between them, or with ``xlong`` steps that never visibly end) and cuts them
  into 50 ms batches on their wall-clock deadlines. Every kernel comes with its launch
  API record. ``--feed cupti`` (the default): it is an injected process as the agent sees
  one. It connects to the agent's CUPTI socket, says HELLO and writes BATCH frames of raw
  ``CUpti_ActivityKernel`` and runtime API records (cupti-python's layouts) as
  libridgeline_cupti.so does (:class:`CuptiFrames`): a 4 MiB buffer's worth as soon as
  it is full, else every 500 ms (the library's defaults). ``--feed arrays``: it pushes the
  decoded event arrays over ZeroMQ (PUSH, non-blocking: a full queue drops the batch and
  counts it) to a bench probe, which measures the agent without its CUPTI intake.
* agent: the real daemon (``agent.daemon.Agent``: window folding with phases and
  roofline, wire encoding, XPUB publishing, health, Prometheus off). With the cupti feed,
  its probe is the real CUPTI probe from the registry (socket server, pump thread,
  parse, decode, launch join, name tables), the GPU named in ``analysis.gpu``; with the
  arrays feed, one probe that drains the feed socket (zero-copy ``np.frombuffer``;
  bounded input queue, RCVHWM). The arrays feed used to be the only one: it left out the
  CUPTI intake, which is about a third of the agent's CPU at 50k kernels/s.
* subscriber: SUB on the agent's ``window`` and ``health`` topics; per window the latency
  from window close (the record's ``end_ns``) to receipt, and the sequence gaps.

Measured for the agent process from ``/proc/PID``: CPU (utime + stime over the steady
interval, after a warm-up) as % of one core, minor page faults per second over the same
interval (fresh pages for the fold's temporaries: see agent/allocator.py), peak RSS
(``VmHWM``); dropped records
(generator send drops + the agent's publisher/window/probe drops); window publish latency
p50/p99; kernels sent and counted in published windows, and the carry lag: from a batch's
send to the end of the first window that counts it, in window lengths. Targets: carry lag
< 2 windows at every rate, <= 1% of one core at 50k kernels/s (200 ns per kernel), <= 256 MB RSS,
zero drops with a subscriber keeping up. Prints one table (markdown) and, with ``--json``, the rows.

``--runs N`` repeats each scenario; ``--baseline TREE`` (another checkout with its own
``.venv``, e.g. the main branch) runs that tree's bench_scale.py for the same scenario
before each of this tree's runs, alternating, so both are measured back to back under
the same load; a second table gives agent CPU and ns per kernel, min / median / max
over the runs, before (baseline) and after (this tree), with each side's faults, drops,
kernels sent and counted in windows, carry lag and the host's load average.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

BATCH_S = 0.05
WINDOW_S = 1.0
WARMUP_S = 5.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
# The agent's CPU target at 1 GPU x 50k kernels/s (issue 21): 1% of one core, 200 ns per kernel.
TARGET_CPU_PCT = 1.0
TARGET_RATE = 50_000


# ---------------------------------------------------------------- generator

def step_template(device: int):
    """One simulated decode step (kernels + launch API records) of one GPU."""
    from ridgeline.agent.simulator.engine import SimConfig, SimEngine
    e = SimEngine(SimConfig(model="llama-3-8b", gpu="h100", device=device, pid=9000 + device, tid=9000 + device,
                            annotations=False), seed=0, metrics=False)
    e.forward([1] * 32, [1000] * 32)
    t = e.drain()
    return t.kernels, t.api, list(t.names), e.gpu.name


class StepStream:
    """The kernels of one simulated engine at ``rate`` kernels/s per GPU, in time order,
    cut into BATCH_S batches by start time.

    Whole steps, as an engine runs them: ``steps="short"`` puts one step every
    n/rate seconds at its simulated length (squeezed to 90% of the step period when the
    rate leaves less), idle between steps; ``steps="long"`` spreads the kernels evenly
    (kernel g at g/rate s), so a step lasts n/rate s and never shows an idle gap or a
    restart: a step that never visibly ends. (The bench used to tile one BATCH_S period
    with the first rate x BATCH_S kernels of the step: below n/BATCH_S = 6,480 kernels/s
    every period sent the same truncated step, which never ends, and at 10 kernels/s it
    sent nothing at all.)"""

    def __init__(self, gpus: int, rate: int, steps: str = "short"):
        from ridgeline.probes.events import API_LAUNCH
        self.gpus, self.rate = gpus, rate
        k, a, names, gpu_name = step_template(0)
        a = a[a["category"] == API_LAUNCH]          # one launch record per kernel
        o = np.argsort(k["start_ns"], kind="stable")
        self.k, self.a = k[o], a[o]
        self.names, self.gpu_name = names, gpu_name
        self.n = n = len(k)
        t0 = int(self.k["start_ns"].min())
        length = max(1, int(self.k["end_ns"].max()) - t0)
        self.period_ns = period = int(1e9 * n / rate)
        scale = 1.0
        if steps == "long":
            gap = period // n
            self.off = np.arange(n, dtype=np.int64) * gap
            self.dur = np.minimum(self.k["end_ns"] - self.k["start_ns"], gap // 2).astype(np.int64)
        else:
            scale = min(1.0, 0.9 * period / length)
            self.off = ((self.k["start_ns"] - t0) * scale).astype(np.int64)
            self.dur = np.maximum(((self.k["end_ns"] - self.k["start_ns"]) * scale).astype(np.int64), 1)
        # The launch records squeezed with their step: one launch thread's calls stay in
        # order and apart, as a real thread's do (unscaled leads of up to a step's length
        # put the next step's launches before this step's).
        self.api_lead = ((self.k["start_ns"] - self.a["start_ns"]) * scale).astype(np.int64)
        self.api_dur = np.maximum(((self.a["end_ns"] - self.a["start_ns"]) * scale).astype(np.int64), 1)

    def first_index(self, t_ns: int) -> int:
        """Global index of the first kernel starting at or after t_ns (times from 0)."""
        j = t_ns // self.period_ns
        r = int(np.searchsorted(self.off, t_ns - j * self.period_ns, side="left"))
        return int(j * self.n + r)

    def batch(self, i: int, base_ns: int = 0):
        """Kernels and launch records of batch i (starts in [i, i+1) x BATCH_S), all GPUs."""
        b = int(BATCH_S * 1e9)
        g = np.arange(self.first_index(i * b), self.first_index((i + 1) * b), dtype=np.int64)
        r = g % self.n
        start = (g // self.n) * self.period_ns + self.off[r] + base_ns
        ks, aps = [], []
        for dev in range(self.gpus):
            kk = self.k[r]
            aa = self.a[r]
            kk["start_ns"] = start
            kk["end_ns"] = start + self.dur[r]
            kk["device"] = dev
            kk["correlation_id"] = g + dev * (1 << 40)
            aa["start_ns"] = start - self.api_lead[r]
            aa["end_ns"] = aa["start_ns"] + self.api_dur[r]
            aa["correlation_id"] = kk["correlation_id"]
            ks.append(kk)
            aps.append(aa)
        return (ks[0], aps[0]) if self.gpus == 1 else (np.concatenate(ks), np.concatenate(aps))


class CuptiFrames:
    """The stream's batches as libridgeline_cupti.so frames them for the agent's socket
    (probes/cupti/protocol.py): a HELLO, then per batch one BATCH with a section of raw
    ``CUpti_ActivityKernel`` records and one of runtime API records, laid out with
    cupti-python's dtypes (tests/support/cupti_records.py), the kernel names sent once as
    the library sends a name the first time it sees the pointer. One served process (this
    one: the agent takes the pid from SO_PEERCRED) launching on every GPU, one launch
    thread per GPU; correlation ids are CUPTI's uint32, unique in the process."""

    def __init__(self, stream: "StepStream"):
        sys.path.insert(0, str(ROOT / "tests"))
        from support import cupti_records as R
        self.R, self.stream = R, stream
        self.ptrs = 0x7F00_0000_0000 + 64 * np.arange(len(stream.names), dtype=np.int64)   # name "pointers"
        self.names_sent = False

    def hello(self) -> bytes:
        R = self.R
        return R.hello_frame(comm=b"bench-engine",
                             cbids=((1, R.CBID_CUDA_LAUNCH_KERNEL, 1, b"cudaLaunchKernel_v7000"),))

    def batch(self, k: np.ndarray, a: np.ndarray) -> bytes | memoryview:
        """One BATCH frame of these kernels and their launch records. Written in place
        into one buffer (frame header, batch header, two sections of records), since
        copying 4 MiB frames piece by piece made the generator too slow for 8 GPUs at
        100k kernels/s; the first frame, with the names, is built by
        tests/support/cupti_records.batch_frame, the library's layout."""
        from ridgeline.probes.cupti import protocol as P
        R = self.R
        n = len(k)
        ksz, asz = R.KERNEL.itemsize, R.API.itemsize
        fh, bh, sh = P.FRAME_DTYPE.itemsize, P.BATCH_DTYPE.itemsize, P.SECTION_DTYPE.itemsize
        body_len = bh + 2 * sh + n * (ksz + asz)
        buf = np.zeros(fh + body_len, np.uint8)
        off = fh + bh
        s1 = buf[off:off + sh].view(P.SECTION_DTYPE)
        s1["kind"], s1["record_size"], s1["count"] = R.KIND_CONCURRENT_KERNEL, ksz, n
        off += sh
        raw = buf[off:off + n * ksz].view(R.KERNEL)
        off += n * ksz
        s2 = buf[off:off + sh].view(P.SECTION_DTYPE)
        s2["kind"], s2["record_size"], s2["count"] = R.KIND_RUNTIME, asz, n
        off += sh
        api = buf[off:off + n * asz].view(R.API)
        corr = ((k["correlation_id"] >> 40) + (k["correlation_id"] & ((1 << 40) - 1)) * self.stream.gpus) \
            % 0xFFFF_FFFF + 1
        raw["kind"] = R.KIND_CONCURRENT_KERNEL
        raw["start"], raw["end"] = k["start_ns"], k["end_ns"]
        raw["completed"] = k["end_ns"]
        raw["device_id"], raw["context_id"], raw["stream_id"] = k["device"], 1, k["stream"]
        raw["correlation_id"] = corr
        for f in ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z"):
            raw[f] = k[f]
        raw["registers_per_thread"] = k["registers"]
        raw["dynamic_shared_memory"] = k["shared_mem_bytes"]
        raw["name"] = self.ptrs[k["name_id"]]
        # CUPTI's "not in a graph" is 0 (the decoder's -1)
        raw["graph_id"], raw["graph_node_id"] = np.maximum(k["graph_id"], 0), np.maximum(k["graph_node_id"], 0)
        api["kind"] = R.KIND_RUNTIME
        api["cbid"] = R.CBID_CUDA_LAUNCH_KERNEL
        api["start"], api["end"] = a["start_ns"], a["end_ns"]
        api["process_id"] = os.getpid()
        api["thread_id"] = 9000 + k["device"]
        api["correlation_id"] = corr
        devices = tuple(range(self.stream.gpus))
        if not self.names_sent:
            self.names_sent = True
            names = {int(p): nm for p, nm in zip(self.ptrs.tolist(), self.stream.names)}
            return R.batch_frame([(R.KIND_CONCURRENT_KERNEL, ksz, raw.tobytes()), (R.KIND_RUNTIME, asz, api.tobytes())],
                                 names=names, devices=devices)
        b = buf[fh:fh + bh].view(P.BATCH_DTYPE)
        b["pid"], b["cupti_version"], b["n_sections"], b["records"] = os.getpid(), 130500, 2, 2 * n
        b["n_devices"] = len(devices)
        b["device_ids"][0, :len(devices)] = devices
        h = buf[:fh].view(P.FRAME_DTYPE)
        h["magic"], h["type"], h["proto"], h["length"] = P.MAGIC, P.MSG_BATCH, P.PROTO_VERSION, body_len
        return memoryview(buf)


def generator_main(endpoint: str, gpus: int, rate: int, steps: str, duration_s: float, t_start: float,
                   out: mp.Queue, feed: str = "cupti"):
    stream = StepStream(gpus, rate, steps)
    if feed == "cupti":
        return _generate_cupti(endpoint, stream, duration_s, t_start, out)
    import zmq
    periods = int(duration_s / BATCH_S)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 20)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart([b"names", json.dumps({"names": stream.names, "gpu": stream.gpu_name,
                                               "gpus": gpus}).encode()])
    while time.time() < t_start:
        time.sleep(0.001)
    base_ns = int(t_start * 1e9)
    sent = dropped = late = 0
    sends = []                                        # (wall time sent, kernels sent so far)
    cpu0 = time.process_time()
    for i in range(periods):
        k, a = stream.batch(i, base_ns)               # built ahead of its deadline
        deadline = t_start + (i + 1) * BATCH_S         # a batch leaves when its period has passed
        delay = deadline - time.time()
        if delay > 0:
            time.sleep(delay)
        elif delay < -BATCH_S:
            late += 1
        if not len(k):
            continue
        try:
            sock.send_multipart([b"k", k.data, a.data], flags=zmq.NOBLOCK, copy=True)
            sent += len(k)
            sends.append((time.time(), sent))
        except zmq.Again:
            dropped += len(k)
    out.put({"sent": sent, "dropped": dropped, "late_batches": late, "sends": sends,
             "generator_cpu_s": time.process_time() - cpu0})
    sock.close()
    ctx.term()


# libridgeline_cupti.so's defaults (probes/native/ridgeline_cupti_config.c): 4 MiB CUPTI
# buffers (RIDGELINE_BUFFER_BYTES), flushed every 500 ms (RIDGELINE_FLUSH_MS); a completed
# buffer goes to the agent as one BATCH.
CUPTI_BUFFER_BYTES = 4 << 20
CUPTI_FLUSH_S = 0.5
CUPTI_POOL_SLOTS = 8          # RIDGELINE_POOL_SLOTS: completed buffers waiting for the sender


def _generate_cupti(path: str, stream: "StepStream", duration_s: float, t_start: float, out: mp.Queue):
    """The generator as an injected process: connects to the agent's CUPTI socket and
    writes frames as the library does: a 4 MiB buffer's worth of records (kernel + launch
    record: 288 bytes a kernel, 14,563 kernels) as soon as it is full, and whatever the
    buffer holds once its oldest record is 500 ms old (the periodic flush). As in the
    library, a sender thread writes the completed buffers from a pool of 8: an agent that
    falls behind fills the pool, and a buffer completed while it is full is dropped and
    counted (the library's ``dropped_pool_full``), never waited for."""
    import queue
    import socket
    import threading
    frames = CuptiFrames(stream)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    for _ in range(200):                                   # the agent may still be binding
        try:
            sock.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.05)
    sock.sendall(frames.hello())
    pool: queue.Queue = queue.Queue(CUPTI_POOL_SLOTS)
    sends = []                                # (wall time sent, kernels sent so far)
    sent = dropped = 0
    unsent = 0                                # frames' kernels the sender did not send
    broken: list[OSError] = []
    stop = threading.Event()

    def sender():
        # Every frame taken is sent or counted unsent, once: after a send fails (the agent
        # went away) or the feed is stopped, the pool is still drained, so that the
        # generator's last put never blocks and nothing is counted twice.
        nonlocal sent, unsent
        while (item := pool.get()) is not None:
            frame, n = item
            if broken or stop.is_set():
                unsent += n
                continue
            try:
                sock.sendall(frame)
            except OSError as exc:
                broken.append(exc)
                unsent += n
                continue
            sent += n
            sends.append((time.time(), sent))
    th = threading.Thread(target=sender, daemon=True)
    th.start()
    periods = int(duration_s / BATCH_S)
    while time.time() < t_start:
        time.sleep(0.001)
    base_ns = int(t_start * 1e9)
    late = 0
    per_buffer = CUPTI_BUFFER_BYTES // (frames.R.KERNEL.itemsize + frames.R.API.itemsize)
    held_k, held_a, held_since = [], [], None
    cpu0 = time.process_time()
    for i in range(periods):
        k, a = stream.batch(i, base_ns)
        deadline = t_start + (i + 1) * BATCH_S
        delay = deadline - time.time()
        if delay > 0:
            time.sleep(delay)
        elif delay < -BATCH_S:
            late += 1
        if len(k):
            held_k.append(k)
            held_a.append(a)
            held_since = deadline - BATCH_S if held_since is None else held_since
        n_held = sum(len(x) for x in held_k)
        flush = held_since is not None and (deadline - held_since >= CUPTI_FLUSH_S or i == periods - 1)
        if n_held < per_buffer and not flush:
            continue
        ks, aps = np.concatenate(held_k), np.concatenate(held_a)
        cut = len(ks) if flush else len(ks) - len(ks) % per_buffer
        for lo in range(0, cut, per_buffer):
            hi = min(lo + per_buffer, cut)
            try:
                pool.put_nowait((frames.batch(ks[lo:hi], aps[lo:hi]), hi - lo))
            except queue.Full:
                dropped += hi - lo
        held_k, held_a = ([ks[cut:]], [aps[cut:]]) if cut < len(ks) else ([], [])
        held_since = None if cut == len(ks) else deadline - BATCH_S
    pool.put(None)
    th.join(10 * WINDOW_S)                                  # what the pool holds goes out first
    if th.is_alive():                                       # an agent too slow to read: the rest unsent
        stop.set()
        th.join(30)
    if th.is_alive():
        # still blocked in sendall on an agent that reads nothing: the shutdown fails that
        # send (counted unsent) and the sender drains the pool
        sock.shutdown(socket.SHUT_RDWR)
        th.join(30)
    if th.is_alive():                                       # never: but then counted, not lost
        while True:
            try:
                item = pool.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                dropped += item[1]
    dropped += unsent
    out.put({"sent": sent, "dropped": dropped, "late_batches": late, "sends": list(sends),
             "generator_cpu_s": time.process_time() - cpu0})
    time.sleep(2 * WINDOW_S)                                # the last frames read before the close
    sock.close()


# ---------------------------------------------------------------- agent

class FeedProbe:
    """Drains the generator's socket; the probe side of a CUPTI-like feed."""
    name = "feed"
    optional = False

    def __init__(self, endpoint: str):
        import zmq

        from ridgeline.probes.events import NameTable
        self.zmq = zmq
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, 20)           # bounded: a slow agent makes the sender drop (counted)
        self.sock.bind(endpoint)
        self.names = NameTable()
        self.devices = []
        self.records = self.errors = 0

    def check(self):
        from ridgeline.probes.probe import Availability
        return Availability(True, "bench feed")

    def start(self):
        pass

    def poll(self):
        from ridgeline.probes.events import API_DTYPE, KERNEL_DTYPE, Device, Trace
        ks, aps = [], []
        for _ in range(1000):
            try:
                frames = self.sock.recv_multipart(flags=self.zmq.NOBLOCK, copy=False)
            except self.zmq.Again:
                break
            if frames[0].bytes == b"names":
                info = json.loads(frames[1].bytes)
                for s in info["names"]:
                    self.names.intern(s)
                self.devices = [Device(g, info["gpu"]) for g in range(info["gpus"])]
                continue
            ks.append(np.frombuffer(frames[1].buffer, dtype=KERNEL_DTYPE))
            aps.append(np.frombuffer(frames[2].buffer, dtype=API_DTYPE))
        if not ks:
            return None
        # Raw record copies (numpy's field-wise concatenation of structured arrays was a
        # third of this probe's cost, charged to the agent; CUPTI's probe hands over
        # decoded arrays without it).
        from ridgeline.aggregator.windows import concat_records
        k = concat_records(ks)
        a = concat_records(aps)
        self.records += len(k) + len(a)
        return {"kind": "events", "trace": Trace(kernels=k, api=a, names=self.names, devices=self.devices,
                                                  meta={"source": "simulated"})}

    def stop(self):
        self.sock.close(0)

    def counters(self):
        return {"records": self.records, "drops": 0, "errors": self.errors}


def agent_main(endpoint: str, pub: str, duration_s: float, profile: str = "", feed: str = "cupti",
               gpu_name: str = "", timers: str = ""):
    """The agent process; ``profile``: write a cProfile of its run loop (after the
    warm-up: the profiler is enabled once the first window with kernels has closed) there;
    ``timers``: the CPU time of named functions per thread (bench/agent_timers.py), from
    the same point on, there."""
    import logging
    if timers:
        sys.path.insert(0, str(ROOT / "bench"))
        import agent_timers
        agent_timers.install()

    from ridgeline.agent import config as config_mod
    from ridgeline.agent import registry
    from ridgeline.agent.daemon import Agent
    from ridgeline.probes.probe import Availability
    logging.basicConfig(level=logging.WARNING)
    cfg = config_mod.defaults()
    cfg.agent.window_s = WINDOW_S
    cfg.agent.run_for_s = duration_s
    cfg.publisher.endpoint = pub
    cfg.prometheus.enabled = False
    if feed == "cupti":
        # The real CUPTI probe from the registry, as the daemon starts it, on its own socket;
        # the GPU named in the configuration, as on a host whose NVML probe is off.
        cfg.probes.enabled = ["cupti"]
        cfg.probes.cupti.socket = endpoint
        cfg.analysis.gpu = gpu_name
        a = Agent(cfg)
        probe = None
    else:
        cfg.probes.enabled = []
        probe = FeedProbe(endpoint)
        step = registry.Step("feed", "events", lambda c: probe, "bench feed")
        running = [registry.Running(step, probe, Availability(True))]
        a = Agent(cfg, probes=running)
    a.start()
    prof = None
    if timers:
        close_t = a.close_window

        def close_then_time(*args, **kw):
            w = close_t(*args, **kw)
            if not agent_timers._on and a.records_total:
                agent_timers.start()
            return w
        a.close_window = close_then_time
    if profile:
        import cProfile
        prof = cProfile.Profile()
        close = a.close_window

        def close_then_profile(*args, **kw):
            w = close(*args, **kw)
            if prof is not None and not getattr(prof, "on", False) and a.records_total:
                prof.on = True
                prof.enable()
            return w
        a.close_window = close_then_profile
    try:
        a.run()
    finally:
        if prof is not None:
            prof.disable()
            prof.dump_stats(profile)
        if timers:
            agent_timers.dump(timers)
        a.shutdown()


# ---------------------------------------------------------------- subscriber

def subscriber_main(endpoint: str, until: float, out: mp.Queue, ready):
    import zmq

    from ridgeline.aggregator import wire
    ctx = zmq.Context()
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.RCVHWM, 0)
    s.connect(endpoint)
    for t in (b"window", b"health"):
        s.setsockopt(zmq.SUBSCRIBE, t)
    ready.set()
    lat, seqs, last = [], {}, {}
    kernels, ends = [], []
    agent_drops = {}
    while time.time() < until:
        if not s.poll(200):
            continue
        topic, env = s.recv_multipart()
        now = time.time_ns()
        e = wire.decode_envelope(env)
        t = topic.decode()
        if t in last and e.seq != last[t] + 1:
            seqs[t] = seqs.get(t, 0) + (e.seq - last[t] - 1)
        last[t] = e.seq
        if t == "window":
            w = wire.decode_window(e.payload)
            lat.append(now - int(w["end_ns"]))
            kernels.append(sum(g.get("kernels", 0) for g in w.get("gpus", [])))
            ends.append(int(w["end_ns"]))
            ag = w.get("agent", {}) or {}
            agent_drops = {"publisher_drops": ag.get("publisher_drops", 0), "window_drops": ag.get("window_drops", 0),
                           "probe_drops": sum((c or {}).get("drops", 0) for c in (ag.get("probes") or {}).values())
                           if isinstance(ag.get("probes"), dict) else 0}
    out.put({"latency_ns": lat, "gaps": seqs, "windows": len(lat), "kernels_per_window": kernels, "window_end_ns": ends,
             "agent_drops": agent_drops})
    s.close(0)
    ctx.term()


# ---------------------------------------------------------------- measurement

def proc_stat(pid: int) -> tuple[float, int]:
    """(CPU seconds, user + system, and minor page faults) of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / CLK_TCK, int(parts[7])


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of a process so far, by thread name
    (``comm``; threads of one name summed)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                head, tail = f.read().rsplit(")", 1)
        except FileNotFoundError:       # the thread ended meanwhile
            continue
        name = "main" if tid == str(pid) else head.split("(", 1)[1]
        parts = tail.split()
        out[name] = out.get(name, 0.0) + (int(parts[11]) + int(parts[12])) / CLK_TCK
    return out


def proc_cpu_s(pid: int) -> float:
    return proc_stat(pid)[0]


def proc_status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def fold_cost_ms(gpus: int, rate: int, steps: str = "short", repeats: int = 3) -> float:
    """CPU ms to fold one 1-s window of this scenario in-process (WindowBuilder add +
    close, with phases and roofline, and wire encoding): the agent's cost without the
    feed, the loop and the publisher. Median of ``repeats`` after one warm-up."""
    from ridgeline.aggregator import wire
    from ridgeline.aggregator.windows import WindowBuilder
    from ridgeline.probes.events import Device, NameTable, Trace
    stream = StepStream(gpus, rate, steps)
    nt = NameTable(stream.names)
    devs = [Device(g, stream.gpu_name) for g in range(gpus)]
    batches = [stream.batch(i) for i in range(int(1 / BATCH_S))]
    costs = []
    for r in range(repeats + 1):
        wb = WindowBuilder(host="bench")
        c0 = time.process_time()
        for k, a in batches:
            wb.add_events(Trace(kernels=k, api=a, names=nt, devices=devs, meta={"source": "simulated"}))
        wire.encode_window(wb.close(0, int(1e9), {}))
        if r:
            costs.append(1000 * (time.process_time() - c0))
    return float(np.median(costs))


def carry_lag_windows(sends: list, window_end_ns: list, kernels: list, window_s: float) -> tuple[float, float]:
    """(max, p99) over the sent batches of the time from a batch's send to the end of the
    first published window whose running kernel count covers it, in window lengths; inf
    where no window covered it."""
    if not sends:
        return 0.0, 0.0
    cum = np.cumsum(np.asarray(kernels, dtype=np.int64))
    ends = np.asarray(window_end_ns, dtype=np.float64) / 1e9
    t, need = np.asarray([x[0] for x in sends]), np.asarray([x[1] for x in sends], dtype=np.int64)
    j = np.searchsorted(cum, need, side="left")
    lag = np.where(j < len(cum), ends[np.minimum(j, len(ends) - 1)] - t, np.inf) / window_s
    return float(lag.max()), float(np.percentile(lag, 99))


def run_scenario(gpus: int, rate: int, duration_s: float, tag: str, steps: str = "short",
                 profile: str = "", feed: str = "cupti", timers: str = "") -> dict:
    load0 = os.getloadavg()[0]
    ctx = mp.get_context("spawn")
    endpoint = (f"/tmp/ridgeline-bench-cupti-{os.getpid()}-{tag}.sock" if feed == "cupti"
                else f"ipc:///tmp/ridgeline-bench-feed-{os.getpid()}-{tag}")
    pub = f"ipc:///tmp/ridgeline-bench-pub-{os.getpid()}-{tag}"
    q_gen, q_sub = ctx.Queue(), ctx.Queue()
    agent = ctx.Process(target=agent_main, args=(endpoint, pub, duration_s + WARMUP_S + 20, profile, feed,
                                                     step_template(0)[3], timers),
                        name="agent")
    agent.start()
    time.sleep(3.0)                                   # agent binds and imports
    ready = ctx.Event()
    t_start = time.time() + 4.0
    # The subscriber stays long enough to see the last batches' open steps released.
    until = t_start + WARMUP_S + duration_s + 3 * WINDOW_S + 3
    sub = ctx.Process(target=subscriber_main, args=(pub, until, q_sub, ready), name="subscriber")
    sub.start()
    ready.wait(20)
    gen = ctx.Process(target=generator_main, args=(endpoint, gpus, rate, steps, WARMUP_S + duration_s, t_start, q_gen, feed),
                      name="generator")
    gen.start()
    while time.time() < t_start + WARMUP_S:
        time.sleep(0.05)
    (c0, f0), th0, w0 = proc_stat(agent.pid), thread_cpu_s(agent.pid), time.monotonic()
    while time.time() < t_start + WARMUP_S + duration_s:
        time.sleep(0.2)
    (c1, f1), th1, w1 = proc_stat(agent.pid), thread_cpu_s(agent.pid), time.monotonic()
    hwm_kb = proc_status_kb(agent.pid, "VmHWM")
    g = q_gen.get(timeout=120)
    gen.join(30)
    s = q_sub.get(timeout=120)
    sub.join(30)
    agent.join(60)
    if agent.is_alive():
        agent.terminate()
    lat = np.array(s["latency_ns"][1:] or [0], dtype=np.float64)   # the first window is partial
    drops = g["dropped"] + sum(s["agent_drops"].values())
    lag_max, lag_p99 = carry_lag_windows(g["sends"], s["window_end_ns"], s["kernels_per_window"], WINDOW_S)
    kpw = s["kernels_per_window"][1:] or [0]
    return {
        "scenario": f"{gpus} GPU x {rate:,} kernels/s, {steps} steps, {feed} feed", "gpus": gpus,
        "rate_per_gpu": rate, "feed": feed,
        "steps": steps, "kernels_in_windows": int(sum(s["kernels_per_window"])),
        "carry_lag_windows_max": lag_max, "carry_lag_windows_p99": lag_p99,
        "kernels_per_window_mean": float(np.mean(kpw)),
        "duration_s": round(w1 - w0, 1),
        "kernels_sent": g["sent"], "agent_cpu_pct_of_core": 100.0 * (c1 - c0) / (w1 - w0),
        "agent_minor_faults_per_s": (f1 - f0) / (w1 - w0),
        "agent_thread_cpu_pct_of_core": {k: 100.0 * (v - th0.get(k, 0.0)) / (w1 - w0) for k, v in th1.items()},
        "agent_peak_rss_mb": hwm_kb / 1024.0, "dropped_records": drops, "generator_drops": g["dropped"],
        "agent_drops": s["agent_drops"], "late_batches": g["late_batches"],
        "generator_cpu_pct": 100.0 * g["generator_cpu_s"] / (WARMUP_S + duration_s),
        "windows": s["windows"], "seq_gaps": sum(s["gaps"].values()),
        "publish_latency_p50_ms": float(np.percentile(lat, 50)) / 1e6,
        "publish_latency_p99_ms": float(np.percentile(lat, 99)) / 1e6,
        "kernels_per_window_median": float(np.median(s["kernels_per_window"][1:] or [0])),
        "load_avg_1m": (load0, os.getloadavg()[0]),
        "fold_cpu_ms_per_window": fold_cost_ms(gpus, rate, steps),
    }


def table(rows: list[dict], command: str) -> str:
    out = [f"Command: `{command}`  ",
           f"Host: {platform.node() or 'host'}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
           "generator, agent and subscriber in separate processes, side by side.", "",
           "| scenario | s | agent CPU (% of one core) | agent minor faults/s | peak RSS (MB) | dropped records | seq gaps | "
           "windows | kernels/window (median / mean) | kernels sent / in windows | carry lag, windows (p99 / max) | "
           "publish latency p50 / p99 (ms) | fold CPU per window, "
           "in-process (ms) | generator CPU % | host load avg (start, end) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['scenario']} | {r['duration_s']:.0f} | {r['agent_cpu_pct_of_core']:.2f} | "
                   f"{r.get('agent_minor_faults_per_s', float('nan')):,.0f} | "
                   f"{r['agent_peak_rss_mb']:.0f} | {r['dropped_records']:,} | {r['seq_gaps']} | {r['windows']} | "
                   f"{r['kernels_per_window_median']:,.0f} / {r['kernels_per_window_mean']:,.0f} | "
                   f"{r['kernels_sent']:,} / {r['kernels_in_windows']:,} | "
                   f"{r['carry_lag_windows_p99']:.2f} / {r['carry_lag_windows_max']:.2f} | "
                   f"{r['publish_latency_p50_ms']:.1f} / "
                   f"{r['publish_latency_p99_ms']:.1f} | {r['fold_cpu_ms_per_window']:.0f} | "
                   f"{r['generator_cpu_pct']:.1f} | {r['load_avg_1m'][0]:.1f}, {r['load_avg_1m'][1]:.1f} |")
    out.append("")
    for r in rows:
        if r["gpus"] == 1 and r["rate_per_gpu"] == TARGET_RATE:
            out.append(f"{r['scenario']}: agent CPU {r['agent_cpu_pct_of_core']:.2f}% of one core = "
                       f"{r['agent_cpu_pct_of_core'] / TARGET_CPU_PCT:.2f}x the target ({TARGET_CPU_PCT:g}%).  ")
    out.append(f"Targets: <= {TARGET_CPU_PCT:g}% of one core at {TARGET_RATE // 1000}k kernels/s "
               f"({TARGET_CPU_PCT / 100 * 1e9 / TARGET_RATE:.0f} ns per kernel), <= 256 MB RSS, zero drops with a "
               "subscriber keeping up. "
               "Dropped records are kernel records (each with its launch API record) refused at the agent's "
               "bounded input; the agent's own publisher/window/probe drops are included.")
    return "\n".join(out)


def ns_per_kernel(row: dict) -> float:
    """Agent CPU per kernel sent, from the steady interval's CPU share."""
    return row["agent_cpu_pct_of_core"] / 100.0 * 1e9 / (row["gpus"] * row["rate_per_gpu"])


def run_baseline(tree: Path, sc: str, duration_s: float, feed: str = "cupti") -> dict:
    """One run of another checkout's bench_scale.py for one scenario (its own venv), with
    the same feed (a tree older than ``--feed``: copy this bench_scale.py into it, as the
    tree's own code is what is measured)."""
    import subprocess
    import tempfile
    py = tree / ".venv" / "bin" / "python"
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "rows.json"
        r = subprocess.run([str(py), str(tree / "bench" / "bench_scale.py"), "--duration", str(duration_s),
                            "--scenarios", sc, "--feed", feed, "--json", str(out)],
                           capture_output=True, text=True, timeout=3600)
        if r.returncode != 0 or not out.exists():
            raise SystemExit(f"bench_scale: the baseline run in {tree} failed: {r.stderr.strip()[-400:]}")
        return json.loads(out.read_text())[0]


def comparison(pairs: dict, baseline: Path | None) -> str:
    """Per scenario: agent CPU and ns per kernel, min / median / max over the runs."""
    def mmm(vals, fmt):
        v = sorted(vals)
        return " / ".join(fmt.format(x) for x in (v[0], float(np.median(v)), v[-1]))
    out = ["", f"Runs per scenario: {max(len(p['after']) for p in pairs.values())}"
           + (f"; before = {baseline} (its own .venv), after = this tree, alternating run by run." if baseline else "."),
           "", "| scenario | | agent CPU, % of one core (min / median / max) | ns per kernel (min / median / max) | "
           "agent minor faults/s (median) | dropped records (max) | kernels sent / in windows (sum) | "
           "carry lag p99, windows (max) | host load avg (lowest / highest) | ratio before / after (medians) |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in pairs.values():
        rows = [("after", p["after"])] + ([("before", p["before"])] if p["before"] else [])
        med = {w: float(np.median([ns_per_kernel(r) for r in rs])) for w, rs in rows}
        for w, rs in reversed(rows):
            ratio = f"{med['before'] / med['after']:.2f}x" if w == "after" and "before" in med else ""
            loads = [x for r in rs for x in r["load_avg_1m"]]
            faults = [r["agent_minor_faults_per_s"] for r in rs if "agent_minor_faults_per_s" in r]
            out.append(f"| {p['name']} | {w} | {mmm([r['agent_cpu_pct_of_core'] for r in rs], '{:.2f}')} | "
                       f"{mmm([ns_per_kernel(r) for r in rs], '{:.0f}')} | "
                       f"{float(np.median(faults)) if faults else float('nan'):,.0f} | "
                       f"{max(r['dropped_records'] for r in rs):,} | "
                       f"{sum(r['kernels_sent'] for r in rs):,} / {sum(r['kernels_in_windows'] for r in rs):,} | "
                       f"{max(r['carry_lag_windows_p99'] for r in rs):.2f} | "
                       f"{min(loads):.1f} / {max(loads):.1f} | {ratio} |")
    out.append("")
    for p in pairs.values():
        r0 = p["after"][0]
        if r0["gpus"] == 1 and r0["rate_per_gpu"] == TARGET_RATE:
            for w in ("before", "after"):
                if p[w]:
                    med = float(np.median([r["agent_cpu_pct_of_core"] for r in p[w]]))
                    out.append(f"{p['name']}, {w}: median agent CPU {med:.2f}% of one core = "
                               f"{med / TARGET_CPU_PCT:.2f}x the target.  ")
    out.append(f"Target: <= {TARGET_CPU_PCT:g}% of one core ({TARGET_CPU_PCT / 100 * 1e9 / TARGET_RATE:.0f} ns per "
               f"kernel) at 1 GPU x {TARGET_RATE // 1000}k kernels/s, zero drops.")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=60.0, help="measured seconds per scenario (default 60)")
    ap.add_argument("--scenarios", default="1x50000,8x100000",
                    help="GPUSxRATE[xlong],... (kernels/s per GPU; xlong: steps that never visibly end)")
    ap.add_argument("--json", type=Path, help="write the rows as JSON here")
    ap.add_argument("--runs", type=int, default=1, help="runs per scenario (default 1)")
    ap.add_argument("--baseline", type=Path, help="another checkout (with .venv) to run before each run, alternating")
    ap.add_argument("--feed", choices=("cupti", "arrays"), default="cupti",
                    help="cupti (default): the generator writes libridgeline_cupti.so's frames of raw CUPTI records "
                         "to the agent's real CUPTI probe; arrays: it pushes decoded event arrays over ZeroMQ to a "
                         "bench probe (the agent's cost without the CUPTI intake)")
    ap.add_argument("--profile-agent", type=Path, metavar="FILE",
                    help="write a cProfile of the agent's loop (after its first window with kernels) to FILE "
                         "(the last run's; it costs the agent CPU, so its CPU figure is not comparable)")
    ap.add_argument("--time-agent", type=Path, metavar="FILE",
                    help="write the CPU time per thread of the functions bench/agent_timers.py names (after the "
                         "agent's first window with kernels) to FILE as JSON (the last run's)")
    args = ap.parse_args(argv)
    if args.runs < 1:
        print("bench_scale: --runs must be >= 1", file=sys.stderr)
        return 2
    if args.baseline is not None and not (args.baseline / ".venv" / "bin" / "python").exists():
        print(f"bench_scale: --baseline {args.baseline} has no .venv/bin/python", file=sys.stderr)
        return 2
    scen = []
    for sc in args.scenarios.split(","):
        parts = sc.lower().split("x")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("long", "short")) \
                or not all(x.isdigit() for x in parts[:2]):
            print(f"bench_scale: bad scenario {sc!r} (GPUSxRATE or GPUSxRATExlong)", file=sys.stderr)
            return 2
        scen.append((sc, int(parts[0]), int(parts[1]), parts[2] if len(parts) == 3 else "short"))
    rows = []
    pairs: dict = {}
    for i, (sc, gpus, rate, steps) in enumerate(scen):
        for r in range(args.runs):
            before = run_baseline(args.baseline, sc, args.duration, args.feed) if args.baseline is not None else None
            rows.append(run_scenario(gpus, rate, args.duration, f"{i}-{r}", steps,
                                     str(args.profile_agent) if args.profile_agent else "", args.feed,
                                     str(args.time_agent) if args.time_agent else ""))
            p = pairs.setdefault(sc, {"name": rows[-1]["scenario"], "after": [], "before": []})
            p["after"].append(rows[-1])
            if before is not None:
                p["before"].append(before)
            print(json.dumps({"after": rows[-1], "before": before}), file=sys.stderr, flush=True)
    cmd = "python bench/bench_scale.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(table(rows, cmd.strip()))
    if args.runs > 1 or args.baseline is not None:
        print(comparison(pairs, args.baseline))
    if args.json:
        args.json.write_text(json.dumps(rows if args.baseline is None else
                                        {"after": rows, "pairs": pairs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
