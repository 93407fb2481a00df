"""agent.config: embedded defaults, overlay checks, one-line errors with exit 2."""
import re
import subprocess
import sys
import tomllib
from importlib import resources

import pytest

from ridgeline.agent import config
from ridgeline.probes.errors import InputError


def _leaves(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def test_every_default_key_is_documented_with_its_default():
    text = resources.files("ridgeline.agent").joinpath("data/agent.toml").read_text()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^([a-z_]+) = ", line)
        if not m:
            continue
        # The comment block right above the key must state "Default:".
        j = i - 1
        block = []
        while j >= 0 and lines[j].startswith("#"):
            block.append(lines[j])
            j -= 1
        assert any("Default:" in b for b in block), f"key {m.group(1)} (line {i + 1}) lacks a documented default"


def test_defaults_load_and_roundtrip_through_print_format():
    cfg = config.load("/nonexistent/ridgeline.toml", missing_ok=True)
    assert cfg["publisher"]["endpoint"] == "tcp://127.0.0.1:7411"
    assert cfg["prometheus"]["listen"] == "127.0.0.1:9464"
    assert tomllib.loads(config.to_toml(cfg)) == cfg


def test_overlay_accepts_int_for_float_and_keeps_other_defaults(tmp_path):
    p = tmp_path / "a.toml"
    p.write_text('[agent]\nwindow_s = 2\n[probes.replay]\nspeed = 3\n')
    cfg = config.load(p)
    assert cfg["agent"]["window_s"] == 2.0 and isinstance(cfg["agent"]["window_s"], float)
    assert cfg["probes"]["replay"]["speed"] == 3.0
    assert cfg["publisher"]["sndhwm"] == 1000


@pytest.mark.parametrize("text, needle", [
    ('[agent]\nwindow_sec = 1\n', "unknown key 'agent.window_sec'"),
    ('[publisher]\nsndhwm = "lots"\n', "'publisher.sndhwm' must be int, got str"),
    ('[agent]\nwindow_s = -1\n', "'agent.window_s' must be > 0"),
    ('[publisher]\nendpoint = "udp://x"\n', "must start with tcp:// or ipc://"),
    ('[prometheus]\nlisten = "9464"\n', "must be HOST:PORT"),
    ('agent = 3\n', "'agent' must be a table"),
    ('[agent\n', "invalid TOML"),
])
def test_bad_config_is_one_clear_line(tmp_path, text, needle):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(InputError) as e:
        config.load(p)
    assert needle in str(e.value) and str(p) in str(e.value)


def test_missing_explicit_config_is_an_error(tmp_path):
    with pytest.raises(InputError, match="config file not found"):
        config.load(tmp_path / "nope.toml")


def test_cli_config_error_exits_2_with_one_line(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text('[agent]\nbogus = 1\n')
    r = subprocess.run([sys.executable, "-m", "ridgeline", "agent", "--config", str(p)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"ridgeline: error: {p}: unknown key 'agent.bogus'"]


def test_cli_print_config_merges_file(tmp_path):
    p = tmp_path / "a.toml"
    p.write_text('[publisher]\nendpoint = "ipc:///tmp/x.sock"\n')
    r = subprocess.run([sys.executable, "-m", "ridgeline", "agent", "--config", str(p), "--print-config"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert tomllib.loads(r.stdout)["publisher"]["endpoint"] == "ipc:///tmp/x.sock"


def test_cli_refuses_clear_text_non_loopback_bind():
    r = subprocess.run([sys.executable, "-m", "ridgeline", "agent", "--endpoint", "tcp://0.0.0.0:7499",
                        "--probes", "", "--no-prometheus", "--run-for", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("ridgeline: error: refusing to publish on tcp://0.0.0.0:7499 in the clear")
    assert "Traceback" not in r.stderr
