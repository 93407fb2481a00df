"""Per-function CPU timers for the agent process of ``bench_scale.py --time-agent FILE``.

cProfile charges every Python call (the recursive record walks of a window close cost
several times their own time under it); these wrap only the named functions and methods,
two ``thread_time_ns`` reads per call (the calling thread's CPU time, not wall time: the
main loop and the CUPTI pump thread are told apart and a wait costs nothing). Times are
inclusive; a function that recurses, or calls itself through another wrapped one, is
timed at its outermost call only. Counting starts when :func:`start` is called (after the
bench's warm-up), so totals divided by the measured seconds are CPU per second.
"""
from __future__ import annotations

import functools
import importlib
import json
import threading
import time

# "module:attr" or "module:Class.method"; the modules are ridgeline's.
TIMED = (
    "agent.daemon:Agent.close_window", "agent.daemon:Agent._poll_once", "agent.daemon:Agent.watch_takeovers",
    "agent.daemon:Agent.probe_counters", "agent.health:HealthMeter.sample",
    "aggregator.windows:WindowBuilder.close", "aggregator.windows:WindowBuilder.add_events",
    "aggregator.windows:WindowBuilder._gpus_close", "aggregator.windows:SourceFold.figures",
    "aggregator.windows:SourceFold._drain", "aggregator.windows:SourceFold._release_idle",
    "aggregator.windows:SourceFold._release_overdue", "aggregator.windows:SourceFold._gpu_process",
    "aggregator.windows:verdict_of", "aggregator.windows:plain", "aggregator.windows:fill_decode_kv_read",
    "aggregator.wire:encode_window", "aggregator.wire:encode_envelope", "agent.publisher:Publisher.publish",
    "probes.cupti.probe:CuptiProbe.poll", "probes.cupti.probe:CuptiProbe._collect",
    "probes.cupti.probe:CuptiProbe._to_shared_names", "probes.cupti.probe:CuptiProbe._merge",
    "probes.cupti.probe:CuptiProbe.ingest", "probes.cupti.probe:CuptiProbe._signal_ready",
    "probes.cupti.decode:ProcessDecoder.take", "probes.cupti.decode:ProcessDecoder._finish",
    "probes.cupti.decode:ProcessDecoder.add_batch", "probes.cupti.decode_native:join",
    "probes.cupti.decode_native:remap", "probes.cupti.server:CuptiServer.pump",
    "probes.cupti.server:CuptiServer.wait", "probes.cupti.server:CuptiServer._read",
    "probes.cupti.server:CuptiServer._frame_done",
)

_on = False
_totals: dict[str, list] = {}       # name -> [calls, cpu ns] (per thread name)
_local = threading.local()


def _wrap(name: str, fn):
    @functools.wraps(fn)
    def timed(*args, **kw):
        if not _on:
            return fn(*args, **kw)
        active = getattr(_local, "active", None)
        if active is None:
            active = _local.active = set()
        if name in active:              # an inner call of a timed one: counted there
            return fn(*args, **kw)
        active.add(name)
        t0 = time.thread_time_ns()
        try:
            return fn(*args, **kw)
        finally:
            dt = time.thread_time_ns() - t0
            active.discard(name)
            acc = _totals.setdefault(f"{threading.current_thread().name}: {name}", [0, 0])
            acc[0] += 1
            acc[1] += dt
    return timed


def install(names=TIMED) -> list[str]:
    """Wrap the named functions; returns those not found (a tree without them)."""
    missing = []
    for spec in names:
        mod_name, attr = spec.split(":")
        try:
            mod = importlib.import_module(f"ridgeline.{mod_name}")
        except ImportError:
            missing.append(spec)
            continue
        owner, _, leaf = attr.rpartition(".")
        obj = getattr(mod, owner) if owner else mod
        fn = obj.__dict__.get(leaf) if owner else getattr(mod, leaf, None)
        if fn is None or isinstance(fn, (staticmethod, classmethod, property)):
            missing.append(spec)
            continue
        setattr(obj, leaf, _wrap(spec, fn))
    return missing


def start() -> None:
    global _on, _t0
    _totals.clear()
    _t0 = time.monotonic()
    _on = True


_t0 = 0.0


def dump(path: str) -> None:
    global _on
    _on = False
    wall = time.monotonic() - _t0
    rows = {k: {"calls": c, "cpu_ms": ns / 1e6, "cpu_us_per_s": ns / 1e3 / wall if wall else 0.0}
            for k, (c, ns) in sorted(_totals.items(), key=lambda kv: -kv[1][1])}
    with open(path, "w") as f:
        json.dump({"seconds": wall, "functions": rows}, f, indent=1)
