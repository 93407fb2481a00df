"""The record walks of a window close, each with its common types found by exact type
(``aggregator.wire._plain``, ``aggregator.windows.plain``), give what their isinstance
definitions (``_plain_reference``, ``plain_reference``) give: the same msgpack bytes, on
windows the builder closes over simulated vLLM kernels (phases, roofline, verdicts, the
agent's health record) and on values chosen to take the general path (numpy scalars,
which subclass Python's float and int, NaN, subclasses of dict, str and int, tuples,
bytes, record arrays, dataclasses, Structs with None fields)."""
from __future__ import annotations

import dataclasses
import enum
import math
from collections import OrderedDict

import msgpack
import numpy as np
import pytest
from support.sim_window import simulated_builder

from ridgeline.aggregator import windows, wire
from ridgeline.probes.records import Health, Latency


def _packed(x) -> bytes:
    # what msgpack cannot pack (a dataclass the wire walk leaves as it is) as its repr
    return msgpack.packb(x, use_bin_type=True, default=lambda o: f"{type(o).__name__}: {o!r}")


def _simulated_window(final: bool = False):
    """A window of the simulator's llama-3-8b decode steps on an H100, closed by the builder."""
    from ridgeline.agent.health import HealthMeter
    wb = simulated_builder()
    health = HealthMeter().sample({"simulated": {"records": 10, "drops": 0, "errors": 0,
                                                 "rate": np.float64(1.5), "nan": float("nan")}}, 10,
                                  extra={"publisher_drops_by_topic": {"window": 0}, "by_pid": {4242: 1}})
    return wb.close(0, 10**9, health, final=final), health


class _Kind(enum.IntEnum):
    A = 3


class _Key(str):
    pass


@dataclasses.dataclass
class _Row:
    a: float
    b: object


ODD = {
    "np_float": np.float64(2.5), "np_nan": np.float64("nan"), "nan": float("nan"), "inf": -math.inf,
    "np_int": np.int32(-7), "np_bool": np.bool_(True), "enum": _Kind.A, "bool": True, "none": None,
    "tuple": (1, np.int64(2), (3.0, None)), "bytes": b"ab\x00\x00", "ordered": OrderedDict(b=1, a=np.uint8(2)),
    _Key("sub_key"): 1, 7: "int key", ("t", 1): "tuple key", "array": np.arange(3, dtype=np.int16),
    "records": np.array([(1, 2.0)], dtype=[("x", "<i4"), ("y", "<f8")]), "strings": np.array([b"x", b"yz"]),
    "dataclass": _Row(1.0, [np.float32(0.5)]), "struct": Latency(count=3, p50_ns=None, p99_ns=np.int64(9)),
    "nested": [{"gpu": {"kernels": np.int64(5)}, "health": Health(cpu_pct=np.float64(1.0))}],
}


def test_wire_walk_gives_its_definitions_bytes_on_a_closed_window():
    window, health = _simulated_window()
    assert window.gpus and window.gpus[0].phases, "the window folded no kernels"
    for rec in (window, health, window.gpus[0], window.agent):
        assert _packed(wire._plain(rec)) == _packed(wire._plain_reference(rec, wire._plain_reference))
    # the encoders themselves, as the golden-byte tests pin them
    assert wire.encode_window(window) == msgpack.packb({0: wire.SCHEMA_VERSION, 1: wire._plain_reference(window)},
                                                       use_bin_type=True)


@pytest.mark.parametrize("key", sorted(k for k in ODD if isinstance(k, str)))
def test_wire_walk_gives_its_definitions_bytes_on_odd_values(key):
    v = ODD[key]
    for x in (v, {key: v}, [v, v], (v,)):
        assert _packed(wire._plain(x)) == _packed(wire._plain_reference(x)), key


def test_wire_walk_keys_and_none_fields():
    # non-str keys travel as text; a Struct's None fields are left out, a dict's None kept
    got = wire._plain(ODD)
    assert got == wire._plain_reference(ODD) or _packed(got) == _packed(wire._plain_reference(ODD))
    assert "7" in got and "('t', 1)" in got and "sub_key" in got
    lat = got["struct"]
    assert lat == {wire.FIELDS["count"]: 3, wire.FIELDS["p99_ns"]: 9}
    assert got["none"] is None


def test_windows_walk_gives_its_definitions_bytes():
    window, health = _simulated_window()
    for x in (health, ODD, [ODD, (ODD,)], window.device, window.engine):
        fast, ref = windows.plain(x), windows.plain_reference(x)
        assert _packed(wire._plain(fast)) == _packed(wire._plain(ref))
    p = windows.plain(ODD)
    # floats: Python's NaN and infinity become None; numpy's float64 is converted first and kept
    assert p["nan"] is None and p["inf"] is None and math.isnan(p["np_nan"])
    assert p["bytes"] == "ab" and p["records"] == [{"x": 1, "y": 2.0}] and p["dataclass"] == {"a": 1.0, "b": [0.5]}
    assert type(p["np_float"]) is float and type(p["tuple"]) is list and "7" in p


def test_fast_walks_are_in_use():
    """The window close calls the fast walks (a change that routes it back through the
    definitions would pass the tests above and lose what they bought)."""
    calls = []
    real = windows.plain_reference

    def counting(obj, walk=None):
        calls.append(type(obj))
        return real(obj, walk)
    windows.plain_reference = counting
    try:
        _simulated_window()
    finally:
        windows.plain_reference = real
    # only values the fast path does not take (numpy scalars, Structs, ...) reach the definition
    assert dict not in calls and list not in calls and float not in calls
