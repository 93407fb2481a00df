"""Issue 18.9: SIGHUP storms while the config file is rewritten.

The file is rewritten (truncate, then write, as ``open(..., "w")`` does; half of the
writes stop part-way) and the agent sent SIGHUP every 10 ms for 10 s. Before, reloads
parsed truncated files -- valid TOML, so the defaults, which enable every probe -- and
started the engine and eBPF probes (with bcc present, its compiler took RSS from 47 to
240 MiB). Now a reload waits until the file has settled: during the storm no other
probe starts and RSS stays put; after it, the last file is applied once.
"""
from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
import urllib.request

from support.net import free_port

STORM_S = 10.0


def _rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _config(tmp, port: int) -> str:
    return (f'[agent]\nwindow_s = 1.0\n[publisher]\nendpoint = "ipc://{tmp}/s.sock"\n'
            f'[prometheus]\nlisten = "127.0.0.1:{port}"\n'
            f'[probes]\nenabled = ["cupti"]\n[probes.cupti]\nsocket = "{tmp}/cupti.sock"\n')


def _metrics_up(port: int) -> bool:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).status == 200
    except OSError:
        return False


def test_sighup_storm_while_the_file_is_rewritten(tmp_path):
    ports = [free_port(), free_port()]
    conf = tmp_path / "agent.toml"
    conf.write_text(_config(tmp_path, ports[0]))
    log = tmp_path / "agent.log"
    p = subprocess.Popen([sys.executable, "-m", "ridgeline", "agent", "--config", str(conf)],
                         stderr=open(log, "w"), cwd=str(tmp_path))
    try:
        end = time.monotonic() + 60
        while not _metrics_up(ports[0]):
            assert p.poll() is None and time.monotonic() < end, log.read_text()[-2000:]
            time.sleep(0.2)
        rss0, peak, rng, i = _rss_mib(p.pid), 0.0, random.Random(18), 0
        t_end = time.monotonic() + STORM_S
        while time.monotonic() < t_end:
            i += 1
            text = _config(tmp_path, ports[i % 2])
            with open(conf, "w") as f:
                f.write(text if i % 2 == 0 else text[:rng.randrange(len(text))])
            p.send_signal(signal.SIGHUP)
            time.sleep(0.01)
            peak = max(peak, _rss_mib(p.pid))
        conf.write_text(_config(tmp_path, ports[1]))     # the last word
        p.send_signal(signal.SIGHUP)
        end = time.monotonic() + 30
        while not _metrics_up(ports[1]):
            assert p.poll() is None and time.monotonic() < end, log.read_text()[-2000:]
            time.sleep(0.2)
        text = log.read_text()
        started = [ln for ln in text.splitlines() if "probe " in ln and ("started" in ln or "unavailable" in ln)]
        assert all("probe cupti" in ln for ln in started), started
        assert peak - rss0 < 30, (rss0, peak)
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
