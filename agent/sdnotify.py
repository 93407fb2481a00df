"""systemd's notify protocol (sd_notify) without libsystemd.

Contract: :class:`Notifier` sends datagrams to ``$NOTIFY_SOCKET`` (a filesystem path or,
when it starts with ``@``, a Linux abstract-namespace socket). Without the variable every
call is a no-op, so the agent runs the same outside systemd. Sends never block and never
raise: a failed send is counted in ``failures`` and the agent goes on.

``watchdog_interval_s()`` is half of ``$WATCHDOG_USEC`` (systemd's advice) when
``$WATCHDOG_PID`` is unset or is our pid, else ``None``.
"""
from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self, env: dict | None = None):
        env = os.environ if env is None else env
        self.address = env.get("NOTIFY_SOCKET") or None
        self._watchdog_usec = env.get("WATCHDOG_USEC")
        self._watchdog_pid = env.get("WATCHDOG_PID")
        self.failures = 0
        self.sent = 0
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def _target(self) -> str | bytes:
        a = self.address
        # "@name" is the abstract namespace: a leading NUL byte on Linux.
        return "\0" + a[1:] if a.startswith("@") else a

    def notify(self, *fields: str) -> bool:
        """Send ``KEY=VALUE`` lines in one datagram; True when sent."""
        if not self.enabled:
            return False
        msg = "\n".join(fields).encode("utf-8", "replace")
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto(msg, self._target())
            self.sent += 1
            return True
        except OSError:
            self.failures += 1
            return False

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", f"MAINPID={os.getpid()}", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def reloading(self) -> bool:
        return self.notify("RELOADING=1")

    def stopping(self, status: str = "") -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def watchdog_interval_s(self) -> float | None:
        if not self._watchdog_usec:
            return None
        if self._watchdog_pid and self._watchdog_pid != str(os.getpid()):
            return None
        try:
            usec = int(self._watchdog_usec)
        except ValueError:
            return None
        return usec / 2e6 if usec > 0 else None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
