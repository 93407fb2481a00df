"""systemd/ridgeline.service, the tmpfiles entry and scripts/install.sh.

Runs ``systemd-analyze security --offline=true`` on the unit (the exposure score is recorded
in docs/systemd.md). The install itself is tested from a clean clone in tests/test_install.py.
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
