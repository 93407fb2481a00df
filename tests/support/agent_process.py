"""The agent as a process (`python -m ridgeline agent`) on a config written for a test,
replaying a shared trace (tests/test_agent_stream.py, tests/test_parquet_recording.py).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from support.net import free_port

TRACE = "nvidia-inference/tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz"   # ~27k kernels/s


def write_config(tmp_path, trace, *, speed=1.0, prom_port=None, sndhwm=1000, events=False, extra="",
                 probes=("replay",)):
    port = free_port()
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f"""
[agent]
window_s = 0.5
[publisher]
endpoint = "tcp://127.0.0.1:{port}"
sndhwm = {sndhwm}
publish_events = {"true" if events else "false"}
[prometheus]
enabled = {"true" if prom_port else "false"}
listen = "127.0.0.1:{prom_port or 9464}"
[probes]
enabled = {json.dumps(list(probes))}
[probes.replay]
path = "{trace}"
speed = {speed}
{extra}
""")
    return cfg, f"tcp://127.0.0.1:{port}"


def start_agent(cfg, env=None, log=None):
    return subprocess.Popen([sys.executable, "-m", "ridgeline", "agent", "--config", str(cfg)],
                            stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            env=dict(os.environ, **(env or {})))


def stop(p, sig=signal.SIGTERM):
    if p.poll() is None:
        p.send_signal(sig)
        try:
            return p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            pytest.fail("agent did not stop within 20 s of SIGTERM")
    return p.returncode
