"""``ridgeline run`` and ``ridgeline inject-unit``: the injection environment, inherited by children."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ridgeline.agent.commands.inject_unit import render, unit_name
from ridgeline.probes.errors import InputError

ROOT = Path(__file__).resolve().parent.parent
LIB = ROOT / "probes" / "native" / "libridgeline_cupti.so"


def ridgeline(*args, env=None):
    e = dict(os.environ, **(env or {}))
    e.pop("CUDA_INJECTION64_PATH", None)
    return subprocess.run([sys.executable, "-m", "ridgeline", *args], capture_output=True, text=True, env=e,
                          cwd=ROOT, timeout=60)


@pytest.fixture(scope="module", autouse=True)
def built():
    subprocess.run(["make", "-s", "-C", str(ROOT / "probes" / "native")], check=True, timeout=120)


def test_run_sets_injection_for_command_and_grandchildren(tmp_path):
    script = ("import os, subprocess, sys; print(os.environ['CUDA_INJECTION64_PATH']); "
              "sys.stdout.flush(); subprocess.run(['sh', '-c', 'echo $NVTX_INJECTION64_PATH $RIDGELINE_SOCKET'])")
    r = ridgeline("run", "--socket", str(tmp_path / "s.sock"), "--", sys.executable, "-c", script)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")
    assert lines[0] == str(LIB)
    assert lines[1] == f"{LIB} {tmp_path / 's.sock'}"


def test_run_passes_the_exit_status_and_options_after_the_command():
    r = ridgeline("run", sys.executable, "-c", "import sys; sys.exit(7)")
    assert r.returncode == 7


def test_run_errors_are_one_line():
    r = ridgeline("run")
    assert r.returncode == 2 and r.stderr.startswith("ridgeline: error: no command") and "Traceback" not in r.stderr
    r = ridgeline("run", "--", "no-such-command-ridgeline")
    assert r.returncode == 2 and "command not found" in r.stderr
    r = ridgeline("run", "--library", "/nonexistent.so", "--", "true")
    assert r.returncode == 2 and "not found" in r.stderr and "--library" in r.stderr


def test_run_without_the_built_library_is_a_runtime_failure(tmp_path):
    # README's exit codes: the command line was fine, what it needs is missing -> 1, not 2
    r = ridgeline("run", "--", "true", env={"RIDGELINE_CUPTI_LIB": str(tmp_path / "libridgeline_cupti.so")})
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("ridgeline: error: injection library not built") and "Traceback" not in r.stderr


def test_run_refuses_to_override_another_injection_tool():
    e = dict(os.environ, CUDA_INJECTION64_PATH="/opt/nsight/libToolsInjection64.so")
    r = subprocess.run([sys.executable, "-m", "ridgeline", "run", "--", "true"], capture_output=True, text=True,
                       env=e, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "another tool" in r.stderr


def test_inject_unit_writes_and_removes_a_dropin(tmp_path):
    r = ridgeline("inject-unit", "vllm", "--root", str(tmp_path), "--mode", "deep", "--libcupti", "none")
    assert r.returncode == 0, r.stderr
    p = tmp_path / "etc/systemd/system/vllm.service.d/ridgeline.conf"
    text = p.read_text()
    assert "[Service]" in text
    assert f'Environment="CUDA_INJECTION64_PATH={LIB}"' in text
    assert f'Environment="NVTX_INJECTION64_PATH={LIB}"' in text
    assert 'Environment="RIDGELINE_MODE=deep"' in text and "RIDGELINE_LIBCUPTI" not in text
    assert "daemon-reload" in r.stdout
    r = ridgeline("inject-unit", "--remove", "vllm.service", "--root", str(tmp_path))
    assert r.returncode == 0 and not p.exists() and not p.parent.exists()


def test_inject_unit_dry_run_writes_nothing(tmp_path):
    r = ridgeline("inject-unit", "sglang@0", "--root", str(tmp_path), "--dry-run")
    assert r.returncode == 0 and "sglang@0.service.d/ridgeline.conf" in r.stdout
    assert not any(tmp_path.iterdir())


def test_unit_names_and_quoting():
    assert unit_name("vllm") == "vllm.service" and unit_name("a.socket") == "a.socket"
    for bad in ("", "../etc", "a b", "x/y"):
        with pytest.raises(InputError):
            unit_name(bad)
    text = render("u.service", {"CUDA_INJECTION64_PATH": '/opt/my "lib"/x.so'})
    assert 'Environment="CUDA_INJECTION64_PATH=/opt/my \\"lib\\"/x.so"' in text


def test_socket_problem_names_what_keeps_a_service_user_out(tmp_path):
    """What `ridgeline run` warns about before exec: a 0750 root folder (systemd's old
    RuntimeDirectoryMode) keeps uid 65534 out; once searchable, a 0666 socket lets it in."""
    import socket as S

    from ridgeline.agent.commands.run import socket_problem
    d = tmp_path / "ridgeline"
    d.mkdir()
    path = str(d / "cupti.sock")
    assert "no agent is listening" in socket_problem(path, 65534, {65534}) or "not searchable" in \
        socket_problem(path, 65534, {65534})
    s = S.socket(S.AF_UNIX)
    s.bind(path)
    try:
        os.chmod(path, 0o666)
        tmp_path.chmod(0o755)
        d.chmod(0o750)
        assert "not searchable by uid 65534" in socket_problem(path, 65534, {65534})
        assert socket_problem(path, 0, {0}) is None
        d.chmod(0o751)
        chain = Path(path).parents
        if all(os.stat(p).st_mode & 0o001 for p in chain):
            assert socket_problem(path, 65534, {65534}) is None
        os.chmod(path, 0o660)
        if all(os.stat(p).st_mode & 0o001 for p in chain):
            assert "not writable by uid 65534" in socket_problem(path, 65534, {65534})
        assert socket_problem(path, os.stat(path).st_uid, {os.stat(path).st_gid}) is None
    finally:
        s.close()


def test_run_warns_and_still_runs_without_an_agent(tmp_path):
    r = ridgeline("run", "--socket", str(tmp_path / "none.sock"), "--", sys.executable, "-c", "print('ran')")
    assert r.returncode == 0 and r.stdout.strip() == "ran"
    assert "no agent is listening" in r.stderr and r.stderr.count("\n") == 1
