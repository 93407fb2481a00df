"""The GPU check's plumbing, without a GPU: its wheel bundle, its judging, one archive.

No GPU is lent here, so scripts/gpu-check.sh cannot run for real; what can be checked is:
the script parses; the bundle it carries to an air-gapped host is built from the pinned
wheels, is under 64 MiB and holds no CUPTI library (the host's libcupti is never
replaced); every judging function passes and fails on literal numbers as its threshold
says; and a run on a host without torch installs the bundle into a private folder (the
interpreter's own packages untouched), fails every point with its reason and leaves
exactly one archive.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.long   # minutes: started first under xdist (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
BUNDLE = ROOT / "build" / "gpu-check-bundle"
LIMIT = 64 << 20


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod           # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


G = _load()


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def _wheels_pinned() -> list[tuple[str, str]]:
    """(requirement, import name) of every wheel the script bundles, read from the script."""
    text = SCRIPT.read_text()
    out = []
    for var in ("WHEELS", "PURE_WHEELS"):
        body = text.split(f'{var}="', 1)[1].split('"', 1)[0]
        out += [tuple(w.rsplit(":", 1)) for w in body.split()]
    return out


def _build_bundle(dest: Path, pythons: str, bindings: bool = False) -> Path:
    if not any(dest.glob("cupti_python-*.whl")):
        env = dict(os.environ, RIDGELINE_GPU_BUNDLE=str(dest), RIDGELINE_GPU_PYTHONS=pythons,
                   RIDGELINE_GPU_BINDINGS="1" if bindings else "0")
        r = subprocess.run(["bash", str(SCRIPT), "--bundle"], capture_output=True, text=True, timeout=900, cwd=ROOT,
                           env=env)
        if r.returncode != 0:
            tail = r.stdout.strip().splitlines()[-1:] + r.stderr.strip().splitlines()[-1:]
            if any(w in r.stderr for w in ("unreachable", "Temporary failure in name resolution",
                                           "Max retries exceeded")):
                pytest.skip(f"package registry unreachable: {tail}")
            raise AssertionError(f"bundle build failed: {tail}")
    return dest


@pytest.fixture(scope="module")
def bundle():
    """The bundle as shipped: the lent host's Python (3.12) only."""
    return _build_bundle(BUNDLE, "3.12")


@pytest.fixture(scope="module")
def bundle_here():
    """The same wheels for this machine's Python too, to play an air-gapped host here, with
    cuda-bindings (which the lent hosts have and this bare Python lacks)."""
    v = f"{sys.version_info.major}.{sys.version_info.minor}"
    return _build_bundle(ROOT / "build" / f"gpu-check-bundle-{v}", f"3.12 {v}", bindings=True)


def test_bundle_is_complete_pinned_and_under_64_mib(bundle):
    wheels = [p.name for p in bundle.glob("*.whl")]
    size = sum(p.stat().st_size for p in bundle.glob("*.whl"))
    assert size <= LIMIT, f"{size} bytes"
    pins = (ROOT / "pyproject.toml").read_text()
    for req, _ in _wheels_pinned():
        name, version = req.split("==")
        stem = f"{name.replace('-', '_')}-{version}-"
        assert any(w.startswith(stem) for w in wheels), req
        if name not in ("cuda-pathfinder", "pyelftools"):        # cupti-python's own dependencies
            assert f'"{req}"' in pins, req                        # the project's own pin
    for w in wheels:                                              # the host's Python only, or pure
        assert "cp312" in w or "abi3" in w or "py3-none-any" in w, w
    assert not any(w.startswith("cuda_bindings-") for w in wheels)   # the hosts have it
    assert not any(w.startswith("ridgeline-") for w in wheels)      # the tree's code runs, never a stale wheel
    assert not any(w.startswith(("nvidia_cuda_cupti", "nvidia-cuda-cupti")) for w in wheels)   # never ship a libcupti
    # what the check imports beyond the standard library, numpy and torch is all in it
    code = "\n".join(p.read_text() for p in (ROOT / "scripts").glob("gpu_*.py"))
    assert "import torch" in code and all(mod.split(".")[0] for _, mod in _wheels_pinned())


def _archives(out: Path) -> dict[str, Path]:
    got = {}
    for a in out.iterdir():
        kind = "preflight" if a.name.startswith("gpu-check-preflight-") else "check"
        assert a.name.endswith(".tar.gz") and kind not in got, sorted(out.iterdir())
        got[kind] = a
    return got


def test_preflight_dry_run_builds_without_make_and_sees_one_kernel(bundle, tmp_path):
    py = ROOT / ".venv" / "bin" / "python"
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(SCRIPT), "--preflight"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=dict(os.environ, PYTHON=str(py), OUT=str(out)))
    assert r.returncode == 0, r.stdout[-3000:]
    arch = _archives(out)
    assert list(arch) == ["preflight"]
    with tarfile.open(arch["preflight"]) as t:
        pre = json.load(t.extractfile("./preflight.json"))
        build_log = t.extractfile("./preflight/build.log").read().decode()
    assert pre["ready"] and pre["dry_run"]
    steps = pre["steps"]
    assert steps["build"]["status"] == "ok" and "make" not in build_log.split()
    assert steps["inject"]["status"] == "ok" and steps["inject"]["kernels"] >= 1 and steps["inject"]["hellos"]
    assert steps["pm"]["status"] == "n/a" and "dry run" in steps["pm"]["detail"]
    assert "DRY RUN" in r.stdout and "READY" in r.stdout
    print(f"preflight dry run: {steps['inject']['at_s']} s to the kernel record")


def test_preflight_on_a_bare_python_installs_only_what_it_lacks(bundle_here, tmp_path):
    """An air-gapped host's Python with numpy only (torch brings it): the preflight installs
    the missing packages from the bundle into a private folder and passes; the host's own
    packages stay first on the path and untouched."""
    host = tmp_path / "hostpy"
    subprocess.run([sys.executable, "-m", "venv", str(host)], check=True, timeout=120)
    hp = host / "bin" / "python"
    numpy_wheel = sorted((ROOT / ".venv").glob("lib/python3*/site-packages/numpy-*.dist-info"))
    r = subprocess.run([str(hp), "-m", "pip", "install", "-q", f"numpy=={np.__version__}"], capture_output=True,
                       text=True, timeout=300)
    if r.returncode != 0:
        pytest.skip(f"numpy for the bare Python not installable here: {r.stderr.strip().splitlines()[-1:]}")
    before = subprocess.run([str(hp), "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(SCRIPT), "--preflight"], capture_output=True, text=True, timeout=180, cwd=ROOT,
                       env=dict(os.environ, PYTHON=str(hp), OUT=str(out), RIDGELINE_GPU_BUNDLE=str(bundle_here)))
    assert r.returncode == 0, r.stdout[-3000:]
    assert "installed from the bundle (the host lacked them):" in r.stdout
    assert "numpy" not in r.stdout.split("installed from the bundle")[1].splitlines()[0]
    after = subprocess.run([str(hp), "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    assert before == after and numpy_wheel


def test_a_run_without_a_gpu_fails_every_point_with_its_reason_and_leaves_its_archives(bundle, tmp_path):
    py = ROOT / ".venv" / "bin" / "python"
    before = subprocess.run([str(py), "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=str(py), OUT=str(out))
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=400, cwd=ROOT, env=env)
    assert r.returncode != 0
    arch = _archives(out)
    assert sorted(arch) == ["check", "preflight"]     # the preflight's, written before the long points
    with tarfile.open(arch["check"]) as t:
        names = t.getnames()
        data = json.load(t.extractfile("./gpu_check.json"))
    assert "./gpu-check.log" in names and "./preflight.json" in names and not any("pydeps" in n for n in names)
    pts = data["points"]
    assert [p["key"] for p in pts] == list(G.POINTS)
    assert all(not p["passed"] and p["measured"].startswith("no data:") and p["threshold"] for p in pts)
    # each failed run says why (its exception), not the log's stdout separator
    steps = data["steps"]
    assert "No module named 'torch'" in steps["plain"]["reason"], steps["plain"]
    for key in G.POINTS:
        assert f"({key}) FAIL" in r.stdout
    assert "ridgeline from" in r.stdout and "pydeps" in r.stdout      # a private copy of this tree's code
    after = subprocess.run([str(py), "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    assert before == after                                             # the interpreter's packages untouched


def test_preflight_judges_build_and_inject_required():
    spec = importlib.util.spec_from_file_location("gpu_preflight", ROOT / "scripts" / "gpu_preflight.py")
    P = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(P)
    ok, lines = P.judge({"versions": {"status": "ok"}, "build": {"status": "ok"}, "inject": {"status": "ok"},
                         "pm": {"status": "n/a", "detail": "no counters"}})
    assert ok and lines[-1].endswith("may start") and "no counters" in lines[3]
    ok, lines = P.judge({"versions": {"status": "ok"}, "build": {"status": "ok"},
                         "inject": {"status": "failed", "detail": "no HELLO"}})
    assert not ok and "NOT READY" in lines[-1] and "not run" in lines[3]
    ok, _ = P.judge({"versions": {"status": "ok"}, "build": {"status": "failed"}})
    assert not ok


# ---------------------------------------------------------------------------------- judging

def test_a_and_b_kernels_against_torch_profiler():
    names = ["void gemm<1>()", "triton_poi_fused_0", "void flash::fwd()"] * 100
    dur = np.full(300, 10_000.0)
    a, b = G.judge_kernels_vs_profiler(names, dur, names, dur * 1.005)
    assert a.passed and b.passed
    a, b = G.judge_kernels_vs_profiler(names[:-1], dur[:-1], names, dur)          # one of 300 lost
    assert not a.passed and "kernels 299 vs 300" in a.measured                    # the count is exact
    a, b = G.judge_kernels_vs_profiler(names[:-4], dur[:-4], names, dur)
    assert not a.passed and not b.passed                                          # 296/300 named: 98.7%
    a, _ = G.judge_kernels_vs_profiler(names, dur * 1.03, names, dur)             # 3% longer each
    assert not a.passed and "ratio 1.030" in a.measured
    skew = dur.copy()
    skew[:150] *= 1.10                                                            # half 10% longer: median
    a, _ = G.judge_kernels_vs_profiler(names, skew, names, dur)                   # ratio ok, total 5% off
    assert not a.passed and a.detail["per_kernel_median_ratio"] == pytest.approx(1.05)
    _, b = G.judge_kernels_vs_profiler(["_ZN5flash3fwdEv"] * 300, dur, names, dur)  # mangled: names differ
    assert not b.passed and b.detail["first_differences"]
    a, b = G.judge_kernels_vs_profiler([], [], names, dur)
    assert not a.passed and "no data" in a.measured


def test_c_graphs():
    assert G.judge_graphs(7, [7] * 10, [7] * 10, 10, 0).passed
    assert not G.judge_graphs(7, [7] * 9 + [6], [7] * 9 + [6], 10, 0).passed          # one node lost
    assert not G.judge_graphs(7, [7] * 10, [7] * 9 + [0], 10, 0).passed               # ids missing
    assert not G.judge_graphs(7, [7] * 10, [7] * 10, 0, 70).passed                    # graph level not honoured
    assert not G.judge_graphs(7, [], [], 10, 0).passed


def test_d_triton_and_driver_launches():
    names = ["triton_poi_fused_add_mul_0"] * 5 + ["void at::native::x()"]
    corr = np.arange(6)
    assert G.judge_triton(names, corr, np.arange(6), np.full(6, 2)).passed
    assert not G.judge_triton(names, corr, np.arange(6), np.full(6, 1)).passed        # runtime, not driver
    assert not G.judge_triton(names, corr, np.arange(2), np.full(2, 2)).passed        # unjoined
    assert not G.judge_triton(["void at::native::x()"], [1], [1], [2]).passed


def test_e_processes():
    assert G.judge_processes({100: 500, 101: 20}, 100, 101).passed
    assert not G.judge_processes({100: 520}, 100, 101).passed                         # child folded into parent
    assert not G.judge_processes({100: 500, 101: 3}, 100, 101).passed
    assert not G.judge_processes({100: 500}, 100, None).passed


def test_f_phases_on_the_roofline():
    peak, bw = 800e12, 4.0e12                                        # ridge 200 FLOP/B
    prefill = {"flops": 400e12, "bytes": 0.5e12, "kernel_time_ns": 1e9, "median_kernel_ns": 200e3}   # AI 800
    decode = {"flops": 2e12, "bytes": 2.4e12, "kernel_time_ns": 1e9, "median_kernel_ns": 50e3}        # AI ~0.8
    p = G.judge_phases(prefill, decode, peak, bw)
    assert p.passed and "60% of copy" in p.measured
    assert not G.judge_phases(decode, decode, peak, bw).passed                          # prefill not compute-bound
    too_fast = dict(decode, bytes=5e12)                                                 # 125% of the ceiling
    assert not G.judge_phases(prefill, too_fast, peak, bw).passed
    assert not G.judge_phases(prefill, decode, None, bw).passed


def test_g_overhead():
    rng = np.random.default_rng(0)
    plain = {"eager": 0.005 + rng.exponential(1e-5, 400), "graph": 0.002 + rng.exponential(1e-5, 900)}
    same = {k: v * 1.01 for k, v in plain.items()}
    g = G.judge_overhead(plain, same)
    assert g.passed and "eager: median" in g.measured and "graph: median" in g.measured
    slow_graph = dict(same, graph=plain["graph"] * 1.04)                     # graph decode 4% slower
    assert not G.judge_overhead(plain, slow_graph).passed
    tail = dict(same, eager=np.where(np.arange(400) % 50 == 0, 0.008, same["eager"]))   # 2% of steps stall
    g = G.judge_overhead(plain, tail)
    assert not g.passed and g.detail["eager"]["median_overhead"] < 0.03 < g.detail["eager"]["p99_overhead"]
    assert not G.judge_overhead(None, same).passed
    assert not G.judge_overhead(plain, {"eager": same["eager"], "graph": [0.002] * 3}).passed


def test_j_torch_profiler_inside_an_injected_process():
    assert G.judge_shared_profiler(361, 361, "", 12001, 12001).passed
    assert not G.judge_shared_profiler(340, 361, "", 12001, 12001).passed       # Kineto lost kernels to us
    assert not G.judge_shared_profiler(361, 361, "bufferCompleted called with unknown buffer\n", 12001,
                                       12001).passed
    assert not G.judge_shared_profiler(361, 361, "", 0, 12001).passed           # our records did not resume
    assert not G.judge_shared_profiler(None, 361, "", 1, 1).passed


def test_k_clock_after_the_profiler():
    wall = 1_796_000_000_000_000_000
    assert G.judge_clock_after_profile(wall + 2_000_000, 10_100_000, wall, 10_000_000.0).passed
    assert not G.judge_clock_after_profile(4_000_000_000_000, 10_000_000, wall, 1e7).passed   # TSC ticks
    assert not G.judge_clock_after_profile(wall, 24_000_000, wall, 1e7).passed   # scaled by the tick rate
    assert not G.judge_clock_after_profile(None, None, wall, 1e7).passed


def test_l_sustained_load():
    assert G.judge_sustained(0, False, 60_000, 60_000).passed
    assert not G.judge_sustained(1, False, 60_000, 60_000).passed
    assert not G.judge_sustained(0, True, 60_000, 60_000).passed
    assert not G.judge_sustained(0, False, 59_000, 60_000).passed
    assert not G.judge_sustained(0, False, 0, 0).passed


def test_pm_metrics_come_from_the_device_list():
    hopper = ["dram__bytes_read.sum", "dram__bytes_write.sum", "sm__pipe_tensor_op_gmma_cycles_active.sum",
              "sm__pipe_tensor_op_hmma_cycles_active.sum", "gr__cycles_active.avg"]
    assert G.choose_pm_metrics(hopper) == ["dram__bytes_read.sum", "dram__bytes_write.sum",
                                           "sm__pipe_tensor_op_gmma_cycles_active.sum"]
    assert G.choose_pm_metrics(hopper[:2] + hopper[3:]) [-1] == "sm__pipe_tensor_op_hmma_cycles_active.sum"
    assert G.choose_pm_metrics(["gr__cycles_active.avg"]) == []


def test_pm_samples_of_a_crashed_sampler_are_missing_with_the_reason(tmp_path):
    (tmp_path / "pm").mkdir()
    (tmp_path / "log_pm_sampler.txt").write_text("Traceback ...\nSegmentation fault\n")
    pm, why = G.read_pm_samples(tmp_path / "pm")
    assert pm is None and "Segmentation fault" in why
    np.savez(tmp_path / "pm" / "pm_samples.npz", start_ns=np.array([1, 2]), end_ns=np.array([2, 3]),
             **{"dram__bytes_read.sum": np.array([5.0, 6.0])})
    pm, why = G.read_pm_samples(tmp_path / "pm")
    assert why == "" and pm["values"]["dram__bytes_read.sum"].tolist() == [5.0, 6.0]


def test_h_nvml_and_gpm():
    rec = {"gpu_busy_time_pct": 90.0, "memory_used_bytes": 1 << 30, "power_w": 400.0, "gpm_sm_util_pct": 70.0,
           "gpm_dram_bw_util_pct": 55.0}
    assert G.judge_nvml([rec, dict(rec, gpm_dram_bw_util_pct=60.0)]).passed
    assert not G.judge_nvml([dict(rec, gpm_sm_util_pct=None, gpm_dram_bw_util_pct=None)]).passed   # no GPM
    assert not G.judge_nvml([dict(rec, gpm_dram_bw_util_pct=140.0)]).passed                        # out of range
    assert not G.judge_nvml([dict(rec, power_w=None)]).passed
    assert not G.judge_nvml([]).passed


def test_i_pm_samples_and_kernels_on_one_clock():
    ps = np.arange(0, 100_000_000, 2_000_000)
    pe = ps + 2_000_000
    dram = np.where((ps >= 20_000_000) & (ps < 60_000_000), 1e9, 1e3)
    ks, ke = np.array([20_500_000, 40_000_000]), np.array([39_000_000, 59_000_000])
    assert G.judge_clock(ps, pe, dram, ks, ke).passed
    shifted = 30_000_000                                             # a clock 30 ms off
    assert not G.judge_clock(ps, pe, dram, ks + shifted + 20_000_000, ke + shifted + 20_000_000).passed
    assert not G.judge_clock([], [], [], ks, ke).passed


def test_model_work_is_compute_heavy_for_prefill_and_bandwidth_heavy_for_decode():
    f_p, b_p = G.model_work("prefill")
    f_d, b_d = G.model_work("decode")
    assert f_p / b_p > 300 > 10 > f_d / b_d
