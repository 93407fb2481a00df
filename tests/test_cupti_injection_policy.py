"""Issue 17 item 8: which descendants the injection collects, and a clear refusal when another
tool owns injection.

The library's policy (``policy_skips`` in probes/native/ridgeline_cupti.c) is run for real: a
Python process started the way PyTorch starts its helpers, which calls InitializeInjection as
the driver would. How PyTorch starts them (pytorch/pytorch):
- torch/_inductor/compile_worker/subproc_pool.py at 60dc4de2, SubprocPool.__init__:
  ``entry = os.path.join(os.path.dirname(__file__), "__main__.py")``, ``cmd = [sys.executable,
  entry, f"--pickler=...", ...]``; its pool forks from that process (SubprocKind.FORK), so the
  workers keep those arguments;
- torch/_inductor/autotune_process.py: ``entry = os.path.join(os.path.dirname(__file__),
  "__autotune_main__.py")``, ``cmd = [sys.executable, entry, ...]`` (the file is upstream at
  123527f6).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ridgeline.probes.cupti import injection_policy as policy

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "probes" / "native"
LIB = NATIVE / "libridgeline_cupti.so"
STUB = NATIVE / "build" / "libcupti_stub.so"
APP = NATIVE / "build" / "ridgeline_inject_app"
FOREIGN = NATIVE / "build" / "libforeign_tool.so"


@pytest.fixture(scope="module", autouse=True)
def built():
    subprocess.run(["make", "-s", "-C", str(NATIVE)], check=True, timeout=180)


def _clean_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_INJECTION64_PATH", "NVTX_INJECTION64_PATH", "LD_PRELOAD", "RIDGELINE_INJECT_SKIP",
                        "RIDGELINE_QUIET", "RIDGELINE_DISABLE")}
    env.update(extra)
    return env


def test_the_library_and_this_module_hold_the_same_skip_list():
    src = (NATIVE / "ridgeline_cupti.c").read_text()
    macro = re.search(r"#define RL_DEFAULT_SKIP\s*\\\n((?:\s*\".*\"\s*\\?\n)+)", src).group(1)
    joined = "".join(re.findall(r'"([^"]*)"', macro))
    assert tuple(e for e in joined.split(";") if e) == policy.DEFAULT_SKIP
    assert int(re.search(r"#define RL_SKIP_ARGS (\d+)", src).group(1)) == policy.SKIP_ARGS


PROBE = """
import ctypes, json, sys
lib = ctypes.CDLL({lib!r})
r = lib.InitializeInjection()
stub = ctypes.CDLL({stub!r})
buf = ctypes.create_string_buffer(1 << 16)
stub.stub_log.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
stub.stub_log(buf, 1 << 16)
print(json.dumps({{"init": r, "cupti_calls": buf.value.decode()}}))
"""


def _run_as(script_path: Path, tmp_path, args=(), **env):
    script_path.parent.mkdir(parents=True, exist_ok=True)
    script_path.write_text(PROBE.format(lib=str(LIB), stub=str(STUB)))
    e = _clean_env(RIDGELINE_LIBCUPTI=str(STUB), RIDGELINE_SOCKET=str(tmp_path / "none.sock"), **env)
    r = subprocess.run([sys.executable, str(script_path), *args], capture_output=True, text=True, env=e,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


@pytest.mark.parametrize("rel", ["torch/_inductor/compile_worker/__main__.py",
                                 "torch/_inductor/__autotune_main__.py"])
def test_inductor_helpers_are_left_alone(tmp_path, rel):
    out, err = _run_as(tmp_path / "site-packages" / rel, tmp_path, ["--pickler=x", "--kind=fork"])
    assert out["init"] == 1                          # the application always goes on
    assert out["cupti_calls"] == ""                  # CUPTI untouched: no subscriber, no kinds
    assert f'matches "{rel}" of the injection policy' in err
    assert policy.skipped_by([sys.executable, str(tmp_path / rel), "--pickler=x"], policy.DEFAULT_SKIP) == rel


def test_engine_workers_are_collected(tmp_path):
    # vLLM's and SGLang's workers are multiprocessing children of the engine: argv is the
    # interpreter's spawn entry, matching nothing.
    out, err = _run_as(tmp_path / "vllm" / "v1" / "executor" / "worker.py", tmp_path,
                       ["-c", "from multiprocessing.spawn import spawn_main"])
    assert "not collected" not in err
    assert "register" in out["cupti_calls"] or "subscribe" in out["cupti_calls"], out["cupti_calls"]


def test_an_empty_skip_list_collects_every_process(tmp_path):
    out, err = _run_as(tmp_path / "torch/_inductor/compile_worker/__main__.py", tmp_path,
                       RIDGELINE_INJECT_SKIP="")
    assert "not collected" not in err and out["cupti_calls"]
    assert policy.skip_list({"RIDGELINE_INJECT_SKIP": ""}) == ()
    assert policy.skip_list({"RIDGELINE_INJECT_SKIP": "a;;b"}) == ("a", "b")


def _ridgeline_run(*args, **env):
    return subprocess.run([sys.executable, "-m", "ridgeline", "run", *args], capture_output=True, text=True,
                          env=_clean_env(**env), cwd=ROOT, timeout=60)


@pytest.mark.parametrize("tool", sorted(policy.OWNING_TOOLS))
def test_run_refuses_a_tool_that_owns_injection(tool):
    r = _ridgeline_run("--", tool, "profile", "python", "serve.py")
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and policy.OWNING_TOOLS[tool] in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("var", ["CUDA_INJECTION64_PATH", "NVTX_INJECTION64_PATH"])
def test_run_refuses_when_another_library_holds_an_injection_slot(var, tmp_path):
    other = tmp_path / "libother_tool.so"
    other.write_bytes(b"\x7fELF")
    r = _ridgeline_run("--", sys.executable, "-c", "print(1)", **{var: str(other)})
    assert r.returncode == 2 and f"{var} is already set to {other}" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_run_inside_run_is_not_a_conflict():
    r = _ridgeline_run("--", sys.executable, "-c", "print('ok')", CUDA_INJECTION64_PATH=str(LIB),
                       NVTX_INJECTION64_PATH=str(LIB))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_preloaded_library_passes_another_owners_cupti_calls_through():
    """A child that another tool injects (CUDA_INJECTION64_PATH names its library) still
    inherits ridgeline run's LD_PRELOAD. The tool's libcupti is outside the global scope
    (the driver dlopens injection libraries RTLD_LOCAL, as the test app does): before the fix
    every CUPTI call of that tool returned CUPTI_ERROR_NOT_INITIALIZED (15) through our entry
    points."""
    r = subprocess.run([str(APP), "10"], capture_output=True, text=True, timeout=60,
                       env=_clean_env(LD_PRELOAD=str(LIB), CUDA_INJECTION64_PATH=str(FOREIGN)))
    assert r.returncode == 0
    assert "tool: register=0 enable=0 flush=0" in r.stdout, (r.stdout, r.stderr)
    assert r.stderr.count("another tool owns CUDA injection") == 1
    assert f"CUDA_INJECTION64_PATH={FOREIGN}" in r.stderr


def test_library_says_when_nvtx_goes_to_another_tool(tmp_path):
    r = subprocess.run([str(APP), "10"], capture_output=True, text=True, timeout=60,
                       env=_clean_env(CUDA_INJECTION64_PATH=str(LIB), NVTX_INJECTION64_PATH="/opt/other/libnvtx_tool.so",
                                      RIDGELINE_LIBCUPTI=str(STUB), RIDGELINE_SOCKET=str(tmp_path / "none.sock")))
    assert r.returncode == 0 and "injection=1" in r.stdout
    assert "NVTX_INJECTION64_PATH=/opt/other/libnvtx_tool.so names another tool" in r.stderr
