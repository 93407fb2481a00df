"""The live eBPF scheduling probe as the ebpf-marked tests start it: no target discovery
(targets only from :meth:`add_target`), and threads met at a wakeup or switch-in recognised
by their tgid for 30 s after a target is added (``seed_s``), the length of these tests."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def started_sched_probe():
    from ridgeline.probes.sched import SchedProbe
    p = SchedProbe(discover=False, seed_s=30.0)
    assert p.check().ok, p.check()
    p.start()
    try:
        yield p
    finally:
        p.stop()
