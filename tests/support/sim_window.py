"""A window builder fed three forwards of the simulator's llama-3-8b decode steps on an H100
(one GPU, no annotations): phases, roofline and verdicts to close over, for the wire walk
tests (tests/test_wire_plain.py) and the close bench (bench/bench_close.py)."""
from __future__ import annotations


def simulated_builder():
    from ridgeline.agent.simulator.engine import SimConfig, SimEngine
    from ridgeline.aggregator.windows import WindowBuilder
    from ridgeline.probes.events import Trace
    e = SimEngine(SimConfig(model="llama-3-8b", gpu="h100", device=0, pid=4242, tid=4242, annotations=False),
                  seed=0, metrics=False)
    wb = WindowBuilder(host="h")
    for _ in range(3):
        e.forward([1] * 32, [1000] * 32)
        t = e.drain()
        wb.add_events(Trace(kernels=t.kernels, api=t.api, names=t.names, devices=t.devices,
                            meta={"source": "simulated"}))
    return wb
