"""Normalised serving-engine figures from vLLM / SGLang Prometheus scrapes (pure).

Input: flat samples of one scrape (:class:`probes.prom_text.Exposition`). Output:

* :func:`snapshot` -- one scrape reduced to the families Ridgeline uses, engine-neutral
  names, V0/V1/SGLang naming differences and ``ray_vllm:`` / ``sglang_`` prefixes
  resolved, ``_created`` series ignored, ranks aggregated (DP ranks and ``engine`` labels
  summed, TP/PP duplicates collapsed by max; reference/engine-metrics.md section 6).
* :func:`window_figures` -- the figures of one window from consecutive snapshots: all
  rates, ratios and percentiles come from *deltas* between scrapes, never from lifetime
  counters; a counter or bucket that goes down is a reset (server restart): the new value
  is taken as the delta since the reset and the window is flagged ``restarted``.
* :func:`lifetime_figures` -- the same figures over the server's lifetime (what one
  scrape can say; used by ``ridgeline scrape``), flagged ``since_start``.
* :func:`histogram_quantile` -- quantiles from cumulative buckets. A quantile in the first
  bucket is reported as "at most b0", one in ``+Inf`` as "more than b_last"; only a
  quantile between two finite bounds is interpolated (Prometheus' linear rule).

Latencies are in seconds (``_s``): the engines' buckets are seconds and converting them
adds nothing. Ratios are 0..1 (``_ratio``).
"""
from __future__ import annotations

import math
import re
from typing import Any, Iterable

from ridgeline.aggregator.preemption_episodes import PreemptionEpisodes

ENGINE_RE = re.compile(r"^(?:ray_)?(vllm|sglang)[:_](.+)$")

# Labels whose values repeat one scheduler view (tensor/pipeline ranks, process ids):
# collapse by max; everything else (engine/DP rank, finished_reason, Ray replica) sums.
_DUPLICATE_DIMS = frozenset({"tp_rank", "pp_rank", "moe_ep_rank", "pid"})

# SGLang's per-stage request latency: one family, ``stage`` label (the stage names of
# RequestStage in python/sglang/srt/observability/req_time_stats.py). Of the stages it
# observes in a unified server (request_process, prefill_forward, chunked_prefill), only
# prefill_forward is a Ridgeline segment: once per request, from its first forward entry
# (leaving the waiting queue) to the end of its prefill, chunks included. prefill_waiting
# (= queue_time_seconds) and decode_loop are not observed, and decode_loop would be one
# observation per decode step, not per request (docs/engine-metrics.md).
SGLANG_PER_STAGE = "per_stage_req_latency_seconds"

# Canonical histogram -> candidate families per engine, first found wins. A candidate is a
# family name, or (family, {label: value}) for the series of one label value (a stage).
HISTOGRAMS: dict[str, dict[str, tuple[str | tuple[str, dict[str, str]], ...]]] = {
    "ttft_s": {"vllm": ("time_to_first_token_seconds",), "sglang": ("time_to_first_token_seconds",)},
    "itl_s": {"vllm": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
              "sglang": ("inter_token_latency_seconds", "time_per_output_token_seconds")},
    "queue_time_s": {"vllm": ("request_queue_time_seconds",), "sglang": ("queue_time_seconds",)},
    "prefill_time_s": {"vllm": ("request_prefill_time_seconds",),
                       "sglang": ((SGLANG_PER_STAGE, {"stage": "prefill_forward"}),)},
    "decode_time_s": {"vllm": ("request_decode_time_seconds",), "sglang": ()},
    "e2e_latency_s": {"vllm": ("e2e_request_latency_seconds",), "sglang": ("e2e_request_latency_seconds",)},
    "iteration_tokens": {"vllm": ("iteration_tokens_total",), "sglang": ()},
}
# The latency histograms passed through to /metrics with the engine's own buckets.
LATENCY_HISTOGRAMS = ("queue_time_s", "prefill_time_s", "decode_time_s", "ttft_s", "itl_s", "e2e_latency_s")

# Canonical counter -> candidate families (looked up with and without ``_total``).
COUNTERS: dict[str, dict[str, tuple[str, ...]]] = {
    "preemptions": {"vllm": ("num_preemptions",), "sglang": ("num_retracted_requests",)},
    "prefix_cache_queries": {"vllm": ("prefix_cache_queries", "gpu_prefix_cache_queries"),
                             "sglang": ("prompt_tokens",)},
    "prefix_cache_hits": {"vllm": ("prefix_cache_hits", "gpu_prefix_cache_hits"), "sglang": ("cached_tokens",)},
    "prompt_tokens": {"vllm": ("prompt_tokens",), "sglang": ("prompt_tokens",)},
    "generation_tokens": {"vllm": ("generation_tokens",), "sglang": ("generation_tokens",)},
    "requests_finished": {"vllm": ("request_success",), "sglang": ("num_requests",)},
    # vLLM >= 0.11 with a KV connector (LMCache, NIXL, ...): the external (cross-instance) cache.
    "external_prefix_cache_queries": {"vllm": ("external_prefix_cache_queries",), "sglang": ()},
    "external_prefix_cache_hits": {"vllm": ("external_prefix_cache_hits",), "sglang": ()},
    # Prompt tokens served from any cache, local + external (vLLM); SGLang's cached_tokens
    # is already the prefix-hit counter above (all cache_source labels summed).
    "prompt_tokens_cached": {"vllm": ("prompt_tokens_cached",), "sglang": ()},
    # KV eviction: only SGLang exports a counter (tokens evicted GPU -> host, hierarchical cache).
    "kv_evicted_tokens": {"vllm": (), "sglang": ("evicted_tokens",)},
    # Engine-side work estimates (vLLM --enable-mfu-metrics, SGLang --enable-mfu-metrics).
    "estimated_flops_per_gpu": {"vllm": ("estimated_flops_per_gpu",), "sglang": ("estimated_flops_per_gpu",)},
    "estimated_read_bytes_per_gpu": {"vllm": ("estimated_read_bytes_per_gpu",),
                                     "sglang": ("estimated_read_bytes_per_gpu",)},
    "estimated_write_bytes_per_gpu": {"vllm": ("estimated_write_bytes_per_gpu",),
                                      "sglang": ("estimated_write_bytes_per_gpu",)},
}
# Per-GPU counters: each rank reports its own GPU; the per-GPU figure is the mean over ranks.
_PER_GPU_COUNTERS = frozenset({"estimated_flops_per_gpu", "estimated_read_bytes_per_gpu",
                               "estimated_write_bytes_per_gpu"})

GAUGES: dict[str, dict[str, tuple[str, ...]]] = {
    "num_running": {"vllm": ("num_requests_running",), "sglang": ("num_running_reqs",)},
    "num_waiting": {"vllm": ("num_requests_waiting",), "sglang": ("num_queue_reqs",)},
    "num_swapped": {"vllm": ("num_requests_swapped",), "sglang": ()},
    # The batch cap: SGLang exports it (sglang:max_running_requests, docs/references/
    # production_metrics.md); vLLM does not export --max-num-seqs.
    "max_running": {"vllm": (), "sglang": ("max_running_requests",)},
    "kv_used_tokens": {"vllm": (), "sglang": ("num_used_tokens",)},
    "kv_pool_tokens": {"vllm": (), "sglang": ("max_total_num_tokens",)},
    "generation_throughput_tokens_per_s": {"vllm": ("avg_generation_throughput_toks_per_s",),
                                           "sglang": ("gen_throughput",)},
    "prompt_throughput_tokens_per_s": {"vllm": ("avg_prompt_throughput_toks_per_s",), "sglang": ()},
}
# Max over all ranks: the fullest rank binds.
KV_USAGE = {"vllm": ("kv_cache_usage_perc", "gpu_cache_usage_perc"), "sglang": ("token_usage",)}

QUANTILES = (0.5, 0.9, 0.99)


# --------------------------------------------------------------------------- snapshot

def _rank_count(series: list[tuple[dict, float]]) -> int:
    """Distinct ranks (label sets after the TP/PP/priority collapse) in a family."""
    return len({tuple(sorted((k, x) for k, x in labels.items() if k not in _DUPLICATE_DIMS))
                for labels, _ in _drop_priority_duplicates(series)})


def _split(name: str) -> tuple[str, str] | None:
    m = ENGINE_RE.match(name)
    return (m.group(1), m.group(2)) if m else None


def _drop_priority_duplicates(series: list[tuple[dict, float]]) -> list[tuple[dict, float]]:
    """SGLang with ``--enable-priority-scheduling`` publishes each scheduler figure twice:
    per priority (``priority="0"``, ``"1"``, ...) and as the total under ``priority=""``.
    Where a total exists for a label set, keep it and drop its per-priority parts, so the
    sum does not count every request twice; without one, the parts are summed."""
    if not any("priority" in labels for labels, _ in series):
        return series
    totals = {tuple(sorted((k, x) for k, x in labels.items() if k != "priority"))
              for labels, _ in series if labels.get("priority", "") == ""}
    return [(labels, v) for labels, v in series
            if labels.get("priority", "") == ""
            or tuple(sorted((k, x) for k, x in labels.items() if k != "priority")) not in totals]


def _aggregate(series: list[tuple[dict, float]]) -> float | None:
    """Sum over DP/engine/other labels after collapsing TP/PP duplicates by max (and
    SGLang's per-priority duplicates of a ``priority=""`` total)."""
    if not series:
        return None
    groups: dict[tuple, float] = {}
    for labels, v in _drop_priority_duplicates(series):
        if math.isnan(v):
            continue
        key = tuple(sorted((k, x) for k, x in labels.items() if k not in _DUPLICATE_DIMS))
        groups[key] = max(groups.get(key, -math.inf), v)
    return sum(groups.values()) if groups else None


def detect_engine(samples: Iterable) -> str | None:
    """``vllm`` or ``sglang`` (by the prefix most series carry), None when neither."""
    counts = {"vllm": 0, "sglang": 0}
    for s in samples:
        sp = _split(s.name)
        if sp:
            counts[sp[0]] += 1
    best = max(counts, key=counts.get)
    return best if counts[best] else None


def snapshot(expo: Any, ts_ns: int, endpoint: str | None = None) -> dict:
    """Reduce one parsed scrape to engine-neutral families (see module docstring).

    Returns a plain dict: ``engine``, ``ts_ns``, ``endpoint``, ``version_hint``,
    ``gauges``, ``counters``, ``histograms`` (``bounds`` finite ascending, ``cumulative``
    counts per bound plus +Inf last, ``count``, ``sum``), ``sources`` (canonical figure ->
    exposed family name), ``model_names``, ``bad_lines``.
    """
    samples = expo.samples
    engine = detect_engine(samples)
    fams: dict[str, list[tuple[dict, float]]] = {}
    model_names: set[str] = set()
    schema_035 = False
    simulated = False
    for s in samples:
        sp = _split(s.name)
        if not sp or sp[0] != engine:
            continue
        suffix = sp[1]
        if suffix.endswith("_created"):
            continue  # a Unix timestamp, never a counter value (reference section 1.3)
        fams.setdefault(suffix, []).append((s.labels, s.value))
        simulated = simulated or s.labels.get("simulated") == "true"
        mn = s.labels.get("model_name")
        # SGLang 0.3.5 labelled every series name=<model>. Later versions label only
        # func_latency_seconds with name=<function>: that is not a model and not the old schema.
        if (mn is None and engine == "sglang" and "name" in s.labels
                and not suffix.startswith("func_latency_seconds")):
            mn = s.labels["name"]
            if suffix == "cache_hit_rate":
                schema_035 = True
        if mn is not None:
            model_names.add(mn)
    # Raw exposed name for each suffix, for the ``sources`` map.
    prefix_of: dict[str, str] = {}
    for s in samples:
        sp = _split(s.name)
        if sp and sp[0] == engine and sp[1] not in prefix_of:
            prefix_of[sp[1]] = s.name[: len(s.name) - len(sp[1])]

    def src(suffix: str) -> str:
        return prefix_of.get(suffix, f"{engine}:") + suffix

    snap: dict[str, Any] = {"engine": engine, "ts_ns": ts_ns, "endpoint": endpoint,
                            "gauges": {}, "counters": {}, "histograms": {}, "sources": {},
                            "model_names": sorted(model_names), "bad_lines": getattr(expo, "bad_lines", 0),
                            # Ridgeline's own workload generator labels every series simulated="true".
                            "simulated": simulated}
    if engine is None:
        snap["version_hint"] = None
        return snap

    for canon, per in GAUGES.items():
        for fam in per.get(engine, ()):
            v = _aggregate(fams.get(fam, []))
            if v is not None:
                snap["gauges"][canon] = v
                snap["sources"][canon] = src(fam)
                break
    usage_series: list[tuple[dict, float]] = []
    for fam in KV_USAGE[engine]:
        usage_series = [(lab, v) for lab, v in _drop_priority_duplicates(fams.get(fam, [])) if not math.isnan(v)]
        if usage_series:
            snap["gauges"]["kv_usage_ratio"] = max(v for _, v in usage_series)
            snap["sources"]["kv_usage_ratio"] = src(fam)
            break
    if engine == "vllm":
        pools = _vllm_pools(fams.get("cache_config_info", []))
        if pools:
            snap["gauges"]["kv_pool_tokens"] = sum(pools.values())
            snap["sources"]["kv_pool_tokens"] = src("cache_config_info") + " num_gpu_blocks*block_size"
            used = _vllm_used_tokens(usage_series, pools)
            if used is not None:
                snap["gauges"]["kv_used_tokens"] = used
                snap["sources"]["kv_used_tokens"] = "sum over engines of kv_cache_usage_perc x own pool"
        hr = [v for _, v in fams.get("gpu_prefix_cache_hit_rate", [])]
        if hr and max(hr) >= 0:  # -1 = prefix caching off (reference section 1.5)
            snap["gauges"]["prefix_cache_hit_rate_gauge_ratio"] = max(hr)
            snap["sources"]["prefix_cache_hit_rate_gauge_ratio"] = src("gpu_prefix_cache_hit_rate")
    else:
        hr = [v for _, v in fams.get("cache_hit_rate", [])]
        if hr:
            v = max(hr) * (0.01 if schema_035 else 1.0)  # 0.3.5 exposed a percentage
            snap["gauges"]["prefix_cache_hit_rate_gauge_ratio"] = v
            snap["sources"]["prefix_cache_hit_rate_gauge_ratio"] = src("cache_hit_rate")
        if "num_retracted_reqs" in fams:
            snap["gauges"]["retracted_requests_last_tick"] = _aggregate(fams["num_retracted_reqs"])
            snap["sources"]["retracted_requests_last_tick"] = src("num_retracted_reqs")
        # SGLang renamed gpu_execution_seconds_total to forward_execution_seconds_total
        # (same category label: extend / decode / mixed / idle ...).
        gx_name = next((n for n in ("forward_execution_seconds_total", "forward_execution_seconds",
                                    "gpu_execution_seconds_total", "gpu_execution_seconds") if fams.get(n)), None)
        gx = fams.get(gx_name) if gx_name else None
        if gx:
            by_cat: dict[str, list] = {}
            for labels, v in gx:
                by_cat.setdefault(labels.get("category", "other"), []).append((labels, v))
            for cat, series in by_cat.items():  # TP ranks repeat one view: aggregated, not added
                v = _aggregate(series)
                if v is not None:
                    snap["counters"][f"gpu_execution_{cat}_s"] = v
            snap["sources"]["gpu_execution_s"] = src(gx_name)

    for canon, per in COUNTERS.items():
        for fam in per.get(engine, ()):
            for name in (fam + "_total", fam):
                if name in fams:
                    v = _aggregate(fams[name])
                    if v is not None:
                        if canon in _PER_GPU_COUNTERS:
                            v /= max(1, _rank_count(fams[name]))
                        snap["counters"][canon] = v
                        snap["sources"][canon] = src(name)
                    break
            if canon in snap["counters"]:
                break
    if engine == "vllm" and snap["sources"].get("prefix_cache_queries", "").endswith("gpu_prefix_cache_queries_total"):
        help_text = expo.helps.get(snap["sources"]["prefix_cache_queries"], "") if hasattr(expo, "helps") else ""
        snap["prefix_cache_unit"] = "blocks" if "block" in help_text.lower() else "tokens"
    else:
        snap["prefix_cache_unit"] = "tokens" if "prefix_cache_queries" in snap["counters"] else None

    for canon, per in HISTOGRAMS.items():
        for cand in per.get(engine, ()):
            fam, where = (cand, None) if isinstance(cand, str) else cand
            h = _histogram(fams, fam, where)
            if h is not None:
                snap["histograms"][canon] = h
                snap["sources"][canon] = src(fam) + _selector(where)
                break
    snap["version_hint"] = _version_hint(engine, fams, expo)
    return snap


def _vllm_pools(series: list[tuple[dict, float]]) -> dict[str, float]:
    """KV pool in tokens per vLLM engine (``engine`` label of ``cache_config_info``)."""
    pools: dict[str, float] = {}
    for labels, _ in series:
        try:
            if labels.get("kv_cache_size_tokens") not in (None, "None"):
                tokens = float(labels["kv_cache_size_tokens"])
            else:
                tokens = float(labels["num_gpu_blocks"]) * float(labels["block_size"])
        except (KeyError, ValueError):
            continue
        pools[labels.get("engine", str(len(pools)))] = tokens
    return pools


def _vllm_used_tokens(usage: list[tuple[dict, float]], pools: dict[str, float]) -> float | None:
    """KV tokens in use over all data-parallel engines: each engine's usage times its own
    pool, summed (not the fullest engine's usage times the summed pool). TP ranks of one
    engine repeat one view and collapse by max. An engine whose pool is unknown gets the
    mean pool of the others (DP engines share one cache config)."""
    if not usage or not pools:
        return None
    per_engine: dict[str, float] = {}
    for labels, v in usage:
        e = labels.get("engine", "0")
        per_engine[e] = max(per_engine.get(e, -math.inf), v)
    mean_pool = sum(pools.values()) / len(pools)
    return sum(u * pools.get(e, mean_pool) for e, u in per_engine.items())


def _selector(where: dict[str, str] | None) -> str:
    """``{stage="prefill_forward"}`` for the label values a source was selected by."""
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(where.items())) + "}" if where else ""


def _only(series: list[tuple[dict, float]], where: dict[str, str] | None) -> list[tuple[dict, float]]:
    """The series whose labels have every value of ``where``, those labels removed."""
    if not where:
        return series
    return [({k: x for k, x in labels.items() if k not in where}, v) for labels, v in series
            if all(labels.get(k) == x for k, x in where.items())]


def _histogram(fams: dict, fam: str, where: dict[str, str] | None = None) -> dict | None:
    """The cumulative histogram ``fam`` (ranks aggregated), or None without a ``+Inf``
    bucket; with ``where``, only its series of those label values (one stage)."""
    buckets = _only(fams.get(fam + "_bucket", []), where)
    if not buckets:
        return None
    by_le: dict[float, list] = {}
    for labels, v in buckets:
        try:
            le = float(labels["le"].replace("+Inf", "inf"))
        except (KeyError, ValueError):
            continue
        rest = {k: x for k, x in labels.items() if k != "le"}
        by_le.setdefault(le, []).append((rest, v))
    if math.inf not in by_le:
        return None
    les = sorted(by_le)
    cum = [_aggregate(by_le[le]) or 0.0 for le in les]
    count = _aggregate(_only(fams.get(fam + "_count", []), where)) or cum[-1]
    total = _aggregate(_only(fams.get(fam + "_sum", []), where)) or 0.0
    return {"bounds": les[:-1], "cumulative": cum, "count": count, "sum": total}


def _version_hint(engine: str, fams: dict, expo: Any) -> str:
    helps = getattr(expo, "helps", {})
    if engine == "sglang":
        if any("engine_type" in lab for s in fams.values() for lab, _ in s[:1]):
            return "sglang>=0.4.4"
        return "sglang"
    if "avg_prompt_throughput_toks_per_s" in fams and "prompt_tokens_total" not in fams:
        return "vllm-0.2.x"
    if "inter_token_latency_seconds_bucket" in fams:
        return "vllm-v1>=0.11"
    if "kv_cache_usage_perc" in fams:
        return "vllm-v1>=0.9"
    if any("model execution batches" in h for k, h in helps.items() if k.endswith("num_requests_running")):
        return "vllm-v1"
    return "vllm-v0"


# --------------------------------------------------------------------------- histograms

def histogram_delta(a: dict | None, b: dict) -> tuple[dict, bool]:
    """``b - a`` bucket by bucket; a reset (any count going down, or a different bucket
    layout) returns ``b`` itself as the delta and ``True``."""
    if a is None:
        return b, False
    if a["bounds"] != b["bounds"]:
        return b, True
    cum = [y - x for x, y in zip(a["cumulative"], b["cumulative"])]
    cnt = b["count"] - a["count"]
    if cnt < 0 or any(c < 0 for c in cum):
        return b, True
    return {"bounds": b["bounds"], "cumulative": cum, "count": cnt, "sum": b["sum"] - a["sum"]}, False


def histogram_add(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    if a["bounds"] != b["bounds"]:  # layouts differ between versions: never merge
        return b
    return {"bounds": b["bounds"], "cumulative": [x + y for x, y in zip(a["cumulative"], b["cumulative"])],
            "count": a["count"] + b["count"], "sum": a["sum"] + b["sum"]}


def histogram_quantile(h: dict, q: float) -> dict:
    """Quantile ``q`` of cumulative buckets, with the bucket it fell in.

    Returns ``{"q", "value", "kind", "lower_bound", "upper_bound"}``; ``kind`` is
    ``interpolated`` (between two finite bounds), ``first_bucket`` (``value`` None, it is at
    most ``upper_bound``; 0 exactly when the first bound is 0), ``above_last_bucket``
    (``value`` None, more than ``lower_bound``) or ``no_data``.
    """
    bounds, cum = h["bounds"], h["cumulative"]
    n = cum[-1] if cum else 0
    if not n or n <= 0:
        return {"q": q, "value": None, "kind": "no_data", "lower_bound": None, "upper_bound": None}
    r = q * n
    for i, c in enumerate(cum):  # noqa: B007  (i is the bucket found, read after the loop)
        if c >= r and c > 0:
            break
    if i >= len(bounds):
        return {"q": q, "value": None, "kind": "above_last_bucket",
                "lower_bound": bounds[-1] if bounds else None, "upper_bound": None}
    hi = bounds[i]
    if i == 0:
        return {"q": q, "value": 0.0 if hi <= 0 else None, "kind": "first_bucket",
                "lower_bound": None, "upper_bound": hi}
    lo = bounds[i - 1]
    c_lo = cum[i - 1]
    value = lo + (hi - lo) * (r - c_lo) / (cum[i] - c_lo) if cum[i] > c_lo else hi
    return {"q": q, "value": value, "kind": "interpolated", "lower_bound": lo, "upper_bound": hi}


def histogram_summary(h: dict | None, quantiles: tuple[float, ...] = QUANTILES) -> dict | None:
    """Count, mean and quantiles of a (delta) histogram; None when absent."""
    if h is None:
        return None
    n = h["count"]
    out = {"count": n, "mean": (h["sum"] / n) if n > 0 else None,
           "first_bucket_upper": h["bounds"][0] if h["bounds"] else None,
           "last_bucket_upper": h["bounds"][-1] if h["bounds"] else None}
    for q in quantiles:
        out[f"p{round(q * 100):d}"] = histogram_quantile(h, q)
    return out


# --------------------------------------------------------------------------- windows

def _pair_deltas(a: dict, b: dict) -> tuple[dict, dict, bool]:
    """Counter and histogram deltas from snapshot a to b, resets handled per series.

    A series absent from ``a`` counts from zero (Prometheus series start at 0 when first
    exposed); one that went down restarted, and its value in ``b`` is the delta.
    """
    changed = a.get("engine") != b.get("engine")
    restarted = changed
    dc: dict[str, float] = {}
    for k, vb in b["counters"].items():
        va = None if changed else a["counters"].get(k)
        if va is None:
            dc[k] = vb
        elif vb < va:
            dc[k], restarted = vb, True
        else:
            dc[k] = vb - va
    dh: dict[str, dict] = {}
    for k, hb in b["histograms"].items():
        d, reset = histogram_delta(None if changed else a["histograms"].get(k), hb)
        restarted |= reset
        dh[k] = d
    return dc, dh, restarted


def window_figures(scrapes: list[dict], previous: dict | None = None) -> dict:
    """Figures of one window from the snapshots scraped in it (oldest first).

    ``previous`` is the last snapshot of the previous window (the baseline for deltas);
    without it, deltas start at the first scrape of this window. With a single snapshot
    and no baseline, only gauges are known (delta figures are None).
    """
    if not scrapes:
        raise ValueError("window_figures needs at least one snapshot")
    seq = ([previous] if previous is not None else []) + list(scrapes)
    cur = seq[-1]
    dc: dict[str, float] = {}
    dh: dict[str, dict] = {}
    restarted = False
    for a, b in zip(seq, seq[1:]):
        c, h, r = _pair_deltas(a, b)
        restarted |= r
        for k, v in c.items():
            dc[k] = dc.get(k, 0.0) + v
        for k, v in h.items():
            dh[k] = histogram_add(dh.get(k), v)
    have_delta = len(seq) > 1
    dt_s = (cur["ts_ns"] - seq[0]["ts_ns"]) / 1e9 if have_delta else None
    g = cur["gauges"]
    kv_samples = [s["gauges"]["kv_usage_ratio"] for s in scrapes if "kv_usage_ratio" in s["gauges"]]
    fig: dict[str, Any] = {
        "engine": cur["engine"],
        "endpoint": cur.get("endpoint"),
        "model_names": cur.get("model_names", []),
        "version_hint": cur.get("version_hint"),
        "simulated": cur.get("simulated", False),
        "ts_ns": cur["ts_ns"],
        "interval_s": dt_s,
        "scrapes": len(scrapes),
        "restarted": restarted,
        "since_start": False,
        "kv_usage_ratio": g.get("kv_usage_ratio"),
        "kv_usage_max_ratio": max(kv_samples) if kv_samples else None,
        "kv_pool_tokens": g.get("kv_pool_tokens"),
        "kv_used_tokens": g.get("kv_used_tokens") if "kv_used_tokens" in g else (
            g["kv_usage_ratio"] * g["kv_pool_tokens"] if "kv_usage_ratio" in g and "kv_pool_tokens" in g else None),
        "num_running_requests": g.get("num_running"),
        "num_waiting_requests": g.get("num_waiting"),
        "num_swapped_requests": g.get("num_swapped"),
        "max_running_requests": g.get("max_running"),
        "num_waiting_change": (g["num_waiting"] - seq[0]["gauges"]["num_waiting"])
        if have_delta and "num_waiting" in g and "num_waiting" in seq[0]["gauges"] else None,
        "preemptions_total": cur["counters"].get("preemptions"),
        # SGLang 0.4.7-0.5.x: only the retractions at the last log tick (not cumulative).
        "retracted_requests_last_tick": g.get("retracted_requests_last_tick"),
        "generation_throughput_tokens_per_s": g.get("generation_throughput_tokens_per_s"),
        "prompt_throughput_tokens_per_s": g.get("prompt_throughput_tokens_per_s"),
    }
    fig.update(_delta_figures(cur, dc if have_delta else None, dh if have_delta else None, dt_s))
    fig["sources"] = dict(cur.get("sources", {}))
    # Lifetime cumulative latency histograms (the engine's own buckets), for /metrics.
    fig["latency_histograms"] = {k: cur["histograms"][k] for k in LATENCY_HISTOGRAMS if k in cur["histograms"]}
    return fig


def lifetime_figures(snap: dict) -> dict:
    """Figures one scrape can give on its own: gauges now, and ratios/percentiles over the
    server's lifetime (counters since start), flagged ``since_start``."""
    zero = {"engine": snap["engine"], "ts_ns": snap["ts_ns"], "gauges": {},
            "counters": {k: 0.0 for k in snap["counters"]},
            "histograms": {k: {"bounds": h["bounds"], "cumulative": [0.0] * len(h["cumulative"]),
                               "count": 0.0, "sum": 0.0} for k, h in snap["histograms"].items()}}
    fig = window_figures([snap], zero)
    fig["since_start"] = True
    fig["interval_s"] = None
    fig["preemption_rate_per_s"] = None
    fig["steps_per_s"] = None
    fig["num_waiting_change"] = None
    # V0 only exposes the allocator's cumulative hit rate as a gauge.
    if fig["prefix_cache_hit_ratio"] is None and "prefix_cache_hit_rate_gauge_ratio" in snap["gauges"]:
        fig["prefix_cache_hit_ratio"] = snap["gauges"]["prefix_cache_hit_rate_gauge_ratio"]
        fig["prefix_cache_hit_source"] = "gauge"
    return fig


def _delta_figures(cur: dict, dc: dict | None, dh: dict | None, dt_s: float | None) -> dict:
    out: dict[str, Any] = {}
    if dc is None:
        dc, dh = {}, {}
    pre = dc.get("preemptions")
    out["preemptions"] = pre
    out["preemption_rate_per_s"] = pre / dt_s if pre is not None and dt_s else None
    fin = dc.get("requests_finished")
    out["requests_finished"] = fin
    out["preemptions_per_finished_request"] = pre / fin if pre is not None and fin else None
    if cur["engine"] == "sglang" and "preemptions" not in cur["counters"]:
        out["preemption_source"] = "gauge" if "retracted_requests_last_tick" in cur["gauges"] else None
    else:
        out["preemption_source"] = "counter" if "preemptions" in cur["counters"] else None
    q, h = dc.get("prefix_cache_queries"), dc.get("prefix_cache_hits")
    out["prefix_cache_queries"] = q
    out["prefix_cache_hits"] = h
    out["prefix_cache_unit"] = cur.get("prefix_cache_unit")
    out["prefix_cache_hit_ratio"] = min(1.0, max(0.0, h / q)) if q and h is not None and q > 0 else None
    out["prefix_cache_hit_source"] = "counter_delta" if out["prefix_cache_hit_ratio"] is not None else None
    out["prompt_tokens"] = dc.get("prompt_tokens")
    out["generation_tokens"] = dc.get("generation_tokens")
    for canon in HISTOGRAMS:
        out[canon] = histogram_summary(dh.get(canon)) if canon in dh else None
    # Prefill vs decode share.
    pf, dd = dh.get("prefill_time_s"), dh.get("decode_time_s")
    out["prefill_time_share_ratio"] = None
    out["prefill_time_share_kind"] = None
    if pf is not None and dd is not None and pf["sum"] + dd["sum"] > 0:
        out["prefill_time_share_ratio"] = pf["sum"] / (pf["sum"] + dd["sum"])
        out["prefill_time_share_kind"] = "request_wall_time"  # summed over concurrent requests
    gx = {k: v for k, v in dc.items() if k.startswith("gpu_execution_")}
    if gx:
        pre_s = sum(v for k, v in gx.items() if ("extend" in k or "prefill" in k))
        dec_s = sum(v for k, v in gx.items() if "decode" in k)
        tot = sum(gx.values())
        if tot > 0:
            out["prefill_time_share_ratio"] = pre_s / tot
            out["decode_gpu_time_share_ratio"] = dec_s / tot
            out["prefill_time_share_kind"] = "gpu_time"
    out.update(_segments(dh))
    out.update(_cache_figures(cur, dc, dt_s))
    out.update(_work_estimates(dc, dt_s))
    it = dh.get("iteration_tokens")
    if it is not None and it["count"] > 0:
        out["tokens_per_step"] = it["sum"] / it["count"]
        out["steps"] = it["count"]
        out["steps_per_s"] = it["count"] / dt_s if dt_s else None
    else:
        out["tokens_per_step"] = out["steps"] = out["steps_per_s"] = None
    return out


def _mean(h: dict | None) -> float | None:
    return h["sum"] / h["count"] if h is not None and h["count"] > 0 else None


def _segments(dh: dict) -> dict:
    """Latency by segment: mean queue / prefill / decode / e2e and TTFT per request in the
    window, and the share of TTFT that is queue wait.

    vLLM exports each segment as its own histogram (observed when the request finishes;
    TTFT when its first token is out), so each mean is measured. SGLang exports queue,
    TTFT and e2e, and where its per-stage histogram has ``stage="prefill_forward"`` the
    prefill (measured; its source names the stage); a prefill without that stage is
    TTFT - queue, and decode is always e2e - TTFT (SGLang observes no per-request decode
    stage), as means, tagged ``derived``. ``queue_share_of_ttft_ratio`` is mean queue / mean TTFT (the two
    histograms count overlapping, not identical, sets of requests: a ratio of means).
    """
    q, pf, dd = _mean(dh.get("queue_time_s")), _mean(dh.get("prefill_time_s")), _mean(dh.get("decode_time_s"))
    ttft, e2e = _mean(dh.get("ttft_s")), _mean(dh.get("e2e_latency_s"))
    kind = {"queue": "measured" if q is not None else None,
            "prefill": "measured" if pf is not None else None,
            "decode": "measured" if dd is not None else None}
    if pf is None and ttft is not None and q is not None and "prefill_time_s" not in dh:
        pf, kind["prefill"] = max(0.0, ttft - q), "derived"
    if dd is None and e2e is not None and ttft is not None and "decode_time_s" not in dh:
        dd, kind["decode"] = max(0.0, e2e - ttft), "derived"
    share = min(1.0, max(0.0, q / ttft)) if q is not None and ttft else None
    return {"queue_mean_s": q, "prefill_mean_s": pf, "decode_mean_s": dd, "ttft_mean_s": ttft,
            "e2e_mean_s": e2e, "queue_share_of_ttft_ratio": share,
            "segment_kinds": {k: v for k, v in kind.items() if v is not None}}


def _cache_figures(cur: dict, dc: dict, dt_s: float | None) -> dict:
    """External prefix cache, cached prompt tokens (local + external) and KV eviction.

    The eviction rate is only what the engine counts (SGLang ``evicted_tokens_total``);
    where no counter is exported it is None with ``kv_eviction_source`` None: unknown,
    never a figure made up from usage drops."""
    out: dict[str, Any] = {}
    eq, eh = dc.get("external_prefix_cache_queries"), dc.get("external_prefix_cache_hits")
    out["external_prefix_cache_hit_ratio"] = min(1.0, max(0.0, eh / eq)) if eq and eh is not None else None
    pc, pt = dc.get("prompt_tokens_cached"), dc.get("prompt_tokens")
    out["prompt_tokens_cached_ratio"] = min(1.0, max(0.0, pc / pt)) if pc is not None and pt else None
    ev = dc.get("kv_evicted_tokens")
    out["kv_evicted_tokens"] = ev
    out["kv_eviction_rate_tokens_per_s"] = ev / dt_s if ev is not None and dt_s else None
    out["kv_eviction_source"] = cur.get("sources", {}).get("kv_evicted_tokens")
    return out


def _work_estimates(dc: dict, dt_s: float | None) -> dict:
    """The engine's own FLOP / byte estimates per GPU (``estimated_*_per_gpu_total``), as
    rates: a roofline point when CUPTI is absent, tagged ``engine_estimate``."""
    fl, rd, wr = (dc.get(k) for k in ("estimated_flops_per_gpu", "estimated_read_bytes_per_gpu",
                                       "estimated_write_bytes_per_gpu"))
    out: dict[str, Any] = {"estimated_flops_per_gpu": fl, "estimated_read_bytes_per_gpu": rd,
                           "estimated_write_bytes_per_gpu": wr}
    out["estimated_flops_per_gpu_per_s"] = fl / dt_s if fl is not None and dt_s else None
    moved = (rd or 0.0) + (wr or 0.0) if rd is not None or wr is not None else None
    out["estimated_bytes_per_gpu_per_s"] = moved / dt_s if moved is not None and dt_s else None
    out["estimated_arithmetic_intensity"] = fl / moved if fl is not None and moved else None
    out["work_estimate_source"] = "engine_estimate" if fl is not None or moved is not None else None
    return out


# --------------------------------------------------------------------------- records

_RECORD_KEYS = (
    "kv_usage_ratio", "kv_usage_max_ratio", "kv_pool_tokens", "kv_used_tokens",
    "num_running_requests", "num_waiting_requests", "num_waiting_change", "num_swapped_requests",
    "max_running_requests", "queue_mean_s", "prefill_mean_s", "decode_mean_s", "ttft_mean_s", "e2e_mean_s",
    "queue_share_of_ttft_ratio", "segment_kinds",
    "external_prefix_cache_hit_ratio", "prompt_tokens_cached_ratio",
    "kv_evicted_tokens", "kv_eviction_rate_tokens_per_s", "kv_eviction_source",
    "estimated_flops_per_gpu", "estimated_read_bytes_per_gpu", "estimated_write_bytes_per_gpu",
    "estimated_flops_per_gpu_per_s", "estimated_bytes_per_gpu_per_s", "estimated_arithmetic_intensity",
    "work_estimate_source", "requests_finished", "prompt_tokens", "generation_tokens",
    "preemptions", "preemption_rate_per_s", "preemptions_total", "retracted_requests_last_tick",
    "prefix_cache_hit_ratio",
    "prefill_time_share_ratio", "prefill_time_share_kind", "tokens_per_step", "steps_per_s",
    "generation_throughput_tokens_per_s", "prompt_throughput_tokens_per_s",
)


def _pick(summary: dict | None, key: str) -> dict | None:
    return None if summary is None else summary.get(key)


def engine_record(fig: dict) -> dict:
    """Flat record of one engine window for the wire's window record: scalars with units,
    latency percentiles as ``<hist>_p50_s`` plus their ``_kind`` (interpolated,
    first_bucket, above_last_bucket) and bounds, and ``source`` naming the endpoint and the
    exposed families each figure came from."""
    rec: dict[str, Any] = {"engine": fig["engine"], "simulated": fig.get("simulated", False),
                           "version_hint": fig.get("version_hint"), "model_names": list(fig.get("model_names") or []),
                           "restarted": fig["restarted"],
                           "since_start": fig["since_start"], "interval_s": fig["interval_s"]}
    for k in _RECORD_KEYS:
        rec[k] = fig.get(k)
    for hist in ("queue_time_s", "prefill_time_s", "decode_time_s", "ttft_s", "itl_s", "e2e_latency_s"):
        s = fig.get(hist)
        base = hist[:-2]
        rec[f"{base}_count"] = None if s is None else s["count"]
        rec[f"{base}_mean_s"] = None if s is None else s["mean"]
        for p in ("p50", "p90", "p99"):
            qd = _pick(s, p)
            rec[f"{base}_{p}_s"] = None if qd is None else qd["value"]
            rec[f"{base}_{p}_kind"] = None if qd is None else qd["kind"]
            rec[f"{base}_{p}_lower_s"] = None if qd is None else qd["lower_bound"]
            rec[f"{base}_{p}_upper_s"] = None if qd is None else qd["upper_bound"]
    rec["source"] = {"probe": "engine", "endpoint": fig.get("endpoint"), "families": fig.get("sources", {})}
    # Lifetime cumulative histograms with the engine's buckets (for /metrics histograms).
    rec["latency_histograms"] = {k: {"bounds": list(h["bounds"]), "cumulative": list(h["cumulative"]),
                                     "count": h["count"], "sum": h["sum"]}
                                 for k, h in (fig.get("latency_histograms") or {}).items()}
    return rec


# Window figures exposed as gauges: record key -> (metric name, HELP).
PROM_GAUGES: dict[str, tuple[str, str]] = {
    "kv_usage_ratio": ("ridgeline_engine_kv_usage_ratio",
                       "KV-cache usage of the fullest engine rank at the latest scrape (0..1)"),
    "kv_usage_max_ratio": ("ridgeline_engine_kv_usage_max_ratio",
                           "Highest KV-cache usage seen in the window's scrapes (0..1)"),
    "kv_pool_tokens": ("ridgeline_engine_kv_pool_tokens", "KV-cache pool size in tokens, all engine ranks"),
    "kv_used_tokens": ("ridgeline_engine_kv_used_tokens",
                       "KV-cache tokens in use, each data-parallel engine's usage times its own pool, summed"),
    "num_running_requests": ("ridgeline_engine_running_requests", "Requests in the running batch"),
    "num_waiting_requests": ("ridgeline_engine_waiting_requests", "Requests waiting to be scheduled"),
    "num_swapped_requests": ("ridgeline_engine_swapped_requests",
                             "Requests swapped out to host memory (vLLM V0 num_requests_swapped)"),
    "prefix_cache_hit_ratio": ("ridgeline_engine_prefix_cache_hit_ratio",
                               "Local prefix-cache hits / queries over the window (tokens)"),
    "external_prefix_cache_hit_ratio": ("ridgeline_engine_external_prefix_cache_hit_ratio",
                                        "External (KV connector) prefix-cache hits / queries over the window"),
    "prompt_tokens_cached_ratio": ("ridgeline_engine_prompt_tokens_cached_ratio",
                                   "Prompt tokens served from any cache (local + external) / prompt tokens"),
    "prefill_time_share_ratio": ("ridgeline_engine_prefill_time_share_ratio",
                                 "Prefill share of prefill + decode time over the window"),
    "queue_share_of_ttft_ratio": ("ridgeline_engine_queue_share_of_ttft_ratio",
                                  "Mean queue wait / mean time to first token over the window"),
    "tokens_per_step": ("ridgeline_engine_tokens_per_step", "Mean tokens per engine step over the window"),
    "kv_eviction_rate_tokens_per_s": ("ridgeline_engine_kv_evicted_tokens_per_second",
                                      "KV tokens evicted per second (only where the engine counts evictions)"),
    "preemption_episode_active": ("ridgeline_engine_preemption_episode_active",
                                  "1 while a preemption episode is open (see docs/engine-metrics.md)"),
    "preemption_episode_elapsed_s": ("ridgeline_engine_preemption_episode_elapsed_seconds",
                                     "Time since the open preemption episode began"),
    "preemption_last_recovery_s": ("ridgeline_engine_preemption_recovery_seconds",
                                   "Recovery time of the last preemption episode that recovered"),
}
PROM_COUNTERS: dict[str, tuple[str, str]] = {
    "preemptions_total": ("ridgeline_engine_preemptions", "Preemptions the engine counted since it started"),
    "preemption_episodes_total": ("ridgeline_engine_preemption_episodes",
                                  "Preemption episodes begun since the agent started"),
}
SEGMENTS = (("queue", "queue_mean_s"), ("prefill", "prefill_mean_s"), ("decode", "decode_mean_s"),
            ("ttft", "ttft_mean_s"), ("e2e", "e2e_mean_s"))
PROM_HISTOGRAMS: dict[str, tuple[str, str]] = {
    "queue_time_s": ("ridgeline_engine_request_queue_time_seconds", "Time requests waited in the queue"),
    "prefill_time_s": ("ridgeline_engine_request_prefill_time_seconds", "Time requests spent in prefill"),
    "decode_time_s": ("ridgeline_engine_request_decode_time_seconds", "Time requests spent in decode"),
    "ttft_s": ("ridgeline_engine_time_to_first_token_seconds", "Time to first token"),
    "itl_s": ("ridgeline_engine_inter_token_latency_seconds", "Time between output tokens"),
    "e2e_latency_s": ("ridgeline_engine_e2e_request_latency_seconds", "End-to-end request latency"),
}


def prometheus_samples(rec: dict, labels: dict | None = None) -> list[tuple[str, dict, float]]:
    """``(name, labels, value)`` for the agent's /metrics: gauges of the window and the
    engine's cumulative counters (names ending ``_total``), base units, ratios 0..1.

    Latency percentiles are not exposed as gauges: :func:`prometheus_histograms` passes
    the engine's histograms through with their own buckets, for ``histogram_quantile``.
    Segment means carry a ``segment`` label (queue, prefill, decode, ttft, e2e).
    """
    base = {"engine": str(rec.get("engine"))}
    base.update(labels or {})
    out = []
    for k, (name, _) in PROM_GAUGES.items():
        v = rec.get(k)
        if v is not None:
            out.append((name, dict(base), float(v)))
    for k, (name, _) in PROM_COUNTERS.items():
        v = rec.get(k)
        if v is not None:
            out.append((name + "_total", dict(base), float(v)))
    for seg, k in SEGMENTS:
        v = rec.get(k)
        if v is not None:
            out.append(("ridgeline_engine_segment_mean_seconds", dict(base, segment=seg), float(v)))
    src = rec.get("work_estimate_source")
    for k, name in (("estimated_flops_per_gpu_per_s", "ridgeline_engine_estimated_flops_per_second"),
                    ("estimated_bytes_per_gpu_per_s", "ridgeline_engine_estimated_bytes_per_second")):
        if rec.get(k) is not None:
            out.append((name, dict(base, source=str(src)), float(rec[k])))
    return out


def prometheus_help(name: str) -> str | None:
    """HELP text of a metric :func:`prometheus_samples` emits (None if not ours)."""
    for table in (PROM_GAUGES, PROM_COUNTERS, PROM_HISTOGRAMS):
        for metric, doc in table.values():
            if name in (metric, metric + "_total"):
                return doc
    return {"ridgeline_engine_segment_mean_seconds":
            "Mean time per request in each latency segment over the window (queue, prefill, decode, ttft, e2e)",
            "ridgeline_engine_estimated_flops_per_second":
            "Engine-estimated FLOP rate per GPU (estimated_flops_per_gpu_total), a roofline source without CUPTI",
            "ridgeline_engine_estimated_bytes_per_second":
            "Engine-estimated memory traffic per GPU (estimated_read/write_bytes_per_gpu_total)"}.get(name)


def prometheus_histograms(rec: dict) -> list[tuple[str, str, list[tuple[str, float]], float]]:
    """``(name, help, [(le, cumulative count), ..., ("+Inf", count)], sum)`` per latency
    histogram the engine exports: its lifetime counts with its own bucket bounds."""
    out = []
    for k, (name, doc) in PROM_HISTOGRAMS.items():
        h = (rec.get("latency_histograms") or {}).get(k)
        if not h or not h.get("cumulative"):
            continue
        buckets = [(_le(b), float(c)) for b, c in zip(h["bounds"], h["cumulative"])]
        buckets.append(("+Inf", float(h["cumulative"][-1])))
        out.append((name, doc, buckets, float(h["sum"])))
    return out


def _le(b: float) -> str:
    return repr(float(b))


# --------------------------------------------------------------------------- agent glue

class EngineTracker:
    """Turns the engine probe's poll output into per-endpoint window records (stateful).

    Keeps the last snapshot of each endpoint as the next window's baseline and one
    :class:`aggregator.alerts.AlertTracker` per endpoint. :meth:`update` takes what
    ``probes.engine.EngineProbe.poll()`` returned (``{"scrapes": [...], "errors": [...]}``
    or None) and returns ``{"endpoints": {url: engine_record + "alerts"}, "errors": [...]}``
    for the endpoints scraped in this window; pass it to ``WindowBuilder.add_engine``.
    """

    def __init__(self, alert_thresholds=None):
        from ridgeline.aggregator import alerts  # same layer; imported here to keep the module's pure core standalone
        self._alerts_mod = alerts
        self._th = alert_thresholds or alerts.AlertThresholds()
        self._prev: dict[str, dict] = {}
        self._alerts: dict[str, Any] = {}
        self._episodes: dict[str, Any] = {}

    def update(self, polled: dict | None) -> dict:
        out: dict[str, Any] = {"endpoints": {}, "errors": list((polled or {}).get("errors", []))}
        by_ep: dict[str, list[dict]] = {}
        pid_of: dict[str, Any] = {}
        for res in (polled or {}).get("scrapes", []):
            pid_of[res["endpoint"]] = res.get("pid")
            snap = snapshot(res["exposition"], res["ts_ns"], res["endpoint"])
            if snap["engine"] is None:
                out["errors"].append({"endpoint": res["endpoint"], "error": "no vLLM or SGLang metrics"})
                continue
            by_ep.setdefault(res["endpoint"], []).append(snap)
        for ep, snaps in by_ep.items():
            snaps.sort(key=lambda s: s["ts_ns"])
            fig = window_figures(snaps, self._prev.get(ep))
            self._prev[ep] = snaps[-1]
            rec = engine_record(fig)
            episodes = self._episodes.setdefault(ep, PreemptionEpisodes())
            rec.update(episodes.update(rec, fig["ts_ns"]))
            tracker = self._alerts.setdefault(ep, self._alerts_mod.AlertTracker(self._th))
            tracker.update(rec, ts_ns=fig["ts_ns"])
            rec["alerts"] = tracker.record()["alerts"]
            rec["pid"] = pid_of.get(ep)   # served process the endpoint was discovered from
            out["endpoints"][ep] = rec
        return out
