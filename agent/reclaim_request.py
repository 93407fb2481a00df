"""The operator's request to reclaim CUPTI: a small file beside the CUPTI socket.

``ridgeline cupti reclaim`` writes ``cupti-reclaim.request`` (JSON ``{"id", "pid"}``,
``pid`` null for every taken-over process) into the socket's folder, which only the
agent's user may write (root; the folder is searchable by others, never writable); the
running agent takes it at its next window, removes it and answers with
``cupti-reclaim.done`` (JSON ``{"id", "pids"}``: the processes asked). A request file
owned by neither the agent's user nor root, over :data:`MAX_BYTES`, a link or not JSON of that shape is
removed and ignored (counted by the caller), never acted on.
"""
from __future__ import annotations

import json
import os
import stat

REQUEST_NAME = "cupti-reclaim.request"
DONE_NAME = "cupti-reclaim.done"
MAX_BYTES = 4096


def paths(socket_path: str) -> tuple[str, str]:
    d = os.path.dirname(socket_path) or "."
    return os.path.join(d, REQUEST_NAME), os.path.join(d, DONE_NAME)


def _write_atomic(path: str, obj: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, json.dumps(obj).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def write_request(socket_path: str, req_id: str, pid: int | None) -> str:
    """Raises OSError (e.g. PermissionError) when this user may not ask."""
    path = paths(socket_path)[0]
    _write_atomic(path, {"id": req_id, "pid": pid})
    return path


def take_request(socket_path: str, owner_uid: int | None = None) -> tuple[dict | None, bool]:
    """(request, rejected): the pending request, removed; ``(None, True)`` when one was
    there but not acceptable; ``(None, False)`` when there is none."""
    path = paths(socket_path)[0]
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None, False
    except OSError:              # a link (ELOOP), or unreadable
        _remove(path)
        return None, True
    try:
        st = os.fstat(fd)
        uid = os.geteuid() if owner_uid is None else owner_uid
        ok = stat.S_ISREG(st.st_mode) and st.st_uid in (uid, 0) and st.st_size <= MAX_BYTES
        data = os.read(fd, MAX_BYTES + 1) if ok else b""
    finally:
        os.close(fd)
    _remove(path)
    if not ok:
        return None, True
    try:
        req = json.loads(data)
    except ValueError:
        return None, True
    pid = req.get("pid") if isinstance(req, dict) else "bad"
    if not isinstance(req, dict) or not isinstance(req.get("id"), str) or len(req["id"]) > 64 \
            or not (pid is None or (isinstance(pid, int) and not isinstance(pid, bool) and 1 <= pid <= 4_194_304)):
        return None, True
    return {"id": req["id"], "pid": pid}, False


def write_done(socket_path: str, req_id: str, pids: list[int]) -> None:
    _write_atomic(paths(socket_path)[1], {"id": req_id, "pids": list(pids)})


def read_done(socket_path: str, req_id: str) -> list[int] | None:
    """The pids the agent asked for request ``req_id``, or None while it has not answered."""
    try:
        with open(paths(socket_path)[1], "rb") as f:
            obj = json.loads(f.read(MAX_BYTES))
    except (OSError, ValueError):
        return None
    if isinstance(obj, dict) and obj.get("id") == req_id and isinstance(obj.get("pids"), list):
        return [int(p) for p in obj["pids"] if isinstance(p, int)]
    return None


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
