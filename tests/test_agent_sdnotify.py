"""agent.sdnotify against real AF_UNIX datagram sockets (path and abstract namespace)."""
import os
import socket
import uuid

from ridgeline.agent.sdnotify import Notifier


def _server(addr):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(addr)
    s.settimeout(2)
    return s


def test_path_socket_receives_ready_status_watchdog_stopping(tmp_path):
    path = str(tmp_path / "notify")
    srv = _server(path)
    n = Notifier({"NOTIFY_SOCKET": path})
    assert n.ready("up")
    msg = srv.recv(4096).decode()
    assert "READY=1" in msg.split("\n") and f"MAINPID={os.getpid()}" in msg and "STATUS=up" in msg
    n.status("busy")
    assert srv.recv(4096) == b"STATUS=busy"
    n.watchdog()
    assert srv.recv(4096) == b"WATCHDOG=1"
    n.stopping()
    assert srv.recv(4096) == b"STOPPING=1"
    assert n.sent == 4 and n.failures == 0
    n.close()
    srv.close()


def test_abstract_namespace_socket():
    name = f"ridgeline-test-{uuid.uuid4().hex}"
    srv = _server("\0" + name)
    n = Notifier({"NOTIFY_SOCKET": "@" + name})
    assert n.watchdog()
    assert srv.recv(4096) == b"WATCHDOG=1"
    srv.close()


def test_without_socket_everything_is_a_no_op():
    n = Notifier({})
    assert not n.enabled
    assert n.ready() is False and n.sent == 0 and n.failures == 0
    assert n.watchdog_interval_s() is None


def test_missing_listener_is_counted_not_raised(tmp_path):
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    assert n.ready() is False
    assert n.failures == 1


def test_watchdog_interval_is_half_and_respects_pid():
    assert Notifier({"WATCHDOG_USEC": "30000000"}).watchdog_interval_s() == 15.0
    assert Notifier({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}).watchdog_interval_s() == 15.0
    assert Notifier({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}).watchdog_interval_s() is None
    assert Notifier({"WATCHDOG_USEC": "junk"}).watchdog_interval_s() is None
