"""GPU check of Ridgeline's CUPTI path: judges points (a)-(i) of issue 10 on one NVIDIA GPU.

Run by scripts/gpu-check.sh (which brings the missing Python packages as wheels, builds
the injection library against the host's CUPTI headers and archives the outputs); never
on a machine without a GPU (it says so and fails every point with that reason).

Workloads run as child processes with random weights (no downloads), plain PyTorch:

  plain       no injection: decode step times, device copy bandwidth, bf16 GEMM FLOP/s
  injected    the same under `ridgeline run` (always-on mode), the agent's CuptiProbe listening here
  graphlevel  CUDA-graph replays under `ridgeline run --graph-level`
  torchprof   the same profiled steps under torch.profiler (Kineto)

Each workload: a Llama-shaped decoder (prefill of BATCH x PROMPT tokens, then decode
steps, NVTX ranges "prefill"/"decode"), P profiled decode steps (NVTX "rl_step", synchronised
inside the range), one eager MLP step and K CUDA-graph replays of it ("eager_step",
"graph_replay"), a torch.compile'd (Triton) function ("triton"), and a child process
that launches N scans of its own. Points and thresholds (THRESHOLDS below):

  (a) kernel count and kernel time of the profiled steps vs torch.profiler
  (b) kernel names as torch.profiler shows them
  (c) CUDA-graph replays attributed per node; graph-level mode gives one record per replay
  (d) Triton kernels seen, launched through the driver API
  (e) parent and child process reported separately
  (f) prefill compute-bound, decode memory-bound; decode bytes/s vs device copy bandwidth
  (g) overhead: steps/s with and without injection
  (h) NVML and GPM readings
  (i) PM sampling and activity timestamps on one clock
  (j) torch.profiler inside an injected process, with GPU work in flight: the same kernel
      count as torch.profiler uninjected, no "unknown buffer", our records resume after it
  (k) after that profiler session (Kineto's __rdtsc timestamp source in force), a ~10 ms
      torch.cuda._sleep comes out in CLOCK_REALTIME ns and within 5% of its CUDA-event time
  (l) seconds of back-to-back kernels with no synchronisation never set the takeover flag

Runs: plain and injected (no side probes: (a) and (g) compare like with like, after the
same warm-up), graphlevel, torchprof, and shared (torch.profiler inside the injected
process, then the sustained load and the clock kernel, with NVML and the PM sampler
beside it; the PM sampler runs in a subprocess of its own, so that a crash of cupti-python
against the host's older libcupti loses (i) only).

Every judging function is pure (plain numbers or arrays in, a :class:`Point` out) and is
tested on literal inputs by tests/test_cupti_gpu_check.py.

Usage: python scripts/gpu_check.py --out DIR [--budget-s 330]
       python scripts/gpu_check.py --workload MODE --out DIR       (internal)
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Llama-shaped, small enough for seconds per run, large enough that decode is bandwidth bound
SHAPE = dict(hidden=2048, layers=8, heads=16, kv_heads=4, intermediate=5632, vocab=32000)
BATCH, PROMPT, DECODE_STEPS = 4, 512, 32
PROFILED_STEPS = 8          # (a)/(b): decode steps under both tools
TIMED_STEPS = 64            # (g): decode steps timed for steps/s
GRAPH_REPLAYS = 10          # (c)
TRITON_CALLS = 5            # (d)
CHILD_SCANS = 20            # (e)
OVERHEAD_BLOCK_S = 2.0      # (g): alternating eager / CUDA-graph decode blocks of this length
OVERHEAD_BLOCKS = 2         # of each kind
BACKGROUND_GEMMS = 400      # (j): GEMMs in flight on a side stream when the profiler starts
SUSTAINED_S = 3.0           # (l): back-to-back kernels, no synchronisation
SLEEP_MS = 10.0             # (k)

THRESHOLDS = {
    "a": "after the same warm-up, no side probes: kernel count of the profiled steps equal to torch.profiler's, "
         "median per-kernel duration ratio within 2% of 1 and summed kernel time within 2%",
    "b": ">= 99% of kernels paired in order carry torch.profiler's name",
    "c": "every replay: eager kernel count, all with graph/node ids; graph-level: 1 record per replay, "
         "no per-node kernels",
    "d": ">= 1 Triton kernel per call, >= 99% joined to a driver-API launch",
    "e": "child pid has >= its scans' kernels, parent has its own, no pid shared",
    "f": "prefill compute-bound, decode memory-bound (roofline rule), decode bytes/s 20-105% of copy bandwidth",
    "g": "decode step time injected vs plain, in alternating blocks of >= 2 s, eager and CUDA-graph: "
         "median within 3%, p99 within 5%",
    "h": "NVML util/memory/power present; GPM SM and DRAM utilisation in [0, 100], DRAM > 0 under load",
    "i": ">= 90% of PM-sampled DRAM bytes fall in samples that overlap Ridgeline's kernels",
    "j": "torch.profiler in an injected process sees as many kernels as uninjected, no 'unknown buffer', "
         "and Ridgeline's records resume after it",
    "k": "a ~10 ms sleep kernel after the profiler session: start within 1 s of time.time_ns(), duration "
         "within 5% of its CUDA-event time",
    "l": f"{SUSTAINED_S:.0f} s of kernels with no synchronisation: takeover flag never set, every launch recorded",
}
POINTS = "abcdefghijkl"


@dataclass
class Point:
    """One judged point: ``passed`` is False whenever the evidence is missing."""
    key: str
    passed: bool
    measured: str
    threshold: str = ""
    detail: dict = field(default_factory=dict)

    def __post_init__(self):
        self.threshold = self.threshold or THRESHOLDS.get(self.key, "")

    def line(self) -> str:
        return f"({self.key}) {'PASS' if self.passed else 'FAIL'}  {self.measured}  [threshold: {self.threshold}]"


def missing(key: str, why: str) -> Point:
    return Point(key, False, f"no data: {why}")


def _rel(a: float, b: float) -> float:
    return abs(a / b - 1.0) if b else float("inf")


# ---------------------------------------------------------------------------------------
# judging (pure)

def judge_kernels_vs_profiler(rl_names: list[str], rl_dur_ns, tp_names: list[str], tp_dur_ns,
                              tol: float = 0.02, name_share: float = 0.99) -> tuple[Point, Point]:
    """(a) and (b): kernels of the same profiled steps, each list in start order."""
    import numpy as np
    rl_d, tp_d = np.asarray(rl_dur_ns, float), np.asarray(tp_dur_ns, float)
    if len(tp_d) == 0:
        return missing("a", "torch.profiler saw no kernels"), missing("b", "torch.profiler saw no kernels")
    if len(rl_d) == 0:
        return missing("a", "Ridgeline saw no kernels"), missing("b", "Ridgeline saw no kernels")
    count_dev = _rel(len(rl_d), len(tp_d))
    time_dev = _rel(rl_d.sum(), tp_d.sum())
    n = min(len(rl_d), len(tp_d))
    ratio = float(np.median(rl_d[:n] / np.maximum(tp_d[:n], 1)))
    a = Point("a", len(rl_d) == len(tp_d) and abs(ratio - 1) <= tol and time_dev <= tol,
              f"kernels {len(rl_d)} vs {len(tp_d)}, median per-kernel duration ratio {ratio:.3f}, time "
              f"{rl_d.sum() / 1e6:.3f} vs {tp_d.sum() / 1e6:.3f} ms ({100 * time_dev:.2f}%) (separate runs, same "
              f"warm-up)", detail={"count_dev": count_dev, "time_dev": time_dev, "per_kernel_median_ratio": ratio})
    same = sum(x == y for x, y in zip(rl_names[:n], tp_names[:n]))
    share = same / len(tp_names)
    diff = [(x, y) for x, y in zip(rl_names[:n], tp_names[:n]) if x != y][:5]
    b = Point("b", share >= name_share, f"{same}/{len(tp_names)} names equal ({100 * share:.1f}%)",
              detail={"share": share, "first_differences": diff})
    return a, b


def judge_graphs(eager_kernels: int, replay_counts: list[int], replay_with_ids: list[int],
                 graph_level_records: int | None, graph_level_node_kernels: int | None,
                 replays: int = GRAPH_REPLAYS) -> Point:
    """(c): per-node kernels per replay in node mode, one GRAPH_TRACE record per replay in graph mode."""
    if not replay_counts:
        return missing("c", "no graph_replay ranges with kernels")
    node_ok = (len(replay_counts) == replays and all(c == eager_kernels for c in replay_counts)
               and replay_with_ids == replay_counts and eager_kernels > 0)
    graph_ok = graph_level_records == replays and graph_level_node_kernels == 0
    return Point("c", node_ok and graph_ok,
                 f"eager {eager_kernels} kernels; replays {replay_counts} (with graph/node ids "
                 f"{replay_with_ids}); graph-level: {graph_level_records} GRAPH_TRACE records, "
                 f"{graph_level_node_kernels} per-node kernels",
                 detail={"node_mode_ok": node_ok, "graph_level_ok": graph_ok})


def judge_triton(names: list[str], kernel_corr, api_corr, api_domain, calls: int = TRITON_CALLS,
                 driver_domain: int = 2, share: float = 0.99) -> Point:
    """(d): Triton kernels (``triton_*``) and the driver-API launch each was joined to."""
    import numpy as np
    tri = np.array([n.startswith("triton") for n in names], bool)
    if not tri.any():
        return missing("d", "no kernel named triton_* in the triton range")
    corr = np.asarray(kernel_corr)[tri]
    api_corr, api_domain = np.asarray(api_corr), np.asarray(api_domain)
    order = np.argsort(api_corr)
    pos = np.clip(np.searchsorted(api_corr[order], corr), 0, max(len(order) - 1, 0))
    hit = (len(order) > 0) & (api_corr[order][pos] == corr) if len(order) else np.zeros(len(corr), bool)
    driver = hit & (api_domain[order][pos] == driver_domain) if len(order) else hit
    frac = float(driver.mean())
    return Point("d", int(tri.sum()) >= calls and frac >= share,
                 f"{int(tri.sum())} Triton kernels for {calls} calls, {100 * frac:.1f}% joined to a driver-API launch",
                 detail={"triton_kernels": int(tri.sum()), "driver_joined_share": frac})


def judge_processes(kernels_by_pid: dict[int, int], parent_pid: int | None, child_pid: int | None,
                    child_min: int = CHILD_SCANS) -> Point:
    """(e): both processes present with their own kernels (pids as the processes saw them)."""
    if parent_pid is None or child_pid is None:
        return missing("e", "the workload did not report the parent and child pids")
    p, c = kernels_by_pid.get(parent_pid, 0), kernels_by_pid.get(child_pid, 0)
    ok = parent_pid != child_pid and p > 0 and c >= child_min
    return Point("e", ok, f"parent {parent_pid}: {p} kernels, child {child_pid}: {c} kernels (>= {child_min})",
                 detail={"kernels_by_pid": {str(k): v for k, v in kernels_by_pid.items()}})


def judge_phases(prefill: dict | None, decode: dict | None, peak_flops: float | None, copy_bps: float | None,
                 lo: float = 0.20, hi: float = 1.05) -> Point:
    """(f): each phase dict holds ``flops``, ``bytes``, ``kernel_time_ns``, ``median_kernel_ns``;
    ceilings measured in the same run (GEMM FLOP/s, device copy bytes/s)."""
    from ridgeline.aggregator.roofline import COMPUTE_BOUND, MEMORY_BOUND, decide_verdict
    if not prefill or not decode:
        return missing("f", "prefill/decode ranges without kernels")
    if not peak_flops or not copy_bps:
        return missing("f", "no measured ceilings (plain run failed)")
    out = {}
    for name, ph in (("prefill", prefill), ("decode", decode)):
        s = ph["kernel_time_ns"] / 1e9
        fps, bps = ph["flops"] / s, ph["bytes"] / s
        verdict, ev = decide_verdict(idle_ratio=None, launch_cover_ratio=None, sync_cover_ratio=None,
                                     median_gap_ns=None, median_kernel_ns=ph.get("median_kernel_ns"),
                                     arithmetic_intensity=ph["flops"] / ph["bytes"],
                                     ridge_point=peak_flops / copy_bps, pct_of_peak_flops=100 * fps / peak_flops,
                                     pct_of_peak_bytes=100 * bps / copy_bps, work_coverage_ratio=1.0)
        out[name] = {"verdict": verdict, "evidence": ev, "flops_per_s": fps, "bytes_per_s": bps}
    ratio = out["decode"]["bytes_per_s"] / copy_bps
    ok = out["prefill"]["verdict"] == COMPUTE_BOUND and out["decode"]["verdict"] == MEMORY_BOUND and lo <= ratio <= hi
    return Point("f", ok, f"prefill {out['prefill']['verdict']}, decode {out['decode']['verdict']}, decode "
                          f"{out['decode']['bytes_per_s'] / 1e9:.0f} GB/s = {100 * ratio:.0f}% of copy "
                          f"{copy_bps / 1e9:.0f} GB/s", detail=out)


def judge_overhead(plain_step_s: dict | None, injected_step_s: dict | None, max_median: float = 0.03,
                   max_p99: float = 0.05) -> Point:
    """(g): per kind ("eager", "graph"), the decode step times (s) of each run's alternating blocks."""
    import numpy as np
    if not plain_step_s or not injected_step_s:
        return missing("g", "no step times from the plain or the injected run")
    out, ok, parts = {}, True, []
    for kind in ("eager", "graph"):
        a, b = np.asarray(plain_step_s.get(kind, []), float), np.asarray(injected_step_s.get(kind, []), float)
        if len(a) < 10 or len(b) < 10:
            return missing("g", f"fewer than 10 {kind} steps timed")
        med = float(np.median(b) / np.median(a) - 1)
        p99 = float(np.percentile(b, 99) / np.percentile(a, 99) - 1)
        out[kind] = {"median_overhead": med, "p99_overhead": p99, "steps": [len(a), len(b)]}
        ok = ok and med <= max_median and p99 <= max_p99
        parts.append(f"{kind}: median {1e3 * np.median(a):.3f} vs {1e3 * np.median(b):.3f} ms ({100 * med:+.1f}%), "
                     f"p99 {100 * p99:+.1f}%")
    return Point("g", ok, "; ".join(parts), detail=out)


def judge_shared_profiler(kineto_injected: int | None, kineto_plain: int | None, stderr: str,
                          resumed_kernels: int, launched_after: int) -> Point:
    """(j): Kineto's kernel count inside the injected process vs uninjected, its complaint, our records after."""
    if kineto_injected is None or kineto_plain is None:
        return missing("j", "no torch.profiler kernel count from the shared or the torchprof run")
    unknown = stderr.count("unknown buffer")
    ok = kineto_injected == kineto_plain and kineto_plain > 0 and unknown == 0 and resumed_kernels >= launched_after
    return Point("j", ok, f"torch.profiler kernels {kineto_injected} injected vs {kineto_plain} plain, "
                          f"{unknown} 'unknown buffer', Ridgeline kernels after it {resumed_kernels} of "
                          f"{launched_after} launched", detail={"unknown_buffer": unknown})


def judge_clock_after_profile(start_ns: int | None, dur_ns: int | None, wall_ns: int, event_ns: float,
                              tol: float = 0.05) -> Point:
    """(k): the sleep kernel's record after the profiler session."""
    if start_ns is None or dur_ns is None:
        return missing("k", "no sleep kernel record after the profiler session")
    off = abs(start_ns - wall_ns)
    dev = _rel(dur_ns, event_ns)
    return Point("k", off < 1_000_000_000 and dev <= tol,
                 f"start {off / 1e6:.1f} ms from time.time_ns(), duration {dur_ns / 1e6:.3f} ms vs CUDA events "
                 f"{event_ns / 1e6:.3f} ms ({100 * dev:.1f}%)", detail={"offset_ns": off, "duration_dev": dev})


def judge_sustained(taken_over_processes: int, flags_taken_over: bool, recorded: int, launched: int) -> Point:
    """(l): the sustained load's kernels, every one recorded, and no takeover flagged."""
    if launched <= 0:
        return missing("l", "no sustained load ran")
    ok = taken_over_processes == 0 and not flags_taken_over and recorded >= launched
    return Point("l", ok, f"{recorded} of {launched} launches recorded, takeover flagged: "
                          f"{bool(taken_over_processes or flags_taken_over)}",
                 detail={"taken_over_processes": taken_over_processes})


def judge_nvml(records: list[dict]) -> Point:
    """(h): device records of probes.nvml taken while the injected run was busy."""
    if not records:
        return missing("h", "no NVML records")
    need = ("gpu_busy_time_pct", "memory_used_bytes", "power_w")
    have = {k: any(r.get(k) is not None for r in records) for k in need}
    gpm = [r for r in records if r.get("gpm_sm_util_pct") is not None]
    in_range = all(0 <= r[k] <= 100 for r in gpm for k in ("gpm_sm_util_pct", "gpm_dram_bw_util_pct")
                   if r.get(k) is not None)
    dram_busy = max((r.get("gpm_dram_bw_util_pct") or 0 for r in gpm), default=0)
    ok = all(have.values()) and bool(gpm) and in_range and dram_busy > 0
    return Point("h", ok, f"{len(records)} NVML records, fields {have}, {len(gpm)} with GPM, max GPM DRAM "
                          f"{dram_busy:.0f}%", detail={"fields": have, "gpm_records": len(gpm)})


def judge_clock(pm_start, pm_end, pm_dram_bytes, k_start, k_end, share: float = 0.90) -> Point:
    """(i): PM samples whose interval overlaps a kernel must hold the DRAM traffic."""
    import numpy as np

    from ridgeline.aggregator.roofline import covered_ns, union_intervals
    pm_start, pm_end = np.asarray(pm_start, np.int64), np.asarray(pm_end, np.int64)
    dram = np.asarray(pm_dram_bytes, float)
    if len(pm_start) == 0 or dram.sum() <= 0:
        return missing("i", "no PM samples with DRAM traffic")
    if len(k_start) == 0:
        return missing("i", "no kernels")
    us, ue = union_intervals(np.asarray(k_start, np.int64), np.asarray(k_end, np.int64))
    cov = covered_ns(pm_start, pm_end, us, ue)
    frac = float(dram[cov > 0].sum() / dram.sum())
    return Point("i", frac >= share, f"{100 * frac:.1f}% of PM DRAM bytes in samples overlapping kernels "
                                     f"({len(pm_start)} samples)", detail={"share": frac})


# ---------------------------------------------------------------------------------------
# analysis of what was recorded (pure, on Traces)

def kernels_in_ranges(trace, label: str):
    """Per range named ``label`` (in start order): the kernel indices inside it, by start."""
    import numpy as np
    k, r = trace.kernels, trace.ranges
    lid = trace.names.lookup(label)
    rs = r[r["name_id"] == lid] if lid >= 0 else r[:0]
    rs = rs[np.argsort(rs["start_ns"])]
    out = []
    for x in rs:
        sel = np.flatnonzero((k["start_ns"] >= x["start_ns"]) & (k["end_ns"] <= x["end_ns"]) & (k["pid"] == x["pid"]))
        out.append(sel[np.argsort(k["start_ns"][sel], kind="stable")])
    return out


def model_work(phase: str, steps: int = DECODE_STEPS) -> tuple[float, float]:
    """FLOPs and bytes of a phase from the model (weights read once per forward, 2 FLOPs per
    multiply-add, KV read/written), the design's third source of work."""
    h, L, nh, nkv, inter, vocab = (SHAPE[k] for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab"))
    hd = h // nh
    params = L * (h * nh * hd + 2 * h * nkv * hd + nh * hd * h + 3 * h * inter) + h * vocab
    weight_bytes = 2 * (params + vocab * h)
    kv_token = 2 * L * nkv * hd * 2
    if phase == "prefill":
        t = BATCH * PROMPT
        attn = 2 * 2 * L * BATCH * nh * hd * PROMPT * PROMPT / 2
        return 2 * params * t + attn, weight_bytes + t * kv_token + 2 * t * h * 2 * L * 6
    ctx = PROMPT + steps / 2
    attn = 2 * 2 * L * BATCH * nh * hd * ctx
    return steps * (2 * params * BATCH + attn), steps * (weight_bytes + BATCH * ctx * kv_token)


# ---------------------------------------------------------------------------------------
# the workload (runs in a child process)

def workload(mode: str, out: Path) -> dict:
    import resource

    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    h, L, nh, nkv, inter, vocab = (SHAPE[k] for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab"))
    hd = h // nh
    max_len = PROMPT + DECODE_STEPS + PROFILED_STEPS + TIMED_STEPS + 8
    nvtx = torch.cuda.nvtx

    def w(*s):
        return torch.randn(*s, device=dev, dtype=dt) * 0.02
    layers = [dict(ln1=torch.ones(h, device=dev, dtype=dt), wq=w(h, nh * hd), wk=w(h, nkv * hd), wv=w(h, nkv * hd),
                   wo=w(nh * hd, h), ln2=torch.ones(h, device=dev, dtype=dt), wg=w(h, inter), wu=w(h, inter),
                   wd=w(inter, h)) for _ in range(L)]
    emb, lm_head, ln_f = w(vocab, h), w(h, vocab), torch.ones(h, device=dev, dtype=dt)
    kc = [torch.zeros(BATCH, nkv, max_len, hd, device=dev, dtype=dt) for _ in range(L)]
    vc = [torch.zeros(BATCH, nkv, max_len, hd, device=dev, dtype=dt) for _ in range(L)]

    def rms(x, g):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * g

    def mlp(y, p):
        return (F.silu(y @ p["wg"]) * (y @ p["wu"])) @ p["wd"]

    def forward(tokens, pos):
        x = emb[tokens]
        b, t, _ = x.shape
        for i, p in enumerate(layers):
            y = rms(x, p["ln1"])
            q = (y @ p["wq"]).view(b, t, nh, hd).transpose(1, 2)
            k = (y @ p["wk"]).view(b, t, nkv, hd).transpose(1, 2)
            v = (y @ p["wv"]).view(b, t, nkv, hd).transpose(1, 2)
            kc[i][:, :, pos:pos + t] = k
            vc[i][:, :, pos:pos + t] = v
            a = F.scaled_dot_product_attention(q, kc[i][:, :, :pos + t], vc[i][:, :, :pos + t], is_causal=(t > 1),
                                               enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(b, t, nh * hd) @ p["wo"]
            x = x + mlp(rms(x, p["ln2"]), p)
        return rms(x[:, -1], ln_f) @ lm_head

    res: dict = {"mode": mode, "pid": os.getpid(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                 "gpu": torch.cuda.get_device_name(0)}
    tokens = torch.randint(0, vocab, (BATCH, PROMPT), device=dev)
    forward(tokens, 0)                       # warm-up: cuBLAS handles, allocator, SDPA choice
    forward(tokens[:, :1], PROMPT)
    torch.cuda.synchronize()
    r0 = resource.getrusage(resource.RUSAGE_SELF)

    # (a)/(b): the profiled steps, right after the same warm-up in every mode
    pos0 = PROMPT + DECODE_STEPS + 8
    nxt = tokens[:, :1]

    def profiled():
        nonlocal nxt
        for s in range(PROFILED_STEPS):
            nvtx.range_push("rl_step")
            nxt = forward(nxt, pos0 + s).argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            nvtx.range_pop()

    def torch_profile(name: str, background: bool) -> int:
        """The profiled steps under torch.profiler; with ``background``, GEMMs launched before it
        on a side stream are still running when it starts (GPU work in flight; launched before
        its window, so not its kernels). The trace is kept, its kernel count returned."""
        from torch.profiler import ProfilerActivity, profile
        if background:
            side = torch.cuda.Stream()
            bg = torch.randn(2048, 2048, device=dev, dtype=dt)
            with torch.cuda.stream(side):
                for _ in range(BACKGROUND_GEMMS):
                    bg @ bg
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            profiled()
        torch.cuda.synchronize()
        path = out / f"{name}.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
        with open(path, "rb") as f, gzip.open(out / f"{name}.json.gz", "wb") as g:
            shutil.copyfileobj(f, g)
        path.unlink()
        return sum(1 for e in events if e.get("cat") == "kernel")

    if mode == "torchprof":
        res["kineto_kernels"] = torch_profile("torch_trace", background=False)
        return res
    if mode == "shared":
        res["kineto_kernels"] = torch_profile("torch_trace_shared", background=True)
        res["profiler_stop_ns"] = time.time_ns()
        # (l) back-to-back kernels, no synchronisation (the launch queue is never drained)
        x = torch.randn(1 << 20, device=dev)
        n, end = 0, time.perf_counter() + SUSTAINED_S
        while time.perf_counter() < end:
            x.mul_(1.0000001)
            n += 1
        torch.cuda.synchronize()
        res["sustained_launches"] = n
        # (k) a sleep of about SLEEP_MS, timed by CUDA events too
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        torch.cuda._sleep(1_000_000)
        e1.record()
        torch.cuda.synchronize()
        cycles = int(1_000_000 * SLEEP_MS / max(e0.elapsed_time(e1), 1e-3))
        res["sleep_wall_ns"] = time.time_ns()
        e0.record()
        torch.cuda._sleep(cycles)
        e1.record()
        torch.cuda.synchronize()
        res["sleep_event_ns"] = e0.elapsed_time(e1) * 1e6
        time.sleep(1.0)                      # one flush period: the library ships before exit anyway
        return res
    if mode != "graphlevel":
        profiled()
        nvtx.range_push("prefill")
        nxt = forward(tokens, 0).argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        nvtx.range_pop()
        nvtx.range_push("decode")
        for s in range(DECODE_STEPS):
            nxt = forward(nxt, PROMPT + s).argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        nvtx.range_pop()
        # (g) decode step times, eager and CUDA-graph (one decode step captured at a fixed position),
        # in alternating blocks
        step_tok = nxt.clone()
        pos_g = PROMPT + DECODE_STEPS + PROFILED_STEPS + 8

        def eager():
            forward(step_tok, pos_g).argmax(-1)
        gs = torch.cuda.Stream()
        gs.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(gs):
            eager()
        torch.cuda.current_stream().wait_stream(gs)
        g_dec = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g_dec):
            forward(step_tok, pos_g).argmax(-1)
        torch.cuda.synchronize()
        times: dict[str, list[float]] = {"eager": [], "graph": []}
        for _ in range(OVERHEAD_BLOCKS):
            for kind, fn in (("eager", eager), ("graph", g_dec.replay)):
                end = time.perf_counter() + OVERHEAD_BLOCK_S
                while time.perf_counter() < end:
                    t = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    times[kind].append(time.perf_counter() - t)
        res["step_s"] = times
        res["steps_per_s"] = 1.0 / float(sorted(times["eager"])[len(times["eager"]) // 2])

    # (c) one eager MLP step, then K replays of it captured in a CUDA graph
    x_static = torch.randn(BATCH, 1, h, device=dev, dtype=dt)
    if mode != "graphlevel":
        nvtx.range_push("eager_step")
        mlp(x_static, layers[0])
        torch.cuda.synchronize()
        nvtx.range_pop()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        mlp(x_static, layers[0])             # warm-up on the capture stream, as torch documents
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mlp(x_static, layers[0])
    torch.cuda.synchronize()
    for _ in range(GRAPH_REPLAYS):
        nvtx.range_push("graph_replay")
        g.replay()
        torch.cuda.synchronize()
        nvtx.range_pop()
    if mode == "graphlevel":
        return res

    # (d) Triton kernels (torch.compile -> Inductor -> Triton, launched with cuLaunchKernel)
    try:
        fn = torch.compile(lambda a: F.gelu(a) * a + 1.0)
        a = torch.randn(1 << 20, device=dev)
        fn(a)
        torch.cuda.synchronize()
        nvtx.range_push("triton")
        for _ in range(TRITON_CALLS):
            fn(a)
        torch.cuda.synchronize()
        nvtx.range_pop()
        res["triton"] = "ok"
    except Exception as e:  # noqa: BLE001  (no compiler on the host, or Triton's own error: (d) fails with this reason)
        res["triton"] = f"{type(e).__name__}: {e}"

    # (e) a child process on the same GPU, with kernels of its own
    child = subprocess.run([sys.executable, "-c",
                            "import os, torch\nx = torch.randn(1 << 16, device='cuda')\n"
                            f"for _ in range({CHILD_SCANS}): x = torch.cumsum(x, 0)\n"
                            "torch.cuda.synchronize(); print(os.getpid())"],
                           capture_output=True, text=True, timeout=120)
    res["child_pid"] = int(child.stdout.strip().splitlines()[-1]) if child.returncode == 0 else None
    res["child_error"] = child.stderr[-500:] if child.returncode else ""

    r1 = resource.getrusage(resource.RUSAGE_SELF)
    res["cpu_s"] = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    if mode == "plain":
        res["copy_bytes_per_s"] = measure_copy_bandwidth(torch)
        res["gemm_flops_per_s"] = measure_gemm(torch)
    return res


def measure_copy_bandwidth(torch) -> float:
    """Device-to-device copy bandwidth (read + write bytes / time): the achievable HBM ceiling."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        b.copy_(a)
    e.record()
    torch.cuda.synchronize()
    return 2 * n * 20 / (s.elapsed_time(e) / 1e3)


def measure_gemm(torch) -> float:
    """bf16 GEMM FLOP/s of a large square matmul: the achievable compute ceiling."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        a @ b
    e.record()
    torch.cuda.synchronize()
    return 2 * n ** 3 * 10 / (s.elapsed_time(e) / 1e3)


# ---------------------------------------------------------------------------------------
# the driver (runs in the parent)

def child(mode: str, out: Path, timeout: float, wrap: list[str] | None = None, tick=None) -> dict:
    """Run one workload; ``tick()`` is called every 0.2 s while it runs (the probes drain then)."""
    cmd = (wrap or []) + [sys.executable, str(Path(__file__).resolve()), "--workload", mode, "--out", str(out)]
    log = out / f"log_{mode}.txt"
    # cwd: the output folder, so that the source tree's ridgeline/ never shadows the installed one
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=f, text=True, cwd=out)
        end = time.monotonic() + max(10, timeout)
        while p.poll() is None:
            if time.monotonic() > end:
                p.kill()
                p.wait()
                raise RuntimeError(f"{mode} run exceeded {timeout:.0f} s")
            if tick is not None:
                tick()
            time.sleep(0.2)
        stdout = p.stdout.read()
    # the reason is the last line of stderr (the exception), read before stdout is appended
    reason = (log.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
    with open(log, "a") as f:
        f.write("\n--- stdout ---\n" + stdout)
    if p.returncode != 0:
        raise RuntimeError(f"{mode} run failed (rc {p.returncode}): {reason}")
    return json.loads(stdout.strip().splitlines()[-1])


def choose_pm_metrics(names: list[str]) -> list[str]:
    """PM-sampling metrics from the device's own list: DRAM bytes for (i), and a tensor-pipe
    counter (Hopper's gmma first, else hmma) to see prefill's tensor work."""
    want = [m for m in ("dram__bytes_read.sum", "dram__bytes_write.sum") if m in names]
    for pat in ("gmma", "hmma"):
        hit = sorted(n for n in names if pat in n and n.endswith(".sum"))
        if hit:
            want.append(hit[0])
            break
    return want


def pm_sampler_main(out: Path) -> int:
    """(internal) PM sampling of device 0 until SIGTERM; samples saved every second to
    OUT/pm_samples.npz (so a crash keeps what came before), metric names to OUT/pm_metrics.json."""
    import signal

    import numpy as np

    from ridgeline.probes.cupti.pm_sampler import PmSampler, metric_list
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    names = sorted({n for v in metric_list(0)["base_metrics"].values() if isinstance(v, list) for n in v})
    metrics = choose_pm_metrics(names)
    (out / "pm_metrics.json").write_text(json.dumps({"available": len(names), "chosen": metrics}))
    if not metrics:
        print("no DRAM metrics in the device's PM-sampling list", file=sys.stderr)
        return 3
    sampler = PmSampler(0, metrics=metrics, interval_ns=2_000_000)
    sampler.start()
    parts, last = [], time.monotonic()

    def save():
        np.savez(out / "pm_samples.tmp.npz", start_ns=np.concatenate([p["start_ns"] for p in parts]),
                 end_ns=np.concatenate([p["end_ns"] for p in parts]),
                 **{m: np.concatenate([p["values"][m] for p in parts]) for m in metrics})
        os.replace(out / "pm_samples.tmp.npz", out / "pm_samples.npz")
    try:
        while not stop:
            time.sleep(0.1)
            got = sampler.poll()
            if got and len(got.get("start_ns", [])):
                parts.append(got)
            if parts and time.monotonic() - last > 1.0:
                last = time.monotonic()
                save()
        got = sampler.poll()
        if got and len(got.get("start_ns", [])):
            parts.append(got)
        if parts:
            save()
    finally:
        sampler.stop()
    return 0


def read_pm_samples(pm_dir: Path) -> tuple[dict | None, str]:
    """What the PM sampler process saved: ({"start_ns", "end_ns", "values"}, "") or (None, why)."""
    import numpy as np
    f = pm_dir / "pm_samples.npz"
    if not f.exists():
        log = pm_dir.parent / "log_pm_sampler.txt"
        tail = (log.read_text(errors="replace").strip().splitlines() or ["no output"])[-1] if log.exists() else ""
        return None, f"the PM sampler saved no samples ({tail})"
    with np.load(f) as z:
        values = {k: z[k] for k in z.files if k not in ("start_ns", "end_ns")}
        return {"start_ns": z["start_ns"], "end_ns": z["end_ns"], "values": values}, ""


def run_injected(out: Path, mode: str, timeout: float, graph_level: bool = False, side: bool = False):
    """One injected run with the agent's probes listening here: (result, trace, nvml records, pm samples)."""
    import numpy as np

    from ridgeline.probes.cupti.probe import CuptiProbe
    from ridgeline.probes.events import Trace
    sock = out / "tmp" / f"cupti-{mode}.sock"
    sock.parent.mkdir(parents=True, exist_ok=True)
    probe = CuptiProbe(str(sock))
    probe.start()
    nvml = None
    nvml_records, pm, notes = [], None, {}
    pm_proc = None
    if side:
        try:
            from ridgeline.probes.nvml import NvmlProbe
            nvml = NvmlProbe(interval_s=0.5)
            nvml.start()
        except Exception as e:   # noqa: BLE001  pynvml's NVMLError and import errors alike: (h) says why
            notes["nvml"] = f"{type(e).__name__}: {e}"
            nvml = None
        # PM sampling in a process of its own: cupti-python 13.4 against the host's older libcupti
        # meets grown structs, and a crash there must lose (i) only
        pm_dir = out / "pm"
        pm_dir.mkdir(exist_ok=True)
        pm_proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--pm-sampler", "--out",
                                    str(pm_dir)], stdout=subprocess.DEVNULL,
                                   stderr=open(out / "log_pm_sampler.txt", "w"), cwd=out)
        time.sleep(1.0)                    # configured before the workload's kernels start
    parts = []

    def tick():
        got = probe.poll()
        if "trace" in got:
            parts.append(got["trace"])
        if nvml is not None:
            nvml_records.extend((nvml.poll() or {}).get("devices", []))

    try:
        wrap = [sys.executable, "-m", "ridgeline", "run", "--socket", str(sock)]
        if graph_level:
            wrap.append("--graph-level")
        res = child(mode, out, timeout, wrap=wrap + ["--"], tick=tick)
        end = time.monotonic() + 3          # the library's last flush
        while time.monotonic() < end:
            tick()
            time.sleep(0.1)
    finally:
        if nvml is not None:
            try:
                nvml.stop()
            except Exception as e:                              # noqa: BLE001  (NVMLError)
                notes["nvml_stop"] = f"{type(e).__name__}: {e}"
        if pm_proc is not None:
            pm_proc.terminate()
            try:
                pm_proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pm_proc.kill()
                pm_proc.wait()
            notes["pm_sampler_rc"] = pm_proc.returncode
            pm, why = read_pm_samples(out / "pm")
            if why:
                notes["pm"] = why
        counters = probe.counters()
        probe.stop()
    if not parts:
        return res, None, nvml_records, pm, counters, notes
    procs = {}
    for t in parts:
        procs.update(t.meta["processes"])
    trace = Trace(kernels=np.concatenate([t.kernels for t in parts]), copies=np.concatenate([t.copies for t in parts]),
                  api=np.concatenate([t.api for t in parts]), ranges=np.concatenate([t.ranges for t in parts]),
                  names=parts[0].names, meta={"source": "cupti", "processes": procs,
                                              "mangled_names": parts[0].meta.get("mangled_names", {})})
    return res, trace, nvml_records, pm, counters, notes


def analyse(results: dict, trace, trace_graph, torch_trace, nvml_records, pm, trace_shared=None,
            shared_counters: dict | None = None, shared_stderr: str = "") -> list[Point]:
    """Every point from what the runs recorded."""
    import numpy as np
    points: dict[str, Point] = {}
    inj, plain = results.get("injected") or {}, results.get("plain") or {}
    k = trace.kernels if trace is not None else None
    if trace is None:
        for key in "abcdef":
            points[key] = missing(key, "the injected run delivered no events")
    else:
        dur = k["end_ns"] - k["start_ns"]
        steps = kernels_in_ranges(trace, "rl_step")
        sel = np.concatenate(steps) if steps else np.empty(0, int)
        rl_names = trace.names.names_of(k["name_id"][sel])
        if torch_trace is not None:
            tk = torch_trace.kernels[np.argsort(torch_trace.kernels["start_ns"], kind="stable")]
            points["a"], points["b"] = judge_kernels_vs_profiler(rl_names, dur[sel], torch_trace.names.names_of(
                tk["name_id"]), tk["end_ns"] - tk["start_ns"])
        else:
            points["a"] = points["b"] = None
        eager = kernels_in_ranges(trace, "eager_step")
        replays = kernels_in_ranges(trace, "graph_replay")
        ids = [int(((k["graph_id"][r] >= 0) & (k["graph_node_id"][r] >= 0)).sum()) for r in replays]
        gl_records = gl_nodes = None
        if trace_graph is not None:
            gl_records = sum(m.get("records_by_kind", {}).get(51, 0) for m in trace_graph.meta["processes"].values())
            kg = trace_graph.kernels        # graph launches are rows without a node id
            gl_nodes = int(sum((kg["graph_node_id"][r] >= 0).sum()
                               for r in kernels_in_ranges(trace_graph, "graph_replay")))
        points["c"] = judge_graphs(len(eager[0]) if eager else 0, [len(r) for r in replays], ids, gl_records, gl_nodes)
        tri = kernels_in_ranges(trace, "triton")
        if tri and len(tri[0]):
            points["d"] = judge_triton(trace.names.names_of(k["name_id"][tri[0]]), k["correlation_id"][tri[0]],
                                       trace.api["correlation_id"], trace.api["domain"])
        else:
            points["d"] = missing("d", f"no kernels in the triton range ({inj.get('triton', 'not run')})")
        pids, counts = np.unique(k["pid"], return_counts=True)
        points["e"] = judge_processes(dict(zip(pids.tolist(), counts.tolist())), inj.get("pid"), inj.get("child_pid"))
        phases = {}
        for ph in ("prefill", "decode"):
            rr = kernels_in_ranges(trace, ph)
            if rr and len(rr[0]):
                d = dur[rr[0]]
                flops, nbytes = model_work(ph)
                phases[ph] = {"flops": flops, "bytes": nbytes, "kernel_time_ns": int(d.sum()),
                              "median_kernel_ns": float(np.median(d))}
        points["f"] = judge_phases(phases.get("prefill"), phases.get("decode"), plain.get("gemm_flops_per_s"),
                                   plain.get("copy_bytes_per_s"))
    for key in "ab":
        if points.get(key) is None:
            points[key] = missing(key, "no torch.profiler trace")
    points["g"] = judge_overhead(plain.get("step_s"), inj.get("step_s"))
    points["h"] = judge_nvml(nvml_records)
    shared, tp = results.get("shared") or {}, results.get("torchprof") or {}
    if trace_shared is None:
        for key in "ijkl":
            points[key] = missing(key, "the shared run delivered no events")
    else:
        ks = trace_shared.kernels
        if pm and len(pm.get("start_ns", [])):
            v = pm["values"]
            dram = np.asarray(v.get("dram__bytes_read.sum", 0)) + np.asarray(v.get("dram__bytes_write.sum", 0))
            points["i"] = judge_clock(pm["start_ns"], pm["end_ns"], dram, ks["start_ns"], ks["end_ns"])
        else:
            points["i"] = missing("i", "no PM samples")
        stop = shared.get("profiler_stop_ns") or 0
        after = ks["start_ns"] >= stop
        launched = int(shared.get("sustained_launches") or 0)
        points["j"] = judge_shared_profiler(shared.get("kineto_kernels"), tp.get("kineto_kernels"), shared_stderr,
                                            int(after.sum()), launched + 2)
        names = trace_shared.names.names_of(ks["name_id"])
        sleeps = [i for i in np.flatnonzero(after) if "spin_kernel" in names[i] or "sleep" in names[i].lower()]
        last = max(sleeps, key=lambda i: ks["start_ns"][i]) if sleeps else None
        points["k"] = judge_clock_after_profile(
            int(ks["start_ns"][last]) if last is not None else None,
            int(ks["end_ns"][last] - ks["start_ns"][last]) if last is not None else None,
            int(shared.get("sleep_wall_ns") or 0), float(shared.get("sleep_event_ns") or 0))
        flagged = any(int(m.get("flags", 0)) & (1 << 6) for m in trace_shared.meta["processes"].values())
        mul = sum(1 for i in np.flatnonzero(after) if "mul" in names[i].lower())
        points["l"] = judge_sustained(int((shared_counters or {}).get("processes_taken_over", 0)), flagged, mul,
                                      launched)
    return [points[x] for x in POINTS]


def main_driver(out: Path, budget_s: float) -> int:
    out.mkdir(parents=True, exist_ok=True)
    try:
        import numpy as np

        from ridgeline.probes.cupti.probe import CuptiProbe  # noqa: F401
    except ImportError as e:           # nothing can be judged: say so for every point
        points = [missing(k, f"{type(e).__name__}: {e}") for k in POINTS]
        (out / "gpu_check.json").write_text(json.dumps({"points": [asdict(p) for p in points]}, indent=2))
        print("\n".join(p.line() for p in points), flush=True)
        return 1
    t_start = time.monotonic()
    left = lambda: budget_s - (time.monotonic() - t_start)  # noqa: E731
    data: dict = {"started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  "host": platform.uname()._asdict(), "python": sys.version, "steps": {}}
    try:
        data["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                            text=True).stdout.strip()
    except OSError:         # no git on the GPU host: the report has no commit
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        data["nvidia_smi"] = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv"],
                                            capture_output=True, text=True).stdout.strip()

    def note(step, status, **kw):
        data["steps"][step] = {"status": status, **kw}
        print(f"gpu-check: {step}: {status} {kw.get('reason', '')}", flush=True)

    results: dict = {}
    trace = trace_graph = torch_trace = pm = trace_shared = None
    nvml_records: list = []
    shared_counters: dict = {}
    for name, fn in (
        ("plain", lambda: child("plain", out, min(120, left()))),
        ("injected", lambda: run_injected(out, "injected", min(120, left()))),
        ("torchprof", lambda: child("torchprof", out, min(60, left()))),
        ("shared", lambda: run_injected(out, "shared", min(90, left()), side=True)),
        ("graphlevel", lambda: run_injected(out, "graphlevel", min(60, left()), graph_level=True)),
    ):
        if left() < 20:
            note(name, "skipped", reason="out of time")
            continue
        try:
            r = fn()
            if name == "injected":
                results[name], trace, _, _, data["probe_counters"], _ = r
            elif name == "shared":
                results[name], trace_shared, nvml_records, pm, shared_counters, notes = r
                data["probe_counters_shared"], data["side_notes"] = shared_counters, notes
            elif name == "graphlevel":
                results[name], trace_graph, _, _, data["probe_counters_graphlevel"], _ = r
            else:
                results[name] = r
            note(name, "ok")
        except Exception as e:  # noqa: BLE001  (each step's failure is the report's finding, with its traceback)
            note(name, "failed", reason=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=4))
    data["results"] = results
    if (out / "torch_trace.json.gz").exists():
        try:
            from ridgeline.probes.kineto import load_trace
            torch_trace = load_trace(out / "torch_trace.json.gz")
        except Exception as e:  # noqa: BLE001  (the report says why the trace could not be read)
            note("torch_trace", "unreadable", reason=f"{type(e).__name__}: {e}")
    if trace is not None:
        np.savez_compressed(out / "cupti_events.npz", kernels=trace.kernels, copies=trace.copies, api=trace.api,
                            ranges=trace.ranges)
        (out / "cupti_names.json").write_text(json.dumps({"names": list(trace.names),
                                                          "mangled": {str(i): m for i, m in
                                                                      trace.meta["mangled_names"].items()}}))
    if pm:
        np.savez_compressed(out / "pm_samples.npz", start_ns=pm["start_ns"], end_ns=pm["end_ns"],
                            **{m.replace(".", "_"): v for m, v in pm["values"].items()})
    log_shared = out / "log_shared.txt"
    points = analyse(results, trace, trace_graph, torch_trace, nvml_records, pm, trace_shared, shared_counters,
                     log_shared.read_text(errors="replace") if log_shared.exists() else "")
    data["points"] = [asdict(p) for p in points]
    data["passed"] = sum(p.passed for p in points)
    data["finished_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
    (out / "gpu_check.json").write_text(json.dumps(data, indent=2, default=str))
    write_provenance(out, data)
    print("\n".join(["", "gpu-check: verdict per point"] + [p.line() for p in points]
                    + [f"gpu-check: {data['passed']}/{len(points)} points pass"]), flush=True)
    return 0 if data["passed"] == len(points) else 1


def write_provenance(out: Path, data: dict) -> None:
    lines = ["# GPU check recordings", "",
             f"- recorded: {data.get('started_utc')} .. {data.get('finished_utc')}",
             f"- by: `bash scripts/gpu-check.sh` (scripts/gpu_check.py) at commit {data.get('git_commit', '?')}",
             f"- GPU: {data.get('nvidia_smi', 'nvidia-smi not found')}",
             f"- workload: Llama-shaped decoder {SHAPE}, batch {BATCH}, prompt {PROMPT}, {DECODE_STEPS} decode "
             f"steps, {PROFILED_STEPS} profiled steps, random bf16 weights, plain PyTorch",
             "- files: gpu_check.json (every number and verdict), cupti_events.npz + cupti_names.json (Ridgeline "
             "CUPTI events of the injected run), torch_trace.json.gz (torch.profiler, the same profiled steps), "
             "pm_samples.npz, log_*.txt", ""]
    (out / "PROVENANCE.md").write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--workload", choices=["plain", "injected", "graphlevel", "torchprof", "shared"])
    ap.add_argument("--pm-sampler", action="store_true", help="(internal) PM sampling until SIGTERM")
    ap.add_argument("--budget-s", type=float, default=330)
    a = ap.parse_args()
    out = Path(a.out)
    if a.workload:
        print(json.dumps(workload(a.workload, out)), flush=True)
        return 0
    if a.pm_sampler:
        return pm_sampler_main(out)
    return main_driver(out, a.budget_s)


if __name__ == "__main__":
    sys.exit(main())
