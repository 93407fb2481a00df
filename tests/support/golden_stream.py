"""The golden window envelope (tests/data) published as the agent would, every 2 ms on a
plain zmq PUB socket: a stream for `ridgeline record` to take (tests/test_record_full_disk.py,
scripts/hardening-check.py)."""
from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import zmq

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "wire_envelope_window_v1.bin"


@contextlib.contextmanager
def golden_window_stream(endpoint: str):
    """Publish the golden envelope on ``endpoint`` until the block ends; yields its size."""
    env = GOLDEN.read_bytes()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)
    stop = threading.Event()

    def send():
        while not stop.is_set():
            pub.send_multipart([b"window", env])
            time.sleep(0.002)
    t = threading.Thread(target=send, daemon=True)
    t.start()
    try:
        yield len(env)
    finally:
        stop.set()
        t.join()
        pub.close(0)
        ctx.term()
