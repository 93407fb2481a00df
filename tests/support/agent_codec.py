"""The wire codec for agent tests: ``aggregator.wire`` when it is installed, otherwise a
stand-in with the same five functions so transport and loop tests run meanwhile.

The stand-in is NOT the project's wire schema (that is aggregator/wire.py, tested in
tests/test_wire.py); it only carries envelopes and Traces through msgpack.
"""
import msgpack
import numpy as np

from ridgeline.probes.errors import InputError
from ridgeline.probes.events import (API_DTYPE, COPY_DTYPE, CPU_OP_DTYPE, KERNEL_DTYPE, RANGE_DTYPE, Device,
                           NameTable, Trace)

_DT = {"kernels": KERNEL_DTYPE, "copies": COPY_DTYPE, "api": API_DTYPE, "ranges": RANGE_DTYPE, "cpu_ops": CPU_OP_DTYPE}


class StandInCodec:
    SCHEMA_VERSION = 0

    @staticmethod
    def encode_envelope(topic, seq, payload, host, ts_ns):
        return msgpack.packb({"v": 0, "topic": topic, "seq": seq, "host": host, "ts_ns": ts_ns, "payload": payload})

    @staticmethod
    def decode_envelope(b):
        try:
            d = msgpack.unpackb(b, strict_map_key=False)
        except (ValueError, TypeError) as exc:   # what msgpack raises for malformed bytes
            raise InputError(f"bad envelope: {exc}") from None
        if not isinstance(d, dict) or d.get("v") != 0:
            raise InputError("bad envelope version")
        return d

    @staticmethod
    def encode_window(w):
        return w

    @staticmethod
    def decode_window(w):
        return w

    @staticmethod
    def encode_event_batch(t):
        return {"arrays": {k: getattr(t, k).tobytes() for k in _DT}, "names": list(t.names),
                "devices": [[d.index, d.name] for d in t.devices], "meta": {k: v for k, v in t.meta.items()
                                                                              if isinstance(v, (str, int, float, bool))}}

    @staticmethod
    def decode_event_batch(p):
        arrays = {k: np.frombuffer(p["arrays"][k], dtype=dt).copy() for k, dt in _DT.items()}
        return Trace(**arrays, names=NameTable(p["names"]), devices=[Device(i, n) for i, n in p["devices"]],
                     meta=dict(p["meta"]))


try:
    from ridgeline.aggregator import wire as codec   # noqa: F401
    REAL_WIRE = True
except ImportError:
    codec = StandInCodec()
    REAL_WIRE = False
