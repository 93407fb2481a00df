"""The agent's CUPTI socket (probes.cupti.server) opened for a test and pumped by it
(tests/test_cupti_peer_process.py, tests/test_cupti_starvation.py)."""
from __future__ import annotations

import contextlib
import time

from ridgeline.probes.cupti.server import CuptiServer


@contextlib.contextmanager
def cupti_server(path, **kw):
    """A CuptiServer listening on ``path`` for the block; closed after it."""
    s = CuptiServer(str(path), **kw)
    s.open()
    try:
        yield s
    finally:
        s.close()


def pump_until(s: CuptiServer, what, seconds: float) -> bool:
    """Pump ``s`` until ``what()`` holds or ``seconds`` pass; what ``what()`` last said."""
    end = time.monotonic() + seconds
    while not (ok := what()) and time.monotonic() < end:
        s.pump(0.01)
    return ok
