"""``ridgeline capacity``: concurrency ceiling from the KV pool and the KV footprint per request.

Examples::

    ridgeline capacity --gpu-memory 80GB --weights 15GB --reserve 5GB --kv-per-request 0.5GB --kv-per-request 2GB
    ridgeline capacity --kv-pool 60GB --model llama-3-8b --context 4096 --context 16384
    ridgeline capacity --gpu h100-sxm --model path/to/config.json --memory-fraction 0.9 --context 8192 --output-tokens 1024
    ridgeline capacity --engine http://127.0.0.1:8000/metrics --context 4096 --output-tokens 512

Sizes take B/KB/MB/GB/TB (powers of 10) or KiB/MiB/GiB/TiB; a bare number is GB.
``--json`` keys: ``gpu_memory_bytes``, ``weight_bytes``, ``memory_fraction``,
``reserve_bytes``, ``kv_pool_bytes``, ``kv_pool_source``, ``kv_bytes_per_token``,
``output_tokens``, ``model``, ``warnings`` (also printed on stderr), ``rows``
(``kv_per_request_bytes``, ``context_tokens``,
``concurrency_ceiling``). With ``--engine URL`` the pool comes from the running engine in
tokens (vLLM ``num_gpu_blocks x block_size``, SGLang ``max_total_num_tokens``) and the
JSON has ``engine``, ``kv_pool_tokens`` and ``rows`` (``tokens_per_request``,
``concurrency_ceiling``).
"""
from __future__ import annotations

import json
import sys

from ridgeline.agent.commands import description
from ridgeline.aggregator import capacity
from ridgeline.probes.errors import InputError


def register(subparsers) -> None:
    p = subparsers.add_parser("capacity", help="KV-cache concurrency ceiling for a GPU, model and context length",
                              description=description(__doc__))
    p.add_argument("--gpu-memory", help="GPU memory (e.g. 80GB)")
    p.add_argument("--gpu", help="GPU model name from the ceilings table (gives its memory size)")
    p.add_argument("--weights", help="weight bytes on this GPU (default: from --model)")
    p.add_argument("--kv-pool", help="KV pool size, when known (skips the memory arithmetic)")
    p.add_argument("--memory-fraction", type=float, default=1.0,
                   help="share of GPU memory the engine may use (vLLM gpu_memory_utilization; default 1.0)")
    p.add_argument("--reserve", default="0", help="activations/graphs/allocator reserve (default 0)")
    p.add_argument("--model", help="Hugging Face config.json, folder or built-in name (KV bytes per token, weights)")
    p.add_argument("--kv-per-request", action="append", default=[], help="KV footprint of one request (repeatable)")
    p.add_argument("--context", type=int, action="append", default=[], help="prompt tokens per request (repeatable)")
    p.add_argument("--output-tokens", type=int, default=0, help="generated tokens per request (default 0)")
    p.add_argument("--engine", metavar="URL", help="read the KV pool (tokens) from a vLLM/SGLang /metrics endpoint")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _size(text: str, what: str) -> float:
    try:
        return capacity.parse_size(text)
    except ValueError as exc:
        raise InputError(f"--{what}: {exc}") from None


def _from_engine(args) -> int:
    from ridgeline.aggregator import engine_metrics
    from ridgeline.probes import engine as engine_probe
    res = engine_probe.scrape(args.engine)
    snap = engine_metrics.snapshot(res["exposition"], res["ts_ns"], args.engine)
    pool = snap["gauges"].get("kv_pool_tokens")
    if snap["engine"] is None or pool is None:
        raise InputError(f"{args.engine}: the endpoint does not expose its KV pool size "
                         "(vLLM cache_config_info or SGLang max_total_num_tokens)")
    if not args.context:
        raise InputError("--engine needs --context (prompt tokens per request)")
    rows = [{"tokens_per_request": c + args.output_tokens,
             "concurrency_ceiling": capacity.ceiling_from_pool_tokens(pool, c + args.output_tokens)}
            for c in args.context]
    out = {"engine": snap["engine"], "endpoint": args.engine, "model_names": snap["model_names"],
           "kv_pool_tokens": pool, "kv_usage": snap["gauges"].get("kv_usage_ratio"), "rows": rows}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"KV pool {pool:.0f} tokens ({snap['engine']} at {args.engine}, {', '.join(snap['model_names']) or '-'})")
    print(f"{'tokens/request':>15} {'max concurrent':>15}")
    for r in rows:
        print(f"{r['tokens_per_request']:>15d} {r['concurrency_ceiling']:>15d}")
    return 0


def run(args) -> int:
    if args.engine:
        return _from_engine(args)
    shape = None
    if args.model:
        from ridgeline.aggregator import model_config
        shape = model_config.load(args.model)
    gpu_mem = _size(args.gpu_memory, "gpu-memory") if args.gpu_memory else None
    if gpu_mem is None and args.gpu:
        from ridgeline.aggregator import ceilings
        try:
            c = ceilings.lookup(args.gpu)
        except (KeyError, ValueError) as exc:
            raise InputError(f"--gpu {args.gpu}: {exc}") from None
        if not c.memory_bytes:
            raise InputError(f"--gpu {args.gpu}: memory size not in the ceilings table; give --gpu-memory")
        gpu_mem = c.memory_bytes
        if c.key != args.gpu:      # a short or loose name: say which part it is
            print(f"ridgeline capacity: --gpu {args.gpu} is {c.key} ({c.memory_bytes / 1e9:.0f} GB)", file=sys.stderr)
    weights = _size(args.weights, "weights") if args.weights else (shape.weight_bytes if shape else None)
    pool = _size(args.kv_pool, "kv-pool") if args.kv_pool else None
    if pool is None and (gpu_mem is None or weights is None):
        raise InputError("give --kv-pool, or --gpu-memory/--gpu with --weights/--model")
    per_req = [_size(x, "kv-per-request") for x in args.kv_per_request]
    if args.context and shape is None:
        raise InputError("--context needs --model (KV bytes per token)")
    if not per_req and not args.context:
        raise InputError("give --kv-per-request, or --model with --context")
    try:
        out = capacity.plan(gpu_memory_bytes=gpu_mem, weight_bytes=weights, pool_bytes=pool,
                            memory_fraction=args.memory_fraction, reserve_bytes=_size(args.reserve, "reserve"),
                            per_request_bytes=per_req,
                            bytes_per_token=capacity.kv_bytes_per_token(shape) if shape else None,
                            context_tokens=args.context, output_tokens=args.output_tokens)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    out["model"] = getattr(shape, "name", None)
    for w in out["warnings"]:
        print(f"ridgeline capacity: warning: {w}", file=sys.stderr)
    if args.json:
        print(json.dumps(out))
        return 0
    gb = capacity.GB
    if out["gpu_memory_bytes"] is not None and out["weight_bytes"] is not None:
        print(f"GPU memory {out['gpu_memory_bytes'] / gb:.1f} GB x {out['memory_fraction']:.2f} "
              f"- weights {out['weight_bytes'] / gb:.1f} GB - reserve {out['reserve_bytes'] / gb:.1f} GB")
    print(f"KV pool {out['kv_pool_bytes'] / gb:.1f} GB ({out['kv_pool_source']})")
    if out["kv_bytes_per_token"]:
        print(f"KV per token {out['kv_bytes_per_token'] / 1024:.0f} KiB ({out['model']})")
    print(f"{'context tokens':>15} {'KV/request':>12} {'max concurrent':>15}")
    for r in out["rows"]:
        ctx = "-" if r["context_tokens"] is None else str(r["context_tokens"])
        print(f"{ctx:>15} {r['kv_per_request_bytes'] / gb:>9.2f} GB {r['concurrency_ceiling']:>15d}")
    return 0
