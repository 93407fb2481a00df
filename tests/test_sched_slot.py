"""The run-queue histogram slot of probes/sched_bpf.c (``rq_slot``) against bcc's own bpf_log2l.

The probe used ``bpf_log2l(d / 1000)`` (clamped to slot 31); ``rq_slot`` gets the same slot by
compares, without the 64-bit division. The reference is bcc's code itself: the text of
``bpf_log2`` / ``bpf_log2l`` is taken from the helpers header embedded in the installed
libbcc (the distro's python3-bpfcc 0.26), and ``rq_slot`` from sched_bpf.c between its markers;
both are compiled with gcc and compared on every slot boundary (1000 * 2^k - 1, 1000 * 2^k,
+1) and on a million pseudo-random waits over the whole u64 range.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "probes" / "sched_bpf.c"

HARNESS = r"""
#include <stdio.h>
typedef unsigned long long u64;
%(bcc)s
%(slot)s
static int check(u64 d) {
    unsigned int want = bpf_log2l(d / 1000);
    if (want > 31) want = 31;                    /* the probe's clamp to RQ_SLOTS - 1 */
    unsigned int got = rq_slot(d);
    if (got != want) { printf("MISMATCH %%llu %%u %%u\n", d, got, want); return 1; }
    return 0;
}
int main(void) {
    int bad = 0; long n = 0;
    for (u64 d = 0; d < 200000; d++, n++) bad += check(d);
    for (int k = 0; k < 54; k++) {
        u64 b = 1000ULL << k;
        bad += check(b - 1) + check(b) + check(b + 1); n += 3;
    }
    u64 x = 88172645463325252ULL;
    for (int i = 0; i < 1000000; i++, n++) {    /* xorshift64, spread over all magnitudes */
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        bad += check(x >> (x & 63));
    }
    bad += check(~0ULL); n++;
    printf("CHECKED %%ld BAD %%d\n", n, bad);
    return bad != 0;
}
"""


def _libbcc_path() -> Path:
    try:
        from ridgeline.probes import bpf as bpfmod
        bpfmod.import_bcc()
    except (ImportError, OSError) as exc:
        pytest.skip(f"the distro bcc is not importable: {exc}")
    for line in Path("/proc/self/maps").read_text().splitlines():
        if "libbcc.so" in line:
            return Path(line.split()[-1])
    pytest.skip("libbcc.so is not mapped after importing bcc")


def _bcc_log2_source(lib: Path) -> str:
    blob = lib.read_bytes()
    start = blob.find(b"unsigned int bpf_log2(unsigned int v)")
    end = blob.find(b"struct bpf_context;", start)
    if start < 0 or end < 0:
        pytest.fail(f"bpf_log2 / bpf_log2l not found in {lib}")
    text = blob[start:end].decode()
    assert "bpf_log2l(unsigned long v)" in text
    return "static inline unsigned int bpf_log2l(unsigned long v);\nstatic inline " + text


def _rq_slot_source() -> str:
    m = re.search(r"/\* RQ_SLOT_BEGIN.*?\*/(.*?)/\* RQ_SLOT_END \*/", SRC.read_text(), re.S)
    assert m, "RQ_SLOT_BEGIN / RQ_SLOT_END markers missing in sched_bpf.c"
    return m.group(1).replace("__always_inline", "inline")


def test_rq_slot_equals_bcc_log2l_of_microseconds(tmp_path):
    if not shutil.which("gcc"):
        pytest.skip("gcc is not installed")
    c = tmp_path / "slot.c"
    c.write_text(HARNESS % {"bcc": _bcc_log2_source(_libbcc_path()), "slot": _rq_slot_source()})
    exe = tmp_path / "slot"
    subprocess.run(["gcc", "-O1", "-o", str(exe), str(c)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-2000:]
    assert "BAD 0" in out.stdout
    assert int(out.stdout.split("CHECKED ")[1].split()[0]) > 1_200_000
