"""systemd/ridgeline.service, the tmpfiles entry and scripts/install.sh.

Runs ``systemd-analyze verify`` and ``systemd-analyze security --offline=true`` on the unit
(the exposure score is recorded in docs/systemd.md) and installs into a temporary root.
"""
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "ridgeline.service"

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze not installed (apt-get install systemd)")


@needs_analyze
def test_security_exposure_is_at_most_4():
    r = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", str(UNIT)],
                       capture_output=True, text=True, timeout=120, cwd="/")
    m = re.search(r"Overall exposure level for ridgeline\.service: (\d+\.\d+)", r.stdout + r.stderr)
    assert m, r.stdout[-2000:] + r.stderr[-2000:]
    score = float(m.group(1))
    assert score <= 4.0
    doc = (ROOT / "docs" / "systemd.md").read_text()
    assert f"{score:.1f}" in doc, "docs/systemd.md must record the current exposure score"


def test_unit_has_the_required_settings():
    text = UNIT.read_text()
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "ProtectSystem=strict",
                 "NoNewPrivileges=yes", "CPUQuota=", "MemoryMax=", "RuntimeDirectory=ridgeline",
                 "ExecReload=/bin/kill -HUP $MAINPID"):
        assert line in text, line
    caps = re.search(r"^CapabilityBoundingSet=(.*)$", text, re.M).group(1).split()
    assert set(caps) == {"CAP_BPF", "CAP_PERFMON", "CAP_SYS_RESOURCE", "CAP_SYS_PTRACE"}
    assert "CAP_SYS_ADMIN" not in text.split("[Service]")[1].split("CapabilityBoundingSet=")[1].splitlines()[0]


def test_tmpfiles_entry_is_restrictive():
    line = [ln for ln in (ROOT / "systemd" / "ridgeline.conf").read_text().splitlines()
            if ln and not ln.startswith("#")]
    assert line == ["d      /run/ridgeline  0750 root root  -"]


@needs_analyze
def test_install_verify_uninstall_into_a_temporary_root(tmp_path):
    root = tmp_path / "root"
    env = dict(os.environ, RIDGELINE_PIP_ARGS="--no-deps")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), "--root", str(root)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    unit = root / "etc/systemd/system/ridgeline.service"
    conf = root / "etc/ridgeline/agent.toml"
    exe = root / "opt/ridgeline/venv/bin/ridgeline"
    assert unit.read_text() == UNIT.read_text()
    assert (root / "etc/tmpfiles.d/ridgeline.conf").exists()
    assert stat.S_IMODE(conf.stat().st_mode) == 0o640
    assert stat.S_IMODE((root / "etc/ridgeline").stat().st_mode) == 0o750
    assert os.access(exe, os.X_OK)
    # Verify the installed unit with its ExecStart pointing into the temporary root.
    check = tmp_path / "ridgeline.service"
    check.write_text(unit.read_text().replace("/opt/ridgeline/venv/bin/ridgeline", str(exe)))
    v = subprocess.run(["systemd-analyze", "verify", str(check)], capture_output=True, text=True, timeout=120,
                       cwd="/")
    problems = [ln for ln in (v.stdout + v.stderr).splitlines() if "ridgeline.service" in ln]
    assert v.returncode == 0 and not problems, v.stdout + v.stderr
    # A second install keeps an edited config.
    conf.write_text("# edited\n")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), "--root", str(root)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0 and conf.read_text() == "# edited\n"
    r = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), "--root", str(root), "--uninstall"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not unit.exists() and not (root / "opt/ridgeline").exists()
    assert conf.exists()


def test_install_refuses_unknown_option():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), "--bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown option --bogus" in r.stderr
