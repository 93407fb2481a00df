"""Which process is behind a CUPTI socket connection, over the connection's life (issue 18.3).

``SO_PEERCRED`` names the process that called ``connect()``; the connection can outlive it
(a forked child keeps the descriptor) and its pid can then be given to another process:
10,000 kernels were counted under a victim's pid that way. A process is named for good by
its pid *and* its start time (field 22 of ``/proc/<pid>/stat``, clock ticks since boot):
the pair never repeats while the system is up.

The parsing and the decisions are pure (:func:`parse_start_ticks`, :func:`judge`); only
:func:`read_start_ticks` and :func:`boot_ticks` read the system, and the server takes the
reader as a parameter so tests can put a fake ``/proc`` at exactly this boundary.
"""
from __future__ import annotations

import os
import time

#: USER_HZ: the unit of /proc/<pid>/stat's starttime (100 on every Linux ABI in use)
CLK_TCK = os.sysconf("SC_CLK_TCK")

ALIVE, GONE, REUSED = "alive", "gone", "reused"


def parse_start_ticks(stat: bytes) -> int:
    """Field 22 (starttime) of a ``/proc/<pid>/stat`` line. The comm (field 2) is in
    parentheses and may itself hold spaces and parentheses: fields are counted from the
    last ``)``. Raises ValueError on a line that is not such a record."""
    end = stat.rfind(b")")
    if end < 0:
        raise ValueError("no ')' closing the comm field")
    rest = stat[end + 1:].split()
    # rest[0] is field 3 (state): field 22 is rest[19]
    if len(rest) < 20:
        raise ValueError(f"{len(rest) + 2} fields, starttime is field 22")
    return int(rest[19])


def read_start_ticks(pid: int) -> int | None:
    """The start time of process ``pid``, or None when there is no such process now."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            return parse_start_ticks(f.read(4096))
    except (FileNotFoundError, ProcessLookupError):
        return None


def boot_ticks() -> int:
    """Now, in the unit and on the clock of ``starttime`` (CLOCK_BOOTTIME in USER_HZ ticks)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * CLK_TCK)


def judge(bound_ticks: int | None, now_ticks: int | None, accepted_ticks: int) -> str:
    """What the start time read now says of a connection accepted at ``accepted_ticks``.

    * ``now_ticks`` None: the process is gone (:data:`GONE`);
    * not bound yet (``bound_ticks`` None, the first look at HELLO): a process that started
      after the connection was accepted cannot be the one that connected, so its pid was
      reused meanwhile (:data:`REUSED`); one tick of slack, as starttime is rounded down to
      a tick and the accept time is read after the accept;
    * bound: any other start time is another process under the same pid (:data:`REUSED`).
    """
    if now_ticks is None:
        return GONE
    if bound_ticks is None:
        return REUSED if now_ticks > accepted_ticks + 1 else ALIVE
    return ALIVE if now_ticks == bound_ticks else REUSED
