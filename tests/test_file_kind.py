"""probes/file_kind.py (issue 24.3): a file named by its content, with headers written by
the real tools (SQLite's library, matplotlib's PNG writer, gzip, the recorder's magic)."""
import gzip
import io
import sqlite3

import pytest

from ridgeline.probes import file_kind


def test_the_recording_magic_is_the_recorders():
    from ridgeline.agent.recording import MAGIC
    assert file_kind.RECORDING_MAGIC == MAGIC          # probes cannot import agent: a copy, checked here
    assert file_kind.sniff(MAGIC + b"\x00" * 8) == "recording"
    assert file_kind.sniff(MAGIC[:5]) == "recording-header-cut"


def test_real_headers(tmp_path):
    db = tmp_path / "x.sqlite"
    con = sqlite3.connect(db)
    con.execute("create table t (a)")
    con.commit()
    con.close()
    assert file_kind.sniff(db.read_bytes()[:16]) == "sqlite"
    assert file_kind.sniff(gzip.compress(b'{"traceEvents": []}')[:16]) == "gzip"
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    buf = io.BytesIO()
    plt.figure().savefig(buf, format="png")
    plt.close("all")
    png = buf.getvalue()[:16]
    assert file_kind.sniff(png) == "a PNG image"
    assert file_kind.mismatch("trace.sqlite", png) == (
        "trace.sqlite: not an SQLite database (an Nsight Systems export starts with 'SQLite format 3'): "
        "its content is a PNG image")


@pytest.mark.parametrize("head,kind", [
    (b"", "empty"), (b'\xef\xbb\xbf  {"traceEvents"', "json"), (b"\n[{", "json"),
    (b"hello world", "text, not a JSON object or array (starts 'hello world')"),
    (b"\xcd\x2a\x9a\x45\x00", "binary data (starts cd 2a 9a 45 ...)"),
])
def test_sniff_literals(head, kind):
    assert file_kind.sniff(head) == kind


def test_mismatch_is_none_for_what_analyze_reads_and_names_the_rest():
    assert file_kind.mismatch("t.json", b"{") is None
    assert file_kind.mismatch("s.rlrec", b"") == "s.rlrec: empty file (0 bytes)"
    assert file_kind.mismatch("s.rlrec", b"\x7fELF\x02\x01") == (
        "s.rlrec: not a ridgeline recording (no RLREC header): its content is an ELF binary")
