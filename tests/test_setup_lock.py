"""Issue 18.8: scripts/setup-ebpf.sh (run as root) takes its lock without opening a name
another user could have prepared: a symlink at the old lock path truncated its target."""
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OLD_LOCK = Path("/run/lock/ridgeline-setup-ebpf.lock")


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/run/lock").is_dir(), reason="needs root and /run/lock")
def test_a_symlink_at_the_old_lock_path_is_not_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    saved = None
    if OLD_LOCK.exists() or OLD_LOCK.is_symlink():
        saved = tmp_path / "saved"
        os.rename(OLD_LOCK, saved)
    try:
        OLD_LOCK.symlink_to(victim)
        subprocess.run(["bash", str(ROOT / "scripts" / "setup-ebpf.sh")], capture_output=True, timeout=600)
        assert victim.read_text() == "precious\n"
    finally:
        OLD_LOCK.unlink(missing_ok=True)
        if saved is not None:
            os.rename(saved, OLD_LOCK)
    assert Path("/run/ridgeline-setup").is_dir() and not Path("/run/ridgeline-setup").is_symlink()
    assert (os.stat("/run/ridgeline-setup").st_mode & 0o777) == 0o700
