"""Issue 18.7: `analyze` of hostile inputs gives one line and exit 2, within bounds.

The inputs are built by tests/support/analyze_bombs.py; the Nsight ones from a copy of a real
export (../shared/third-party/nsys/, skipped when absent). The gzip bomb runs the real
CLI under an address-space limit (RLIMIT_AS), where it died of MemoryError before.
"""
from __future__ import annotations

import gzip
import resource
import subprocess
import sys
import time

import pytest
from conftest import third_party
from support import analyze_bombs

from ridgeline.agent.cli import main
from ridgeline.probes import json_chunks, nsys
from ridgeline.probes.errors import InputError

SAXPY = "nsys/pipit_saxpy_mpi_cuda_perlmutter0.sqlite.gz"
CLOVERLEAF = "nsys/pipit_cloverleaf_cuda_perlmutter.sqlite.gz"
AS_LIMIT_BYTES = 1 << 30


def one_error_line(capsys, path) -> str:
    assert main(["analyze", str(path), "--json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ridgeline: error: "), err
    return err


def cli_under_limit(path, limit_bytes=AS_LIMIT_BYTES):
    def pre():
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    return subprocess.run([sys.executable, "-m", "ridgeline", "analyze", str(path), "--json"],
                          preexec_fn=pre, capture_output=True, text=True, timeout=300)


def test_gzip_of_a_gib_of_brackets_under_an_address_space_limit(tmp_path):
    f = analyze_bombs.gzip_of_brackets(tmp_path / "brackets.json.gz")
    assert f.stat().st_size < 2 << 20
    p = cli_under_limit(f)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.count("\n") == 1 and "'[' or '{'" in p.stderr


@pytest.mark.parametrize("inside_event", [False, True])
def test_json_nested_a_million_deep(tmp_path, capsys, inside_event):
    f = analyze_bombs.nested_json(tmp_path / "deep.json", inside_event=inside_event)
    err = one_error_line(capsys, f)
    assert "nested 100000" in err and f"at most {json_chunks.MAX_DEPTH}" in err


def test_nesting_just_deeper_than_the_limit_is_refused_by_the_scanner(tmp_path):
    d = json_chunks.MAX_DEPTH
    f = tmp_path / "d.json"
    f.write_bytes(b'{"traceEvents": [{"args": {"a": ' + b"[" * d + b"]" * d + b"}}]}")
    with pytest.raises(InputError, match=f"nested {d + 3} deep"):
        list(json_chunks.ArrayStream(f))
    f.write_bytes(b'{"traceEvents": [{"args": {"a": ' + b"[" * (d - 3) + b"]" * (d - 3) + b"}}]}")
    assert sum(len(c.starts) for c in json_chunks.ArrayStream(f)) == 1


def test_bracket_dense_arrays_are_refused_before_the_scan(tmp_path, capsys):
    f = tmp_path / "dense.json"
    f.write_bytes(b'{"traceEvents": [' + b"[]," * (3 << 20) + b"[]]}")
    assert "'[' or '{'" in one_error_line(capsys, f)


@pytest.fixture
def saxpy(tmp_path):
    f = tmp_path / "saxpy.sqlite"
    f.write_bytes(gzip.decompress(third_party(SAXPY).read_bytes()))
    return f


@pytest.mark.parametrize("kind", sorted(analyze_bombs.GENERATED))
def test_nsight_generated_column_is_refused(saxpy, capsys, kind):
    analyze_bombs.nsys_generated_column(saxpy, kind)
    assert "generated columns (correlationId)" in one_error_line(capsys, saxpy)


def test_nsight_generated_column_past_the_schema_check_stops_at_the_value_limit(saxpy, monkeypatch):
    """Defence in depth: were the schema check absent, the 800 MB value is refused."""
    analyze_bombs.nsys_generated_column(saxpy, "memory")
    monkeypatch.setattr(nsys._Db, "check_plain", lambda self, t: None)
    with pytest.raises(InputError, match=f"value over {nsys.MAX_VALUE_BYTES >> 20} MiB"):
        nsys.load_trace(saxpy)


def test_nsight_generated_column_past_the_schema_check_stops_at_the_time_budget(saxpy, monkeypatch):
    analyze_bombs.nsys_generated_column(saxpy, "time", rows=2560)
    monkeypatch.setattr(nsys._Db, "check_plain", lambda self, t: None)
    monkeypatch.setattr(nsys, "TIME_BASE_S", 1.0)
    t0 = time.monotonic()
    with pytest.raises(InputError, match="takes more than 1 s to read"):
        nsys.load_trace(saxpy)
    # not a timing assert on our code: the 2560 rows cost about a minute unbounded
    assert time.monotonic() - t0 < 30


def test_nsight_step_budget_scales_with_the_rows_counted(tmp_path, monkeypatch):
    f = tmp_path / "clover.sqlite"
    f.write_bytes(gzip.decompress(third_party(CLOVERLEAF).read_bytes()))
    assert len(nsys.load_trace(f).kernels) > 0
    monkeypatch.setattr(nsys, "STEPS_PER_ROW", 1)
    monkeypatch.setattr(nsys, "STEPS_BASE", 20_000)
    with pytest.raises(InputError, match="SQLite steps"):
        nsys.load_trace(f)


def test_nsight_int64_overflow(saxpy, capsys):
    analyze_bombs.nsys_int64_overflow(saxpy)
    t = nsys.load_trace(saxpy)
    assert len(t.kernels) == 5
    # the sum and the int32 grid fields are unknown, not wrapped
    assert (t.kernels["shared_mem_bytes"] == -1).all() and (t.kernels["grid_x"] == -1).all()
    assert main(["analyze", str(saxpy), "--json"]) == 0
