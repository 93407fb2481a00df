"""Every view of one window shows the same figures (issue 24: "make one view's figure equal
another's").

The fixed window of tests/view_window.py goes over the wire as the agent publishes it,
then through each view: the report's answer (``demo``/``analyze``), a ``top`` frame at
80x24 and at 200x50, ``tail --json`` and ``/metrics``. Each view must name the same
binding face, the same per-phase numbers (TB/s, % of peak, TFLOP/s), the same KV usage
and the same waiting requests, each in its own unit.
"""
import io
import re

import orjson
import pytest
from prometheus_client import generate_latest
from rich.console import Console
from view_window import ENDPOINT, view_window

from ridgeline.agent.commands.tail import jsonable
from ridgeline.agent.prometheus import WindowCollector, registry_for
from ridgeline.agent.top import TopState
from ridgeline.agent.top_frame import frame
from ridgeline.agent.top_view import ViewState
from ridgeline.aggregator import report, wire
from ridgeline.probes import prom_text


@pytest.fixture(scope="module")
def views():
    w = wire.decode_window(wire.encode_window(view_window()))      # what a subscriber decodes
    buf = io.StringIO()
    report.render_answer(w["verdict"], Console(file=buf, width=200, color_system=None), "Answer")
    view = ViewState()
    view.observe(w)
    top80 = frame(w, TopState(windows=1), view, 80, 24).plain
    top200 = frame(w, TopState(windows=1), view, 200, 50).plain
    tail = orjson.loads(orjson.dumps({"topic": "window", "payload": jsonable(w)}))["payload"]
    coll = WindowCollector(host="gpu-host-1")
    coll.observe(w)
    metrics = {}
    for s in prom_text.parse(generate_latest(registry_for(coll)).decode()).samples:
        metrics.setdefault(s.name, []).append((s.labels, s.value))
    return {"report": buf.getvalue(), "top80": top80, "top200": top200, "tail": tail, "metrics": metrics}


def metric(views, name, **labels):
    got = [v for lab, v in views["metrics"].get(name, []) if all(lab.get(k) == str(x) for k, x in labels.items())]
    assert len(got) == 1, (name, labels, views["metrics"].get(name))
    return got[0]


def test_the_binding_face_is_the_same_in_every_view(views):
    verdict, face = "memory-bandwidth-bound", "bandwidth"
    headline = "memory-bandwidth-bound (decode): decode: 78% of peak HBM bytes/s (2.60 TB/s)"
    assert headline in views["report"]
    assert headline in views["top80"].replace("\n", " ") and headline in views["top200"]
    assert [(v["device"], v["verdict"], v["face"]) for v in views["tail"]["verdict"]] == [
        (0, verdict, face), (1, verdict, face)]
    for gpu in ("0", "1"):
        assert metric(views, "ridgeline_verdict_state", gpu=gpu, verdict=verdict, face=face) == 1.0
        assert metric(views, "ridgeline_verdict_state", gpu=gpu, verdict="compute-bound") == 0.0
    # The other faces, each with its figure: the report's lines are top's lines.
    for line in ("GPU memory (KV cache): ruled out: KV 55.0% of the pool (watermark 85%), 0 preemptions, 3 waiting",
                 "compute: ruled out: decode 11% of peak FLOP/s (binds at 50%)",
                 "queueing: ruled out: 3 waiting, mean queue time 0.12 s",
                 "limit: clocks held back: sw_power_cap"):
        assert line in views["report"] and line in views["top200"]


def test_per_phase_numbers_agree(views):
    tail_decode = views["tail"]["gpus"][0]["phases"]["decode"]
    bps = tail_decode["achieved_bytes_per_s"]
    assert bps == 2.60e12
    assert metric(views, "ridgeline_phase_achieved_bytes_per_second", gpu="0", phase="decode") == bps
    ratio = metric(views, "ridgeline_phase_peak_bandwidth_ratio", gpu="0", phase="decode")
    assert ratio == pytest.approx(tail_decode["pct_of_peak_bytes"] / 100)
    flops = metric(views, "ridgeline_phase_achieved_flops_per_second", gpu="0", phase="prefill")
    assert flops == views["tail"]["gpus"][0]["phases"]["prefill"]["achieved_flops_per_s"] == 6.80e14
    # top's phase rows print those figures: TB/s, % of peak bytes, TFLOP/s, % of peak FLOP/s, FLOP/B.
    row = re.compile(r"decode\s+87%\s+2\.60\s+78%\s+108\.0\s+11%\s+41\.4\s+memory-bound")
    assert row.search(views["top80"]) and row.search(views["top200"])
    assert re.search(r"prefill\s+13%\s+0\.62\s+18%\s+680\.0\s+69%\s+1094\.0\s+compute-bound", views["top200"])
    assert "78% of peak HBM bytes/s (2.60 TB/s)" in views["report"]          # the report's answer: the same


def test_kv_and_queue_agree(views):
    e = views["tail"]["engine"]["engine"]["endpoints"][ENDPOINT]
    assert (e["kv_usage_ratio"], e["kv_usage_max_ratio"], e["num_waiting_requests"]) == (0.52, 0.55, 3.0)
    assert metric(views, "ridgeline_engine_kv_usage_ratio", endpoint=ENDPOINT) == 0.52
    assert metric(views, "ridgeline_engine_kv_usage_max_ratio", endpoint=ENDPOINT) == 0.55
    assert metric(views, "ridgeline_engine_waiting_requests", endpoint=ENDPOINT) == 3.0
    # The verdict weighs the window's highest KV usage; top shows it beside the latest.
    for top in (views["top80"], views["top200"]):
        assert "52.0% (max 55.0%)" in top and "waiting 3" in top.replace("\n", " ")
    assert "KV 55.0% of the pool" in views["report"] and "3 waiting" in views["report"]
    assert views["tail"]["verdict"][0]["kv_usage_ratio"] == 0.55
    assert views["tail"]["verdict"][0]["num_waiting_requests"] == 3.0


def test_device_health_agrees(views):
    assert metric(views, "ridgeline_gpu_window_xid_errors", gpu="0") == 1.0
    assert metric(views, "ridgeline_gpu_last_xid", gpu="0") == 79.0
    assert metric(views, "ridgeline_gpu_remapped_rows_correctable", gpu="0") == 3.0
    assert "XID 79 (1 in the window)" in views["top200"] and "remapped rows 3/0" in views["top200"]
    assert views["tail"]["device"]["nvml"]["devices"][0]["xid_errors"] == [79]


def test_tail_text_gives_the_same_answer_as_the_report(views):
    from ridgeline.agent.commands.tail import summary

    class Msg:
        topic = "window"
        payload = wire.decode_window(wire.encode_window(view_window()))
    text = summary(Msg())
    assert "\n" not in text                 # tail prints one line per record
    assert text.startswith("2 gpu/process, 122200 kernels, verdict gpu0/4242: memory-bandwidth-bound")
    for line in ("gpu0/pid 4242: memory-bandwidth-bound (decode): decode: 78% of peak HBM bytes/s (2.60 TB/s)",
                 "GPU memory (KV cache): ruled out: KV 55.0% of the pool (watermark 85%), 0 preemptions, 3 waiting",
                 "limit: clocks held back: sw_power_cap"):
        assert line in text and line in views["report"]


def test_the_launch_call_is_one_measure_under_one_name(views):
    """Issue 24.2: `top` said "launch p50 2.9 us" where the report said "Launch latency (API
    call start -> kernel start): p50 2.61 ms": two measures under one word. `top` names the
    launch call's own duration, in the unit the figure needs, and never calls it latency."""
    p50_us = views["tail"]["gpus"][0]["launch"]["p50_ns"] / 1e3
    for key in ("top80", "top200"):
        text = " ".join(views[key].split())          # the 80-column frame wraps long lines
        assert f"launch call p50 {p50_us:.1f} us" in text, views[key]
        assert "launch latency" not in text.lower()
