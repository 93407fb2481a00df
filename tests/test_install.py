"""The documented install, from a clean clone: wheel contents, scripts/install.sh, ridgeline run.

A ``git clone`` of this repository (its committed HEAD: what a user gets, without this
tree's build outputs or uncommitted files) is built into a wheel and installed with
``scripts/install.sh --root DIR``; ``ridgeline run`` from that install must inject the
library the package build compiled (issue 11 item 1). The installs reach the package
index for the pinned dependencies and build requirements (pip's cache makes a repeat
take about 20 s here).
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.long   # minutes: started first under xdist (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
LIB = "libridgeline_cupti.so"


def _need(tool: str) -> None:
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} not installed (needed for the clean-clone install)")


@pytest.fixture(scope="module")
def clean_clone(tmp_path_factory) -> Path:
    _need("git")
    _need("make")
    _need("cc")
    if not (ROOT / ".git").exists():
        pytest.skip(f"{ROOT} is not a git checkout: nothing to clone")
    dst = tmp_path_factory.mktemp("clone") / "ridgeline"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dst)], check=True, timeout=120)
    assert not (dst / "probes" / "native" / LIB).exists(), "a clean clone must not carry a built library"
    return dst


def _install(src: Path, root: Path, pip_args: str | None = None, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("RIDGELINE_PIP_ARGS", None)
    env.pop("RIDGELINE_CUPTI_LIB", None)
    if pip_args is not None:
        env["RIDGELINE_PIP_ARGS"] = pip_args
    # From the clone's top folder, as the README says (`sudo scripts/install.sh`).
    return subprocess.run(["bash", "scripts/install.sh", "--root", str(root), *extra],
                          capture_output=True, text=True, timeout=900, env=env, cwd=str(src))


@pytest.fixture(scope="module")
def installed(clean_clone, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("install") / "root"
    # the extras the installed demo draws its report and plot with (the agent needs none)
    r = _install(clean_clone, root, None, "--extras", "terminal,plot")
    print(f"$ scripts/install.sh --root {root} --extras terminal,plot\n{r.stdout}{r.stderr}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return root


def _ridgeline(root: Path, *args: str, timeout_s: float = 120, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RIDGELINE_CUPTI_LIB", "CUDA_INJECTION64_PATH")}
    env.update(kw.pop("env", {}))
    # The launcher's shebang names /opt/ridgeline/venv (where the tree will run), not this
    # test's DIR: run it with the tree's interpreter, as the image's / would.
    venv = root / "opt/ridgeline/venv"
    return subprocess.run([str(venv / "bin/python"), str(venv / "bin/ridgeline"), *args], capture_output=True,
                          text=True, timeout=timeout_s, env=env, **kw)


def test_wheel_from_a_clean_clone_carries_the_library_under_one_import_name(clean_clone, tmp_path):
    out = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(clean_clone)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    # issue 24.7: a first `make demo` printed setuptools' 40-line warning for each data folder
    assert "would be ignored" not in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    (whl,) = out.glob("*.whl")
    # A native library inside: tagged for this platform, any CPython 3.
    assert re.fullmatch(rf"ridgeline-[^-]+-py3-none-linux_{platform.machine()}\.whl", whl.name), whl.name
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        tops = {n.split("/")[0] for n in names}
        assert tops == {"ridgeline", next(t for t in tops if t.endswith(".dist-info"))}, tops
        lib = z.read(f"ridgeline/probes/native/{LIB}")
        assert lib[:4] == b"\x7fELF"
        # the native trace reader (probes/native_json), where kineto_native.library_path() looks
        assert z.read("ridgeline/probes/native_json/libridgeline_json.so")[:4] == b"\x7fELF"
        (tmp_path / LIB).write_bytes(lib)
        entry = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
        wheel_meta = z.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
    assert "ridgeline = ridgeline.agent.cli:main" in entry
    assert "Root-Is-Purelib: false" in wheel_meta
    for data in ("ridgeline/agent/data/agent.toml", "ridgeline/aggregator/data/gpu_ceilings.toml",
                 "ridgeline/aggregator/data/kernel_signatures.toml", "ridgeline/aggregator/data/engine_kernels.toml",
                 "ridgeline/probes/sched_bpf.c", "ridgeline/probes/cuda_uprobes_bpf.c"):
        assert data in names, data
    # The native sources stay in the repository: nothing in site-packages invites a `make` there.
    assert not [n for n in names if n.startswith("ridgeline/probes/native/") and not n.endswith(LIB)]
    # The native fold library (aggregator/native), where aggregator/fold_native.py looks for it.
    assert [n for n in names if n.startswith("ridgeline/aggregator/native/")] == \
        ["ridgeline/aggregator/native/libridgeline_fold.so"]
    # The native CUPTI decoder (probes/cupti/native), where probes/cupti/decode_native.py looks for it.
    assert [n for n in names if n.startswith("ridgeline/probes/cupti/native/")] == \
        ["ridgeline/probes/cupti/native/libridgeline_cupti_decode.so"]
    # The scheduling probe's slot free (probes/sched_native), where probes/sched.py looks for it.
    assert [n for n in names if n.startswith("ridgeline/probes/sched_native/")] == \
        ["ridgeline/probes/sched_native/libridgeline_sched.so"]
    # The shipped library is the one without the test entry points (ridgeline_cupti_test.c).
    table = subprocess.run(["nm", "-D", "--defined-only", str(tmp_path / LIB)], capture_output=True, text=True,
                           check=True).stdout
    assert "InitializeInjection" in table and "ridgeline_test_" not in table


def test_install_from_a_clean_clone_then_run_injects_the_built_library(installed, tmp_path):
    venv = installed / "opt/ridgeline/venv"
    libs = list(venv.glob(f"lib/python3*/site-packages/ridgeline/probes/native/{LIB}"))
    assert len(libs) == 1 and os.access(libs[0], os.X_OK), libs
    r = _ridgeline(installed, "run", "--print-env", "--", "true")
    assert r.returncode == 0, r.stderr
    env = dict(line.split("=", 1) for line in r.stdout.splitlines())
    assert Path(env["CUDA_INJECTION64_PATH"]).resolve() == libs[0].resolve()
    assert env["NVTX_INJECTION64_PATH"] == env["CUDA_INJECTION64_PATH"]
    # libcupti from the install's own nvidia-cuda-cupti wheel (a pinned dependency).
    assert Path(env["RIDGELINE_LIBCUPTI"]).is_file() and str(env["RIDGELINE_LIBCUPTI"]).startswith(str(venv))
    # What the child process really gets:
    r = _ridgeline(installed, "run", "--", "sh", "-c", 'printf "%s\\n" "$CUDA_INJECTION64_PATH" "$RIDGELINE_SOCKET"')
    assert r.returncode == 0, r.stderr
    inj, sock = r.stdout.splitlines()
    assert Path(inj).is_file() and Path(inj).resolve() == libs[0].resolve() and sock
    # A tiny program doing what the CUDA driver does at cuInit: dlopen the injection
    # library and call InitializeInjection. Without a GPU the library logs that CUPTI is
    # off and the program runs on untouched.
    app = tmp_path / "inject_app"
    src = ROOT / "probes" / "native" / "ridgeline_inject_app.c"
    subprocess.run(["cc", "-O2", "-o", str(app), str(src), "-ldl"], check=True, timeout=120)
    r = _ridgeline(installed, "run", "--", str(app), "100")
    assert r.returncode == 0, r.stderr
    assert "cannot load injection" not in r.stderr
    m = re.search(r"app: injection=(-?\d+) sum=5050", r.stdout)
    assert m and int(m.group(1)) >= 0, r.stdout + r.stderr


def test_a_tree_installed_under_root_runs_where_it_is_installed(installed):
    """`--root DIR` builds a tree for an image: the unit runs /opt/ridgeline/venv/bin/ridgeline,
    so the launchers and activate scripts must name /opt/ridgeline/venv, never DIR (issue 24.7)."""
    bindir = installed / "opt/ridgeline/venv/bin"
    assert (bindir / "ridgeline").read_text().splitlines()[0] == "#!/opt/ridgeline/venv/bin/python"
    unit = (installed / "etc/systemd/system/ridgeline.service").read_text()
    assert "ExecStart=/opt/ridgeline/venv/bin/ridgeline" in unit
    for f in bindir.iterdir():
        if f.is_file() and not f.is_symlink():
            assert str(installed) not in f.read_text(errors="replace"), f
    assert "/opt/ridgeline/venv" in (bindir / "activate").read_text()
    # The tmpfiles comment tells the mode its entry sets.
    conf = (installed / "etc/tmpfiles.d/ridgeline.conf").read_text()
    assert re.search(r"^d\s+/run/ridgeline\s+0751\s", conf, re.M) and "mode 0751" in conf
    assert "no access for others" not in conf


def test_installed_agent_reads_its_embedded_defaults(installed):
    # The package data travels under the one import name (ridgeline.agent/data/agent.toml).
    r = _ridgeline(installed, "agent", "--print-config", "--config", str(installed / "etc/ridgeline/agent.toml"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "[probes]" in r.stdout and "window_s" in r.stdout


def test_installed_demo_runs_the_whole_pipeline(installed, tmp_path):
    # Subprocesses by the one import name (`python -m ridgeline`), package data (kernel
    # signatures, ceilings, engine kernels) read from the installed package.
    out = tmp_path / "demo"
    r = _ridgeline(installed, "demo", "--duration", "6", "-o", str(out), cwd=str(tmp_path), timeout_s=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:] + "".join(
        f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in out.glob("*.log"))
    assert (out / "report.txt").stat().st_size > 0 and (out / "stream.rlrec").stat().st_size > 0


def test_missing_library_hint_does_not_point_into_site_packages(installed):
    (lib,) = (installed / "opt/ridgeline/venv").glob(f"lib/python3*/site-packages/ridgeline/probes/native/{LIB}")
    moved = lib.with_name(LIB + ".away")
    lib.rename(moved)
    try:
        r = _ridgeline(installed, "run", "--", "true")
    finally:
        moved.rename(lib)
    # A library that is not there is a runtime failure (exit 1, README exit-code table), not bad input.
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "make -C" not in r.stderr and "reinstall" in r.stderr, r.stderr


def test_installed_files_reinstall_keeps_config_and_uninstall(installed, clean_clone):
    unit = installed / "etc/systemd/system/ridgeline.service"
    conf = installed / "etc/ridgeline/agent.toml"
    assert unit.read_text() == (ROOT / "systemd/ridgeline.service").read_text()
    assert (installed / "etc/tmpfiles.d/ridgeline.conf").exists()
    assert stat.S_IMODE(conf.stat().st_mode) == 0o640
    assert stat.S_IMODE((installed / "etc/ridgeline").stat().st_mode) == 0o750
    if shutil.which("systemd-analyze"):
        exe = installed / "opt/ridgeline/venv/bin/ridgeline"
        check = installed.parent / "ridgeline.service"
        check.write_text(unit.read_text().replace("/opt/ridgeline/venv/bin/ridgeline", str(exe)))
        v = subprocess.run(["systemd-analyze", "verify", str(check)], capture_output=True, text=True, timeout=120,
                           cwd="/")
        problems = [ln for ln in (v.stdout + v.stderr).splitlines() if "ridgeline.service" in ln]
        assert v.returncode == 0 and not problems, v.stdout + v.stderr
    saved = conf.read_text()
    conf.write_text("# edited\n")
    try:
        r = _install(clean_clone, installed)
        assert r.returncode == 0 and conf.read_text() == "# edited\n", r.stderr[-2000:]
    finally:
        conf.write_text(saved)


def test_uninstall_keeps_only_the_config(clean_clone, tmp_path):
    root = tmp_path / "root"
    r = _install(clean_clone, root)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run(["bash", str(clean_clone / "scripts/install.sh"), "--root", str(root), "--uninstall"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not (root / "etc/systemd/system/ridgeline.service").exists() and not (root / "opt/ridgeline").exists()
    assert (root / "etc/ridgeline/agent.toml").exists()


def test_help_does_not_recommend_pip_arguments_that_break_the_install(clean_clone, tmp_path):
    r = subprocess.run(["bash", str(clean_clone / "scripts/install.sh"), "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    for opt in re.findall(r"^#\s+(--[a-z-]+)(?= )", r.stdout, re.M):
        assert opt in ("--root", "--uninstall", "--python", "--no-ebpf", "--extras"), opt   # install.sh's own
    assert 'tests use "--no-deps' not in r.stdout
    # What the old help recommended is refused up front, with the reason.
    for args in ("--no-deps --no-build-isolation", "--no-deps", "--no-build-isolation"):
        r = _install(clean_clone, tmp_path / "root", args)
        assert r.returncode == 2 and "must not hold" in r.stderr, r.stderr[-2000:]
        assert not (tmp_path / "root").exists()


def test_an_install_without_the_dependencies_is_caught(clean_clone, tmp_path):
    # pip's own --no-deps via PIP_NO_DEPENDENCIES gets past the argument check: pip check stops it.
    env = dict(os.environ, PIP_NO_DEPENDENCIES="1")
    env.pop("RIDGELINE_PIP_ARGS", None)
    r = subprocess.run(["bash", "scripts/install.sh", "--root", str(tmp_path / "root")], capture_output=True,
                       text=True, timeout=900, env=env, cwd=str(clean_clone))
    assert r.returncode == 1 and "lacks ridgeline's pinned dependencies" in r.stderr, r.stderr[-2000:]


def test_install_refuses_unknown_option():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), "--bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown option --bogus" in r.stderr


def _fake_apt(tmp_path: Path, install_rc: int) -> Path:
    """An apt-get on PATH that logs its arguments, and whose install fails with apt's own
    words when ``install_rc`` is not 0 (update always succeeds)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "apt-get").write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> "{tmp_path}/calls"\n'
        'case "$1" in update) echo "Reading package lists..."; exit 0 ;; esac\n'
        'echo "Reading package lists..."\n'
        f'[ {install_rc} = 0 ] && exit 0\n'
        'echo "E: Unable to locate package $7" >&2\n'
        f"exit {install_rc}\n")
    (bindir / "apt-get").chmod(0o755)
    return bindir


@pytest.mark.parametrize("install_rc", [0, 100])
def test_setup_apt_waits_for_the_dpkg_lock_and_keeps_errors(tmp_path, install_rc):
    """scripts/apt.sh (what setup.sh and setup-native.sh install with): every apt-get call
    waits for the dpkg lock, stdout stays quiet, and a failure shows apt's own error."""
    bindir = _fake_apt(tmp_path, install_rc)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}")
    r = subprocess.run(["bash", "-c", f'. "{ROOT}/scripts/apt.sh"; apt_install nosuchpkg'], capture_output=True,
                       text=True, timeout=60, env=env)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert all("-o DPkg::Lock::Timeout=60" in c for c in calls), calls
    assert r.stdout == ""
    if install_rc == 0:
        assert r.returncode == 0 and calls == [
            "install -y -q --no-install-recommends -o DPkg::Lock::Timeout=60 nosuchpkg"] and r.stderr == ""
    else:
        # Tried, lists refreshed, tried again; both errors shown, the status kept.
        assert r.returncode == 100 and [c.split()[0] for c in calls] == ["install", "update", "install"]
        assert r.stderr.count("E: Unable to locate package nosuchpkg") == 2, r.stderr
        assert "apt-get install nosuchpkg failed" in r.stderr


def test_setup_scripts_install_only_through_apt_sh():
    """No apt-get install/update in the set-up scripts that drops its errors or skips the lock."""
    for name in ("setup.sh", "setup-native.sh"):
        text = (ROOT / "scripts" / name).read_text()
        assert "apt_install" in text and ". " in text and "apt.sh" in text, name
        for line in text.splitlines():
            if re.search(r"apt-get (-\S+ )*(install|update)\b", line):
                assert "DPkg::Lock::Timeout" in line and "2>&1" not in line and "2>/dev/null" not in line, line


def test_reinstall_keeps_the_config_folder_mode_unit_edits_and_drop_ins(installed, clean_clone):
    """Issue 18.9: install.sh over an install reset /etc/ridgeline to 0750 and overwrote
    local unit edits."""
    etc, unit = installed / "etc/ridgeline", installed / "etc/systemd/system/ridgeline.service"
    new, dropin = unit.with_name("ridgeline.service.ridgeline-new"), unit.with_name("ridgeline.service.d") / "local.conf"
    packaged = (clean_clone / "systemd/ridgeline.service").read_text()
    try:
        os.chmod(etc, 0o700)
        r = _install(clean_clone, installed)
        assert r.returncode == 0, r.stderr[-2000:]
        assert stat.S_IMODE(etc.stat().st_mode) == 0o700
        assert unit.read_text() == packaged and not new.exists()     # ours, unedited: replaced
        dropin.parent.mkdir()
        dropin.write_text("[Service]\nMemoryMax=1G\n")
        edited = packaged.replace("[Service]\n", "[Service]\nNice=5\n", 1)
        assert edited != packaged
        unit.write_text(edited)
        r = _install(clean_clone, installed)
        assert r.returncode == 0, r.stderr[-2000:]
        assert unit.read_text() == edited and new.read_text() == packaged
        assert dropin.read_text() == "[Service]\nMemoryMax=1G\n"
        assert "has local edits: kept" in r.stderr and stat.S_IMODE(etc.stat().st_mode) == 0o700
    finally:
        os.chmod(etc, 0o750)
        unit.write_text(packaged)
        new.unlink(missing_ok=True)
        dropin.unlink(missing_ok=True)
        if dropin.parent.exists():
            dropin.parent.rmdir()
