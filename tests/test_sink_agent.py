"""The object-storage sink in the agent (issue 23): ``[sink] enabled = true`` makes the
daemon start and supervise a recorder child (agent/sink_supervisor.py) whose counters are on
the agent's /metrics and in ``ridgeline check``.

Real parts: the agent as a process replaying a shared trace (tests/support/agent_process.py),
a real S3 API server on loopback (s3rver 3.7.1 from npm, tests/support/s3_server.py) killed
and started again with its data, the sink child killed with -9 mid-file, and what reached
the store read back through the AWS SDK (pyarrow's S3 filesystem) and the project's Parquet
reader. Nothing lost (every message the dead child had journaled is in the store, and what
the agent published while no child ran reached the next one through the agent's hand-off:
no sequence gap, ``ridgeline_sink_missed_messages_total`` 0), nothing duplicated (each frame
and each topic's sequence number once).
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("pyarrow", reason="pyarrow (the ridgeline[parquet] extra) is not installed")

from support import s3_server  # noqa: E402
from support.agent_process import TRACE, start_agent, stop, write_config  # noqa: E402
from support.net import free_port  # noqa: E402

from ridgeline.agent import object_sink as S  # noqa: E402
from ridgeline.agent import parquet_recording as pqr  # noqa: E402
from ridgeline.agent import sink_metrics  # noqa: E402

pytestmark = pytest.mark.long   # a minute or two each: started first under xdist


def _metrics(port: int) -> dict[str, float]:
    """The ridgeline_sink_* samples of the agent's /metrics, by name and labels."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    out = {}
    for m in re.finditer(r"^(ridgeline_sink_\w+)(\{[^}]*\})? (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        labels.pop("Hostname", None)
        key = m.group(1) + "".join(f"[{v}]" for v in labels.values())
        out[key] = float(m.group(3))
    return out


def _wait(port: int, pred, seconds: float, what: str) -> dict:
    end = time.monotonic() + seconds
    m = {}
    while time.monotonic() < end:
        m = _metrics(port)
        if m and pred(m):
            return m
        time.sleep(0.25)
    raise AssertionError(f"{what}: not within {seconds:g} s; last /metrics: {m}")


def _sink_config(tmp_path, trace, prom, extra: str):
    return write_config(tmp_path, trace, prom_port=prom, events=True, extra=extra)


def _rows(root) -> dict[str, int]:
    import pyarrow.parquet as pq
    out = {}
    for f in root.rglob("*.parquet"):
        table = f.relative_to(root).parts[0]
        out[table] = out.get(table, 0) + pq.ParquetFile(f).metadata.num_rows
    return out


def test_the_agents_sink_survives_a_store_outage_and_a_killed_child(tmp_path, trace_path, monkeypatch):
    exe = s3_server.s3rver_bin()
    s3_server.s3_env(monkeypatch)
    srv = s3_server.S3Server(exe, tmp_path / "s3data").start()
    prom = free_port()
    spool = tmp_path / "spool"
    cfg, ep = _sink_config(tmp_path, trace_path(TRACE), prom, f"""
[sink]
enabled = true
url = "s3://fleet/ridgeline"
endpoint = "{srv.endpoint}"
scheme = "http"
region = "us-east-1"
spool_dir = "{spool}"
roll_s = 2.0
min_free_bytes = 0
""")
    log = open(tmp_path / "agent.log", "w")
    a = start_agent(cfg, log=log)
    try:
        m = _wait(prom, lambda m: m.get("ridgeline_sink_files_total[uploaded]", 0) >= 6, 90, "first uploads")
        assert m["ridgeline_sink_up"] == 1
        before_outage = m
        srv.kill()                                            # the store goes away mid-run
        m = _wait(prom, lambda m: m["ridgeline_sink_upload_retries_total"] >= 1 and m["ridgeline_sink_spool_files"] >= 4,
                  60, "files held in the spool during the outage")
        during = m
        srv.start()                                           # ... and comes back with its data
        m = _wait(prom, lambda m: m["ridgeline_sink_files_total[uploaded]"] >= during["ridgeline_sink_files_total[written]"],
                  90, "the held files uploaded")
        # the child killed with -9 mid-file: one second after a roll, the open file's rows are
        # only in its journal
        st = json.loads((spool / "status.json").read_text())
        rolls = st["rolls"]
        end = time.monotonic() + 30
        while time.monotonic() < end:
            st = json.loads((spool / "status.json").read_text())
            if st["rolls"] > rolls:
                break
            time.sleep(0.1)
        time.sleep(1.0)
        child = st["pid"]
        subprocess.run(["kill", "-9", str(child)], check=True)
        journaled = set()
        for j in (spool / "journal").glob("*.rjl"):
            from ridgeline.aggregator import wire
            _, frames, _ = S.read_journal(j)
            journaled |= {(e.topic, int(e.seq)) for e in (wire.decode_envelope(b) for b, _ in frames)}
        assert journaled, "the killed child's open file had no messages"
        m = _wait(prom, lambda m: m["ridgeline_sink_restarts_total"] == 1 and m["ridgeline_sink_up"] == 1
                  and m["ridgeline_sink_messages_total"] > 0, 60, "the child started again")
        time.sleep(5)                                          # a few more rolls with the new child
        after = _metrics(prom)
    finally:
        rc = stop(a)
        log.close()
    assert rc == 0, (tmp_path / "agent.log").read_text()[-3000:]
    final = json.loads((spool / "status.json").read_text())   # the last child's last word
    srv.start()
    try:
        got = srv.download(tmp_path / "from-s3") / "ridgeline"
    finally:
        srv.kill()
    (host, rec), = pqr.recordings_in(got)                     # one recording across the restart
    msgs = [(f, topic, seq) for f, _, topic, seq, _, _ in pqr.iter_messages(got, host, rec)]
    frames = [f for f, _, _ in msgs]
    assert frames == list(range(len(frames)))                 # every frame once, none missing
    keys = [(t, s) for _, t, s in msgs]
    assert len(keys) == len(set(keys))                        # nothing duplicated
    assert journaled <= set(keys)                             # nothing the dead child had taken lost
    gaps = 0
    by_topic: dict[str, list[int]] = {}
    for t, s in keys:
        by_topic.setdefault(t, []).append(s)
    for seqs in by_topic.values():
        assert seqs == sorted(seqs)
        gaps += sum(b - a - 1 for a, b in zip(seqs, seqs[1:]))
    # nothing the agent published is absent, from its first message on: the new child took
    # the agent's hand-off of what it published while no child ran (agent/sink_handoff.py)
    assert gaps == 0 and final["missed_messages"] == 0 and after["ridgeline_sink_missed_messages_total"] == 0, \
        (gaps, final, (tmp_path / "agent.log").read_text()[-3000:])
    assert {t: seqs[0] for t, seqs in by_topic.items()} == dict.fromkeys(by_topic, 0)
    assert final["handed_over_messages"] >= 1 and final["replayed_messages"] >= len(journaled)
    assert final["dropped_files"] == 0 and after["ridgeline_sink_files_total[dropped]"] == 0
    assert final["spool_files"] == 0                          # everything left the spool on stop
    rows = _rows(got)
    assert rows["messages"] == len(msgs) and rows["kernels"] > 1000
    print(f"\nsink under faults: before the outage {before_outage['ridgeline_sink_files_total[uploaded]']:.0f} files "
          f"uploaded; during it {during['ridgeline_sink_spool_files']:.0f} held in the spool "
          f"({during['ridgeline_sink_spool_bytes']:.0f} bytes), {during['ridgeline_sink_upload_retries_total']:.0f} "
          f"failed uploads; child killed -9 with {len(journaled)} messages only in its journal, "
          f"{final['replayed_messages']} replayed; {final['handed_over_messages']} handed over by the agent "
          f"({final['duplicate_messages']} duplicates dropped), {final['missed_messages']} missed; "
          f"in the store: {len(msgs)} messages (frames 0..{len(msgs) - 1} once each), rows {rows}")


def test_the_agents_sink_is_bounded_and_check_says_so(tmp_path, trace_path):
    dead = f"127.0.0.1:{free_port()}"                         # nothing listens: every upload fails
    prom = free_port()
    spool = tmp_path / "spool"
    cap = 1 << 20
    cfg, ep = _sink_config(tmp_path, trace_path(TRACE), prom, f"""
[sink]
enabled = true
url = "s3://fleet/x"
endpoint = "{dead}"
scheme = "http"
region = "us-east-1"
spool_dir = "{spool}"
roll_s = 1.0
spool_max_bytes = {cap}
""")
    env = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x"}
    a = start_agent(cfg, env=env)
    try:
        m = _wait(prom, lambda m: m.get("ridgeline_sink_files_total[dropped]", 0) >= 2, 120, "files dropped at the cap")
        assert m["ridgeline_sink_bytes_total[dropped]"] > 0 and m["ridgeline_sink_upload_retries_total"] >= 1
        assert m["ridgeline_sink_files_total[uploaded]"] == 0
        # the spool near its cap: at most one roll's files and journal past it
        assert m["ridgeline_sink_spool_bytes"] <= cap + 600_000, m
        assert len(m) == 13 == sink_metrics.SERIES, sorted(m)   # the series one host's sink adds
        r = subprocess.run([sys.executable, "-m", "ridgeline", "check", "--config", str(cfg), "--json",
                            "--probe", "replay", "--agent-timeout", "10"], capture_output=True, text=True,
                           timeout=60)
        out = json.loads(r.stdout)
        sink = out["sink"]
        assert sink["enabled"] and sink["ok"] and sink["url"] == "s3://fleet/x"
        assert sink["agent"]["state"] == "running" and sink["agent"]["dropped_files"] >= 2
        assert sink["agent"]["upload_errors"] >= 1 and sink["agent"]["last_error"], sink
        text = subprocess.run([sys.executable, "-m", "ridgeline", "check", "--config", str(cfg), "--probe", "replay",
                               "--agent-timeout", "10"], capture_output=True, text=True, timeout=60).stdout
        assert re.search(r"^sink   running  s3://fleet/x: 0 files \(0 bytes\) uploaded, \d+ waiting in the spool "
                         r"\(\d+ bytes\), \d+ dropped over the cap, \d+ failed uploads retried, 0 restarts", text, re.M), text
    finally:
        assert stop(a) == 0
    print(f"\nspool cap {cap} bytes with the store unreachable: {m['ridgeline_sink_files_total[dropped]']:.0f} files "
          f"({m['ridgeline_sink_bytes_total[dropped]']:.0f} bytes) dropped, spool at {m['ridgeline_sink_spool_bytes']:.0f} "
          f"bytes; /metrics: {len(m)} sink series")


def test_the_sink_child_does_not_outlive_an_agent_killed_with_9(tmp_path, trace_path):
    import os
    spool, dest = tmp_path / "spool", tmp_path / "dest"
    cfg, _ = _sink_config(tmp_path, trace_path(TRACE), None, f"""
[sink]
enabled = true
url = "{dest}"
spool_dir = "{spool}"
roll_s = 1.0
min_free_bytes = 0
""")
    a = start_agent(cfg)
    try:
        end = time.monotonic() + 60
        while not (spool / "status.json").exists() and time.monotonic() < end:
            time.sleep(0.1)
        child = json.loads((spool / "status.json").read_text())["pid"]
        a.send_signal(signal.SIGKILL)
        a.wait()
        end = time.monotonic() + 30
        while time.monotonic() < end:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the sink child outlived its agent by 30 s")
    finally:
        stop(a)
    # it stopped as on SIGTERM: its last roll went out, the spool's lock is free for the next
    assert list(dest.rglob("*.parquet")) and not list(spool.glob("out/**/*.parquet"))
    S.ObjectSink(spool, f"file://{dest}", upload_interval_s=0.05).close()
    (host, rec), = pqr.recordings_in(dest)
    frames = [m[0] for m in pqr.iter_messages(dest, host, rec)]
    assert frames == list(range(len(frames))) and frames     # every message it took, once


def test_a_sink_enabled_without_a_url_is_one_line(tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text("[sink]\nenabled = true\n")
    r = subprocess.run([sys.executable, "-m", "ridgeline", "agent", "--config", str(cfg), "--print-config"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "'sink.url' must be set when the sink is enabled" in r.stderr


def test_the_daemon_does_not_import_pyarrow_with_the_sink_on(tmp_path):
    code = ("import sys; from ridgeline.agent import daemon, sink_supervisor, sink_metrics, prometheus; "
            "print('pyarrow' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr


def test_a_reload_turns_the_sink_on_and_off(tmp_path):
    """SIGHUP's reload (Agent.reload) applies [sink]: on starts the recorder child, off stops it
    (it rolls and uploads on its SIGTERM); the agent never imports pyarrow for it."""
    import os
    import threading

    from ridgeline.agent import config
    from ridgeline.agent.daemon import Agent
    from ridgeline.agent.sdnotify import Notifier
    from ridgeline.aggregator import wire
    path = tmp_path / "agent.toml"
    ep = f"ipc://{tmp_path}/r.sock"
    spool, dest = tmp_path / "spool", tmp_path / "dest"
    base = f'[agent]\nwindow_s = 0.2\n[publisher]\nendpoint = "{ep}"\n[prometheus]\nenabled = false\n' \
           '[probes]\nenabled = []\n'
    sink = f'[sink]\nenabled = true\nurl = "{dest}"\nspool_dir = "{spool}"\nroll_s = 1.0\nmin_free_bytes = 0\n'

    def rewrite(text):
        path.write_text(text)
        old = time.time() - 5                   # settled: a reload applies it at once
        os.utime(path, (old, old))
    rewrite(base)
    agent = Agent(config.load(path), config_path=str(path), probes=[], codec=wire, notifier=Notifier({}))
    agent.start()
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    try:
        assert agent.sink is None
        rewrite(base + sink)
        agent.request_reload()
        end = time.monotonic() + 60
        while not (spool / "status.json").exists() and time.monotonic() < end:
            time.sleep(0.1)
        assert agent.sink is not None and agent.sink.pid == json.loads((spool / "status.json").read_text())["pid"]
        child = agent.sink.proc
        end = time.monotonic() + 60               # its first roll of the agent's windows reached the folder
        while not list(dest.rglob("*.parquet")) and time.monotonic() < end:
            time.sleep(0.1)
        assert list(dest.rglob("*.parquet"))
        rewrite(base)
        agent.request_reload()
        assert child.wait(60) == 0                # stopped on SIGTERM, cleanly
        end = time.monotonic() + 10
        while agent.sink is not None and time.monotonic() < end:
            time.sleep(0.05)
        assert agent.sink is None and agent.reloads == 2
    finally:
        agent.request_stop()
        t.join(60)
        agent.shutdown()
