"""``ridgeline analyze`` run under an address-space limit, with its own peak RSS measured:
what the input-bound tests (tests/test_input_bounds*.py) run each hostile or huge input with."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

CEILING_BYTES = 1 << 30
AS_LIMIT_BYTES = 3 << 30         # the child dies at this size: a bound breaking fails the test, not the host


# The child is started by a small launcher process, not by pytest: ru_maxrss counts the
# pages of the process it was forked from, so a child forked from a large test process
# would carry that size into its peak. The launcher forks the child with the address-space
# limit, reaps it with wait4 and writes the child's own peak RSS to a file.
_LAUNCHER = """
import os, resource, subprocess, sys
limit, out = int(sys.argv[1]), sys.argv[2]
def pre():
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
p = subprocess.Popen(sys.argv[3:], preexec_fn=pre)
_, status, ru = os.wait4(p.pid, 0)
code = os.waitstatus_to_exitcode(status)
open(out, "w").write(str(ru.ru_maxrss * 1024))
sys.exit(code if code >= 0 else 128 - code)
"""


def run_bounded(*argv, timeout=600, as_limit=AS_LIMIT_BYTES):
    """(exit code, peak RSS bytes, wall s, stdout, stderr) of ``ridgeline analyze ARGV``."""
    import tempfile
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as rss_file:
        t0 = time.monotonic()
        p = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(as_limit), rss_file.name,
                              sys.executable, "-m", "ridgeline", "analyze", *map(str, argv)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)      # the launcher and the analyze child it started
            p.communicate()
            pytest.fail(f"analyze {argv} ran past {timeout} s")
        wall = time.monotonic() - t0
        rss = int(rss_file.read() or 0)
    return p.returncode, rss, wall, out.decode(), err.decode()


def one_line_exit_2(code, err):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ridgeline: error: "), err
    assert "Traceback" not in err
