"""Every bench of the project in one run, one table, with the command that reproduces each row.

    .venv/bin/python bench/run_all.py                       # quick settings (minutes)
    .venv/bin/python bench/run_all.py --full                # each bench's own defaults (long)
    .venv/bin/python bench/run_all.py --write docs/benchmarks.md

Runs each ``bench/bench_*.py`` as a child process, one after the other (so they do not
compete for the CPUs), with the arguments below (quick) or none (``--full``); a bench
that is missing, needs hardware that is absent, or fails is listed with the reason, never
silently dropped. Each bench prints its own markdown table; every row of it becomes one
row here (its columns as ``name: value``), next to the exact command that produced it.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

# bench file -> (what it measures, quick arguments). Benches found in bench/ but not listed
# here run with no arguments.
KNOWN = {
    "bench_scale.py": ("agent scale and cost (simulated load)", ["--duration", "60"]),
    "bench_analyze.py": ("ridgeline analyze vs zcat and HTA; bytes per kernel event", ["--kernels", "100000", "--gzip"]),
    "bench_wire.py": ("wire encoding: bytes per kernel event", []),
    "bench_ebpf.py": ("eBPF probe overheads", ["--rounds", "3"]),
    "bench_cupti_decode.py": ("CUPTI buffer decode rate", ["--kernels", "500000", "--repeat", "3"]),
    "bench_phases.py": ("phase mapping rate", ["--steps", "500", "--replicas", "200"]),
    "bench_decode.py": ("gzip inflate and JSON parser choices for the importer", []),
    "bench_requests.py": ("OTLP span decode vs the bare parse; the request join per window", []),
    "bench_served.py": ("injection library's own host CPU per kernel launch (stand-in libcupti)", ["--runs", "3"]),
    "bench_cupti_buffer_path.py": ("injection library's completed-buffer path per record, pre-split vs this checkout",
                                   ["--runs", "5", "--buffers", "20"]),
}
SKIP = {"run_all.py", "make_big_trace.py"}


def md_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Markdown tables in ``text``: (header cells, rows of cells)."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines) - 1:
        if lines[i].lstrip().startswith("|") and re.match(r"^\s*\|?\s*:?-{2,}", lines[i + 1]):
            head = [c.strip() for c in lines[i].strip().strip("|").split("|")]
            rows = []
            j = i + 2
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                rows.append([c.strip() for c in lines[j].strip().strip("|").split("|")])
                j += 1
            out.append((head, rows))
            i = j
        else:
            i += 1
    return out


def run_bench(path: Path, args: list[str], timeout_s: float) -> dict:
    cmd = [PY, str(path.relative_to(ROOT)), *args]
    shown = " ".join([".venv/bin/python", *cmd[1:]])
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"command": shown, "status": f"timed out after {timeout_s:.0f} s", "tables": []}
    wall = time.monotonic() - t0
    tables = md_tables(p.stdout)
    if p.returncode != 0:
        err = (p.stderr.strip().splitlines() or p.stdout.strip().splitlines() or ["no output"])[-1]
        return {"command": shown, "status": f"exit {p.returncode}: {err[:200]}", "tables": tables, "wall_s": wall}
    if not tables:
        # A bench printing a plain-text table: keep its lines (up to 30) as rows.
        lines = [ln.strip() for ln in p.stdout.splitlines() if ln.strip() and not ln.lstrip().startswith("{")]
        if not lines:
            return {"command": shown, "status": "no output", "tables": [], "wall_s": wall}
        return {"command": shown, "status": "ok", "tables": [(["output"], [[ln] for ln in lines[:30]])],
                "wall_s": wall}
    return {"command": shown, "status": "ok", "tables": tables, "wall_s": wall}


def combined(results: list[tuple[str, str, dict]]) -> str:
    out = ["| bench | what | result | command |", "|---|---|---|---|"]
    for name, what, r in results:
        cmd = f"`{r['command']}`"
        if not r["tables"]:
            out.append(f"| {name} | {what} | skipped: {r['status'].replace('|', '/')} | {cmd} |")
            continue
        for head, rows in r["tables"]:
            for row in rows:
                cells = "; ".join(f"{h}: {v}" for h, v in zip(head, row) if v)
                out.append(f"| {name} | {what} | {cells.replace('|', '/')} | {cmd} |")
        if r["status"] != "ok":
            out.append(f"| {name} | {what} | incomplete: {r['status'].replace('|', '/')} | {cmd} |")
    return "\n".join(out)


BEGIN, END = "<!-- run_all:begin -->", "<!-- run_all:end -->"


def write_between_markers(path: Path, text: str) -> None:
    """Replace the text between the run_all markers of ``path`` (the prose around them
    stays); a file without markers is written whole."""
    block = f"{BEGIN}\n{text}\n{END}"
    old = path.read_text() if path.exists() else ""
    if BEGIN in old and END in old:
        new = old[:old.index(BEGIN)] + block + old[old.index(END) + len(END):]
    else:
        new = "# Benchmarks (all benches, one run)\n\n" + block + "\n"
    path.write_text(new)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="run each bench with its own defaults")
    ap.add_argument("--only", help="comma list of bench files to run (e.g. bench_scale.py)")
    ap.add_argument("--timeout", type=float, default=1800, help="per bench, seconds")
    ap.add_argument("--write", type=Path, help="also write the table (with a header) to this markdown file")
    args = ap.parse_args(argv)
    found = sorted(p for p in (ROOT / "bench").glob("bench_*.py") if p.name not in SKIP)
    names = [p.name for p in found]
    wanted = args.only.split(",") if args.only else list(dict.fromkeys(list(KNOWN) + names))
    results = []
    for name in wanted:
        what, quick = KNOWN.get(name, (name[len("bench_"):-3].replace("_", " "), []))
        path = ROOT / "bench" / name
        if not path.exists():
            results.append((name, what, {"command": f".venv/bin/python bench/{name}",
                                         "status": "not present in this checkout", "tables": []}))
            continue
        print(f"running {name} ...", file=sys.stderr, flush=True)
        results.append((name, what, run_bench(path, [] if args.full else quick, args.timeout)))
    this = "python bench/run_all.py " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (f"Produced by `{this.strip()}` on {platform.node() or 'host'} ({os.cpu_count()} CPUs, "
              f"Python {platform.python_version()}), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.")
    table = combined(results)
    print(header + "\n\n" + table)
    if args.write:
        write_between_markers(args.write, header + "\n\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
