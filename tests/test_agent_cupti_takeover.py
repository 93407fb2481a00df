"""agent.cupti_takeover (the reclaim policy, with literal times) and agent.reclaim_request
(the operator's request file, including hostile ones), and probes.cupti.socket_group
reaching the real socket."""
from __future__ import annotations

import json
import os
import stat
import time

from ridgeline.agent import config, reclaim_request, registry
from ridgeline.agent.cupti_takeover import TakeoverWatch

LINE = ("takeover: another CUPTI client (torch.profiler?) re-registered the activity buffer callbacks: buffers "
        "CUPTI filled for us were not returned by our flushes (1 buffer(s) lost to it); Ridgeline records are "
        "paused until it is done")


def test_default_policy_reports_and_never_reclaims_by_itself():
    w = TakeoverWatch(0.0)
    w.status_lines({41: LINE, 42: "resumed: something"})
    assert w.observe({41}, 1000.0) == []
    assert w.observe({41}, 1000.0 + 86400) == []
    assert w.report(1000.0 + 86400) == [{"pid": 41, "since_unix_s": 1000.0, "taken_over_s": 86400.0,
                                          "status": LINE, "reclaims_requested": 0, "uid": -1, "comm": ""}]
    assert w.observe(set(), 90000.0) == [] and w.report(90000.0) == []     # resumed: off the list


def test_the_report_says_whose_process_it_is_and_uids_on_metrics_are_bounded():
    """Issue 18.3: any local user may flag its own process as taken over; the report and
    /metrics say whose (uid from the kernel, comm as sent, cut to 15), uids bounded."""
    from ridgeline.agent.cupti_takeover import UID_SERIES
    w = TakeoverWatch(0.0)
    pids = set(range(100, 100 + UID_SERIES + 5)) | {7}
    w.observe(pids, 10.0)
    w.owners({p: (p, "vllm-worker-with-a-long-name") for p in pids - {7}} | {7: (100, "python")})
    rep = {r["pid"]: r for r in w.report(11.0)}
    assert rep[7]["uid"] == 100 and rep[7]["comm"] == "python" and rep[101]["comm"] == "vllm-worker-wit"
    by = w.by_uid()
    assert len(by) == UID_SERIES + 1 and by["100"] == 2 and by["other"] == len(pids) - UID_SERIES - 1
    assert sum(by.values()) == len(pids)


def test_after_the_configured_age_it_asks_once_per_period():
    w = TakeoverWatch(30.0)
    assert w.observe({7, 8}, 100.0) == []
    assert w.observe({7, 8}, 129.9) == []
    assert w.observe({7, 8}, 130.0) == [7, 8]
    assert w.observe({7, 8}, 131.0) == []              # a reclaim that did not work: asked again later,
    assert w.observe({7}, 160.0) == [7]                # not in a loop
    assert w.reclaims_requested == 3
    assert w.report(160.0)[0]["reclaims_requested"] == 2
    assert w.observe({7}, 170.0) == []
    assert w.observe({9}, 170.0) == [] and w.report(170.0)[0]["since_unix_s"] == 170.0  # a new episode


def test_the_operator_asks_whatever_the_age_and_only_those_taken_over():
    w = TakeoverWatch(0.0)
    w.observe({5, 6}, 10.0)
    w.request(6)
    w.request(99)                                          # not taken over: nothing to ask
    assert w.observe({5, 6}, 10.5) == [6]
    assert w.observe({5, 6}, 11.0) == []                   # one request, one reclaim
    w.request(None)
    assert w.observe({5, 6}, 11.5) == [5, 6]


def test_request_file_roundtrip(tmp_path):
    sock = str(tmp_path / "cupti.sock")
    path = reclaim_request.write_request(sock, "abc", 1234)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert reclaim_request.take_request(sock) == ({"id": "abc", "pid": 1234}, False)
    assert not os.path.exists(path)
    assert reclaim_request.take_request(sock) == (None, False)
    assert reclaim_request.read_done(sock, "abc") is None
    reclaim_request.write_done(sock, "abc", [1234])
    assert reclaim_request.read_done(sock, "abc") == [1234] and reclaim_request.read_done(sock, "xyz") is None


def test_hostile_request_files_are_removed_and_never_acted_on(tmp_path):
    sock = str(tmp_path / "cupti.sock")
    req = tmp_path / reclaim_request.REQUEST_NAME
    for body in (b"x" * 5000, b"not json", b"[1]", json.dumps({"id": "a", "pid": 0}).encode(),
                 json.dumps({"id": "a", "pid": True}).encode(), json.dumps({"id": "a" * 65, "pid": None}).encode(),
                 json.dumps({"id": 3, "pid": None}).encode()):
        req.write_bytes(body)
        assert reclaim_request.take_request(sock) == (None, True), body
        assert not req.exists()
    (tmp_path / "target").write_text(json.dumps({"id": "a", "pid": None}))
    req.symlink_to(tmp_path / "target")                     # a link: never followed
    assert reclaim_request.take_request(sock) == (None, True) and not req.exists()
    me = os.geteuid()
    req.write_text(json.dumps({"id": "a", "pid": None}))    # written by a user who is not the agent's
    if me == 0:
        os.chown(req, 65534, -1)
    assert reclaim_request.take_request(sock, owner_uid=4242) == (None, True)
    if me == 0:      # root may always ask: an agent running as a service user takes root's request
        req.write_text(json.dumps({"id": "a", "pid": None}))
        assert reclaim_request.take_request(sock, owner_uid=4242) == ({"id": "a", "pid": None}, False)


def test_socket_group_from_the_configuration_reaches_the_socket(tmp_path):
    import grp
    group = grp.getgrgid(os.getegid()).gr_name
    for given, mode, gid in (("", 0o666, None), (group, 0o660, os.getegid())):
        cfg = config.overlay(config.defaults(), {"probes": {"cupti": {"socket": str(tmp_path / "c.sock"),
                                                                      "socket_group": given}}})
        probe = registry.STEPS["cupti"].factory(cfg)
        probe.start()
        try:
            st = os.stat(tmp_path / "c.sock")
        finally:
            probe.stop()
        assert stat.S_IMODE(st.st_mode) == mode, given
        if gid is not None:
            assert st.st_gid == gid


def test_reload_applies_reclaim_after_s_without_restarting_the_cupti_socket(tmp_path):
    from ridgeline.agent.daemon import Agent
    from ridgeline.agent.sdnotify import Notifier

    def write(after):
        cfg = config.overlay(config.defaults(), {
            "agent": {"window_s": 0.2}, "publisher": {"endpoint": f"ipc://{tmp_path}/stream.sock"},
            "prometheus": {"enabled": False},
            "probes": {"enabled": ["cupti"], "cupti": {"socket": str(tmp_path / "c.sock"), "reclaim_after_s": after}}})
        (tmp_path / "a.toml").write_text(config.to_toml(cfg))
        settled = time.time() - 10       # written a while ago: reloaded at once (daemon.RELOAD_SETTLE_S)
        os.utime(tmp_path / "a.toml", (settled, settled))
        return cfg

    agent = Agent(write(0.0), config_path=str(tmp_path / "a.toml"), notifier=Notifier({}))
    agent.start()
    try:
        (before,) = [r.probe for r in agent.running]
        assert agent.takeovers.reclaim_after_s == 0.0
        write(120.0)
        agent.reload()
        assert agent.reloads == 1 and agent.takeovers.reclaim_after_s == 120.0
        assert [r.probe for r in agent.running] == [before]      # served processes stay connected
    finally:
        agent.shutdown()


def test_the_health_part_stays_small_however_many_processes_are_taken_over():
    from ridgeline.agent.cupti_takeover import REPORT_MAX, STATUS_MAX_CHARS
    w = TakeoverWatch(0.0)
    w.status_lines({p: "takeover: " + "x" * 100_000 for p in range(1, 1001)})
    for p in range(1, 1001):
        w.observe(set(range(1, p + 1)), float(p))
    rep = w.report(2000.0)
    assert w.count() == 1000 and len(rep) == REPORT_MAX
    assert [r["pid"] for r in rep] == list(range(1, REPORT_MAX + 1))          # the longest taken over first
    assert all(len(r["status"]) == STATUS_MAX_CHARS for r in rep)
