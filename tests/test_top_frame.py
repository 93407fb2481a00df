"""``ridgeline top``'s frame (agent/top_frame.py) and keys (agent/top_view.py), with the
fixed window of tests/view_window.py: it fits 80x24 and 200x50, keeps the answer, and the
keys select, sort and quit as htop's do."""
import copy

import msgspec
import pytest
from view_window import view_window

from ridgeline.agent.top import TopState
from ridgeline.agent.top_frame import KEYS, frame, quantile_text, sparkline
from ridgeline.agent.top_view import HISTORY, SORTS, ViewState, pressure_pct
from ridgeline.probes.records import EngineFigures, VerdictRecord, window_of


def rows(t):
    return t.plain.split("\n")


@pytest.mark.parametrize("width,height", [(80, 24), (200, 50), (100, 30)])
def test_the_frame_fits_the_terminal(width, height):
    r = rows(frame(view_window(), TopState(windows=3), ViewState(), width, height))
    assert len(r) <= height and max(len(x) for x in r) <= width
    assert r[-1].startswith(KEYS)                                        # the keys, last
    assert any(x.startswith("agent: ") for x in r)                      # never cut before the agent line
    text = "\n".join(r)
    # The verdict in full (not "memory-bo..."), and the figure that rules out each other face.
    assert "memory-bandwidth-bound (decode)" in text
    assert "GPU memory (KV cache): ruled out: KV 55.0% of the pool" in text
    assert "compute: ruled out: decode 11% of peak FLOP/s" in text
    assert "limit: clocks held back: sw_power_cap" in text


def test_80x24_drops_the_least_needed_rows_and_says_so():
    w = view_window()
    for i in range(2, 6):                       # six GPUs: more than 24 rows hold
        w["gpus"].append(dict(copy.deepcopy(w["gpus"][1]), device=i, pid=5000 + i))
    small = rows(frame(w, TopState(), ViewState(), 80, 24))
    big = rows(frame(w, TopState(), ViewState(), 200, 60))
    assert len(small) == 24 and small[-1].endswith(" rows hidden")
    assert not any("rows hidden" in x for x in big)
    assert any(x.startswith("engine http://127.0.0.1:8000/metrics") for x in small)   # KV kept
    assert any("GPU 5 pid 5005" in x for x in big)


def test_device_rows_name_xid_ecc_and_remapped_rows():
    text = frame(view_window(), width=200, height=None).plain
    assert "power 612/700 W  SM 1755/1980 MHz  mem 71.6/79.6 GiB  61 C  throttle sw_power_cap" in text
    assert "XID 79 (1 in the window)  ECC uncorr 0 vol/0 life, corr 12 vol  remapped rows 3/0" in text
    w = view_window()
    w["device"] = {}
    assert "device: no NVML figures in this window" in frame(w, width=200, height=None).plain
    w = view_window()
    for d in w["device"]["nvml"]["devices"]:
        d.update(xid_errors_count=None, xid_errors=None, ecc_uncorrected_volatile_errors_total=None,
                 ecc_corrected_volatile_errors_total=None)
    assert "XID unknown  ECC unknown" in frame(w, width=200, height=None).plain   # unknown, never "none"


def test_latency_percentiles_show_their_bucket_bound():
    e = msgspec.convert({"queue_time_p50_s": None, "queue_time_p50_kind": "first_bucket", "queue_time_p50_upper_s": 0.3,
                         "itl_p99_s": None, "itl_p99_kind": "above_last_bucket", "itl_p99_lower_s": 20.0,
                         "ttft_p50_s": 0.0183}, EngineFigures)
    assert quantile_text(e.queue_time_p50_s, e.queue_time_p50_kind, e.queue_time_p50_lower_s,
                         e.queue_time_p50_upper_s) == "<=300.0 ms"
    assert quantile_text(e.itl_p99_s, e.itl_p99_kind, e.itl_p99_lower_s, e.itl_p99_upper_s) == ">20.0 s"
    assert quantile_text(e.ttft_p50_s, e.ttft_p50_kind, e.ttft_p50_lower_s, e.ttft_p50_upper_s) == "18.3 ms"
    assert quantile_text(None, None, None, None) == "-"          # no histogram: no figure
    assert quantile_text(None, "first_bucket", None, None) == "-"    # a kind without its bound


def test_sparkline_and_pressure():
    assert sparkline([0, 50, 100, None, 250, -3]) == "▁▅█ █▁"
    rec = msgspec.convert(view_window()["verdict"][0], VerdictRecord)
    assert rec.face == "bandwidth" and pressure_pct(rec) == pytest.approx(77.6)
    assert pressure_pct(VerdictRecord(face="memory-capacity", kv_usage_ratio=0.9)) == pytest.approx(90.0)
    assert pressure_pct(VerdictRecord(face="queue")) is None


def test_history_feeds_the_sparkline_and_is_bounded():
    view = ViewState()
    w = view_window()
    for i in range(HISTORY + 5):
        w["verdict"][0]["phase_pct_of_peak_bytes"] = float(i * 4 % 100)
        view.observe(window_of(w))
    h = view.history[(0, 4242)]
    assert len(h) == HISTORY and h[-1] == ("bandwidth", float((HISTORY + 4) * 4 % 100))
    assert sparkline([p for _, p in h]) in frame(w, TopState(), view, 200, None).plain


def test_keys_quit_sort_and_pick():
    view = ViewState()
    w = view_window()
    view.observe(window_of(w))
    assert [view.sort] + [view.key("s") and view.sort for _ in SORTS] == [*SORTS, SORTS[0]]
    assert view.key("x") is False and not view.quit
    assert view.key("g") and view.gpu == 0
    text = frame(w, TopState(), view, 200, None).plain
    assert "GPU 0 NVIDIA" in text and "GPU 1" not in text and "GPU 0, pid all" in text
    assert view.key("g") and view.gpu == 1 and view.key("g") and view.gpu is None   # all, 0, 1, all
    assert view.key("p") and view.pid == 4242 and view.key("p") and view.pid == 4243
    text = frame(w, TopState(), view, 200, None).plain
    assert "GPU 1 NVIDIA" in text and "pid 4243" in text and "GPU 0" not in text
    view.gpu = 0           # GPU 0 with pid 4243: nothing matches, and the frame says how to change it
    assert "no GPU/process matches the selection (g / p to change)" in frame(w, TopState(), view, 80, 24).plain
    assert view.key("q") and view.quit


def test_sort_by_pressure_puts_the_most_pressed_gpu_first():
    w = view_window()
    w["verdict"][1]["phase_pct_of_peak_bytes"] = 95.0
    view = ViewState(sort="pressure")
    typed = window_of(w)
    verdicts = {(r.device, r.pid): r for r in (msgspec.convert(x, VerdictRecord) for x in w["verdict"])}
    assert [g.device for g in view.pick(typed.gpus, verdicts)] == [1, 0]
    assert [g.device for g in ViewState().pick(typed.gpus, {})] == [0, 1]


def test_the_frame_keeps_the_straggler_lines():
    """Issue 23's TP-group line (agent/straggler_view.py) is in the fitted frame too."""
    import msgspec

    from ridgeline.agent.straggler_view import stragglers_lines
    from ridgeline.probes.records import WindowStragglers
    w = view_window()
    ranks = [{"pid": 4242 + d, "device": d, "last_count": 108 * d, "wait_ns": 0} for d in (0, 1)]
    w["stragglers"] = {"groups": [{"collectives": 120, "ranks": ranks,
                                   "straggler_device": 1, "straggler_pid": 4243, "straggler_last_share_ratio": 0.9,
                                   "late_by_p50_ns": 250_000, "late_by_p99_ns": 900_000, "cause": "host",
                                   "waiting_share_ratio": 0.2}]}
    want = [t.plain for t in stragglers_lines(msgspec.convert(w["stragglers"], WindowStragglers))]
    assert want and want[0].startswith("TP group GPUs 0,1: 120 collectives; straggler GPU 1")
    assert want[0] in frame(w, TopState(), ViewState(), 400, None).plain


def test_a_stragglers_record_of_the_wrong_shape_is_one_line():
    """The frame reads the stragglers as the typed record: a producer's bug is said, not a traceback."""
    w = view_window()
    w["stragglers"] = {"groups": [{"collectives": "many"}]}
    text = frame(w, TopState(), ViewState(), 400, None).plain
    assert "stragglers record not readable:" in text and "TP group" not in text
