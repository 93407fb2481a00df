"""SchedProbe lifecycle without loading anything: poll before start, idempotent stop, layout checks."""
from __future__ import annotations

from ridgeline.probes import btf
from ridgeline.probes.sched import SchedProbe, raw_layout_problem


def test_lifecycle_without_start():
    p = SchedProbe(pids=[1])
    assert p.poll() is None
    p.stop()
    p.stop()
    c = p.counters()
    assert c == {"records": 0, "drops": 0, "errors": 0}
    p.add_target(2)              # before start: remembered for start()
    assert p._initial == [1, 2]


def test_raw_layout_check_reports_a_mismatch():
    types = [None,
             (btf.KIND_INT, "int", 4, None)]
    assert "not in BTF" in raw_layout_problem(types)
