"""Issue 18.8: output files (analyze --perfetto/--plot, record -o) are never written
through a link another user left at the name (root runs these in /tmp)."""
import os
import subprocess
import sys

import pytest

from ridgeline.agent.recording import RecordingWriter
from ridgeline.probes.errors import InputError
from ridgeline.probes.output_file import open_output

B200 = "nvidia-inference/tracelens_b200_vllm_gptoss_tp8_prefill888.json.gz"


@pytest.fixture
def victim(tmp_path):
    v = tmp_path / "victim"           # stands for /etc/shadow
    v.write_text("precious\n")
    return v


def test_a_symlink_is_refused_and_its_target_kept(tmp_path, victim):
    link = tmp_path / "out.json"
    link.symlink_to(victim)
    with pytest.raises(InputError, match="symbolic link"):
        open_output(link)
    assert victim.read_text() == "precious\n"


def test_a_hard_link_is_refused_and_its_target_kept(tmp_path, victim):
    link = tmp_path / "out.json"
    os.link(victim, link)
    with pytest.raises(InputError, match="hard links"):
        open_output(link)
    assert victim.read_text() == "precious\n"


def test_a_fifo_is_refused_without_blocking(tmp_path):
    f = tmp_path / "out.json"
    os.mkfifo(f)
    with pytest.raises(InputError):
        open_output(f)


def test_a_plain_file_is_created_or_truncated(tmp_path):
    p = tmp_path / "out.bin"
    p.write_bytes(b"x" * 100)
    with open_output(p) as f:
        f.write(b"ok")
    assert p.read_bytes() == b"ok"
    with open_output(tmp_path / "new.bin") as f:
        f.write(b"new")
    assert (tmp_path / "new.bin").read_bytes() == b"new"


def test_record_writer_refuses_a_symlink(tmp_path, victim):
    link = tmp_path / "rec.rlrec"
    link.symlink_to(victim)
    with pytest.raises(InputError, match="symbolic link"):
        RecordingWriter(link)
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("flag, name", [("--perfetto", "p.json"), ("--plot", "p.png")])
def test_analyze_refuses_to_write_through_a_symlink(trace_path, tmp_path, victim, flag, name):
    link = tmp_path / name
    link.symlink_to(victim)
    p = subprocess.run([sys.executable, "-m", "ridgeline", "analyze", str(trace_path(B200)), flag, str(link),
                        "--json"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stderr[-500:]
    assert len(lines) == 1 and "symbolic link" in lines[0] and "Traceback" not in p.stderr
    assert victim.read_text() == "precious\n"
