"""Preflight of the GPU check: the plumbing, proven in seconds before any long point runs.

The lent GPU host gives one shot (15 minutes in all, the machine's start included), so a
plumbing failure must show in the first half minute, with its evidence already on disk:

  versions   Python, torch (CUDA build, device), nvidia-smi, the CUDA driver's version,
             the libcupti in use and its API version, cupti-python
  build      the injection library compiled with the C compiler directly (the host may lack
             make), against the host's CUPTI headers
  inject     one CUDA kernel in a child process under the injection environment, with the
             agent's CuptiProbe listening here: its HELLO and that kernel's record must arrive
  pm         the device's PM-sampling metric list, in a subprocess of its own (cupti-python
             against an older libcupti meets grown structs and may crash: that must not take
             the preflight down), "n/a" with the reason where the runtime gives none

Everything goes to OUT/preflight.json and OUT/preflight.txt as each step ends. Without a GPU
(this development machine, CI) it is a dry run on the stand-in libcupti
(probes/native/tests/stub_cupti.c) and the stand-in served process (tests/support/native_harness.py):
the same build, socket, HELLO and record path, said to be a dry run in every output.

Usage: python scripts/gpu_preflight.py --out DIR [--cupti-include DIR] [--stub] [--budget-s 30]
Exit 0 when build, HELLO and the kernel record all passed; 1 otherwise.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "probes" / "native"
# The Makefile's flags (probes/native/Makefile), so the library built here is that one.
CFLAGS = ["-O2", "-g", "-std=c11", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter",
          "-pthread"]
STEPS = ("versions", "build", "inject", "pm")
REQUIRED = ("build", "inject")        # what the long points cannot do without

# One CUDA kernel, synchronised, in the injected child; it prints its pid (the record's).
GPU_CHILD = ("import os, time, torch\n"
             "x = torch.ones(4096, device='cuda')\n"
             "y = (x * 2).sum()\n"
             "torch.cuda.synchronize()\n"
             "print(os.getpid(), float(y.item()), flush=True)\n"
             "time.sleep(0.5)\n")
PM_CHILD = ("import json, sys\n"
            "from ridgeline.probes.cupti.pm_sampler import metric_list\n"
            "m = metric_list(0)\n"
            "names = sorted({n for v in m['base_metrics'].values() if isinstance(v, list) for n in v})\n"
            "print(json.dumps({'chip': m['chip'], 'metrics': len(names), 'names': names,\n"
            "                  'gmma': [n for n in names if 'gmma' in n]}))\n")


def cupti_include_dirs(env: dict[str, str]) -> list[str]:
    """Folders holding cupti_activity.h: this interpreter's nvidia-cuda-cupti wheel first
    (what torch loads), then a toolkit where CUDA_HOME/CUDA_PATH or nvcc say, then the usual
    places (runfile installs keep CUPTI under extras/CUPTI/include, packages under targets/)."""
    out = []
    for sp in sys.path:
        for pat in ("nvidia/cu13/include", "nvidia/cuda_cupti/include"):
            out += [d for d in glob.glob(f"{sp}/{pat}") if os.path.isfile(f"{d}/cupti_activity.h")]
    roots = [env.get("CUDA_HOME", ""), env.get("CUDA_PATH", "")]
    nvcc = shutil.which("nvcc", path=env.get("PATH"))
    if nvcc:
        roots.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    roots += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-1[23]*"), reverse=True) + ["/opt/nvidia/cuda"]
    for r in filter(None, roots):
        for sub in ("extras/CUPTI/include", "include", "targets/x86_64-linux/include", "targets/sbsa-linux/include"):
            d = f"{r}/{sub}"
            if os.path.isfile(f"{d}/cupti_activity.h") and d not in out:
                out.append(d)
    return out


def library_sources() -> list[str]:
    """The library's parts: every ridgeline_cupti*.c but the test entry points (as the
    Makefile's SRCS)."""
    return sorted(str(p) for p in NATIVE.glob("ridgeline_cupti*.c") if p.name != "ridgeline_cupti_test.c")


def build_commands(include: str, work: Path, stub: bool) -> list[list[str]]:
    """The compiler calls for the library (and, for a dry run, the stand-in libcupti and the
    test library, whose counters the stand-in served process reads)."""
    cc = os.environ.get("CC") or shutil.which("cc") or "gcc"
    inc = ["-I" + str(NATIVE / "compat"), "-I" + include, "-I" + str(NATIVE)]
    link = ["-shared", "-pthread", "-Wl,--no-undefined", "-Wl,-z,defs", "-o"]
    cmds = [[cc, *CFLAGS, *inc, *link, str(work / "libridgeline_cupti.so"), *library_sources(), "-ldl"]]
    if stub:
        cmds.append([cc, *CFLAGS, *inc, *link, str(work / "libridgeline_cupti_test.so"), *library_sources(),
                     str(NATIVE / "ridgeline_cupti_test.c"), "-ldl"])
        cmds.append([cc, *CFLAGS, *inc, "-shared", "-Wl,-soname,libcupti_stub.so", "-o",
                     str(work / "libcupti_stub.so"), str(NATIVE / "tests" / "stub_cupti.c")])
    return cmds


def judge(steps: dict[str, dict]) -> tuple[bool, list[str]]:
    """Whether the long points may start, and one line per step (pure: tested on literals)."""
    lines, ok = [], True
    for name in STEPS:
        s = steps.get(name)
        if s is None:
            status, detail = "not run", ""
        else:
            status, detail = s["status"], s.get("detail", "")
        if name in REQUIRED and status != "ok":
            ok = False
        lines.append(f"preflight: {name:<8} {status:<7} {detail}".rstrip())
    lines.append("preflight: " + ("READY: the long points may start" if ok else
                                 "NOT READY: fix the steps above before spending GPU time on the long points"))
    return ok, lines


class Preflight:
    def __init__(self, out: Path, budget_s: float, stub: bool, include: str | None):
        self.out, self.stub, self.include = out, stub, include
        self.deadline = time.monotonic() + budget_s
        self.t0 = time.monotonic()
        self.steps: dict[str, dict] = {}
        self.work = out / "preflight"
        self.work.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return max(1.0, self.deadline - time.monotonic())

    def record(self, name: str, status: str, detail: str = "", **facts) -> None:
        self.steps[name] = {"status": status, "detail": detail, "at_s": round(time.monotonic() - self.t0, 2), **facts}
        print(f"preflight: {name}: {status} {detail}".rstrip(), flush=True)
        self.save()

    def save(self) -> None:
        ok, lines = judge(self.steps)
        (self.out / "preflight.json").write_text(json.dumps({"dry_run": self.stub, "ready": ok, "steps": self.steps},
                                                            indent=2, default=str))
        (self.out / "preflight.txt").write_text("\n".join(lines) + "\n")

    # -- steps -------------------------------------------------------------------------
    def versions(self) -> None:
        facts: dict = {"python": sys.version.split()[0], "platform": platform.platform()}
        smi = shutil.which("nvidia-smi")
        if smi:
            r = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=min(10, self.left()))
            facts["nvidia_smi"] = r.stdout.strip() or r.stderr.strip()
        try:
            v = ctypes.c_int()
            libcuda = ctypes.CDLL("libcuda.so.1")
            facts["cuda_driver_api"] = v.value if libcuda.cuDriverGetVersion(ctypes.byref(v)) == 0 else "error"
        except OSError as e:
            facts["cuda_driver_api"] = f"n/a ({e})"
        r = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, torch.version.cuda, "
                            "torch.cuda.is_available())"], capture_output=True, text=True,
                           timeout=min(20, self.left()))
        facts["torch"] = r.stdout.strip() or f"n/a ({(r.stderr.strip().splitlines() or ['?'])[-1]})"
        from ridgeline.probes.cupti.library import find_libcupti
        lib = os.environ.get("RIDGELINE_LIBCUPTI") or (str(find_libcupti()) if find_libcupti() else None)
        facts["libcupti"] = lib or "none found in this interpreter's wheels"
        if lib and not self.stub:
            try:
                v = ctypes.c_uint32()
                facts["cupti_api_version"] = (v.value if ctypes.CDLL(lib).cuptiGetVersion(ctypes.byref(v)) == 0
                                              else "error")
            except OSError as e:
                facts["cupti_api_version"] = f"n/a ({e})"
        r = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; print(m.version('cupti-python'))"],
                           capture_output=True, text=True, timeout=min(10, self.left()))
        facts["cupti_python"] = r.stdout.strip() or "not installed"
        self.record("versions", "ok", facts.get("nvidia_smi", "no nvidia-smi") + ("; DRY RUN (stand-in libcupti)"
                                                                                 if self.stub else ""), **facts)

    def build(self) -> bool:
        dirs = [self.include] if self.include else cupti_include_dirs(dict(os.environ))
        if not dirs:
            self.record("build", "failed", "no CUPTI headers (nvidia-cuda-cupti wheel, CUDA_HOME or /usr/local/cuda)")
            return False
        t = time.monotonic()
        for cmd in build_commands(dirs[0], self.work, self.stub):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=min(60, self.left()))
            (self.work / "build.log").open("a").write(" ".join(cmd) + "\n" + r.stdout + r.stderr)
            if r.returncode != 0:
                self.record("build", "failed", (r.stderr.strip().splitlines() or ["?"])[-1], headers=dirs[0])
                return False
        self.record("build", "ok", f"{self.work / 'libridgeline_cupti.so'} against {dirs[0]} in "
                                   f"{time.monotonic() - t:.1f} s (cc, no make)", headers=dirs[0])
        return True

    def inject(self) -> None:
        from ridgeline.probes.cupti.library import injection_env
        from ridgeline.probes.cupti.probe import CuptiProbe
        sock = Path(f"/tmp/rl-preflight-{os.getpid()}.sock")
        lib = self.work / "libridgeline_cupti.so"
        probe = CuptiProbe(str(sock))
        probe.start()
        hellos, kernels, names, status = [], 0, [], {}
        env = {k: v for k, v in os.environ.items() if not k.startswith("STUB_")}
        try:
            if self.stub:
                env.update(RIDGELINE_LIBCUPTI=str(self.work / "libcupti_stub.so"), RIDGELINE_SOCKET=str(sock),
                           RIDGELINE_FLUSH_MS="100")
                child = subprocess.Popen([sys.executable, str(ROOT / "tests" / "support" / "native_harness.py"), "--stub",
                                          str(self.work / "libridgeline_cupti_test.so"),
                                          str(self.work / "libcupti_stub.so")], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                child.stdin.write("emit 1 0 1\nemitted\n")
                child.stdin.flush()
            else:
                env.update(injection_env(str(sock), lib=lib))
                child = subprocess.Popen([sys.executable, "-c", GPU_CHILD], stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True, env=env, cwd=self.work)
            end = time.monotonic() + min(20, self.left())
            while time.monotonic() < end and not (hellos and kernels):
                got = probe.poll()
                hellos += got.get("new_pids", [])
                status.update(got.get("status", {}))
                if "trace" in got:
                    t = got["trace"]
                    kernels += len(t.kernels)
                    names += [t.names[int(i)] for i in t.kernels["name_id"][:4]]
                time.sleep(0.05)
            if self.stub and child.poll() is None:
                child.stdin.write("quit\n")
                child.stdin.flush()
            try:
                _, err = child.communicate(timeout=min(10, self.left()))
            except subprocess.TimeoutExpired:
                child.kill()
                _, err = child.communicate()
            (self.work / "inject.stderr.txt").write_text(err)
        finally:
            counters = probe.counters()
            probe.stop()
        facts = {"hellos": [list(h) for h in hellos], "kernels": kernels, "names": names, "library_status": status,
                 "probe_counters": counters, "child_rc": child.returncode}
        if hellos and kernels:
            self.record("inject", "ok", f"HELLO from pid {hellos[0][0]} ({hellos[0][1]}), {kernels} kernel "
                                        f"record(s): {names[0] if names else '?'}", **facts)
        else:
            why = "no HELLO" if not hellos else "HELLO but no kernel record"
            tail = (err.strip().splitlines() or ["child said nothing"])[-1]
            self.record("inject", "failed", f"{why} within the time (child rc {child.returncode}: {tail})", **facts)

    def pm(self) -> None:
        if self.stub:
            self.record("pm", "n/a", "dry run: the stand-in libcupti has no PM sampling")
            return
        try:
            r = subprocess.run([sys.executable, "-c", PM_CHILD], capture_output=True, text=True,
                               timeout=min(20, self.left()), cwd=self.work)
        except subprocess.TimeoutExpired:
            self.record("pm", "n/a", "the metric list did not come within the time")
            return
        if r.returncode != 0:
            tail = (r.stderr.strip().splitlines() or [f"rc {r.returncode}"])[-1]
            self.record("pm", "n/a", f"no PM-sampling metric list from this runtime: {tail} (rc {r.returncode})")
            return
        m = json.loads(r.stdout.strip().splitlines()[-1])
        (self.work / "pm_metrics.json").write_text(json.dumps(m, indent=1))
        self.record("pm", "ok", f"{m['chip']}: {m['metrics']} metrics, {len(m['gmma'])} gmma", chip=m["chip"],
                    metrics=m["metrics"], gmma=m["gmma"][:20])

    def run(self) -> int:
        self.versions()
        if self.build():
            self.inject()
        self.pm()
        ok, lines = judge(self.steps)
        print("\n".join(lines), flush=True)
        print(f"preflight: {time.monotonic() - self.t0:.1f} s", flush=True)
        return 0 if ok else 1


def has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
    return r.returncode == 0 and "GPU" in r.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cupti-include", default=None)
    ap.add_argument("--stub", action="store_true", help="dry run on the stand-in libcupti (automatic without a GPU)")
    ap.add_argument("--budget-s", type=float, default=30)
    a = ap.parse_args()
    stub = a.stub or not has_gpu()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if stub and not a.stub:
        print("preflight: no GPU here (nvidia-smi -L lists none): DRY RUN on the stand-in libcupti", flush=True)
    return Preflight(out, a.budget_s, stub, a.cupti_include).run()


if __name__ == "__main__":
    sys.exit(main())
