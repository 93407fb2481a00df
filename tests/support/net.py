"""Ports and waiting, for tests that start servers of their own (bound to port 0 first:
safe with tests running in parallel).
"""
from __future__ import annotations

import socket
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred, seconds=30.0):
    """Poll ``pred`` until it holds; False at the deadline."""
    end = time.monotonic() + seconds
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True
