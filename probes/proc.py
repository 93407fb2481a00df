"""Reading /proc: processes, threads, scheduler statistics, open devices, mapped libraries.

Parsers are pure functions of the file text (tested with literals); readers are thin and
return ``None`` (or empty) for a process or thread that has gone, never raise for that:
processes exit between any two reads.
"""
from __future__ import annotations

import os
import re
from typing import Iterable, NamedTuple

PROC = "/proc"


class Mapping(NamedTuple):
    path: str
    inode: int
    dev: str


def parse_schedstat(text: str) -> tuple[int, int, int]:
    """``/proc/<pid>/task/<tid>/schedstat``: (on-CPU ns, run-queue wait ns, timeslices)."""
    parts = text.split()
    if len(parts) < 3:
        raise ValueError(f"malformed schedstat: {text!r}")
    return int(parts[0]), int(parts[1]), int(parts[2])


def parse_ctxt_switches(status_text: str) -> tuple[int, int]:
    """(voluntary, nonvoluntary) context switches from a ``status`` file."""
    vol = nonvol = None
    for line in status_text.splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            vol = int(line.split(":", 1)[1])
        elif line.startswith("nonvoluntary_ctxt_switches:"):
            nonvol = int(line.split(":", 1)[1])
    if vol is None or nonvol is None:
        raise ValueError("status has no ctxt_switches lines")
    return vol, nonvol


def parse_status_tgid(status_text: str) -> int | None:
    m = re.search(r"^Tgid:\s*(\d+)", status_text, re.M)
    return int(m.group(1)) if m else None


_MAPS_RE = re.compile(r"^[0-9a-f]+-[0-9a-f]+\s+\S+\s+[0-9a-f]+\s+(\S+)\s+(\d+)\s+(.*)$")


def parse_maps(text: str, basename_re: str) -> list[Mapping]:
    """Distinct file mappings of a ``maps`` file whose base name matches ``basename_re``.

    Deleted files and anonymous mappings are skipped; each (dev, inode) appears once.
    """
    pat = re.compile(basename_re)
    out, seen = [], set()
    for line in text.splitlines():
        m = _MAPS_RE.match(line)
        if not m:
            continue
        dev, inode, path = m.group(1), int(m.group(2)), m.group(3).strip()
        if inode == 0 or not path.startswith("/") or path.endswith(" (deleted)"):
            continue
        if not pat.search(os.path.basename(path)):
            continue
        if (dev, inode) in seen:
            continue
        seen.add((dev, inode))
        out.append(Mapping(path, inode, dev))
    return out


def parse_steal_ns(stat_text: str, cpu: int | None = None) -> int:
    """Host steal time (ns) from ``/proc/stat`` for all CPUs or one (USER_HZ = 100)."""
    want = "cpu" if cpu is None else f"cpu{cpu}"
    for line in stat_text.splitlines():
        f = line.split()
        if f and f[0] == want:
            return int(f[8]) * 10_000_000 if len(f) > 8 else 0
    raise ValueError(f"{want} not in /proc/stat")


# ---------------------------------------------------------------------- readers

def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    except PermissionError:
        return None


def pids() -> list[int]:
    """All process ids (thread-group leaders) now."""
    return [int(d) for d in os.listdir(PROC) if d.isdigit()]


def alive(pid: int) -> bool:
    return os.path.exists(f"{PROC}/{pid}")


def tids(pid: int) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(f"{PROC}/{pid}/task"))
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return []


def comm(pid: int, tid: int | None = None) -> str | None:
    t = _read(f"{PROC}/{pid}/task/{tid}/comm" if tid else f"{PROC}/{pid}/comm")
    return t.rstrip("\n") if t is not None else None


def schedstat(pid: int, tid: int) -> tuple[int, int, int] | None:
    t = _read(f"{PROC}/{pid}/task/{tid}/schedstat")
    return parse_schedstat(t) if t else None


def ctxt_switches(pid: int, tid: int) -> tuple[int, int] | None:
    t = _read(f"{PROC}/{pid}/task/{tid}/status")
    return parse_ctxt_switches(t) if t else None


def steal_ns(cpu: int | None = None) -> int:
    return parse_steal_ns(_read(f"{PROC}/stat") or "", cpu)


def has_open_device(pid: int, prefixes: Iterable[str] = ("/dev/nvidia",)) -> bool:
    """Whether the process holds an fd on a path starting with one of ``prefixes``."""
    prefixes = tuple(prefixes)
    try:
        fds = os.listdir(f"{PROC}/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"{PROC}/{pid}/fd/{fd}").startswith(prefixes):
                return True
        except OSError:
            continue
    return False


def mapped_libraries(pid: int, basename_re: str) -> list[Mapping]:
    """Libraries the process maps whose base name matches ``basename_re`` (e.g. ``^libcudart\\.so``)."""
    t = _read(f"{PROC}/{pid}/maps")
    return parse_maps(t, basename_re) if t else []


def path_in_process(pid: int, path: str, inode: int | None = None) -> str:
    """A path to the file the process sees as ``path`` (it may live in another mount namespace).

    The plain path when it reaches the same inode (it stays valid after the process
    exits), else the path through ``/proc/<pid>/root``.
    """
    if inode is not None:
        try:
            if os.stat(path).st_ino == inode:
                return path
        except OSError:
            pass
    via_root = f"{PROC}/{pid}/root{path}"
    return via_root if os.path.exists(via_root) else path
