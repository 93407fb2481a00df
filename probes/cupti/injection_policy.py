"""Which processes the CUPTI injection collects, and when another tool owns injection.

The injection environment (``CUDA_INJECTION64_PATH``, ``NVTX_INJECTION64_PATH``,
``LD_PRELOAD``) reaches every descendant of ``ridgeline run``. The injection library decides
for each process at ``InitializeInjection`` (``policy_skips`` in
``probes/native/ridgeline_cupti.c``, which this module mirrors; a test keeps the two lists
equal): a process whose first ``SKIP_ARGS`` arguments after the interpreter end with an
entry of the skip list is left alone (no CUPTI, no agent connection).

The default list holds PyTorch Inductor's helper processes, which compile or time kernels
and whose timings would otherwise be taken under CUPTI's overhead (docs/cupti.md, "Which
processes are collected"); engine workers (vLLM's and SGLang's multiprocessing children)
match nothing and are collected. ``RIDGELINE_INJECT_SKIP=a;b`` replaces the list, ``""``
collects every process.

``owner_problem`` says why ``ridgeline run`` must refuse: another tool already owns the CUDA
or NVTX injection slot (one library per variable), or the command is a tool that installs
its own injection for the processes it launches and would displace Ridgeline's silently.
"""
from __future__ import annotations

import os

# Inductor's compile workers: pytorch/pytorch torch/_inductor/compile_worker/subproc_pool.py
# (at 60dc4de2) starts `[sys.executable, entry, ...]` with entry = os.path.join(
# os.path.dirname(__file__), "__main__.py"), and its pool forks from that process, so the
# forked workers keep its arguments; older releases ran `python -m
# torch._inductor.compile_worker`. Autotune workers: torch/_inductor/autotune_process.py
# starts `[sys.executable, entry, ...]` with entry = .../__autotune_main__.py (the file exists
# upstream at 123527f6); `torch._inductor.autotune_process` covers a `-m` start.
DEFAULT_SKIP: tuple[str, ...] = (
    "torch/_inductor/compile_worker/__main__.py",
    "torch._inductor.compile_worker",
    "torch/_inductor/__autotune_main__.py",
    "torch._inductor.autotune_process",
)
SKIP_ARGS = 4          # RL_SKIP_ARGS: arguments after argv[0] that are looked at

# Command names of tools that put their own injection library into the processes they
# launch; run under `ridgeline run` they would replace Ridgeline's variables for their
# target, or run it with two CUPTI clients. The tool's own name, as invoked.
OWNING_TOOLS: dict[str, str] = {
    "nsys": "Nsight Systems",
    "nsys-launcher": "Nsight Systems",
    "ncu": "Nsight Compute",
    "nv-nsight-cu-cli": "Nsight Compute",
    "compute-sanitizer": "Compute Sanitizer",
    "cuda-memcheck": "CUDA-MEMCHECK",
    "nvprof": "nvprof",
}


def skip_list(env: dict[str, str]) -> tuple[str, ...]:
    """The skip list in force for a process with environment ``env``."""
    raw = env.get("RIDGELINE_INJECT_SKIP")
    if raw is None:
        return DEFAULT_SKIP
    return tuple(e for e in raw.split(";") if e)


def skipped_by(argv: list[str], skip: tuple[str, ...]) -> str | None:
    """The entry of ``skip`` that leaves the process with arguments ``argv`` alone, or None
    (``policy_skips`` in the library: an argument among argv[1..SKIP_ARGS] ending with it)."""
    for a in argv[1:1 + SKIP_ARGS]:
        for e in skip:
            if a.endswith(e):
                return e
    return None


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:      # one of them does not exist: compare the names
        return os.path.abspath(a) == os.path.abspath(b)


def owner_problem(env: dict[str, str], cmd: list[str], lib: str) -> str | None:
    """Why ``ridgeline run`` cannot inject ``lib`` into ``cmd`` under environment ``env``,
    or None. One sentence naming the owner and what to do."""
    for var in ("CUDA_INJECTION64_PATH", "NVTX_INJECTION64_PATH"):
        other = env.get(var)
        if other and other != "none" and not _same_file(other, lib):
            return (f"{var} is already set to {other} (another tool owns that injection slot, and a process "
                    f"loads one library per slot); unset it, or run without ridgeline run")
    if cmd:
        name = os.path.basename(cmd[0])
        if name in OWNING_TOOLS:
            return (f"{name} ({OWNING_TOOLS[name]}) installs its own CUDA injection in the processes it "
                    f"launches and would displace Ridgeline's silently; run one profiler at a time "
                    f"(the agent's other probes keep working without ridgeline run)")
    return None
