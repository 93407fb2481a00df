"""The CLI's conventions (issue 11.5): one exit-code table for every command (0 done,
1 runtime failure, 2 bad input or usage), one error prefix, --version, and tail/top/record
reading a CURVE-protected stream with a key pair made by `ridgeline keys`."""
import shutil
import subprocess
import sys
import threading

import pytest
from support.net import free_port

from ridgeline.agent import cli

PREFIX = "ridgeline: error: "


def run(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "ridgeline", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_lists_commands(capsys):
    code = cli.main([])
    assert code == 2


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.startswith("ridgeline ")


def test_unknown_command_is_a_usage_error():
    r = run("no-such-command")
    assert r.returncode == 2
    assert r.stderr.strip().startswith(PREFIX) and "Traceback" not in r.stderr


def _cases(tmp):
    dead = f"ipc://{tmp}/nobody-here.sock"
    return [
        # (argv, exit code, text in the one error line)
        (["tail", "--topic", "nosuch"], 2, "tail: argument --topic: invalid choice: 'nosuch'"),
        (["tail", "--count", "-1"], 2, "--count must be >= 0"),
        (["tail", "--server-key", "x" * 40], 2, "--server-key and --client-key go together"),
        (["tail", "--endpoint", dead, "--timeout", "1"], 1, "tail: no record for 1 s"),
        (["top", "--duration", "-1"], 2, "--duration must be >= 0"),
        (["top", "--once", "--endpoint", dead, "--timeout", "1"], 1, "top: no window from"),
        (["record", "-o", f"{tmp}/r.rlrec", "--topic", "bogus"], 2, "record: argument --topic: invalid choice"),
        (["record", "-o", f"{tmp}/r.rlrec", "--endpoint", dead, "--timeout", "1"], 1, "record: no message for 1 s"),
        (["record", "-o", f"{tmp}/r.rlrec", "--client-key", f"{tmp}/none", "--server-key", f"{tmp}/none"], 2,
         "--server-key"),
        (["check", "--probe", "nosuch"], 2, "check: unknown probe 'nosuch'"),
        (["check", "--probe", "replay"], 1, "check: probe replay cannot run here"),
        (["check", "--config", f"{tmp}/missing.toml"], 2, "config file not found"),
        (["agent", "--print-config", "--prometheus-listen", "127.0.0.1:99999"], 2, "port in 1..65535"),
        (["scrape", "http://127.0.0.1:99999/metrics"], 2, "invalid URL"),
        (["scrape", f"http://127.0.0.1:{free_port()}/metrics", "--timeout", "2"], 1, "cannot reach"),
        (["keys", "-o", "/dev/null/keys"], 2, "cannot create the folder"),
        (["analyze", f"{tmp}/missing.json"], 2, "no such file"),
        (["sched", "--pid", "1", "--duration", "0"], 2, "--duration must be positive"),
        (["tail", "--bogus-flag"], 2, "tail: unrecognized arguments: --bogus-flag"),
    ]


@pytest.mark.parametrize("i", range(19))
def test_exit_codes_and_one_error_line_per_command(tmp_path, i):
    argv, code, needle = _cases(tmp_path)[i]
    r = run(*argv)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code, (argv, r.stderr)
    assert lines and lines[-1].startswith(PREFIX) and needle in lines[-1], (argv, r.stderr)
    assert "Traceback" not in r.stderr


def _engine_config(tmp_path, url):
    from ridgeline.agent import config
    cfg = config.overlay(config.defaults(), {"probes": {"engine": {"url": url}}})
    (tmp_path / "engine.toml").write_text(config.to_toml(cfg))
    return str(tmp_path / "engine.toml")


def test_ok_cases_exit_0(tmp_path):
    import json

    from support.engine_samples import V011, MetricsServer, sample_text
    with MetricsServer(sample_text(V011)) as srv:
        conf = _engine_config(tmp_path, srv.url)
        r = run("check", "--probe", "engine", "--config", conf, "--agent-timeout", "0")
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"answering ({srv.url})" in r.stdout
        r = run("check", "--probe", "engine", "--json", "--config", conf, "--agent-timeout", "0")
        out = json.loads(r.stdout)
        assert r.returncode == 0 and out["ok"] and out["probes"][0]["name"] == "engine"
        r = run("check", "--probe", "replay", "--probe", "engine", "--json", "--config", conf, "--agent-timeout", "0")
        out = json.loads(r.stdout)
        assert r.returncode == 1 and not out["ok"]
        assert [p["ok"] for p in out["probes"]] == [False, True]
    r = run("keys", "-o", str(tmp_path))
    assert r.returncode == 0
    assert (tmp_path / "client.key").exists() and (tmp_path / "client.key_secret").stat().st_mode & 0o077 == 0
    r = run("keys", "-o", str(tmp_path))          # never overwrites a key
    assert r.returncode == 2 and "exists" in r.stderr
    # A missing folder (and its parents) is made, private: it holds a secret key.
    r = run("keys", "-o", str(tmp_path / "new" / "keys"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "new" / "keys" / "client.key_secret").is_file()
    assert (tmp_path / "new" / "keys").stat().st_mode & 0o077 == 0


@pytest.fixture
def curve_agent(tmp_path):
    """A real agent publishing windows over CURVE on loopback tcp, its keys and an
    allowed client's made by `ridgeline keys`."""
    from ridgeline.agent import config
    from ridgeline.agent.daemon import Agent
    from ridgeline.agent.sdnotify import Notifier
    from ridgeline.aggregator import wire as codec
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    for name in ("server", "client", "stranger"):
        assert run("keys", "-o", str(keys), "--name", name).returncode == 0
    shutil.copy(keys / "client.key", allowed / "client.key")
    port = free_port()
    cfg = config.overlay(config.defaults(), {
        "agent": {"window_s": 0.2},
        "publisher": {"endpoint": f"tcp://127.0.0.1:{port}", "curve_secret_key_file": str(keys / "server.key_secret"),
                      "curve_allowed_clients_dir": str(allowed)},
        "prometheus": {"enabled": False}, "probes": {"enabled": []}})
    agent = Agent(cfg, probes=[], codec=codec, notifier=Notifier({}))
    agent.start()
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    try:
        yield f"tcp://127.0.0.1:{port}", keys
    finally:
        agent.request_stop()
        t.join(60)
        agent.shutdown()


def test_tail_top_record_read_a_curve_stream_with_client_keys(curve_agent, tmp_path):
    ep, keys = curve_agent
    auth = ["--endpoint", ep, "--server-key", str(keys / "server.key"), "--client-key", str(keys / "client.key_secret")]
    r = run("tail", *auth, "--topic", "window", "--count", "2", "--json", "--timeout", "20")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 2
    r = run("top", *auth, "--once", "--timeout", "20")
    assert r.returncode == 0, r.stderr
    r = run("record", *auth, "-o", str(tmp_path / "c.rlrec"), "--duration", "1.5", "--timeout", "20")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "c.rlrec").stat().st_size > 8
    # The server's Z85 public key works as well as its certificate file.
    import zmq.auth
    z85 = zmq.auth.load_certificate(str(keys / "server.key"))[0].decode()
    # (as KEY=VALUE: Z85's alphabet has '-', and a key starting with it would read as an option)
    r = run("tail", "--endpoint", ep, f"--server-key={z85}", "--client-key", str(keys / "client.key_secret"),
            "--count", "1", "--timeout", "20")
    assert r.returncode == 0, r.stderr


def test_a_client_key_the_agent_does_not_allow_is_refused_with_exit_1(curve_agent):
    ep, keys = curve_agent
    r = run("tail", "--endpoint", ep, "--server-key", str(keys / "server.key"),
            "--client-key", str(keys / "stranger.key_secret"), "--timeout", "20", timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith(PREFIX + "tail: the agent at ")
    assert "refused this client key" in r.stderr


def _commands():
    import argparse
    p = cli.build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


@pytest.mark.parametrize("command", _commands())
def test_every_command_answers_a_usage_error_with_exit_2_and_the_prefix(command):
    r = run(command, "--no-such-option-xyz")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (command, r.stderr)
    assert len(lines) == 1 and lines[0].startswith(PREFIX) and "Traceback" not in r.stderr


@pytest.mark.parametrize("command", _commands())
def test_every_command_has_help_exit_0(command):
    r = run(command, "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: ridgeline " + command)


def test_a_z85_server_key_that_looks_like_a_path_is_a_key():
    """Z85's alphabet has "/" and ".": a generated public key may start with either (one did
    in a CI run and was taken for a missing certificate file)."""
    from ridgeline.agent.subscriber import server_key
    key = "/P-ca?=yX/MagA:mrm7i3>R*@XH@P<UD@(I4jq9!"
    assert server_key(key) == key.encode()
    assert server_key("." + key[1:]) == ("." + key[1:]).encode()


@pytest.mark.parametrize("command", _commands())
def test_help_has_a_plain_text_description(command):
    """Every command's --help says what it does, in plain text: no reST markup (issue 24.7)."""
    r = run(command, "--help")
    assert r.returncode == 0, r.stderr
    head = r.stdout.split("\noptions:")[0]
    desc = head.split("\n\n", 1)[1] if "\n\n" in head else ""
    assert len(desc.split()) >= 8, r.stdout[:600]
    assert "``" not in r.stdout and ":mod:" not in r.stdout and ":func:" not in r.stdout, r.stdout[:600]


def test_check_says_an_engine_endpoint_does_not_answer(tmp_path):
    """Issue 24.3: not `engine ok` when nothing listens at the configured endpoint."""
    import json
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    conf = _engine_config(tmp_path, dead)
    r = run("check", "--probe", "engine", "--config", conf, "--agent-timeout", "0")
    assert r.returncode == 1, r.stdout + r.stderr
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("engine")]
    assert "unavailable" in line and f"{dead} not answering: cannot reach (Connection refused)" in line, line
    out = json.loads(run("check", "--probe", "engine", "--json", "--config", conf, "--agent-timeout", "0").stdout)
    assert out["probes"][0]["ok"] is False and dead in out["probes"][0]["reason"]
