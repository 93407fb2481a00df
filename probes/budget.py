"""The memory budget of one analysis: how many events a reader may keep.

Every reader of recorded input (Kineto JSON, recordings, Nsight Systems exports)
charges the rows it keeps to an :class:`EventBudget` as it reads, and stops with an
:class:`InputError` (one line, exit 2) as soon as the rows it holds would cost more
than the budget, instead of growing until the kernel's OOM killer picks a process.

The cost of a row is what an analysis of it costs at its peak, not just the row's own
bytes: the join of kernels to their CPU operators and the phase mapping hold several
arrays per row. The weights below come from ``ru_maxrss`` of ``ridgeline analyze --json``
(2026-12-01, this machine, the typed importer and the vectorised operator join),
minus the interpreter's 45 MiB, rounded up:

* 2M kernels alone: 606 MiB -> about 280 B per kernel;
* 2M kernels + 2M launch calls: 826 MiB -> about 110 B per API call;
* the shared A100 training trace replicated to 304k kernels (83k copies, 1.70M API
  calls, 1.26M CPU operators, 5.4M events): 385 MiB -> about 50 B per CPU operator
  (charged at 100).

* the same A100 trace replicated to 1M kernels (274k copies, 5.58M API calls, 4.14M CPU
  operators, 59k ranges; the issue-13 benchmark file): 835 MiB.

API calls and CPU operators are charged at 50 B: the real mix above (most API calls are
not launches, most operators launch nothing) costs far less per row than the synthetic
2M-launch case, and at the 110/100 B first charged the 1M-kernel benchmark trace, which
an analysis holds in 835 MiB, was refused under the 1 GiB default. The estimate stays
at or above every measured peak (2M kernels: 732 vs 606 MiB; with 2M launch calls 828 vs
826; the 304k A100 replica 412 vs 385; the 1M A100 replica 997 vs 835): a trace is
refused early rather than late. Re-measure before lowering a weight.
"""
from __future__ import annotations

from .errors import InputError

DEFAULT_MAX_MEMORY_BYTES = 1 << 30       # the ceiling for any input
BASE_BYTES = 160 << 20                   # interpreter, numpy, the report, the largest chunk

# peak bytes per kept row, by kind (measured; see the module docstring)
ROW_COST_BYTES = {"kernels": 300, "copies": 300, "api": 50, "ranges": 150, "cpu_ops": 50}
NAME_COST_BYTES = 200    # per interned name on top of its characters (str object, dict entry)
NAME_COPIES = 3          # a name is held as the str, the reader's bytes key and its slice


class EventBudget:
    """Rows kept so far against a memory ceiling.

    ``charge(kind, rows)`` raises :class:`InputError` naming ``source`` when the rows
    kept so far would cost more than ``max_memory_bytes`` at the analysis' peak.
    """

    def __init__(self, max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES, source: str = "input"):
        self.max_memory_bytes = int(max_memory_bytes)
        self.source = source
        self.rows = {k: 0 for k in ROW_COST_BYTES}
        self.cost_bytes = BASE_BYTES
        self._names_seen = 0

    def charge(self, kind: str, rows: int) -> None:
        self.rows[kind] = self.rows.get(kind, 0) + int(rows)
        self.cost_bytes += int(rows) * ROW_COST_BYTES.get(kind, 300)
        self._check()

    def charge_names(self, names) -> None:
        """Charge the names interned since the last call (a :class:`NameTable`): distinct
        names are few in real traces, but each may be as long as an event."""
        new = names.strings[self._names_seen:]
        if not new:
            return
        self._names_seen += len(new)
        self.rows["names"] = self.rows.get("names", 0) + len(new)
        self.cost_bytes += NAME_COPIES * sum(len(s) for s in new) + NAME_COST_BYTES * len(new)
        self._check()

    def _check(self) -> None:
        if self.cost_bytes > self.max_memory_bytes:
            held = ", ".join(f"{n} {k}" for k, n in self.rows.items() if n)
            raise InputError(
                f"{self.source}: more events than an analysis within {self.max_memory_bytes >> 20} MiB "
                f"can hold (after {held}); cut the trace, or raise --max-memory")

    def release(self, kind: str, rows: int) -> None:
        """Rows handed back (a window analysed and dropped)."""
        self.rows[kind] = max(0, self.rows.get(kind, 0) - int(rows))
        self.cost_bytes -= int(rows) * ROW_COST_BYTES.get(kind, 300)

    def fresh(self) -> "EventBudget":
        """The same ceiling with nothing charged (a reader starting over after another
        reader of the same file gave up)."""
        return EventBudget(self.max_memory_bytes, self.source)

    def half(self) -> "EventBudget":
        """A budget for one of two parallel readers of one file."""
        return EventBudget(BASE_BYTES + (self.max_memory_bytes - BASE_BYTES) // 2, self.source)
