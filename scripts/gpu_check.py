"""GPU check of Ridgeline's CUPTI path: run on a machine with an NVIDIA GPU (scripts/gpu-check.sh).

Not run in CI and never run on a machine without a GPU (it detects that and says so).
It runs a small Llama-shaped decoder (plain PyTorch, random weights, bf16) for one
prefill and a decode loop, several times, as separate processes:

  plain      no injection: baseline CPU time and kernel launches
  injected   under `ridgeline run --mode deep`, the agent's CuptiProbe listening here
  torchprof  under torch.profiler (Kineto), exported as a Chrome trace
  coexist    torch.profiler inside an injected process: does each tool still get its
             data, and does the library report the other CUPTI subscriber?

and records, with provenance, in OUT:
  gpu_check.json        every number below, and every step's status / reason
  cupti_events.npz      the columnar events the probe decoded (+ cupti_names.json)
  torch_trace.json.gz   the torch.profiler trace of the same workload
  pm_metrics.json       the chip's PM-sampling metric list (cupti-python profiler_host)
  pm_samples.npz        PM samples taken during an injected run, if PM sampling works
  PROVENANCE.md         machine, driver, versions, commit, commands

Comparisons: kernel count and total kernel time vs torch.profiler; phase split (NVTX
"prefill"/"decode" ranges, and aggregator.phases when present); decode achieved
bandwidth (weights + KV read per step / step time) vs measured device copy bandwidth;
CPU cost per kernel of the injection (injected - plain CPU time / kernels); PM-sampling
metrics attributed to phases (aggregator.counters).

Usage: python scripts/gpu_check.py --out DIR [--budget-s 540]
       python scripts/gpu_check.py --workload {plain,injected,torchprof} --out DIR   (internal)
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Llama-shaped, small enough for seconds per run, large enough that decode is bandwidth bound
SHAPE = dict(hidden=2048, layers=8, heads=16, kv_heads=4, intermediate=5632, vocab=32000)
BATCH, PROMPT, DECODE_STEPS = 4, 512, 64


# ---------------------------------------------------------------------------------------
# the workload (runs in a child process)

def workload(mode: str, out: Path) -> dict:
    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    dev = torch.device("cuda")
    dt = torch.bfloat16
    h, L, nh, nkv, inter, vocab = (SHAPE[k] for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab"))
    hd = h // nh
    max_len = PROMPT + DECODE_STEPS

    def w(*s):
        return (torch.randn(*s, device=dev, dtype=dt) * 0.02)
    layers = [dict(ln1=torch.ones(h, device=dev, dtype=dt), wq=w(h, nh * hd), wk=w(h, nkv * hd), wv=w(h, nkv * hd),
                   wo=w(nh * hd, h), ln2=torch.ones(h, device=dev, dtype=dt), wg=w(h, inter), wu=w(h, inter),
                   wd=w(inter, h)) for _ in range(L)]
    emb, lm_head = w(vocab, h), w(h, vocab)
    kc = [torch.zeros(BATCH, nkv, max_len, hd, device=dev, dtype=dt) for _ in range(L)]
    vc = [torch.zeros(BATCH, nkv, max_len, hd, device=dev, dtype=dt) for _ in range(L)]
    weight_bytes = sum(t.numel() * t.element_size() for d in layers for t in d.values()) + \
        (emb.numel() + lm_head.numel()) * 2

    def rms(x, g):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * g

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
            kk = kc[i][:, :, :pos + t].repeat_interleave(nh // nkv, dim=1)
            vv = vc[i][:, :, :pos + t].repeat_interleave(nh // nkv, dim=1)
            a = F.scaled_dot_product_attention(q, kk, vv, is_causal=(t > 1))
            x = x + a.transpose(1, 2).reshape(b, t, nh * hd) @ p["wo"]
            y = rms(x, p["ln2"])
            x = x + (F.silu(y @ p["wg"]) * (y @ p["wu"])) @ p["wd"]
        return rms(x[:, -1], torch.ones(h, device=dev, dtype=dt)) @ lm_head

    def run_once():
        tokens = torch.randint(0, vocab, (BATCH, PROMPT), device=dev)
        torch.cuda.nvtx.range_push("prefill")
        logits = forward(tokens, 0)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        nxt = logits.argmax(-1, keepdim=True)
        torch.cuda.nvtx.range_push("decode")
        for s in range(DECODE_STEPS):
            logits = forward(nxt, PROMPT + s)
            nxt = logits.argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()

    run_once()                     # warm-up (cuBLAS handles, allocator)
    torch.cuda.synchronize()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    if mode in ("torchprof", "coexist"):
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            run_once()
        stem = "torch_trace" if mode == "torchprof" else "torch_trace_coexist"
        prof.export_chrome_trace(str(out / f"{stem}.json"))
        with open(out / f"{stem}.json", "rb") as f, gzip.open(out / f"{stem}.json.gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.unlink(out / f"{stem}.json")
    else:
        run_once()
    torch.cuda.synchronize()
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    kv_bytes_per_token = 2 * L * nkv * hd * 2
    return {"mode": mode, "cpu_s": (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime),
            "wall_s": t1 - t0, "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes_per_token,
            "torch": torch.__version__, "torch_cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
            "shape": SHAPE, "batch": BATCH, "prompt": PROMPT, "decode_steps": DECODE_STEPS,
            "copy_bandwidth": measure_copy_bandwidth(torch) if mode == "plain" else None}


def measure_copy_bandwidth(torch) -> dict:
    """Device-to-device copy bandwidth (read + write bytes / time), the achievable HBM ceiling."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    s.record()
    for _ in range(reps):
        b.copy_(a)
    e.record()
    torch.cuda.synchronize()
    sec = s.elapsed_time(e) / 1e3
    return {"bytes_per_s": 2 * n * reps / sec, "buffer_bytes": n, "reps": reps, "method": "torch copy_ D2D, 2x bytes"}


# ---------------------------------------------------------------------------------------
# the driver (runs in the parent)

class Report:
    def __init__(self, out: Path):
        self.out = out
        self.data: dict = {"steps": {}, "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat()}

    def step(self, name: str, status: str, **kw):
        self.data["steps"][name] = {"status": status, **kw}
        print(f"gpu-check: {name}: {status} {kw.get('reason', '')}", flush=True)
        self.save()

    def save(self):
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=2, default=str))


def child(mode: str, out: Path, timeout: float, env_extra: dict | None = None, wrap: list[str] | None = None):
    cmd = (wrap or []) + [sys.executable, str(Path(__file__).resolve()), "--workload", mode, "--out", str(out)]
    env = dict(os.environ, **(env_extra or {}))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    (out / f"log_{mode}.txt").write_text(r.stdout + "\n--- stderr ---\n" + r.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"{mode} run failed (rc {r.returncode}): {r.stderr.strip().splitlines()[-1:] }")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_injected(rep: Report, out: Path, timeout: float, pm: bool, mode: str = "injected") -> tuple[dict, object, object]:
    """One injected run with the probe listening here; returns (workload result, trace, pm samples)."""
    import numpy as np
    from ridgeline.probes.cupti.probe import CuptiProbe
    sock = out / "tmp" / "cupti.sock"
    sock.parent.mkdir(parents=True, exist_ok=True)
    probe = CuptiProbe(str(sock))
    probe.start()
    sampler, pm_out = None, None
    if pm:
        try:
            from ridgeline.probes.cupti.pm_sampler import PmSampler
            sampler = PmSampler(0, metrics=["dram__bytes_read.sum", "dram__bytes_write.sum"], interval_ns=1_000_000)
            sampler.start()
        except Exception as e:
            from ridgeline.probes.cupti.pm_sampler import unavailable_reason
            rep.step("pm_sampling_run", "unavailable", reason=" / ".join(unavailable_reason(e)))
            sampler = None
    traces = []
    try:
        wrap = [sys.executable, "-m", "ridgeline", "run", "--socket", str(sock), "--mode", "deep", "--"]
        res = child(mode, out, timeout, wrap=wrap)
        end = time.monotonic() + 3
        while time.monotonic() < end:
            got = probe.poll()
            if "trace" in got:
                traces.append((got["trace"], got["launch_latency_ns"]))
            if "status" in got:
                rep.data.setdefault("library_status", {}).update({str(k): v for k, v in got["status"].items()})
            time.sleep(0.1)
        if sampler is not None:
            pm_out = sampler.poll()
    finally:
        if sampler is not None:
            sampler.stop()
        counters = probe.counters()
        probe.stop()
    rep.data.setdefault("probe_counters", []).append(counters)
    from ridgeline.probes.events import Trace
    if not traces:
        return res, None, pm_out
    t = traces[0][0]
    procs = {}
    for tr, _ in traces:
        procs.update(tr.meta["processes"])
    merged = Trace(kernels=np.concatenate([tr.kernels for tr, _ in traces]),
                   copies=np.concatenate([tr.copies for tr, _ in traces]),
                   api=np.concatenate([tr.api for tr, _ in traces]),
                   ranges=np.concatenate([tr.ranges for tr, _ in traces]),
                   names=t.names, meta={"source": "cupti", "processes": procs})
    merged.meta["launch_latency_ns"] = np.concatenate([lat for _, lat in traces])
    return res, merged, pm_out   # not re-sorted: launch_latency_ns stays aligned with kernels


def phase_split(trace) -> dict:
    import numpy as np
    names = trace.names
    out = {}
    k = trace.kernels
    dur = k["end_ns"] - k["start_ns"]
    for r in trace.ranges:
        label = names[int(r["name_id"])] if r["name_id"] >= 0 else "?"
        if label not in ("prefill", "decode"):
            continue
        sel = (k["start_ns"] >= r["start_ns"]) & (k["end_ns"] <= r["end_ns"])
        out[label] = {"kernels": int(sel.sum()), "kernel_time_ns": int(dur[sel].sum()),
                      "range_ns": int(r["end_ns"] - r["start_ns"]), "start_ns": int(r["start_ns"]),
                      "end_ns": int(r["end_ns"])}
    try:
        from ridgeline.aggregator.phases import PHASE_NAMES, map_phases
        pm = map_phases(trace, use_annotations=True)
        per = np.bincount(pm.kernel_phase, weights=dur, minlength=len(PHASE_NAMES))
        out["aggregator_phases_kernel_time_ns"] = {PHASE_NAMES[i]: int(v) for i, v in enumerate(per)}
    except Exception as e:
        out["aggregator_phases"] = f"unavailable: {type(e).__name__}: {e}"
    return out


def main_driver(out: Path, budget_s: float) -> int:
    out.mkdir(parents=True, exist_ok=True)
    rep = Report(out)
    t_start = time.monotonic()
    left = lambda: budget_s - (time.monotonic() - t_start)  # noqa: E731
    rep.data["host"] = {"uname": platform.uname()._asdict(), "python": sys.version}
    try:
        rep.data["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                                text=True).stdout.strip()
    except Exception:
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        r = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem",
                            "--format=csv"], capture_output=True, text=True)
        rep.data["nvidia_smi"] = r.stdout.strip()
    try:
        import torch
        ok = torch.cuda.is_available()
        rep.step("torch", "ok" if ok else "no-cuda", version=torch.__version__, cuda=torch.version.cuda,
                 reason="" if ok else "torch.cuda.is_available() is False")
        have_torch = ok
    except Exception as e:
        rep.step("torch", "missing", reason=f"{type(e).__name__}: {e}; workload steps skipped "
                                            "(pip install torch needs a package index this machine may not reach)")
        have_torch = False

    # PM-sampling metric list (needs only cupti-python and a driver)
    try:
        from ridgeline.probes.cupti.pm_sampler import metric_list
        ml = metric_list(0)
        (out / "pm_metrics.json").write_text(json.dumps(ml, indent=1))
        rep.step("pm_metric_list", "ok", chip=ml.get("chip"),
                 counts={k: len(v) if isinstance(v, list) else v for k, v in ml["base_metrics"].items()})
    except Exception as e:
        from ridgeline.probes.cupti.pm_sampler import unavailable_reason
        rep.step("pm_metric_list", "failed", reason=" / ".join(unavailable_reason(e)),
                 traceback=traceback.format_exc(limit=3))

    if not have_torch:
        rep.data["finished_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
        rep.save()
        write_provenance(out, rep.data)
        return 0
    import numpy as np
    results = {}
    try:
        results["plain1"] = child("plain", out, min(150, left()))
        results["plain2"] = child("plain", out, min(150, left()))
        rep.step("plain", "ok", cpu_s=[results["plain1"]["cpu_s"], results["plain2"]["cpu_s"]],
                 copy_bandwidth=results["plain1"]["copy_bandwidth"])
    except Exception as e:
        rep.step("plain", "failed", reason=str(e))
    trace = None
    try:
        res1, trace, _ = run_injected(rep, out, min(150, left()), pm=False)
        res2, trace2, pm_samples = run_injected(rep, out, min(150, left()), pm=True)
        results["inj1"], results["inj2"] = res1, res2
        if trace is None:
            rep.step("injected", "no-events", reason="the probe received nothing; see log_injected.txt",
                     library_status=rep.data.get("library_status"))
        else:
            k = trace.kernels
            np.savez_compressed(out / "cupti_events.npz", kernels=k, copies=trace.copies, api=trace.api,
                                ranges=trace.ranges, launch_latency_ns=trace.meta.pop("launch_latency_ns"))
            (out / "cupti_names.json").write_text(json.dumps(list(trace.names)))
            lat = np.load(out / "cupti_events.npz")["launch_latency_ns"]
            good = lat[lat >= 0]
            rep.step("injected", "ok", kernels=int(len(k)), copies=int(len(trace.copies)), api=int(len(trace.api)),
                     ranges=int(len(trace.ranges)), kernel_time_ns=int((k["end_ns"] - k["start_ns"]).sum()),
                     tid_joined_ratio=float((k["tid"] >= 0).mean()) if len(k) else 0.0,
                     launch_latency_ns_p50=float(np.median(good)) if len(good) else None,
                     meta={kk: v for kk, v in trace.meta.items() if kk != "launch_latency_ns"})
            ph = phase_split(trace)
            rep.step("phase_split", "ok", **ph)
            # decode achieved bandwidth vs device copy bandwidth
            if "decode" in ph and results.get("plain1"):
                r = results["plain1"]
                ctx = PROMPT + DECODE_STEPS / 2
                bytes_per_step = r["weight_bytes"] + BATCH * ctx * r["kv_bytes_per_token"]
                step_s = ph["decode"]["range_ns"] / 1e9 / DECODE_STEPS
                kern_s = ph["decode"]["kernel_time_ns"] / 1e9 / DECODE_STEPS
                cb = r["copy_bandwidth"]["bytes_per_s"]
                rep.step("decode_bandwidth", "ok", model_bytes_per_step=bytes_per_step,
                         achieved_bytes_per_s_wall=bytes_per_step / step_s,
                         achieved_bytes_per_s_kernel_time=bytes_per_step / kern_s,
                         copy_bytes_per_s=cb, ratio_wall=bytes_per_step / step_s / cb,
                         work_source="model (weights + KV read once per step)")
            if pm_samples and trace2 is not None and len(pm_samples.get("start_ns", [])):
                np.savez_compressed(out / "pm_samples.npz", start_ns=pm_samples["start_ns"],
                                    end_ns=pm_samples["end_ns"], **{k.replace(".", "_"): v for k, v in
                                                                   pm_samples["values"].items()})
                try:
                    from ridgeline.aggregator.counters import EXTENSIVE, CounterSamples, attribute
                    k2 = trace2.kernels
                    ph2 = phase_split(trace2)
                    phase = np.zeros(len(k2), np.uint8)
                    for code, lab in ((1, "prefill"), (2, "decode")):
                        if lab in ph2:
                            phase[(k2["start_ns"] >= ph2[lab]["start_ns"]) & (k2["end_ns"] <= ph2[lab]["end_ns"])] = code
                    cs = CounterSamples("cupti_pm_sampling", pm_samples["start_ns"], pm_samples["end_ns"],
                                        dict(pm_samples["values"]), {m: EXTENSIVE for m in pm_samples["values"]},
                                        {m: "bytes" for m in pm_samples["values"]})
                    rep.step("pm_attribution", "ok", phases=attribute(cs, k2["start_ns"], k2["end_ns"], phase),
                             note="PM timestamps and activity timestamps both CUPTI ns; same clock assumed")
                except Exception as e:
                    rep.step("pm_attribution", "failed", reason=f"{type(e).__name__}: {e}")
    except Exception as e:
        rep.step("injected", "failed", reason=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=5))

    try:
        results["prof"] = child("torchprof", out, min(200, left()))
        from ridgeline.probes.kineto import load_trace
        tt = load_trace(out / "torch_trace.json.gz")
        kk = tt.kernels
        cmp = {"torch_kernels": int(len(kk)), "torch_kernel_time_ns": int((kk["end_ns"] - kk["start_ns"]).sum())}
        if trace is not None:
            k = trace.kernels
            cmp.update(cupti_kernels=int(len(k)), cupti_kernel_time_ns=int((k["end_ns"] - k["start_ns"]).sum()))
            cmp["count_ratio"] = cmp["cupti_kernels"] / max(1, cmp["torch_kernels"])
            cmp["time_ratio"] = cmp["cupti_kernel_time_ns"] / max(1, cmp["torch_kernel_time_ns"])
            from collections import Counter
            a = Counter(trace.names.names_of(k["name_id"]))
            b = Counter(tt.names.names_of(kk["name_id"]))
            cmp["top_kernels"] = [(n, a[n], b.get(n, 0)) for n, _ in a.most_common(15)]
        rep.step("vs_torch_profiler", "ok", **cmp)
    except Exception as e:
        rep.step("vs_torch_profiler", "failed", reason=f"{type(e).__name__}: {e}")

    if "plain1" in results and "inj1" in results and trace is not None and len(trace.kernels):
        n = len(trace.kernels)
        plain = min(results["plain1"]["cpu_s"], results["plain2"]["cpu_s"])
        inj = min(results["inj1"]["cpu_s"], results["inj2"]["cpu_s"])
        rep.step("cpu_cost", "ok", plain_cpu_s=plain, injected_cpu_s=inj, kernels=n,
                 cpu_ns_per_kernel=(inj - plain) / n * 1e9,
                 wall_plain_s=results["plain1"]["wall_s"], wall_injected_s=results["inj1"]["wall_s"],
                 note="min of two runs each; injected runs are in deep mode")
    if left() > 120:
        try:
            rep.data.pop("library_status", None)
            res, tr, _ = run_injected(rep, out, min(150, left() - 60), pm=False, mode="coexist")
            from ridgeline.probes.kineto import load_trace
            tt = load_trace(out / "torch_trace_coexist.json.gz")
            rep.step("coexist_torch_profiler", "ok", ridgeline_kernels=int(len(tr.kernels)) if tr is not None else 0,
                     torch_profiler_kernels=int(len(tt.kernels)), library_status=rep.data.get("library_status"),
                     processes=tr.meta.get("processes") if tr is not None else None)
        except Exception as e:
            rep.step("coexist_torch_profiler", "failed", reason=f"{type(e).__name__}: {e}")
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--require", "gpu", "-m", "gpu",
                            "tests/test_cupti_pm_sampler.py"], cwd=ROOT, capture_output=True, text=True,
                           timeout=max(30, min(120, left())))
        rep.step("pytest_gpu", "ok" if r.returncode == 0 else "failed", tail=r.stdout[-1500:])
    except Exception as e:
        rep.step("pytest_gpu", "failed", reason=str(e))
    rep.data["finished_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
    rep.save()
    write_provenance(out, rep.data)
    return 0


def write_provenance(out: Path, data: dict) -> None:
    lines = ["# GPU check recordings", "",
             f"- recorded: {data.get('started_utc')} .. {data.get('finished_utc')}",
             f"- by: `bash scripts/gpu-check.sh` (scripts/gpu_check.py) at commit {data.get('git_commit', '?')}",
             f"- GPU: {data.get('nvidia_smi', 'nvidia-smi not found')}",
             f"- torch: {data['steps'].get('torch', {})}",
             f"- workload: Llama-shaped decoder {SHAPE}, batch {BATCH}, prompt {PROMPT}, {DECODE_STEPS} decode "
             "steps, random bf16 weights, plain PyTorch; NVTX ranges 'prefill' and 'decode'",
             "- files: gpu_check.json (all numbers), cupti_events.npz + cupti_names.json (Ridgeline CUPTI "
             "events), torch_trace.json.gz (torch.profiler), pm_metrics.json, pm_samples.npz, log_*.txt", ""]
    (out / "PROVENANCE.md").write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--workload", choices=["plain", "injected", "torchprof", "coexist"])
    ap.add_argument("--budget-s", type=float, default=540)
    a = ap.parse_args()
    out = Path(a.out)
    if a.workload:
        print(json.dumps(workload(a.workload, out)), flush=True)
        return 0
    return main_driver(out, a.budget_s)


if __name__ == "__main__":
    sys.exit(main())
