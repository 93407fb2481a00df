"""probes.kineto_typed (msgspec typed decoding, the importer's fast path) and the
structural scanner it falls back to, both against the dict-based reference parse of the
real shared traces."""
from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest
from support.kineto_traces import TRACES, same_events

from ridgeline.probes import json_chunks, kineto_records, kineto_scan, kineto_typed, trace_joins
from ridgeline.probes.kineto import load_trace
from ridgeline.probes.kineto_dicts import load_trace_via_dicts


@pytest.fixture
def no_reference(monkeypatch):
    """Fail if any piece goes to the reference builder: the typed path did the work."""
    def refuse(piece, b):
        raise AssertionError("piece read by the reference builder")
    monkeypatch.setattr(kineto_typed, "reference", refuse)


@pytest.mark.parametrize("name", TRACES)
def test_typed_equals_reference(name, trace_path, no_reference):
    p = trace_path(name)
    same_events(kineto_typed.load(p), load_trace_via_dicts(p))


@pytest.mark.parametrize("name", TRACES)
def test_scanner_equals_reference(name, trace_path):
    p = trace_path(name)
    same_events(kineto_scan.load(Path(p), 1 << 20, False), load_trace_via_dicts(p))


@pytest.mark.parametrize("chunk", [4096, 100_000])
def test_piece_size_does_not_matter(chunk, trace_path, no_reference):
    p = trace_path(TRACES[2])
    same_events(kineto_typed.load(p, chunk_bytes=chunk), load_trace_via_dicts(p))


def test_two_readers_equal_one(tmp_path, trace_path, monkeypatch):
    p = tmp_path / "a100.json"
    p.write_bytes(gzip.open(trace_path(TRACES[5])).read())
    ref = load_trace_via_dicts(p)
    took = []
    real = kineto_typed._load_two
    monkeypatch.setattr(kineto_typed, "_load_two", lambda *a: took.append(real(*a)) or took[-1])
    same_events(kineto_typed.load(p, chunk_bytes=256 << 10, parallel=True), ref)
    assert took and took[0] is not None          # really read by two processes
    gz = trace_path(TRACES[5])
    same_events(kineto_typed.load(gz, chunk_bytes=256 << 10, parallel=True), ref)


@pytest.mark.parametrize("name", TRACES)
def test_two_readers_equal_the_reference_on_real_traces(name, trace_path, monkeypatch, no_reference):
    """The two-reader path (the child's rows through its spool file, its name ids mapped
    onto the parent's table, pieces merged in file order) against the dict-based
    reference on every shared trace, with pieces small enough that both readers take
    several; and the child really took its share."""
    p = trace_path(name)
    got = []
    real = kineto_typed._read_rows
    monkeypatch.setattr(kineto_typed, "_read_rows", lambda *a: got.append(a[2]) or real(*a))
    took = []
    real_two = kineto_typed._load_two
    monkeypatch.setattr(kineto_typed, "_load_two", lambda *a: took.append(real_two(*a)) or took[-1])
    same_events(kineto_typed.load(p, chunk_bytes=64 << 10, parallel=True), load_trace_via_dicts(p))
    assert took and took[0] is not None
    assert sum(got) > 0          # rows came from the child's spool file


def test_child_share_is_spread_evenly():
    takes = [kineto_typed._child_takes(i) for i in range(1600)]
    num, den = kineto_typed.CHILD_SHARE
    assert sum(takes) == 1600 * num // den
    # never more than two pieces in a row for either reader
    runs = "".join("c" if t else "p" for t in takes)
    assert "ccc" not in runs and "ppp" not in runs


def test_a_failing_child_falls_back_to_one_reader(tmp_path, trace_path, monkeypatch):
    p = trace_path(TRACES[5])

    def broken(*a):
        raise RuntimeError("child's decode failed")
    monkeypatch.setattr(kineto_typed, "_child_takes", lambda i: bool(i % 2))
    real = kineto_typed._decode_piece
    monkeypatch.setattr(kineto_typed, "_decode_piece",
                        lambda piece, b, names: real(piece, b, names) if os.getpid() == parent else broken())
    parent = os.getpid()
    took = []
    real_two = kineto_typed._load_two
    monkeypatch.setattr(kineto_typed, "_load_two", lambda *a: took.append(real_two(*a)) or took[-1])
    same_events(kineto_typed.load(p, chunk_bytes=256 << 10, parallel=True), load_trace_via_dicts(p))
    assert took == [None]        # the two-reader attempt gave up; one reader read it all


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("trouble", ["no temporary directory", "fork refused"])
def test_no_second_reader_falls_back_to_one(trouble, trace_path, monkeypatch):
    """Where the second reader cannot be set up (no usable temporary directory for its
    spool file: a read-only root, a full or missing TMPDIR; or fork refused: a process
    limit), the file is read by this process alone, as load_trace's contract says of
    any trouble with the second reader, and no descriptor is left open. Before: the
    OSError went out of load (analyze printed a traceback, exit 1)."""
    import tempfile
    p = trace_path(TRACES[5])
    if trouble == "no temporary directory":
        monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/ridgeline-spool")
    else:
        import multiprocessing.context

        def refuse(self):     # as Process.start raises it when fork() fails (EAGAIN)
            raise BlockingIOError(11, "Resource temporarily unavailable")
        monkeypatch.setattr(multiprocessing.context.ForkProcess, "start", refuse)
    took = []
    real_two = kineto_typed._load_two
    monkeypatch.setattr(kineto_typed, "_load_two", lambda *a: took.append(real_two(*a)) or took[-1])
    before = _open_fds()
    t = kineto_typed.load(p, chunk_bytes=256 << 10, parallel=True)
    assert took == [None]
    assert _open_fds() == before
    monkeypatch.undo()
    same_events(t, load_trace_via_dicts(p))


def test_the_child_runs_at_most_the_spool_lead_ahead_of_the_parent(trace_path, monkeypatch):
    """The child waits once its spool is SPOOL_LEAD_BYTES past what the parent has read
    back, so the spool (memory, where the temporary directory is a tmpfs) stays bounded
    however the two are scheduled. Here the parent takes only piece 0 and then reads the
    rest of the stream without taking the child's rows until the end: unbounded, the
    child's whole share would sit in the spool (it did before the bound)."""
    p = trace_path(TRACES[5])
    monkeypatch.setattr(kineto_typed, "SPOOL_LEAD_BYTES", 1)
    monkeypatch.setattr(kineto_typed, "_child_takes", lambda i: i > 0)
    ahead, pieces = [], []
    real_read, real_release = kineto_typed._read_rows, kineto_typed._release

    def read_rows(fd, dtype, n, offset):
        ahead.append(os.fstat(fd).st_size - offset)      # written by the child, not yet read back
        return real_read(fd, dtype, n, offset)

    def release(fd, offset, length):
        pieces.append(length)
        return real_release(fd, offset, length)
    monkeypatch.setattr(kineto_typed, "_read_rows", read_rows)
    monkeypatch.setattr(kineto_typed, "_release", release)
    took = []
    real_two = kineto_typed._load_two
    monkeypatch.setattr(kineto_typed, "_load_two", lambda *a: took.append(real_two(*a)) or took[-1])
    t = kineto_typed.load(p, chunk_bytes=64 << 10, parallel=True)
    assert took and took[0] is not None
    assert len(pieces) > 8 and sum(pieces) > 8 * max(pieces)     # enough pieces for the bound to show
    # one piece written past the lead, and the one the child is writing when the parent looks
    assert max(ahead) <= 2 * max(pieces) + 1, (max(ahead), max(pieces), sum(pieces))
    monkeypatch.undo()
    same_events(t, load_trace_via_dicts(p))


def test_spool_bytes_read_are_released(tmp_path):
    """The parent punches out what it has read of the child's spool (a tmpfs temporary
    directory would otherwise hold it in memory until the end)."""
    import tempfile
    with tempfile.TemporaryFile(dir=tmp_path) as f:
        f.write(b"x" * (4 << 20))
        f.flush()
        os.fsync(f.fileno())
        before = os.fstat(f.fileno()).st_blocks
        kineto_typed._release(f.fileno(), 0, 3 << 20)
        after = os.fstat(f.fileno()).st_blocks
        if after == before:
            pytest.skip("this file system does not punch holes")
        assert after * 512 <= (1 << 20) + 65536
        assert os.fstat(f.fileno()).st_size == 4 << 20          # size kept
        assert os.pread(f.fileno(), 16, (3 << 20) + 16) == b"x" * 16  # the rest intact
        assert os.pread(f.fileno(), 4, 0) == b"\0" * 4


@pytest.mark.parametrize("name", TRACES)
def test_per_name_equals_the_per_row_definition(name, trace_path):
    """kineto_records.per_name (a table by name id) against fn applied to each row's name."""
    from ridgeline.probes.kineto_records import api_category, copy_direction
    t = load_trace(trace_path(name), parallel=False)
    for rows, fn in ((t.api, api_category), (t.copies, copy_direction)):
        ids = rows["name_id"]
        want = [fn(t.names[i]) if i >= 0 else 0 for i in ids.tolist()]
        assert kineto_records.per_name(t.names, ids, fn, np.uint8).tolist() == want
    with_missing = np.array([-1, 3, -1, 0], dtype=np.int32)
    assert kineto_records.per_name(t.names, with_missing, len, np.int64).tolist() == \
        [0, len(t.names[3]), 0, len(t.names[0])]


def _write(tmp_path, events, name="t.json"):
    p = tmp_path / name
    p.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events, "deviceProperties": []}))
    return p


def _kernel(i, **over):
    e = {"ph": "X", "cat": "kernel", "name": f"k{i}", "pid": 0, "tid": 7, "ts": 100.5 + i, "dur": 0.25,
         "args": {"device": 0, "stream": 7, "correlation": i, "grid": [1, 2, 3], "block": [4, 5, 6]}}
    e.update(over)
    return e


def test_values_off_type_go_to_the_reference_builder(tmp_path):
    """null, bool, float and string values where ints belong, a two-element grid, a
    non-object element, a category this module does not know: same result as the
    reference, piece by piece."""
    events = [_kernel(i) for i in range(50)]
    events[3]["args"]["device"] = None
    events[9]["args"]["stream"] = True
    events[15]["args"]["correlation"] = 3.0
    events[21]["pid"] = "Spans"
    events[27]["args"]["grid"] = [1, 2]
    events.insert(33, 7)
    events[40]["cat"] = "Kernel"
    p = _write(tmp_path, events)
    ref = load_trace_via_dicts(p)
    for chunk in (256, 1 << 20):
        same_events(kineto_typed.load(p, chunk_bytes=chunk), ref)
    assert len(ref.kernels) == 49


def test_boundary_inside_a_string_falls_back_to_the_scanner(tmp_path):
    """'},{' inside a name: the cut there is not valid JSON, so the typed path gives up
    and load_trace reads the file with the scanner; the result is still exact."""
    events = [_kernel(i) for i in range(200)]
    events[100]["name"] = 'odd}, {"ph": "X"} name'
    p = _write(tmp_path, events)
    ref = load_trace_via_dicts(p)
    cuts = [c for c in range(100, 4000, 97)
            if _raises_unsplit(lambda c=c: kineto_typed.load(p, chunk_bytes=c))]
    assert cuts, "no piece size put a cut inside the string"
    for c in cuts[:3]:
        same_events(load_trace(p, chunk_bytes=c), ref)


def _raises_unsplit(fn) -> bool:
    try:
        fn()
    except json_chunks.Unsplit:
        return True
    return False


def test_bad_files_still_name_the_problem(tmp_path, trace_path):
    from ridgeline.probes.errors import InputError
    raw = gzip.open(trace_path(TRACES[2])).read()
    cut = tmp_path / "cut.json"
    cut.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(InputError, match="truncated JSON"):
        load_trace(cut)
    gz = tmp_path / "cut.json.gz"
    gz.write_bytes(trace_path(TRACES[2]).read_bytes()[:100_000])
    with pytest.raises(InputError, match="truncated gzip"):
        load_trace(gz)


def _stack_reference(pid, tid, ss, se):
    """The one-pass stack the vectorised parent search replaced."""
    parent, stack, last = [-1] * len(ss), [], None
    for i in range(len(ss)):
        if (pid[i], tid[i]) != last:
            stack.clear()
            last = (pid[i], tid[i])
        while stack and se[stack[-1]] < ss[i]:
            stack.pop()
        if stack:
            parent[i] = stack[-1]
        stack.append(i)
    return parent


def test_stack_parents_equal_the_stack_pass():
    """Nested, disjoint and partially overlapping intervals on several threads."""
    import numpy as np
    rng = np.random.default_rng(7)
    for _ in range(200):
        n = int(rng.integers(1, 300))
        pid, tid = rng.integers(0, 3, n), rng.integers(0, 2, n)
        st = rng.integers(0, 200, n)
        en = st + rng.integers(0, 60, n)
        o = np.lexsort((-en, st, tid, pid))
        pid, tid, st, en = pid[o], tid[o], st[o], en[o]
        thread = (pid.astype(np.int64) << 32) | tid
        assert trace_joins._stack_parents(thread, st, en).tolist() == \
            _stack_reference(pid.tolist(), tid.tolist(), st.tolist(), en.tolist())


def test_rows_grow_in_place(monkeypatch, trace_path):
    """Columns far larger than the first mapping: the mapping grows and keeps every row."""
    import numpy as np

    from ridgeline.probes.events import KERNEL_DTYPE, empty
    monkeypatch.setattr(kineto_typed, "ROWS_INITIAL_BYTES", 4096)
    rows = kineto_typed._Rows(KERNEL_DTYPE)
    parts = []
    for i in range(40):
        a = empty(KERNEL_DTYPE, 1000 + i)
        a["start_ns"] = np.arange(len(a)) + i * 10_000
        parts.append(a)
        rows.append(a)
    assert np.array_equal(rows.array(), np.concatenate(parts))
    p = trace_path(TRACES[5])
    same_events(kineto_typed.load(p, chunk_bytes=256 << 10, parallel=True), load_trace_via_dicts(p))


@pytest.mark.parametrize("name", [TRACES[2], TRACES[5]])
def test_tagged_decoder_alone_equals_reference(name, trace_path, monkeypatch):
    """Pieces decoded by the phase-tagged decoder only (the untagged one disabled, so
    a piece it refuses goes to the reference builder): same result."""
    import msgspec
    monkeypatch.setattr(kineto_typed, "_DECODER", msgspec.json.Decoder(list[int]))
    p = trace_path(name)
    same_events(kineto_typed.load(p, chunk_bytes=64 << 10), load_trace_via_dicts(p))


def test_without_msgspec_and_isal_the_scanner_reads_with_zlib(tmp_path, trace_path):
    """A host with ridgeline installed without its dependencies (the GPU check's bundle)
    still reads traces: the scanner path, with the standard library's gzip."""
    import subprocess
    import sys
    code = (
        "import sys, builtins\n"
        "real = builtins.__import__\n"
        "def imp(name, *a, **k):\n"
        "    if name.split('.')[0] in ('msgspec', 'isal'):\n"
        "        raise ImportError(name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = imp\n"
        "from ridgeline.probes.kineto import load_trace\n"
        "from ridgeline.probes import json_chunks\n"
        "assert json_chunks.igzip.__name__ == 'gzip'\n"
        "t = load_trace(sys.argv[1])\n"
        "print(len(t.kernels), len(t.api))\n")
    p = trace_path(TRACES[2])
    out = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    ref = load_trace_via_dicts(p)
    assert out.stdout.split() == [str(len(ref.kernels)), str(len(ref.api))]


def test_category_codes_and_exact_times_equal_the_reference(tmp_path, no_reference):
    """The tagged decoder reads "cat" as coded enum members: an absent or null category,
    known categories on phases other than "X" (counted, no rows), times that are ints,
    floats or ints past 2**53 us (float64 is not exact there), and operator shapes: same
    result as the reference, without its help."""
    # kernels' times all ints (the reference's rule is per kind: ints exact, any float
    # makes the whole column float), the operators' mixed
    events = [_kernel(i, ts=100 + i, dur=1) for i in range(20)]
    events[2]["ts"] = (1 << 53) + 3          # past float64's exact integers (and the time limit)
    events[7]["ts"] = kineto_records.TIME_LIMIT_US    # the last time kept
    events[8]["ts"] = kineto_records.TIME_LIMIT_US + 1
    events[3]["ts"], events[3]["dur"] = 1683564901550101, 8
    events[4]["dur"] = 1
    del events[5]["cat"]
    events[6]["cat"] = None
    events += [{"ph": "i", "name": "mark", "pid": 1, "tid": 1, "ts": 5},
               {"ph": "i", "cat": None, "name": "mark", "pid": 1, "tid": 1, "ts": 6},
               {"ph": "i", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 7},
               {"ph": "f", "cat": "kernel", "id": 3, "pid": 0, "tid": 7, "ts": 8, "bp": "e"},
               {"ph": "s", "cat": "ac2g", "id": 3, "pid": 1, "tid": 1, "ts": 8},
               {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 2, "ts": 9.125, "dur": 2,
                "args": {"External id": 4, "Input Dims": [[2, 3], [3, 4]], "Input type": ["float", "float"]}},
               {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 2, "ts": 12, "dur": 1,
                "args": {"External id": 5, "Input Dims": [[2, 3], []], "Input type": ["float", "Scalar"]}},
               {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 2, "ts": 14, "dur": 1,
                "args": {"External id": 6, "Input Dims": [[2, 3], [3, 4]], "Input type": ["float", "float"]}},
               {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 2, "ts": 15,
                "dur": 1, "args": {"External id": 6, "cbid": 211, "correlation": 1}}]
    p = _write(tmp_path, events)
    ref = load_trace_via_dicts(p)
    for chunk in (128, 1 << 20):
        same_events(kineto_typed.load(p, chunk_bytes=chunk), ref)
    # 20 kernels, 2 without a category, 3 with a time past the limit (7: its end)
    assert len(ref.kernels) == 15 and len(ref.cpu_ops) == 3


def test_an_unknown_category_goes_to_the_reference_builder(tmp_path):
    """A category this module does not know, on a complete event or a flow: the piece is
    the reference builder's (the tagged decoder refuses it, the untagged one reads it)."""
    events = [_kernel(i) for i in range(10)]
    events[4]["cat"] = "gpu_something_new"
    events.append({"ph": "f", "cat": "new_flow", "id": 3, "pid": 0, "tid": 7, "ts": 8})
    p = _write(tmp_path, events)
    same_events(kineto_typed.load(p), load_trace_via_dicts(p))
