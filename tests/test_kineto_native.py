"""probes.kineto_native (libridgeline_json.so, simdjson) against the typed reader
(probes.kineto_typed) and the dict reference (probes.kineto_dicts), on the real shared
traces, on the simulator's own traces, on odd values, and fuzzed with truncated and
garbage files (in a child process: a crash there is a failure here, not a lost worker)."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
import textwrap

import pytest
from support.kineto_traces import TRACES, same_events

from ridgeline.agent.simulator.engine import SimConfig, SimEngine
from ridgeline.agent.simulator.kineto_writer import write_kineto
from ridgeline.agent.simulator.workload import Workload
from ridgeline.probes import kineto_native, kineto_typed
from ridgeline.probes.errors import InputError
from ridgeline.probes.kineto import load_trace
from ridgeline.probes.kineto_dicts import load_trace_via_dicts


@pytest.fixture
def references(monkeypatch):
    """The pieces handed to the reference builder (each still read by it)."""
    seen = []
    real = kineto_typed.reference

    def counted(piece, b):
        seen.append(bytes(piece))
        return real(piece, b)
    monkeypatch.setattr(kineto_typed, "reference", counted)
    return seen


def same_tables(a, b):
    """Same events, and the same name table (ids too: same strings in the same order; the
    order follows the pieces, so both readers are given the same piece size)."""
    same_events(a, b)
    assert list(a.names) == list(b.names)


@pytest.mark.parametrize("name", TRACES)
def test_native_equals_typed_and_reference_on_real_traces(name, trace_path, references):
    p = trace_path(name)
    native = kineto_native.load(p)
    assert not references            # the native reader read every piece itself
    same_tables(native, kineto_typed.load(p, chunk_bytes=kineto_native.CHUNK_BYTES))
    same_events(native, load_trace_via_dicts(p))


@pytest.mark.parametrize("chunk", [4096, 100_000])
def test_piece_size_does_not_matter(chunk, trace_path, references):
    p = trace_path(TRACES[3])
    same_tables(kineto_native.load(p, chunk_bytes=chunk), kineto_typed.load(p, chunk_bytes=chunk))
    assert not references


def test_load_trace_reads_with_the_native_reader(trace_path, monkeypatch):
    calls = []
    real = kineto_native.load
    monkeypatch.setattr(kineto_native, "load", lambda *a, **k: calls.append(a) or real(*a, **k))
    p = trace_path(TRACES[0])
    same_events(load_trace(p), load_trace_via_dicts(p))
    assert len(calls) == 1


def test_native_equals_typed_on_the_simulators_trace(tmp_path, references):
    """The project's own Kineto writer (agent/simulator/kineto_writer.py)."""
    w = Workload(rate_per_s=20, duration_s=0.5, prompt_mean=128, prompt_max=256, output_mean=16, output_max=32)
    e = SimEngine(SimConfig(model="llama-3-8b", workload=w), seed=7)
    e.run()
    p = write_kineto(e.drain(), tmp_path / "sim.json.gz")
    native = kineto_native.load(p)
    assert len(native.kernels) > 100 and not references
    same_tables(native, kineto_typed.load(p, chunk_bytes=kineto_native.CHUNK_BYTES))
    same_events(native, load_trace_via_dicts(p))


_KERNEL = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 100, "dur": 2,
           "args": {"device": 0, "stream": 7, "correlation": 5, "grid": [1, 2, 3], "block": [4, 5, 6]}}
_OP = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 2, "ts": 99, "dur": 10,
       "args": {"External id": 9, "Input Dims": [[4, 8], [8, 16]], "Input type": ["float", "float"]}}


def _with(base: dict, **changes) -> dict:
    ev = json.loads(json.dumps(base))
    for k, v in changes.items():
        if k.startswith("a_"):
            ev["args"][k[2:].replace("_", " ")] = v
        else:
            ev[k] = v
    return ev


# Events whose values are not what Kineto writes: the native side must leave their piece
# to the reference builder (True), or read it itself exactly (False).
ODD = {
    "float-ts": (_with(_KERNEL, ts=1.5e3, dur=0.0015), False),
    "string-pid": (_with(_KERNEL, pid="Spans"), False),
    "wide-tid": (_with(_OP, tid=1 << 40), False),
    "negative-pid": (_with(_OP, pid=-7), False),
    "no-dur": ({k: v for k, v in _KERNEL.items() if k != "dur"}, False),
    "null-name": (_with(_KERNEL, name=None), False),
    "escaped-name": (_with(_KERNEL, name='a\\"b\u00e9\n'), False),
    "no-args": ({k: v for k, v in _KERNEL.items() if k != "args"}, False),
    "other-phase": (_with(_KERNEL, ph="i"), False),
    "null-cat": (_with(_KERNEL, cat=None), False),
    "ignored-cat": (_with(_KERNEL, cat="python_function", ts="not a number"), False),
    "op-floats-in-dims": (_with(_OP, a_Input_Dims=[[1.5, 2e3]]), False),
    # read natively, then dropped by reject_invalid_times: the library counts such rows
    # (rj_bad_times), or finishing the trace would skip that check
    "negative-dur": (_with(_KERNEL, dur=-5), False),
    "negative-dur-op": (_with(_OP, dur=-0.5), False),
    "end-past-limit": (_with(_KERNEL, ts=(1 << 62) // 1000 - 10, dur=100), False),
    "no-ts": ({k: v for k, v in _KERNEL.items() if k != "ts"}, True),
    "string-ts": (_with(_KERNEL, ts="100"), True),
    "null-ts": (_with(_KERNEL, ts=None), True),
    "huge-ts": (_with(_KERNEL, ts=1e300), True),
    "int-past-int64": (_with(_KERNEL, a_correlation=1 << 64), True),
    "float-correlation": (_with(_KERNEL, a_correlation=5.0), True),
    "bool-device": (_with(_KERNEL, a_device=True), True),
    "null-device": (_with(_KERNEL, a_device=None), True),
    "short-grid": (_with(_KERNEL, a_grid=[1, 2]), True),
    "wide-registers": (_with(_KERNEL, a_registers_per_thread=1 << 33), True),
    "float-pid": (_with(_KERNEL, pid=1.0), True),
    "unknown-cat": (_with(_KERNEL, cat="something_new"), True),
    "number-cat": (_with(_KERNEL, cat=3), True),
    "number-name": (_with(_KERNEL, name=3), True),
    "number-ph": (_with(_KERNEL, ph=1), True),
    "element-not-object": (7, True),
}


@pytest.mark.parametrize("case", sorted(ODD))
def test_odd_values_read_exactly_as_the_reference(case, tmp_path, references):
    ev, to_reference = ODD[case]
    doc = {"traceEvents": [_KERNEL, _OP, ev, _with(_KERNEL, name="after", ts=200)], "deviceProperties": []}
    p = tmp_path / "odd.json"
    p.write_text(json.dumps(doc))
    try:
        ref = load_trace_via_dicts(p)
    except (OverflowError, AttributeError):
        # values the reference cannot hold: the structural scanner decides (probes.kineto)
        from ridgeline.probes import json_chunks, kineto_scan
        with pytest.raises(json_chunks.Unsplit):
            kineto_native.load(p)
        assert to_reference and references
        same_events(load_trace(p), kineto_scan.load(p, 1 << 20, False))
        return
    got = kineto_native.load(p)
    same_events(got, ref)
    assert bool(references) == to_reference


def test_args_not_an_object_is_read_by_the_scanner_not_a_traceback(tmp_path):
    """The dict reference cannot read it (AttributeError there): the scanner decides."""
    from ridgeline.probes import json_chunks, kineto_scan
    p = tmp_path / "args.json"
    p.write_text(json.dumps({"traceEvents": [_KERNEL, _with(_KERNEL, args=[1])]}))
    with pytest.raises(json_chunks.Unsplit):
        kineto_native.load(p)
    same_events(load_trace(p), kineto_scan.load(p, 1 << 20, False))


def test_sdpa_causal_flag_as_the_typed_reader(tmp_path, trace_path):
    """SDPA operators' causal flag comes from their Concrete Inputs (probes.sdpa)."""
    from ridgeline.probes import sdpa
    op = sorted(sdpa.SDPA_OPS)[0]
    evs = [_with(_OP, name=op, a_Concrete_Inputs=["", "", "", "", "0.0", "True"], a_Input_type=["float"] * 6),
           _with(_OP, name=op, ts=120), _with(_OP, name="aten::mm", a_Concrete_Inputs=["x"])]
    p = tmp_path / "sdpa.json"
    p.write_text(json.dumps({"traceEvents": [_KERNEL, *evs]}))
    got, typed = kineto_native.load(p), kineto_typed.load(p)
    same_tables(got, typed)
    same_events(got, load_trace_via_dicts(p))


def test_a_missing_library_is_one_line_naming_it(tmp_path, trace_path, monkeypatch):
    monkeypatch.setattr(kineto_native, "_lib", None)
    monkeypatch.setattr(kineto_native, "library_path", lambda: tmp_path / "libridgeline_json.so")
    with pytest.raises(InputError) as e:
        load_trace(trace_path(TRACES[0]))
    msg = str(e.value)
    assert "\n" not in msg and "libridgeline_json.so is missing" in msg and "make -C" in msg
    assert "libsimdjson-dev" in msg
    (tmp_path / "libridgeline_json.so").write_bytes(b"not a library")
    with pytest.raises(InputError, match="does not load"):
        load_trace(trace_path(TRACES[0]))


_FUZZ = textwrap.dedent("""
    import random, sys
    from ridgeline.probes.kineto import load_trace
    from ridgeline.probes.errors import InputError
    src = open(sys.argv[1], "rb").read()
    out = sys.argv[2]
    rnd = random.Random(21)
    cases = [src[:n] for n in sorted(rnd.sample(range(1, len(src)), 40))]
    for _ in range(60):
        b = bytearray(src)
        for _ in range(rnd.randint(1, 8)):
            b[rnd.randrange(len(b))] = rnd.choice(b'{}[]",:0123456789eE.-\\\\ntfu\\x00\\xff')
        cases.append(bytes(b))
    cases += [bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 4096))) for _ in range(20)]
    cases += [b'{"traceEvents": [' + b'[' * 5000 + b']' * 5000 + b']}',
              b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "' + b'\\\\' * 3 + b'"}]}']
    ok = errors = 0
    for i, data in enumerate(cases):
        p = f"{out}/c{i}.json"
        open(p, "wb").write(data)
        try:
            load_trace(p)
            ok += 1
        except InputError as e:
            assert "\\n" not in str(e), str(e)
            errors += 1
    print(ok, errors)
""")


def test_fuzzed_files_give_a_trace_or_one_line_never_a_crash(tmp_path, trace_path):
    src = tmp_path / "src.json"
    src.write_bytes(gzip.open(trace_path(TRACES[0])).read()[:200_000])
    r = subprocess.run([sys.executable, "-c", _FUZZ, str(src), str(tmp_path)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    ok, errors = map(int, r.stdout.split())
    assert ok + errors == 122 and errors >= 40     # truncations and garbage are refused


@pytest.mark.parametrize("name", TRACES)
def test_analyze_prints_the_same_figures_with_either_reader(name, trace_path, capsys, monkeypatch):
    """The whole command's output (`analyze --json`), native reader vs the typed one."""
    from ridgeline.agent.cli import main
    p = str(trace_path(name))
    assert main(["analyze", p, "--json"]) == 0
    native = capsys.readouterr().out
    monkeypatch.setattr(kineto_native, "load",
                        lambda path, chunk_bytes, budget=None: kineto_typed.load(path, chunk_bytes, False, budget))
    assert main(["analyze", p, "--json"]) == 0
    typed = capsys.readouterr().out
    assert len(native) > 1000 and native == typed


def test_a_lone_surrogate_escape_is_one_line_not_a_traceback(tmp_path):
    """simdjson refuses it (the piece goes to the reference, whose orjson refuses it too);
    the structural scanner's orjson error used to escape as a traceback."""
    p = tmp_path / "surrogate.json"
    p.write_text('{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "a\\ud800b", "ts": 1, "dur": 1}]}')
    with pytest.raises(InputError, match="not valid JSON .no low surrogate"):
        load_trace(p)


def test_a_piece_past_the_parsers_cap_is_read_by_the_reference(tmp_path, references):
    """The parser's memory is bounded by its cap (twice the piece size plus 1 MiB)."""
    p = tmp_path / "big.json"
    p.write_text(json.dumps({"traceEvents": [_KERNEL, _with(_KERNEL, name="k" * (2 << 20)), _OP]}))
    got = kineto_native.load(p, chunk_bytes=64 << 10)
    assert references
    same_events(got, load_trace_via_dicts(p))
    assert got.names[int(got.kernels["name_id"][1])] == "k" * (2 << 20)
