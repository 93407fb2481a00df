"""``ridgeline run [--] CMD...``: run a command with the CUPTI injection library loaded.

Sets ``CUDA_INJECTION64_PATH`` (the CUDA driver loads the library at cuInit) and
``NVTX_INJECTION64_PATH`` (NVTX ranges reach CUPTI), plus where the agent listens, and
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``_PROTOCOL`` (the engine's per-request spans go
to the agent's receiver once the engine's own tracing flag is on), then
replaces itself with the command (exec), so signals and the exit status are the
command's own. Child processes inherit the environment, so tensor-parallel workers are
injected too. Without a running agent the command runs normally; the library drops and
counts its records until an agent appears.
"""
from __future__ import annotations

import argparse
import os
import shutil
import stat
import sys

from ridgeline.agent.commands import description
from ridgeline.probes.errors import InputError, RuntimeFailure


def register(sub) -> None:
    p = sub.add_parser("run", help="run a command with Ridgeline's CUPTI injection (zero code changes)",
                       description=description(__doc__) + " " + description(__doc__, 1))
    add_injection_options(p)
    p.add_argument("--otlp-endpoint", default=None, metavar="URL",
                   help="where the command's OpenTelemetry traces go (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT): "
                        "default the agent's span receiver, probes.otlp.listen of /etc/ridgeline/agent.toml "
                        "(http://127.0.0.1:4318/v1/traces); 'none' sets nothing. A value already in the "
                        "environment is kept")
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
    from ridgeline.probes.cupti.library import build_hint, injection_env, library_path
    lib = args.library or library_path()
    if not os.path.isfile(lib):
        if args.library:     # a path the user gave that is not there: bad input
            raise InputError(f"injection library not found: {lib} (check the --library path)")
        # the input was fine; what it needs (the built library) is missing: a runtime failure
        raise RuntimeFailure(f"injection library not built: {lib} ({build_hint()})")
    libcupti = None if args.libcupti in ("", "none") else args.libcupti
    return injection_env(args.socket, args.mode, args.graph_level, libcupti, lib)


def socket_problem(path: str, uid: int, gids: set[int]) -> str | None:
    """Why a process of ``uid``/``gids`` could not connect to the agent's socket at ``path``,
    or None when it can (root can always). Plain permission bits, as the kernel checks them."""
    def allowed(st, bit_user: int) -> bool:      # bit_user: 0o4 read, 0o2 write, 0o1 search
        if uid == 0:
            return True
        if st.st_uid == uid:
            return bool(st.st_mode & (bit_user << 6))
        if st.st_gid in gids:
            return bool(st.st_mode & (bit_user << 3))
        return bool(st.st_mode & bit_user)
    p = os.path.abspath(path)
    parts = p.split(os.sep)[1:-1]
    d = os.sep
    for part in [""] + parts:
        d = os.path.join(d, part) if part else d
        try:
            st = os.stat(d)
        except OSError:
            return f"{d} does not exist (no agent has opened its socket yet)"
        if not allowed(st, 0o1):
            return f"{d} is not searchable by uid {uid}"
    try:
        st = os.stat(p)
    except OSError:
        return f"no agent is listening at {p}"
    if not stat.S_ISSOCK(st.st_mode):
        return f"{p} is not a socket"
    if not allowed(st, 0o2):
        return f"{p} is not writable by uid {uid}"
    return None


def otlp_env(endpoint: str | None) -> dict[str, str]:
    """The OpenTelemetry exporter variables that need no flag: the OTLP/HTTP traces endpoint
    (the agent's receiver) and its protocol. The engine still turns its tracing on with its
    own flag (vLLM ``--otlp-traces-endpoint``, SGLang ``--enable-trace``)."""
    if endpoint is None:
        from ridgeline.agent import config
        try:
            listen = config.load(None, missing_ok=True).probes.otlp.listen
        except InputError:
            listen = "127.0.0.1:4318"
        if listen.startswith("unix:"):
            return {}        # the OpenTelemetry exporters post over TCP only
        host, _, port = listen.rpartition(":")
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        endpoint = f"http://{host}:{port}/v1/traces"
    if endpoint == "none":
        return {}
    if not endpoint.startswith(("http://", "https://")):
        raise InputError(f"--otlp-endpoint must be an http:// or https:// URL or 'none', got {endpoint!r}")
    out = {}
    for k, v in (("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint),
                 ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")):
        if k not in os.environ:
            out[k] = v
    return out


def run(args) -> int:
    env = injection_env_from_args(args)
    env.update(otlp_env(args.otlp_endpoint))
    if args.print_env:
        for k, v in env.items():
            print(f"{k}={v}")
        return 0
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise InputError("no command given: ridgeline run [--] CMD [ARGS...]")
    from ridgeline.probes.cupti.injection_policy import owner_problem
    owner = owner_problem(dict(os.environ), cmd, env["CUDA_INJECTION64_PATH"])
    if owner:
        raise InputError(owner)
    exe = shutil.which(cmd[0])
    if exe is None:
        raise InputError(f"command not found: {cmd[0]}")
    problem = socket_problem(env["RIDGELINE_SOCKET"], os.geteuid(), set(os.getgroups()) | {os.getegid()})
    if problem:
        # the command runs regardless: the library counts its records as dropped_no_agent
        print(f"ridgeline run: warning: {problem}; this process's GPU records will be counted as dropped "
              "until it can connect", file=sys.stderr)
    full = dict(os.environ)
    full.update(env)
    os.execve(exe, cmd, full)
    return 127   # not reached
