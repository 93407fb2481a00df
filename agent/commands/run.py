"""``ridgeline run [--] CMD...``: run a command with the CUPTI injection library loaded.

Sets ``CUDA_INJECTION64_PATH`` (the CUDA driver loads the library at cuInit) and
``NVTX_INJECTION64_PATH`` (NVTX ranges reach CUPTI), plus where the agent listens, then
replaces itself with the command (exec), so signals and the exit status are the
command's own. Child processes inherit the environment, so tensor-parallel workers are
injected too. Without a running agent the command runs normally; the library drops and
counts its records until an agent appears.
"""
from __future__ import annotations

import argparse
import os
import shutil

from ridgeline.probes.errors import InputError


def register(sub) -> None:
    p = sub.add_parser("run", help="run a command with Ridgeline's CUPTI injection (zero code changes)")
    add_injection_options(p)
    p.add_argument("--print-env", action="store_true", help="print the variables and exit instead of running")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD", help="the command and its arguments (after --)")
    p.set_defaults(func=run)


def add_injection_options(p) -> None:
    """Options shared with ``inject-unit``."""
    from ridgeline.probes.cupti.server import DEFAULT_SOCKET
    p.add_argument("--socket", default=os.environ.get("RIDGELINE_SOCKET", DEFAULT_SOCKET),
                   help=f"the agent's CUPTI socket (default {DEFAULT_SOCKET})")
    p.add_argument("--mode", choices=["always-on", "deep"], default=None,
                   help="initial collection mode (default always-on; the agent can switch it live)")
    p.add_argument("--graph-level", action="store_true",
                   help="one record per CUDA-graph launch instead of per kernel node (cannot be undone live)")
    p.add_argument("--libcupti", default="auto",
                   help="libcupti to use when the process has none loaded (default: this venv's wheel, else search)")
    p.add_argument("--library", default=None, help="the injection library (default: the built probes/native one)")


def injection_env_from_args(args) -> dict[str, str]:
    from ridgeline.probes.cupti.library import injection_env, library_path
    lib = args.library or library_path()
    if not os.path.isfile(lib):
        raise InputError(f"injection library not built: {lib} (run `make -C probes/native`)")
    libcupti = None if args.libcupti in ("", "none") else args.libcupti
    return injection_env(args.socket, args.mode, args.graph_level, libcupti, lib)


def run(args) -> int:
    env = injection_env_from_args(args)
    if args.print_env:
        for k, v in env.items():
            print(f"{k}={v}")
        return 0
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise InputError("no command given: ridgeline run [--] CMD [ARGS...]")
    other = os.environ.get("CUDA_INJECTION64_PATH")
    if other and other not in ("none", env["CUDA_INJECTION64_PATH"]):
        raise InputError(f"CUDA_INJECTION64_PATH is already set to {other} (another tool); unset it first")
    exe = shutil.which(cmd[0])
    if exe is None:
        raise InputError(f"command not found: {cmd[0]}")
    full = dict(os.environ)
    full.update(env)
    os.execve(exe, cmd, full)
    return 127   # not reached
