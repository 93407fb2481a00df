"""SGLang's per-request metrics files as request records (probes.sglang_request_metrics): the
fallback for SGLang servers that send no traces.

Read from SGLang's source, github.com/sgl-project/sglang at
d6645396ff692a91ea327aec8a4d13e300a02e5c, ``python/sglang/srt/managers/request_metrics_exporter.py``:

* ``RequestMetricsExporter._format_output_data`` (lines 33-61) builds each record as
  ``{"request_parameters": json.dumps(request_params), **filtered_out_meta_info}``
  (lines 57-60): the request's dataclass fields (``rid`` among them) JSON-encoded in one
  string, then the response's ``meta_info`` keys at the top level;
* ``FileRequestMetricsExporter`` writes it with ``json.dump(metrics_data, f)`` and
  ``f.write("\\n")`` (JSON lines) to ``os.path.join(export_dir,
  f"sglang-request-metrics-{hour_suffix}.log")``, ``hour_suffix =
  datetime.now().strftime("%Y%m%d_%H")``, and skips requests whose rid holds
  ``"HEALTH_CHECK"`` (``write_record``); ``create_request_metrics_exporters`` makes it
  when ``server_args.export_metrics_to_file`` is set, into ``export_metrics_to_file_dir``.

The ``meta_info`` keys are those of SGLang's ``tokenizer_manager.py``: ``id``,
``finish_reason``, ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``,
``e2e_latency`` (``state.finished_time - state.created_time``, time.time() seconds) and,
from ``_calculate_timing_metrics`` (with metrics enabled), ``request_received_ts``
(``state.created_time``), ``request_sent_to_scheduler_ts``, ``prefill_finished_ts``
(``state.first_token_time``), ``response_sent_to_client_ts``, ``decode_finished_ts``
(``state.finished_time``), ``inference_time`` and ``decode_throughput``.
"""
from __future__ import annotations

import json
import os
from datetime import datetime

import pytest
from support import request_scenarios as sc

from ridgeline.aggregator.request_history import RequestHistory
from ridgeline.probes import sglang_request_metrics as S


def exporter_line(rid: str, start_ns: int, first_ns: int, end_ns: int, prompt: int, completion: int,
                  skip_timing: bool = False) -> str:
    """One line as FileRequestMetricsExporter writes it (json.dump of the record, then "\\n")."""
    request_params = {"rid": rid, "text": "hello", "sampling_params": {"max_new_tokens": completion},
                      "stream": False, "log_metrics": True}
    meta_info = {"id": rid, "finish_reason": {"type": "length", "length": completion},
                 "prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": 0,
                 "e2e_latency": (end_ns - start_ns) / 1e9}
    if not skip_timing:
        meta_info.update({"request_received_ts": start_ns / 1e9, "request_sent_to_scheduler_ts": start_ns / 1e9 + 1e-4,
                          "prefill_finished_ts": first_ns / 1e9, "response_sent_to_client_ts": end_ns / 1e9 + 1e-4,
                          "decode_finished_ts": end_ns / 1e9, "inference_time": (end_ns - start_ns) / 1e9,
                          "decode_throughput": completion / max((end_ns - first_ns) / 1e9, 1e-9)})
    record = {"request_parameters": json.dumps(request_params), **meta_info}
    return json.dumps(record) + "\n"


def hour_file(folder, when: datetime | None = None) -> str:
    return os.path.join(folder, f"sglang-request-metrics-{(when or datetime.now()).strftime('%Y%m%d_%H')}.log")


def test_a_record_as_sglang_writes_it():
    rec = S.parse_line(exporter_line("9f1c2e", 10**18, 10**18 + 250_000_000, 10**18 + 8 * 10**9, 100, 500)
                       .encode())
    assert (rec.engine, rec.request_id, rec.prompt_tokens, rec.completion_tokens) == ("sglang", "9f1c2e", 100, 500)
    assert rec.start_ns == pytest.approx(10**18, abs=1_000) and rec.e2e_ns == pytest.approx(8e9, abs=1_000)
    assert rec.ttft_ns == pytest.approx(250_000_000, abs=1_000) and rec.queue_ns == -1


def test_health_checks_and_untimed_records_are_not_requests():
    assert S.parse_line(exporter_line("HEALTH_CHECK_1", 10**18, 10**18, 10**18 + 1, 1, 1).encode()) is None
    assert S.parse_line(exporter_line("r", 10**18, 10**18, 10**18 + 10**9, 1, 1, skip_timing=True).encode()) is None
    for bad in (b"{", b"[1]", b"\xff\xfe"):
        with pytest.raises(S.LineError):
            S.parse_line(bad)


def test_the_seed_example_from_sglang_files_names_the_culprit(tmp_path):
    """The seed's two requests written by SGLang's exporter, followed by the probe as the
    server appends them, joined with the steps: 12.5 s of the answer's decode is the long
    request's, within 10%, as from the OTLP spans."""
    steps, spans = sc.seed_batched()
    p = S.SglangRequestMetricsProbe(str(tmp_path))
    path = hour_file(tmp_path)
    open(path, "w").close()
    assert p.check().ok
    p.start()
    with open(path, "a") as f:
        for s in spans:
            f.write(exporter_line(s.request_id, s.start_ns, s.start_ns + s.ttft_ns, s.end_ns, s.prompt_tokens,
                                  s.completion_tokens))
    got = p.poll()["requests"]
    assert {r.request_id for r in got} == {s.request_id for s in spans}
    h = RequestHistory(join_delay_s=0)
    from support.request_scenarios import held
    h.add_steps(held(steps))
    h.add_requests(got)
    _w, stories = h.close(max(r.end_ns for r in got) + 10**9)
    story = next(s for s in stories if s.request_id == "answer-500")
    assert story.engine == "sglang" and story.culprits[0].request_id == "long-4000"
    assert abs(story.culprits[0].added_ns - 12.5e9) <= 0.10 * 12.5e9
    # The file has no queue time: the story says so rather than telling 0.
    from ridgeline.aggregator.request_join import story_text
    assert story.queue_ns == -1 and "queue time: not reported by the engine." in story_text(story)


def test_follow_appends_partial_lines_rotation_and_bounds(tmp_path):
    old = hour_file(tmp_path, datetime(2026, 12, 2, 17))
    with open(old, "w") as f:
        f.write(exporter_line("before-start", 10**18, 10**18 + 1, 10**18 + 10**9, 1, 1))
    p = S.SglangRequestMetricsProbe(str(tmp_path), max_line_bytes=4096)
    p.start()
    assert p.poll() is None                              # what was there at start is not read
    line = exporter_line("a", 10**18, 10**18 + 1, 10**18 + 10**9, 1, 1)
    with open(old, "a") as f:
        f.write(line[:40])                               # half a line: nothing yet
    assert p.poll() is None
    with open(old, "a") as f:
        f.write(line[40:] + "x" * 10_000 + "\n" + "not json\n")
    got = p.poll()["requests"]
    assert [r.request_id for r in got] == ["a"] and p.lines_too_long == 1 and p.bad_lines == 1
    new = hour_file(tmp_path, datetime(2026, 12, 2, 18))  # the next hour's file
    with open(new, "w") as f:
        f.write(exporter_line("b", 10**18, 10**18 + 1, 10**18 + 10**9, 1, 1))
    assert [r.request_id for r in p.poll()["requests"]] == ["b"]
    # A line over the bound written in pieces is skipped to its end, then reading goes on.
    with open(new, "a") as f:
        f.write("y" * 5000)
    assert p.poll() is None
    with open(new, "a") as f:
        f.write("y" * 5000 + "\n" + exporter_line("c", 10**18, 10**18 + 1, 10**18 + 10**9, 1, 1))
    assert [r.request_id for r in p.poll()["requests"]] == ["c"] and p.lines_too_long == 2


def test_bytes_per_poll_are_bounded(tmp_path):
    path = hour_file(tmp_path)
    p = S.SglangRequestMetricsProbe(str(tmp_path), max_bytes_per_poll=2000, from_start=True)
    with open(path, "w") as f:
        for i in range(50):
            f.write(exporter_line(f"r{i}", 10**18, 10**18 + 1, 10**18 + 10**9, 1, 1))
    p.start()
    seen = []
    for _ in range(100):
        r = p.poll()
        if r:
            assert len(r["requests"]) <= 2000 // 400 + 1
            seen += [x.request_id for x in r["requests"]]
    assert seen == [f"r{i}" for i in range(50)]


def test_no_folder_is_a_clear_reason(tmp_path):
    assert "not a folder" in S.SglangRequestMetricsProbe(str(tmp_path / "none")).check().reason
    assert "no folder" in S.SglangRequestMetricsProbe("").check().reason


def test_config_builds_the_probe_and_refuses_it_without_a_folder(tmp_path):
    from ridgeline.agent import config, registry
    from ridgeline.probes.errors import InputError
    good = tmp_path / "good.toml"
    good.write_text(f'[probes]\nenabled = ["sglang_requests"]\n[probes.sglang_requests]\ndir = "{tmp_path}"\n')
    cfg = config.load(good)
    probe, av = registry.availability("sglang_requests", cfg)
    assert av.ok and isinstance(probe, S.SglangRequestMetricsProbe) and probe.folder == str(tmp_path)
    assert registry.STEPS["sglang_requests"].topic == "requests"
    bad = tmp_path / "bad.toml"
    bad.write_text('[probes]\nenabled = ["sglang_requests"]\n')
    with pytest.raises(InputError, match="probes.sglang_requests.dir"):
        config.load(bad)
