"""Can the scheduling probe keep its per-thread entries in task-local storage? (issue 21 item 4)

    sudo .venv/bin/python bench/ebpf_task_storage_check.py

Loads, with the distro bcc on the running kernel, a raw-tracepoint program (the probe's
program type) that calls ``bpf_task_storage_get`` on (1) the current task, from
``bpf_get_current_task_btf()`` (prev in sched_switch), and (2) the ``next`` task of the raw
arguments; and asks the kernel to iterate the task-storage map from user space
(``BPF_MAP_GET_NEXT_KEY``), which is how the agent reads every thread's totals once per
window. Each case runs in a child process, so a load failure is reported with the
verifier's own words. Results are in docs/benchmarks-ebpf.md.
"""
from __future__ import annotations

import ctypes as ct
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ridgeline.probes import bpf as bpfmod  # noqa: E402

HEAD = r"""
struct st_t { u64 ts; u64 oncpu_ns; };
BPF_TASK_STORAGE(tstore, struct st_t);
"""
CASES = {
    "current": r"""
RAW_TRACEPOINT_PROBE(sched_switch) {
    struct task_struct *t = bpf_get_current_task_btf();
    struct st_t *s = tstore.task_storage_get(t, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
    if (s) s->ts = 1;
    return 0;
}""",
    "next": r"""
RAW_TRACEPOINT_PROBE(sched_switch) {
    struct task_struct *t = (struct task_struct *)ctx->args[2];
    struct st_t *s = tstore.task_storage_get(t, 0, 0);
    if (s) s->ts = 1;
    return 0;
}""",
}


def run_case(name: str) -> int:
    bcc = bpfmod.import_bcc()
    b = bcc.BPF(text=(HEAD + CASES[name]).encode(), cflags=["-w"])
    b.load_func(b"raw_tracepoint__sched_switch", bcc.BPF.RAW_TRACEPOINT)
    print("LOADED")
    fd = bcc.lib.bpf_table_fd(b.module, b"tstore")
    key = ct.c_int(0)
    rc = bcc.lib.bpf_get_next_key(fd, None, ct.byref(key))
    print(f"GET_NEXT_KEY {rc} {os.strerror(-rc) if rc < 0 else 'ok'}")
    b.cleanup()
    return 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--case":
        return run_case(sys.argv[2])
    for name in CASES:
        r = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True, text=True)
        out = r.stdout + r.stderr
        if "LOADED" in r.stdout:
            nk = [ln for ln in r.stdout.splitlines() if ln.startswith("GET_NEXT_KEY")]
            print(f"{name}: loads; user-space iteration of the map: {nk[0] if nk else '?'} "
                  "(-524 is ENOTSUPP)")
        else:
            why = [ln for ln in out.splitlines() if "expected" in ln or "type=" in ln]
            print(f"{name}: rejected by the verifier: {why[-1] if why else out.strip().splitlines()[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
