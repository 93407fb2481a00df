"""``ridgeline scrape URL [--json] [--window S]``: normalised figures of a vLLM/SGLang endpoint.

One scrape gives gauges now and ratios/percentiles over the server's lifetime
(``since_start``: true). With ``--window S`` it scrapes twice, S seconds apart, and
reports the window's figures from the deltas (rates, hit rate, percentiles of what
happened in the window).

JSON keys: ``engine``, ``version_hint``, ``model_names``, ``simulated`` (series labelled
``simulated="true"`` by Ridgeline's workload generator), ``endpoint``, ``since_start``,
``interval_s``, ``kv_usage`` (0..1), ``kv_pool_tokens``, ``num_running``,
``num_waiting``, ``preemptions_total``, ``preemptions`` (in the window / since start),
``preemption_rate_per_s``, ``prefix_cache_hit_rate`` (null when not derivable),
``prefix_cache_hit_source`` (``counter_delta`` or ``gauge``), ``prefill_time_share``,
``tokens_per_step``, ``restarted``, and ``histograms``: per family (``ttft_s``, ``itl_s``,
``queue_time_s``, ``prefill_time_s``, ``decode_time_s``, ``e2e_latency_s``,
``iteration_tokens``) ``count``, ``mean``, and ``p50``/``p90``/``p99`` each as
``{value, kind, lower_bound, upper_bound}`` (``kind``: interpolated, first_bucket,
above_last_bucket, no_data), ``sources``: figure -> exposed family.
"""
from __future__ import annotations

import json
import time

from ridgeline.agent.commands import description
from ridgeline.aggregator import engine_metrics as em
from ridgeline.probes import engine as engine_probe
from ridgeline.probes.errors import InputError

HIST_KEYS = tuple(em.HISTOGRAMS)


def register(subparsers) -> None:
    p = subparsers.add_parser("scrape", help="scrape a vLLM/SGLang /metrics endpoint and print normalised figures",
                              description=description(__doc__))
    p.add_argument("url", help="endpoint, e.g. http://127.0.0.1:8000/metrics (a bare host:port gets /metrics)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=float, default=engine_probe.DEFAULT_TIMEOUT_S, help="seconds per request")
    p.add_argument("--window", type=float, default=None, metavar="S",
                   help="scrape twice, S seconds apart, and report the window's deltas")
    p.set_defaults(func=run)


def _normalise_url(url: str) -> str:
    if "://" not in url:
        url = "http://" + url
    scheme, rest = url.split("://", 1)
    if "/" not in rest:
        url = f"{scheme}://{rest}/metrics"
    return url


def _snapshot(url: str, timeout: float) -> dict:
    res = engine_probe.scrape(url, timeout)
    snap = em.snapshot(res["exposition"], res["ts_ns"], url)
    if snap["engine"] is None:
        raise InputError(f"{url}: no vLLM or SGLang metrics in the response "
                         f"({len(res['exposition'].samples)} other samples)")
    return snap


def figures_json(fig: dict) -> dict:
    """The documented JSON object of the command from engine window figures."""
    hists = {}
    for k in HIST_KEYS:
        s = fig.get(k)
        if s is not None:
            hists[k] = s
    return {
        "engine": fig["engine"],
        "version_hint": fig.get("version_hint"),
        "model_names": fig.get("model_names", []),
        "simulated": fig.get("simulated", False),
        "endpoint": fig.get("endpoint"),
        "since_start": fig["since_start"],
        "interval_s": fig.get("interval_s"),
        "restarted": fig["restarted"],
        "kv_usage": fig["kv_usage_ratio"],
        "kv_pool_tokens": fig["kv_pool_tokens"],
        "kv_used_tokens": fig["kv_used_tokens"],
        "num_running": fig["num_running_requests"],
        "num_waiting": fig["num_waiting_requests"],
        "preemptions_total": fig["preemptions_total"],
        "preemptions": fig["preemptions"],
        "preemption_rate_per_s": fig["preemption_rate_per_s"],
        "prefix_cache_hit_rate": fig["prefix_cache_hit_ratio"],
        "prefix_cache_hit_source": fig.get("prefix_cache_hit_source"),
        "prefix_cache_unit": fig.get("prefix_cache_unit"),
        "prefill_time_share": fig.get("prefill_time_share_ratio"),
        "prefill_time_share_kind": fig.get("prefill_time_share_kind"),
        "tokens_per_step": fig.get("tokens_per_step"),
        "generation_throughput_tokens_per_s": fig.get("generation_throughput_tokens_per_s"),
        "num_swapped": fig.get("num_swapped_requests"),
        "segments_mean_s": {seg: fig.get(f"{seg}_mean_s") for seg in ("queue", "prefill", "decode", "ttft", "e2e")},
        "segment_kinds": fig.get("segment_kinds", {}),
        "queue_share_of_ttft": fig.get("queue_share_of_ttft_ratio"),
        "external_prefix_cache_hit_rate": fig.get("external_prefix_cache_hit_ratio"),
        "prompt_tokens_cached_rate": fig.get("prompt_tokens_cached_ratio"),
        "kv_eviction_rate_tokens_per_s": fig.get("kv_eviction_rate_tokens_per_s"),
        "kv_eviction_source": fig.get("kv_eviction_source"),
        "estimated_flops_per_gpu_per_s": fig.get("estimated_flops_per_gpu_per_s"),
        "estimated_bytes_per_gpu_per_s": fig.get("estimated_bytes_per_gpu_per_s"),
        "histograms": hists,
        "sources": fig.get("sources", {}),
    }


def _amount(x: float, unit: str) -> str:
    if unit != "s":
        return f"{x:.3g}"
    return f"{x * 1000:.3g}ms" if x < 1 else f"{x:.3g}s"


def _fmt_q(qd: dict, unit: str) -> str:
    k = qd["kind"]
    if k == "interpolated" or qd.get("value") is not None:
        return _amount(qd["value"], unit)
    if k == "first_bucket":
        return "<=" + _amount(qd["upper_bound"], unit)
    if k == "above_last_bucket":
        return ">" + _amount(qd["lower_bound"], unit)
    return "-"


def _fmt(v, pattern="{:.3g}") -> str:
    return "-" if v is None else pattern.format(v)


def run(args) -> int:
    url = _normalise_url(args.url)
    first = _snapshot(url, args.timeout)
    if args.window is not None:
        if args.window <= 0:
            raise InputError(f"--window must be positive, got {args.window}")
        time.sleep(args.window)
        fig = em.window_figures([_snapshot(url, args.timeout)], first)
    else:
        fig = em.lifetime_figures(first)
    out = figures_json(fig)
    if args.json:
        print(json.dumps(out, sort_keys=False))
        return 0
    scope = "since server start" if out["since_start"] else f"over {out['interval_s']:.1f} s"
    sim = "  [SIMULATED]" if out["simulated"] else ""
    print(f"{out['engine']} ({out['version_hint']}) at {url}  models: {', '.join(out['model_names']) or '-'}{sim}")
    pool = f" of {out['kv_pool_tokens']:.0f} tokens" if out["kv_pool_tokens"] is not None else ""
    print(f"  KV usage        {_fmt(out['kv_usage'], '{:.1%}')}{pool}")
    print(f"  requests        running {_fmt(out['num_running'], '{:.0f}')}  waiting {_fmt(out['num_waiting'], '{:.0f}')}")
    print(f"  preemptions     total {_fmt(out['preemptions_total'], '{:.0f}')}  rate {_fmt(out['preemption_rate_per_s'])}/s")
    print(f"  prefix hit rate {_fmt(out['prefix_cache_hit_rate'], '{:.1%}')} ({scope})"
          f"  external {_fmt(out['external_prefix_cache_hit_rate'], '{:.1%}')}"
          f"  cached prompt tokens {_fmt(out['prompt_tokens_cached_rate'], '{:.1%}')}")
    kinds = out["segment_kinds"]
    segs = "  ".join(f"{k}{'*' if kinds.get(k) == 'derived' else ''} {_fmt(v, '{:.3g}')} s"
                     for k, v in out["segments_mean_s"].items())
    print(f"  segments (mean) {segs}  queue share of TTFT {_fmt(out['queue_share_of_ttft'], '{:.0%}')}"
          + ("  (* derived from means)" if "derived" in kinds.values() else ""))
    ev = (f"{_fmt(out['kv_eviction_rate_tokens_per_s'])} tokens/s" if out["kv_eviction_source"]
          else "unknown (not exported)")
    print(f"  KV eviction     {ev}")
    for k, s in out["histograms"].items():
        unit = "s" if k.endswith("_s") else ""
        qs = "  ".join(f"{p} {_fmt_q(s[p], unit)}" for p in ("p50", "p90", "p99"))
        print(f"  {k:<16} n={s['count']:.0f}  {qs}  ({scope})")
    if out["restarted"]:
        print("  counters went down between scrapes: server restarted; deltas count from the restart")
    return 0
