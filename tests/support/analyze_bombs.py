"""Hostile `analyze` inputs of issue 18.7, written by us (no third-party bytes): the test
(tests/test_analyze_bombs.py) and scripts/hardening-check.py build the same files.

The Nsight Systems ones start from a real export (a copy the caller decompressed from
../shared/third-party/nsys/) and change one table the way an attacker could: a column
turned into a generated one whose expression is costly to compute, or values that
overflow int64 when the reader adds them.
"""
from __future__ import annotations

import sqlite3
import zlib
from pathlib import Path


def gzip_of_brackets(path: Path, inflated_bytes: int = 1 << 30) -> Path:
    """A gzip of ``inflated_bytes`` of '[' (1 GiB in about 1 MB)."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = b"[" * (1 << 24)
    with open(path, "wb") as f:
        for _ in range(inflated_bytes // len(block)):
            f.write(z.compress(block))
        f.write(z.flush())
    return path


def nested_json(path: Path, depth: int = 1_000_000, inside_event: bool = False) -> Path:
    """A trace whose traceEvents holds one value nested ``depth`` deep (as an element, or
    as an event's args)."""
    deep = b"[" * depth + b"]" * depth
    if inside_event:
        body = b'{"ph":"X","cat":"kernel","name":"k","ts":1,"dur":2,"pid":0,"tid":0,"args":{"a":' + deep + b"}}"
    else:
        body = deep
    path.write_bytes(b'{"traceEvents": [' + body + b"]}")
    return path


# expressions a generated column can hold: no subquery is allowed there, so the cost
# comes from one function's output per row (memory) or from many rows (time)
GENERATED = {
    "memory": "length(hex(zeroblob(400000000 + \"end\" % 2)))",     # 800 MB of hex per row
    "time": "length(replace(hex(zeroblob(3000000 + \"end\" % 2)), '0', 'ab'))",  # 12 MB, ~20 ms a row
}


def nsys_generated_column(export: Path, kind: str = "memory", rows: int = 3000) -> Path:
    """The export with the kernel table's ``correlationId`` (which every reader selects)
    recomputed on every read by ``GENERATED[kind]`` (and, for "time", ``rows`` kernels so
    that it keeps going). An INSERT would compute the column too, so the rows go into a
    table without it and the schema text is then rewritten (``writable_schema``): a
    virtual column is not stored, the records read the same."""
    c = sqlite3.connect(export)
    t = "CUPTI_ACTIVITY_KIND_KERNEL"
    sql = c.execute("SELECT sql FROM sqlite_master WHERE name = ?", (t,)).fetchone()[0]
    cols = [r[1] for r in c.execute(f"PRAGMA table_info({t})")]
    head, _, rest = sql.partition("correlationId")
    _, _, after = rest.partition("\n")
    keep = [x for x in cols if x != "correlationId"]
    c.execute((head + after).replace(t, "new_kernels", 1))
    c.execute(f"INSERT INTO new_kernels SELECT {', '.join(keep)} FROM {t}")
    while kind == "time" and c.execute("SELECT count(*) FROM new_kernels").fetchone()[0] < rows:
        c.execute("INSERT INTO new_kernels SELECT * FROM new_kernels")
    c.execute(f"DROP TABLE {t}")
    c.execute(f"ALTER TABLE new_kernels RENAME TO {t}")
    c.commit()
    generated = f"{head}correlationId INTEGER GENERATED ALWAYS AS ({GENERATED[kind]}) VIRTUAL,\n{after}"
    c.execute("PRAGMA writable_schema = ON")
    c.execute("UPDATE sqlite_master SET sql = ? WHERE name = ?", (generated, t))
    c.commit()
    c.close()
    return export


def nsys_int64_overflow(export: Path) -> Path:
    """The export with both shared-memory sizes of every kernel at int64's maximum: their
    sum (static + dynamic, per block) leaves int64."""
    c = sqlite3.connect(export)
    c.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET staticSharedMemory = 9223372036854775807, "
              "dynamicSharedMemory = 9223372036854775807, gridX = 9223372036854775807")
    c.commit()
    c.close()
    return export
