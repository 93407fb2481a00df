"""``json_chunks.ArrayStream.pieces``: the pieces of a real trace are its events, in order,
whole, also when the consumer writes on the byte before and the byte after each padded
piece (the native reader puts its brackets there and parses in place, ``probes/native_json``).

Checked on shared third-party traces (``../shared/traces``, PROVENANCE.md there) against
orjson's parse of the whole decompressed file, at block sizes that cut most events' neighbours.
"""
from __future__ import annotations

import gzip

import numpy as np
import orjson
import pytest
from conftest import shared_trace

from ridgeline.probes import json_chunks

TRACES = ["nvidia-training/hta_a100_alexnet_benchmark.json.gz",
          "nvidia-inference/tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz"]


def _pieces(path, chunk_bytes: int, scribble: bool) -> tuple[list[bytes], int]:
    stream = json_chunks.ArrayStream(path, "traceEvents", chunk_bytes)
    out, padded = [], 0
    for piece in stream.pieces():
        out.append(bytes(piece))
        if stream.padded:
            padded += 1
            if scribble:
                # what rj_piece does: brackets on the byte before the piece and the one after
                # it; here bytes that break the JSON if they leak into the next piece
                base = piece.obj
                at = np.frombuffer(piece, np.uint8).ctypes.data - np.frombuffer(base, np.uint8).ctypes.data
                end = at + len(piece)
                assert at >= 1 and end + json_chunks.PIECE_PAD <= len(base)   # readable padding
                base[at - 1] = base[end] = ord("#")
    return out, padded


@pytest.mark.parametrize("name", TRACES)
@pytest.mark.parametrize("chunk_bytes", [4096, 100_000])
def test_pieces_are_the_events_whole_even_when_the_padding_is_written(name, chunk_bytes):
    path = shared_trace(name)
    want = orjson.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    for scribble in (False, True):
        pieces, padded = _pieces(path, chunk_bytes, scribble)
        got = [e for p in pieces for e in orjson.loads(b"[" + p + b"]")]
        assert got == want
        assert padded == len(pieces) - 1 >= 3     # every piece but the array's last is padded


def test_the_native_reader_refuses_to_load_when_simdjson_reads_past_the_pad(monkeypatch):
    # pieces are parsed in place with PIECE_PAD readable bytes after them; the library says
    # how many its simdjson reads (SIMDJSON_PADDING), and a larger figure refuses the reader
    from ridgeline.probes import json_chunks, kineto_native
    lib = kineto_native.library()
    assert 0 < lib.rj_padding() <= json_chunks.PIECE_PAD
    monkeypatch.setattr(kineto_native, "_lib", None)
    monkeypatch.setattr(json_chunks, "PIECE_PAD", lib.rj_padding() - 1)
    with pytest.raises(kineto_native.MissingReader, match="PIECE_PAD"):
        kineto_native.library()


@pytest.mark.parametrize("form", ["plain", "two_members"])
def test_pieces_of_a_plain_file_and_of_a_two_member_gzip_are_the_events(form, tmp_path):
    """Blocks are inflated straight into the piece buffer (readinto): the same events from
    an uncompressed file and from a gzip of two members cut inside an event (the inflate
    crosses the member boundary within one block)."""
    src = shared_trace(TRACES[1])
    raw = gzip.decompress(src.read_bytes())
    want = orjson.loads(raw)["traceEvents"]
    path = tmp_path / ("t.json" if form == "plain" else "t.json.gz")
    if form == "plain":
        path.write_bytes(raw)
    else:
        half = len(raw) // 2 + 7
        path.write_bytes(gzip.compress(raw[:half]) + gzip.compress(raw[half:]))
    for chunk_bytes in (4096, 1 << 20):
        pieces, padded = _pieces(path, chunk_bytes, scribble=True)
        assert [e for p in pieces for e in orjson.loads(b"[" + p + b"]")] == want
        assert padded == len(pieces) - 1 >= 1


def test_truncated_gzip_is_one_input_error(tmp_path):
    data = shared_trace(TRACES[1]).read_bytes()
    path = tmp_path / "cut.json.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(json_chunks.InputError, match="truncated gzip file"):
        for _ in json_chunks.ArrayStream(path, "traceEvents", 4096).pieces():
            pass
