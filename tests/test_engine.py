"""Engine probe: real HTTP scrapes over loopback, back-off, /proc port discovery."""
import os
import signal
import socket
import time

import pytest
from support.engine_samples import V011, V026, MetricsServer, advance, free_port, sample_text

from ridgeline.aggregator import engine_metrics as em
from ridgeline.probes import engine
from ridgeline.probes.errors import InputError


@pytest.mark.parametrize("name,engine_name,kv", [(V011, "vllm", 0.0), (V026, "vllm", 0.38849487785658)])
def test_scrape_real_samples_over_loopback(name, engine_name, kv):
    text = sample_text(name)
    with MetricsServer(text) as srv:
        res = engine.scrape(srv.url, timeout_s=5)
    assert res["endpoint"] == srv.url and res["exposition"].bad_lines == 0
    s = em.snapshot(res["exposition"], res["ts_ns"], srv.url)
    assert s["engine"] == engine_name and s["gauges"]["kv_usage_ratio"] == pytest.approx(kv)
    assert engine.is_engine_exposition(res["exposition"])


def test_fetch_errors_are_one_line_input_errors():
    with pytest.raises(InputError, match="cannot reach"):
        engine.fetch(f"http://127.0.0.1:{free_port()}/metrics", timeout_s=2)
    with MetricsServer("nope", status=503) as srv:
        with pytest.raises(InputError, match="HTTP 503"):
            engine.fetch(srv.url)
    with pytest.raises(InputError):
        engine.fetch("ftp://127.0.0.1/metrics")


def test_timeout_is_enforced():
    # A listening socket that never answers: the request must give up at the timeout.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        t0 = time.monotonic()
        with pytest.raises(InputError, match="no answer within 0.3 s"):
            engine.fetch(f"http://127.0.0.1:{s.getsockname()[1]}/metrics", timeout_s=0.3)
        assert time.monotonic() - t0 < 3
    finally:
        s.close()


def test_backoff_delay_doubles_and_caps():
    assert [engine.backoff_delay_s(n, 5, 60) for n in range(6)] == [5, 5, 10, 20, 40, 60]


def test_probe_backoff_on_failing_endpoint():
    url = f"http://127.0.0.1:{free_port()}/metrics"
    p = engine.EngineProbe(urls=[url], interval_s=1.0, timeout_s=1.0, backoff_max_s=8, discover=False)
    p._client = None
    p.scrape_due(100.0)
    ep = p._endpoints[url]
    assert ep.failures == 1 and ep.next_s == 101.0
    p.scrape_due(100.5)          # backing off: not retried
    assert ep.failures == 1
    p.scrape_due(101.0)
    assert ep.failures == 2 and ep.next_s == 103.0
    out = p.poll()
    assert out["scrapes"] == [] and len(out["errors"]) == 2 and "cannot reach" in out["errors"][0]["error"]
    assert p.counters()["errors"] == 2 and p.counters()["endpoints_failing"] == 1


def test_probe_thread_scrapes_sequence_and_recovers():
    base = sample_text(V011)
    with MetricsServer(base) as srv:
        p = engine.EngineProbe(urls=[srv.url], interval_s=0.1, timeout_s=2, discover=False)
        assert p.check().ok
        p.start()
        try:
            deadline = time.monotonic() + 10
            got = []
            while time.monotonic() < deadline and len(got) < 2:
                out = p.poll()
                if out:
                    got += out["scrapes"]
                time.sleep(0.05)
            srv.text = advance(base, counters={"vllm:num_preemptions_total": 3})
            later = []
            while time.monotonic() < deadline and not later:
                out = p.poll()
                later += [r for r in (out or {}).get("scrapes", [])
                          if em.snapshot(r["exposition"], r["ts_ns"])["counters"]["preemptions"] == 3]
                time.sleep(0.05)
        finally:
            p.stop()
            p.stop()   # idempotent
    assert len(got) >= 2 and later
    snaps = [em.snapshot(r["exposition"], r["ts_ns"]) for r in got + later]
    f = em.window_figures(snaps[1:], snaps[0])
    assert f["preemptions"] == 3 and not f["restarted"]
    assert p.counters()["records"] >= 3 and p.counters()["drops"] == 0


def test_parse_proc_net_tcp_literal():
    text = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 00000000:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0 100 0 0 10 0\n"
        "   1: 0100007F:AE2C 0100007F:1F40 01 00000000:00000000 00:00000000 00000000     0        0 4343 1 0 20 4 30 10 -1\n"
        "   2: 0100007F:0BB8 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4444 1 0 100 0 0 10 0\n")
    rows = engine.parse_proc_net_tcp(text)
    assert rows[0] == ("0.0.0.0", 8000, "0A", 4242)
    assert rows[1] == ("127.0.0.1", 44588, "01", 4343)
    # Only listening sockets the process owns; 0.0.0.0 is reached through loopback.
    assert engine.listening_endpoints(rows, {4242, 4343}) == [("127.0.0.1", 8000)]
    v6 = ("  sl  local_address                         remote_address                        st ...\n"
          "   0: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A "
          "00000000:00000000 00:00000000 00000000     0        0 5555 1 0\n")
    rows6 = engine.parse_proc_net_tcp(v6)
    assert rows6 == [("::", 8080, "0A", 5555)]
    assert engine.listening_endpoints(rows6, {5555}) == [("127.0.0.1", 8080)]


def test_discovery_finds_our_own_metrics_port():
    base = sample_text(V011)
    with MetricsServer(base) as srv, MetricsServer("process_cpu_seconds_total 1\n") as other:
        ports = engine.listening_ports(os.getpid())
        assert ("127.0.0.1", srv.port) in ports and ("127.0.0.1", other.port) in ports
        # pytest's command line names no port: only with discover_any_port are they probed.
        cautious = engine.EngineProbe(pids=[os.getpid()], interval_s=1, timeout_s=2)
        cautious._client = None
        assert cautious.discover_once() == [] and srv.requests == 0
        p = engine.EngineProbe(pids=[os.getpid()], interval_s=1, timeout_s=2, discover_any_port=True)
        p._client = None
        found = p.discover_once()
        assert srv.url in found and other.url not in found     # only engine endpoints kept
        assert p.endpoints() == [srv.url]
        assert p.discover_once() == []                          # nothing new the second time
        out = p.poll()
        assert out["scrapes"][0]["endpoint"] == srv.url


def test_cmdline_ports():
    argv = ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "x", "--port", "8001"]
    assert engine.cmdline_ports(argv) == {8001}
    assert engine.cmdline_ports(["sglang.launch_server", "--port=30010", "--host", "0.0.0.0"]) == {30010}
    assert engine.cmdline_ports(["vllm", "serve", "m", "--port"]) == set()


SERVE_CHILD = """
import http.server, sys
body = open(sys.argv[1], 'rb').read()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header('Content-Length', str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
srv = http.server.HTTPServer(('127.0.0.1', int(sys.argv[3])), H)
print('ready', flush=True)
srv.serve_forever()
"""


def test_discovery_probes_the_port_named_on_the_command_line():
    """A served process started as `... --port N` (here a small HTTP server serving the real
    0.11 scrape) is found from its pid alone, with the cautious default."""
    import subprocess
    import sys

    from support.engine_samples import sample_path
    port = free_port()
    child = subprocess.Popen([sys.executable, "-c", SERVE_CHILD, str(sample_path(V011)), "--port", str(port)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        p = engine.EngineProbe(pids=[child.pid], interval_s=1, timeout_s=2)
        p._client = None
        url = f"http://127.0.0.1:{port}/metrics"
        assert engine.listening_ports(child.pid) == [("127.0.0.1", port)]
        assert p.discover_once() == [url]
        res = p.poll()["scrapes"][0]
        assert res["pid"] == child.pid            # the served process it was found from
        snap = em.snapshot(res["exposition"], 0)
        assert snap["engine"] == "vllm" and snap["gauges"]["kv_pool_tokens"] == 39232
    finally:
        child.kill()
        child.wait()


def test_check_without_endpoints():
    assert not engine.EngineProbe(discover=False).check().ok
    av = engine.EngineProbe().check()
    assert av.ok and "discover" in av.reason


def test_loopback_port_and_owner_literal():
    assert engine.loopback_port("http://127.0.0.1:8000/metrics") == 8000
    assert engine.loopback_port("http://localhost:30000/metrics") == 30000
    assert engine.loopback_port("http://[::1]:8080/metrics") == 8080
    assert engine.loopback_port("http://127.3.0.1/metrics") == 80
    assert engine.loopback_port("http://10.0.0.5:8000/metrics") is None      # another host: not ours to resolve
    assert engine.loopback_port("http://gpu-host-3:8000/metrics") is None
    assert engine.loopback_port("ftp://127.0.0.1:21/") is None
    assert engine.loopback_port("http://127.0.0.1:notaport/metrics") is None
    # vLLM: the API server (ancestor) listens, the engine core (target) holds the GPU.
    chains = [(11, [[("127.0.0.1", 9000)], [("127.0.0.1", 22)]]),
              (12, [[], [("127.0.0.1", 8000)]]),
              (13, [[("127.0.0.1", 8000)]])]
    assert engine.owner_pid(8000, chains) == 12
    assert engine.owner_pid(9000, chains) == 11
    assert engine.owner_pid(7000, chains) is None
    rows = [("0.0.0.0", 8000, "0A", 1), ("127.0.0.1", 8000, "01", 2), ("10.1.2.3", 8000, "0A", 3),
            ("::", 8000, "0A", 4), ("127.0.0.1", 8001, "0A", 5)]
    assert engine.loopback_listener_inodes(rows, 8000) == {1, 4}


SERVE_PARENT = """
import http.server, subprocess, sys
body = open(sys.argv[1], 'rb').read()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header('Content-Length', str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
srv = http.server.HTTPServer(('127.0.0.1', int(sys.argv[2])), H)
core = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])
print('ready', core.pid, flush=True)
try:
    srv.serve_forever()
finally:
    core.kill()
"""


def test_configured_loopback_url_is_given_its_served_process():
    """An endpoint configured by URL carries the pid of the process behind it, so engine
    and phase series join by pid: the target whose ancestor listens (vLLM's engine core
    under its API server), else the listening process itself; again after a restart."""
    import subprocess
    import sys

    from support.engine_samples import sample_path
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"

    def start():
        child = subprocess.Popen([sys.executable, "-c", SERVE_PARENT, str(sample_path(V011)), str(port)],
                                 stdout=subprocess.PIPE, text=True, start_new_session=True)
        procs.append(child)
        word, core = child.stdout.readline().split()
        assert word == "ready"
        return child, int(core)

    procs = []
    try:
        server, core = start()
        # No target processes: the process holding the listening socket.
        p = engine.EngineProbe(urls=[url], discover=False, interval_s=1, timeout_s=5)
        p.scrape_due(0.0)
        assert p.poll()["scrapes"][0]["pid"] == server.pid
        # The agent watches the engine core (the GPU process): that pid, not the listener's.
        p = engine.EngineProbe(urls=[url], pids=[os.getpid(), core], discover=False, interval_s=1, timeout_s=5)
        p.scrape_due(0.0)
        assert p.poll()["scrapes"][0]["pid"] == core
        # Not a loopback URL: nothing guessed.
        q = engine.EngineProbe(urls=["http://192.0.2.1:8000/metrics"], discover=False)
        assert q.resolve_pid("http://192.0.2.1:8000/metrics") is None
        # The server restarts on the same port: the new process is found.
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        server, core2 = start()
        p.set_pids([core2])
        p.scrape_due(10.0)
        assert p.poll()["scrapes"][0]["pid"] == core2
    finally:
        for c in procs:      # the server and its engine-core child: one process group each
            try:
                os.killpg(c.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            c.wait()
