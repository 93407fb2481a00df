"""Wire format between libridgeline_cupti.so and the agent (mirror of probes/native/ridgeline_wire.h).

Frames over a unix-domain stream socket: a 16-byte header (magic, type, protocol
version, body length) and a body. Parsing here is strict and bounded: every length and
count is checked against the bytes actually present before anything is sliced, so a
malformed or hostile peer gets a :class:`ProtocolError` (counted by the server, which
then closes that one connection) and never an exception from deep inside numpy, a huge
allocation, or a stall.

Two levels of error: a broken *frame* (magic, version, type, or a length over
:data:`MAX_BODY_BYTES`) cannot be resynchronised, so that connection is closed; a
complete frame whose *body* is wrong costs only that message (the next frame starts at
a known offset). Inside a batch, a section whose kind or record size is implausible
(e.g. the library's record walk failed and the rest of the buffer became one record)
costs only that section: it is returned in :attr:`Batch.rejected` and counted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MAGIC = 0x31434C52            # b"RLC1" little-endian
PROTO_VERSION = 1
MSG_HELLO, MSG_BATCH, MSG_CONTROL = 1, 2, 3
MODE_ALWAYS_ON, MODE_DEEP = 0, 1
MODE_NAMES = {MODE_ALWAYS_ON: "always-on", MODE_DEEP: "deep"}

FLAG_GRAPH_LEVEL = 1 << 0
FLAG_MULTI_SUBSCRIBER = 1 << 1
FLAG_CONFLICT = 1 << 2
FLAG_NO_CUPTI = 1 << 3
FLAG_TEST_MODE = 1 << 4
FLAG_WALK_WITH_CUPTI = 1 << 5
#: legacy CUPTI: another tool (torch.profiler/Kineto) took the activity callbacks; collection
#: is paused until it is done (the status lines say "takeover:" / "resumed:")
FLAG_TAKEN_OVER = 1 << 6
#: CONTROL flags (agent -> library)
CONTROL_RECLAIM = 1 << 0

MAX_DEVICES = 16
#: Largest body accepted. A batch is one CUPTI buffer plus the names new on the
#: connection; the library caps its buffers at 64 MiB and the names of one batch at
#: 16 MiB so that every batch fits (probes/native, RIDGELINE_BUFFER_BYTES).
MAX_BODY_BYTES = 96 << 20
MAX_NAME_BYTES = 4096
MAX_SECTIONS = 64
MAX_KIND = 64
#: CUPTI callback ids are small dense enums (runtime about 500, driver about 800 in 13.x);
#: the decoder indexes tables by them, so anything larger is refused, not allocated.
MAX_CBID = 4096
MAX_CBIDS = 4096
MAX_RECORD_BYTES = 4096
#: Device ordinals above this are not GPUs (CUDA enumerates a few dozen at most).
MAX_DEVICE_ID = 1023
#: Library counters are cumulative event counts; 2**53 is beyond any real value and the
#: largest integer a float (Prometheus' sample type) holds exactly.
MAX_COUNTER = 1 << 53

FRAME_DTYPE = np.dtype([("magic", "<u4"), ("type", "<u2"), ("proto", "<u2"), ("length", "<u4"),
                        ("reserved", "<u4")])
HELLO_DTYPE = np.dtype([("pid", "<u4"), ("cupti_version", "<u4"), ("header_api_version", "<u4"),
                        ("mode", "<u4"), ("flags", "<u4"), ("kernel_sample_every", "<u4"),
                        ("comm_len", "<u4"), ("status_len", "<u4"), ("n_sizes", "<u4"), ("n_cbids", "<u4")])
KIND_SIZE_DTYPE = np.dtype([("kind", "<u4"), ("size", "<u4")])
CBID_DTYPE = np.dtype([("domain", "<u4"), ("cbid", "<u4"), ("category", "<u4"), ("name_len", "<u4")])
BATCH_DTYPE = np.dtype([
    ("pid", "<u4"), ("cupti_version", "<u4"), ("seq", "<u8"),
    ("mode", "<u4"), ("flags", "<u4"), ("kernel_sample_every", "<u4"), ("n_devices", "<u4"),
    ("n_names", "<u4"), ("n_sections", "<u4"), ("records", "<u8"),
    ("dropped_cupti", "<u8"), ("dropped_pool_full", "<u8"), ("dropped_no_agent", "<u8"),
    ("dropped_send", "<u8"), ("sampled_out", "<u8"), ("names_dropped", "<u8"), ("walk_errors", "<u8"),
    ("device_ids", "<u4", (MAX_DEVICES,)),
])
NAME_DTYPE = np.dtype([("ptr", "<u8"), ("len", "<u4"), ("reserved", "<u4")])
SECTION_DTYPE = np.dtype([("kind", "<u4"), ("record_size", "<u4"), ("count", "<u4"), ("reserved", "<u4")])
CONTROL_DTYPE = np.dtype([("mode", "<u4"), ("kernel_sample_every", "<u4"), ("flags", "<u4"), ("reserved", "<u4")])

#: Cumulative library counters carried in every batch header.
LIBRARY_COUNTERS = ("dropped_cupti", "dropped_pool_full", "dropped_no_agent", "dropped_send",
                    "sampled_out", "names_dropped", "walk_errors")

_BATCH_FIELDS = BATCH_DTYPE.names

assert FRAME_DTYPE.itemsize == 16 and HELLO_DTYPE.itemsize == 40 and BATCH_DTYPE.itemsize == 168


class ProtocolError(ValueError):
    """A message that breaks the wire format; the sender's connection is closed."""


@dataclass
class Hello:
    pid: int
    cupti_version: int
    header_api_version: int
    mode: int
    flags: int
    kernel_sample_every: int
    comm: str
    status: str
    record_sizes: dict[int, int]
    #: (domain, cbid) -> (category, name)
    cbids: dict[tuple[int, int], tuple[int, str]] = field(default_factory=dict)


@dataclass
class Section:
    kind: int
    record_size: int
    count: int
    data: memoryview      # count * record_size bytes, exactly as CUPTI wrote them


@dataclass
class Batch:
    header: np.void       # one BATCH_DTYPE record
    names: dict[int, str]  # CUPTI name pointer -> string (new on this connection)
    sections: list[Section]
    #: sections skipped because their kind or record size is implausible: (kind, count, reason)
    rejected: list[tuple[int, int, str]] = field(default_factory=list)


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def parse_frame_header(buf) -> tuple[int, int]:
    """Return ``(type, body_length)`` of the 16-byte frame header, or raise ProtocolError."""
    if len(buf) < FRAME_DTYPE.itemsize:
        raise ProtocolError("short frame header")
    h = np.frombuffer(buf, FRAME_DTYPE, 1)[0]
    if int(h["magic"]) != MAGIC:
        raise ProtocolError(f"bad magic 0x{int(h['magic']):08x}")
    if int(h["proto"]) != PROTO_VERSION:
        raise ProtocolError(f"unsupported protocol version {int(h['proto'])}")
    t = int(h["type"])
    if t not in (MSG_HELLO, MSG_BATCH, MSG_CONTROL):
        raise ProtocolError(f"unknown message type {t}")
    n = int(h["length"])
    if n > MAX_BODY_BYTES:
        raise ProtocolError(f"message of {n} bytes exceeds the {MAX_BODY_BYTES} byte limit")
    return t, n


class _Reader:
    __slots__ = ("mv", "pos")

    def __init__(self, body):
        self.mv = memoryview(body).cast("B")
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.mv):
            raise ProtocolError(f"truncated message: {what} needs {n} bytes at offset {self.pos}, "
                                f"{len(self.mv) - self.pos} left")
        out = self.mv[self.pos:self.pos + n]
        self.pos += n
        return out

    def struct(self, dtype: np.dtype, what: str, count: int = 1) -> np.ndarray:
        return np.frombuffer(self.take(dtype.itemsize * count, what), dtype, count)

    def text(self, n: int, what: str, limit: int) -> str:
        if n > limit:
            raise ProtocolError(f"{what} of {n} bytes exceeds {limit}")
        raw = bytes(self.take(n, what))
        self.take(_pad8(n) - n, what + " padding")
        return raw.decode("utf-8", "replace")


def parse_hello(body) -> Hello:
    r = _Reader(body)
    h = r.struct(HELLO_DTYPE, "hello")[0]
    if int(h["n_sizes"]) > MAX_KIND or int(h["n_cbids"]) > MAX_CBIDS:
        raise ProtocolError("hello: implausible table sizes")
    comm = r.text(int(h["comm_len"]), "comm", 256)
    status = r.text(int(h["status_len"]), "status", 8192)
    sizes = r.struct(KIND_SIZE_DTYPE, "record sizes", int(h["n_sizes"]))
    cbids: dict[tuple[int, int], tuple[int, str]] = {}
    for _ in range(int(h["n_cbids"])):
        c = r.struct(CBID_DTYPE, "cbid")[0]
        name = r.text(int(c["name_len"]), "cbid name", 256)
        domain, cbid, category = int(c["domain"]), int(c["cbid"]), int(c["category"])
        if domain not in (1, 2) or cbid >= MAX_CBID or category > 255:
            raise ProtocolError(f"hello: callback id {cbid} of domain {domain} (category {category}) "
                                f"is out of range (domains 1-2, ids below {MAX_CBID})")
        cbids[(domain, cbid)] = (category, name)
    if r.pos != len(r.mv):
        raise ProtocolError(f"hello: {len(r.mv) - r.pos} trailing bytes")
    return Hello(int(h["pid"]), int(h["cupti_version"]), int(h["header_api_version"]), int(h["mode"]),
                 int(h["flags"]), int(h["kernel_sample_every"]), comm, status,
                 {int(k): int(s) for k, s in zip(sizes["kind"], sizes["size"])}, cbids)


def parse_batch(body) -> Batch:
    r = _Reader(body)
    h = r.struct(BATCH_DTYPE, "batch header")[0]
    # every field as a Python int at once: field by field cost a microsecond each, per batch
    hv = dict(zip(_BATCH_FIELDS, h.item()))
    n_names, n_sections = hv["n_names"], hv["n_sections"]
    if n_sections > MAX_SECTIONS:
        raise ProtocolError(f"batch: {n_sections} sections (at most {MAX_SECTIONS})")
    if hv["n_devices"] > MAX_DEVICES:
        raise ProtocolError("batch: too many devices")
    for k in LIBRARY_COUNTERS:
        if hv[k] >= MAX_COUNTER:
            raise ProtocolError(f"batch: counter {k} = {hv[k]} is out of range")
    # each name takes at least 16 bytes: a count larger than the body allows is a lie
    if n_names * NAME_DTYPE.itemsize > len(r.mv):
        raise ProtocolError(f"batch: {n_names} names cannot fit in {len(r.mv)} bytes")
    names: dict[int, str] = {}
    for _ in range(n_names):
        n = r.struct(NAME_DTYPE, "name")[0]
        names[int(n["ptr"])] = r.text(int(n["len"]), "name", MAX_NAME_BYTES)
    sections: list[Section] = []
    rejected: list[tuple[int, int, str]] = []
    seen = set()
    total = 0
    for _ in range(n_sections):
        kind, size, count, _ = r.struct(SECTION_DTYPE, "section header")[0].item()
        # the bytes must be there whatever the section says: that keeps the framing
        data = r.take(size * count, f"section of kind {kind}")
        total += count
        if not 0 < kind < MAX_KIND or kind in seen:
            rejected.append((kind, count, f"bad or repeated record kind {kind}"))
            continue
        seen.add(kind)
        if size < 8 or size > MAX_RECORD_BYTES or size % 8:
            rejected.append((kind, count, f"implausible record size {size} for kind {kind}"))
            continue
        sections.append(Section(kind, size, count, data))
    if r.pos != len(r.mv):
        raise ProtocolError(f"batch: {len(r.mv) - r.pos} trailing bytes")
    if total != hv["records"]:
        raise ProtocolError(f"batch: header says {hv['records']} records, sections hold {total}")
    return Batch(h, names, sections, rejected)


def encode_control(mode: int, kernel_sample_every: int = 0, flags: int = 0) -> bytes:
    """A CONTROL frame switching the library's mode (and optionally its kernel sampling);
    ``flags`` may ask it to reclaim CUPTI after a takeover (:data:`CONTROL_RECLAIM`)."""
    if mode not in MODE_NAMES:
        raise ValueError(f"unknown mode {mode}")
    body = np.zeros(1, CONTROL_DTYPE)
    body["mode"] = mode
    body["kernel_sample_every"] = kernel_sample_every
    body["flags"] = flags
    hdr = np.zeros(1, FRAME_DTYPE)
    hdr["magic"], hdr["type"], hdr["proto"], hdr["length"] = MAGIC, MSG_CONTROL, PROTO_VERSION, CONTROL_DTYPE.itemsize
    return hdr.tobytes() + body.tobytes()


def encode_frame(msg_type: int, body: bytes) -> bytes:
    """Frame ``body`` (used by tests and tools that speak the library's side)."""
    hdr = np.zeros(1, FRAME_DTYPE)
    hdr["magic"], hdr["type"], hdr["proto"], hdr["length"] = MAGIC, msg_type, PROTO_VERSION, len(body)
    return hdr.tobytes() + body
