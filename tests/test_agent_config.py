"""agent.config: embedded defaults, overlay checks, one-line errors with exit 2."""
import re
import subprocess
import sys
import tomllib
from importlib import resources

import msgspec
import pytest

from ridgeline.agent import config
from ridgeline.probes.errors import InputError


def _leaves(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _fields(t, prefix=""):
    """(dotted key, msgspec type info) of every key of the typed configuration."""
    for f in t.fields:
        if isinstance(f.type, msgspec.inspect.StructType):
            yield from _fields(f.type, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f.type


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
    assert cfg.publisher.endpoint == "ipc:///run/ridgeline/stream.sock"
    assert cfg.prometheus.listen == "127.0.0.1:9464"
    assert tomllib.loads(config.to_toml(cfg)) == config.as_table(cfg)
    assert msgspec.convert(tomllib.loads(config.to_toml(cfg)), config.Config) == cfg


def test_overlay_accepts_int_for_float_and_keeps_other_defaults(tmp_path):
    p = tmp_path / "a.toml"
    p.write_text('[agent]\nwindow_s = 2\n[probes.replay]\nspeed = 3\n')
    cfg = config.load(p)
    assert cfg.agent.window_s == 2.0 and isinstance(cfg.agent.window_s, float)
    assert cfg.probes.replay.speed == 3.0
    assert cfg.publisher.sndhwm == 1000


@pytest.mark.parametrize("text, needle", [
    ('[agent]\nwindow_sec = 1\n', "unknown key 'agent.window_sec'"),
    ('[publisher]\nsndhwm = "lots"\n', "'publisher.sndhwm' must be int, got str"),
    ('[agent]\nwindow_s = -1\n', "'agent.window_s' must be between 0.05 and 3600, got -1.0"),
    ('[publisher]\nendpoint = "udp://x"\n', "must start with tcp:// or ipc://"),
    ('[prometheus]\nlisten = "9464"\n', "must be HOST:PORT"),
    # issue 14.5: every value range-checked, one line naming the key
    ('[agent]\nwindow_s = nan\n', "'agent.window_s' must be a finite number, got nan"),
    ('[agent]\nwindow_s = inf\n', "'agent.window_s' must be a finite number, got inf"),
    ('[agent]\nwindow_s = -inf\n', "'agent.window_s' must be a finite number"),
    ('[agent]\nrun_for_s = 1e400\n', "'agent.run_for_s' must be a finite number"),
    ('[publisher]\nsndhwm = 99999999999999999999\n', "'publisher.sndhwm' must be between 1 and 1e+06"),
    ('[publisher]\nsndhwm = 0\n', "'publisher.sndhwm' must be between"),
    ('[publisher]\nendpoint = "tcp://127.0.0.1:99999"\n', "'publisher.endpoint' must be tcp://HOST:PORT with a port in 1..65535"),
    ('[publisher]\nendpoint = "tcp://127.0.0.1:0"\n', "port in 1..65535"),
    ('[publisher]\nendpoint = "ipc://relative.sock"\n', "'publisher.endpoint' must be an absolute path"),
    ('[publisher]\nendpoint = "ipc:///etc/ridgeline-test/x.sock"\n', "folder /etc/ridgeline-test does not exist"),
    ('[publisher]\nipc_group = "no-such-group-xyz"\n', "'publisher.ipc_group' names no group"),
    ('[prometheus]\nlisten = "127.0.0.1:99999"\n', "'prometheus.listen' must be HOST:PORT with a port in 1..65535"),
    ('[prometheus]\nlisten = "0.0.0.0:9464"\n', "'prometheus.listen' 0.0.0.0:9464 is not a loopback address"),
    ('[prometheus]\nlisten = "[::]:9464"\n', "is not a loopback address"),
    ('[prometheus]\nmax_connections = 100000\n', "'prometheus.max_connections' must be between 1 and 1024"),
    ('[probes.engine]\ninterval_s = 0\n', "'probes.engine.interval_s' must be between 0.25 and 3600"),
    ('[probes.engine]\ninterval_s = -1\n', "'probes.engine.interval_s' must be between"),
    ('[probes.engine]\ninterval_s = 0.05\n', "'probes.engine.interval_s' must be between"),
    ('[probes.engine]\nmax_body_bytes = 10\n', "'probes.engine.max_body_bytes' must be between"),
    ('[probes.engine]\nurl = "file:///etc/passwd"\n', "'probes.engine.url' must be an http:// or https:// URL"),
    ('[probes]\npids = ["abc", -1]\n', "'probes.pids' must hold process ids"),
    ('[probes]\npids = [-1]\n', "'probes.pids' must hold process ids"),
    ('[probes]\npids = [99999999]\n', "'probes.pids' must hold process ids"),
    ('[probes]\nenabled = ["engine", "nosuch"]\n', "'probes.enabled' names an unknown probe 'nosuch'"),
    ('[probes.cupti]\nsocket = "/etc/ridgeline-test/cupti.sock"\n', "'probes.cupti.socket' folder /etc/ridgeline-test does not exist"),
    ('[probes.cupti]\nsocket = "cupti.sock"\n', "'probes.cupti.socket' must be an absolute path"),
    ('[probes.cupti]\nsocket = "/run/a/../../etc/x/c.sock"\n', "without '.' or '..' parts"),
    ('[probes.cupti]\nsocket_group = "no-such-group-xyz"\n', "'probes.cupti.socket_group' names no group"),
    ('[probes.cupti]\nreclaim_after_s = -1\n', "'probes.cupti.reclaim_after_s' must be between 0 and 86400"),
    ('[probes.cupti]\nreclaim_after_s = nan\n', "'probes.cupti.reclaim_after_s' must be a finite number"),
    ('[probes.cupti]\nidle_peer_s = 1\n', "'probes.cupti.idle_peer_s' must be between 5 and 86400"),
    ('[probes.replay]\nspeed = nan\n', "'probes.replay.speed' must be a finite number"),
    ('[probes.simulator]\nseed = 99999999999999999999\n', "'probes.simulator.seed' must be between"),
    ('agent = 3\n', "'agent' must be a table"),
    ('[agent]\nlog_level = "loud"\n', "'agent.log_level' must be debug, info, warning or error"),
    ('[bogus]\nx = 1\n', "unknown key 'bogus'"),
    ('[publisher]\npublish_events = 1\n', "'publisher.publish_events' must be bool, got int"),
    ('[publisher]\nsndhwm = 2.5\n', "'publisher.sndhwm' must be int, got float"),
    ('[probes]\nenabled = [1]\n', "'probes.enabled' must hold probe names, got 1"),
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


def test_every_numeric_key_has_a_range():
    """No number reaches a socket option or a timer unchecked (issue 14.5): every int or
    float key (and list element) of the typed configuration declares both bounds beside it
    (issue 19), and the defaults have a key for each field and no other."""
    numbers = (msgspec.inspect.IntType, msgspec.inspect.FloatType)
    fields = dict(_fields(msgspec.inspect.type_info(config.Config)))
    unbounded = []
    for key, t in fields.items():
        t = t.item_type if isinstance(t, msgspec.inspect.ListType) else t
        if isinstance(t, numbers) and (t.ge is None or t.le is None):
            unbounded.append(key)
    assert not unbounded
    assert sum(isinstance(getattr(t, "item_type", t), numbers) for t in fields.values()) >= 25
    text = resources.files("ridgeline.agent").joinpath("data/agent.toml").read_text()
    assert {k for k, _ in _leaves(tomllib.loads(text))} == set(fields)


def test_a_bound_declared_beside_a_field_is_what_a_file_meets(tmp_path):
    """The range a file is checked against is the one declared on the field (no second table)."""
    t = dict(_fields(msgspec.inspect.type_info(config.Config)))["probes.cupti.idle_peer_s"]
    p = tmp_path / "a.toml"
    p.write_text(f"[probes.cupti]\nidle_peer_s = {t.le}\n")
    assert config.load(p).probes.cupti.idle_peer_s == t.le
    p.write_text(f"[probes.cupti]\nidle_peer_s = {t.le + 1}\n")
    with pytest.raises(InputError, match=f"between {t.ge:g} and {t.le:g}"):
        config.load(p)


def test_overlay_returns_a_new_checked_record():
    base = config.defaults()
    new = config.overlay(base, {"agent": {"window_s": 2}})
    assert new.agent.window_s == 2.0 and base.agent.window_s == 1.0
    with pytest.raises(InputError, match="override: 'agent.window_s' must be between"):
        config.overlay(base, {"agent": {"window_s": 0}})


def test_a_bad_socket_path_creates_nothing(tmp_path):
    """probes.cupti.socket / an ipc endpoint may not make the agent create folders (issue 14.5)."""
    target = tmp_path / "not" / "here"
    p = tmp_path / "a.toml"
    p.write_text(f'[probes.cupti]\nsocket = "{target}/c.sock"\n')
    with pytest.raises(InputError, match="does not exist"):
        config.load(p)
    assert not (tmp_path / "not").exists()
    # An existing folder is fine, and so is a missing one directly under /run.
    p.write_text(f'[probes.cupti]\nsocket = "{tmp_path}/c.sock"\n[publisher]\nendpoint = "ipc:///run/rl-x/s.sock"\n')
    assert config.load(p).probes.cupti.socket == f"{tmp_path}/c.sock"


def test_remote_metrics_need_an_explicit_opt_in(tmp_path):
    p = tmp_path / "a.toml"
    p.write_text('[prometheus]\nlisten = "0.0.0.0:9464"\nallow_remote = true\n')
    assert config.load(p).prometheus.listen == "0.0.0.0:9464"


@pytest.mark.parametrize("args, needle", [
    (["--prometheus-listen", "0.0.0.0:9464"], "is not a loopback address"),
    (["--prometheus-listen", "127.0.0.1:99999"], "port in 1..65535"),
    (["--endpoint", "tcp://127.0.0.1:70000"], "port in 1..65535"),
    (["--probes", "engine,bogus"], "unknown probe 'bogus'"),
])
def test_cli_range_errors_are_one_line_exit_2(args, needle):
    r = subprocess.run([sys.executable, "-m", "ridgeline", "agent", "--print-config", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ridgeline: error: command line: ") and needle in lines[0]
