"""``ridgeline simulate``: a simulated continuous-batching LLM server (a load source).

Runs :mod:`agent.simulator` for a GPU (ceilings table) and a model (built-in name or
HF ``config.json``) under Poisson (or recorded-rate) arrivals, and writes a Kineto
trace (``--trace``), serves the engine's vLLM V1 metrics on 127.0.0.1 (``--serve-metrics``,
paced in real time), or both. ``--forward BxS`` simulates one profiled forward pass of B
sequences of S tokens instead. Everything it emits is labelled simulated.
"""
from __future__ import annotations

import time

import numpy as np

from ridgeline.agent.commands import description
from ridgeline.probes.errors import InputError


def register(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="simulate a continuous-batching LLM server (labelled simulated)",
                              description=description(__doc__, 1))
    p.add_argument("--gpu", default="h100", help="GPU from the ceilings table (default h100 = h100-sxm)")
    p.add_argument("--model", default="llama-3-8b", help="built-in model name or path to an HF config.json")
    p.add_argument("--engine", default="vllm", help="kernel conventions: vllm or hf (engine_kernels.toml)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=4.0, help="mean arrival rate, requests/s (Poisson)")
    p.add_argument("--recorded-rate", metavar="CSV",
                   help="arrival-rate segments, lines 'duration_s,rate_per_s' (overrides --rate/--duration)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals (default 30)")
    p.add_argument("--prompt-mean", type=int, default=512)
    p.add_argument("--prompt-max", type=int, default=4096)
    p.add_argument("--output-mean", type=int, default=256)
    p.add_argument("--output-max", type=int, default=1024)
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens of a system prompt shared by all requests")
    p.add_argument("--max-num-seqs", type=int, default=256, help="batch limit")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="prefill token budget per step")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-gb", type=float, help="KV pool size in GB (overrides the memory-derived size)")
    p.add_argument("--no-annotations", action="store_true", help="omit the engine's step annotations")
    p.add_argument("--forward", metavar="BxS", help="one forward pass of B sequences x S tokens (e.g. 16x559)")
    p.add_argument("--trace", metavar="PATH", help="write a Kineto trace (.json or .json.gz)")
    p.add_argument("--serve-metrics", type=int, metavar="PORT",
                   help="serve /metrics on 127.0.0.1:PORT and run in real time (0 = any free port)")
    p.add_argument("--speed", type=float, default=1.0, help="real-time factor with --serve-metrics")
    p.set_defaults(func=run)


def _recorded_rate(path: str) -> tuple:
    try:
        rows = []
        for line in open(path):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            d, r = line.split(",")[:2]
            rows.append((float(d), float(r)))
    except OSError as exc:
        raise InputError(f"{path}: cannot read recorded rate ({exc.strerror or exc})") from None
    except ValueError:
        raise InputError(f"{path}: expected lines 'duration_s,rate_per_s'") from None
    if not rows:
        raise InputError(f"{path}: no rate segments")
    return tuple(rows)


def config_from_args(args):
    from ridgeline.agent.simulator.engine import SimConfig
    from ridgeline.agent.simulator.scheduler import SchedulerConfig
    from ridgeline.agent.simulator.workload import Workload
    segments = _recorded_rate(args.recorded_rate) if args.recorded_rate else ()
    duration = sum(d for d, _ in segments) if segments else args.duration
    w = Workload(rate_per_s=args.rate, duration_s=duration, prompt_mean=args.prompt_mean,
                 prompt_max=args.prompt_max, output_mean=args.output_mean, output_max=args.output_max,
                 shared_prefix_tokens=args.shared_prefix, recorded_rate=segments)
    w.validate()
    if args.max_num_seqs < 1 or args.max_num_batched_tokens < 1:
        raise InputError("--max-num-seqs and --max-num-batched-tokens must be >= 1")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise InputError("--gpu-memory-utilization must be in (0, 1]")
    return SimConfig(gpu=args.gpu, model=args.model, engine=args.engine, workload=w,
                     scheduler=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens,
                                               not args.no_chunked_prefill),
                     gpu_memory_utilization=args.gpu_memory_utilization,
                     kv_cache_bytes=args.kv_cache_gb * 1e9 if args.kv_cache_gb else None,
                     annotations=not args.no_annotations)


def summary(engine) -> str:
    steps = list(engine.steps)
    fin = engine.finished
    lines = [f"SIMULATED {engine.cfg.engine} server: {engine.model.name} on {engine.gpu.name} (seed {engine.seed})",
             f"  KV pool: {engine.pool.total_blocks} blocks x {engine.pool.block_size} tokens"
             f" = {engine.pool.capacity_tokens} tokens"]
    if not steps:
        return "\n".join(lines + ["  no steps"])
    span_s = max(1e-9, (steps[-1].end_ns - steps[0].start_ns) / 1e9)
    launched = sum(s.kernels for s in steps)
    lines.append(f"  steps {len(steps)}, kernels {launched} ({launched / span_s:,.0f}/s simulated), span {span_s:.2f} s"
                 + (f", {engine.dropped_kernels} kernel records dropped (buffer full)" if engine.dropped_kernels else ""))
    if fin:
        ttft = np.array([(r.first_token_ns - r.arrival_ns) / 1e6 for r in fin])
        lines.append(f"  requests finished {len(fin)}, aborted {engine.aborted}, preemptions {engine.preemptions_total}")
        lines.append(f"  TTFT p50 {np.percentile(ttft, 50):.1f} ms p99 {np.percentile(ttft, 99):.1f} ms; "
                     f"generated {sum(r.generated for r in fin)} tokens "
                     f"({sum(r.generated for r in fin) / span_s:,.0f} tok/s)")
    lines.append(f"  KV usage peak {100 * max(s.kv_usage_ratio for s in steps):.1f}%, "
                 f"max running {max(s.running for s in steps)}, max waiting {max(s.waiting for s in steps)}")
    return "\n".join(lines)


def run(args) -> int:
    from ridgeline.agent.simulator.engine import SimEngine
    from ridgeline.agent.simulator.kineto_writer import write_kineto
    cfg = config_from_args(args)
    if args.forward:
        try:
            b, s = (int(x) for x in args.forward.lower().split("x"))
            if b < 1 or s < 1:
                raise ValueError
        except ValueError:
            raise InputError(f"--forward {args.forward!r}: expected BxS, e.g. 16x559") from None
        eng = SimEngine(cfg, seed=args.seed, metrics=False)
        rec = eng.forward([s] * b)
        print(f"SIMULATED forward {b}x{s} ({cfg.engine}, {eng.model.name}, {eng.gpu.name}): "
              f"GPU {(rec.gpu_end_ns - rec.gpu_start_ns) / 1e6:.3f} ms, {rec.kernels} kernels, "
              f"{rec.flops / 1e12:.2f} TFLOP, {rec.bytes / 1e9:.2f} GB")
    elif args.serve_metrics is not None:
        if args.speed <= 0:
            raise InputError("--speed must be > 0")
        cfg.emit_events = bool(args.trace)    # metrics only: skip building event arrays nobody reads
        eng = SimEngine(cfg, seed=args.seed, metrics=True, keep_steps=10_000)
        port = eng.metrics.serve(args.serve_metrics)
        print(f"SIMULATED engine metrics on http://127.0.0.1:{port}/metrics (Ctrl-C stops)", flush=True)
        t0 = time.monotonic()
        try:
            while not eng.done:
                sim_now = int((time.monotonic() - t0) * args.speed * 1e9)
                eng.run_until(sim_now)
                time.sleep(0.02)
        except KeyboardInterrupt:
            pass
        finally:
            eng.metrics.close()
    else:
        eng = SimEngine(cfg, seed=args.seed, metrics=False)
        eng.run()
    if args.trace:
        path = write_kineto(eng.drain(), args.trace)
        print(f"wrote {path} (simulated)")
    if not args.forward:
        print(summary(eng))
    return 0
