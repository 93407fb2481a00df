"""Where the injection library and libcupti are, and the environment that injects them.

Shared by ``ridgeline run`` and ``ridgeline inject-unit``: both set the same variables,
so a command and a systemd unit are profiled the same way. Children inherit the
environment, so tensor-parallel workers spawned by the server are injected too.
"""
from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

from ridgeline.probes.cupti.server import DEFAULT_SOCKET

LIB_NAME = "libridgeline_cupti.so"


def library_path() -> Path:
    """The built injection library (``RIDGELINE_CUPTI_LIB`` overrides)."""
    env = os.environ.get("RIDGELINE_CUPTI_LIB")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "native" / LIB_NAME


def build_hint() -> str:
    """What to do when library_path() does not exist, for the probe's and ``run``'s messages.

    A source checkout (editable install) has probes/native/Makefile next to this package:
    build there. An installed copy has no Makefile (the wheel's build step compiles the
    library), so the hint never points into site-packages.
    """
    makefile = Path(__file__).resolve().parent.parent / "native" / "Makefile"
    if makefile.is_file():
        return f"run `make -C {makefile.parent}` (needs a C compiler and the CUPTI headers)"
    return ("reinstall from the source tree (`sudo scripts/install.sh` or `pip install .` builds the library; "
            "needs a C compiler and make), or set RIDGELINE_CUPTI_LIB to a built libridgeline_cupti.so")


def find_libcupti() -> Path | None:
    """A libcupti.so.13 from the nvidia-cuda-cupti wheel of this interpreter, if installed.

    The library also finds one on its own (one already loaded in the process first,
    then the loader path, then /usr/local/cuda); this only pins the one the agent's
    decoder matches best.
    """
    for sp in sys.path:
        for pat in ("nvidia/cu13/lib/libcupti.so.13", "nvidia/cuda_cupti/lib/libcupti.so.1[0-9]"):
            hits = sorted(glob.glob(os.path.join(sp, pat)))
            if hits:
                return Path(hits[-1])
    return None


def injection_env(socket_path: str = DEFAULT_SOCKET, mode: str | None = None, graph_level: bool = False,
                  libcupti: Path | None | str = "auto", lib: Path | None = None,
                  preload: bool = True, inherited_preload: str | None = None) -> dict[str, str]:
    """Variables that make a CUDA process load the injection library at cuInit.

    ``NVTX_INJECTION64_PATH`` names the same library, which forwards NVTX to the
    libcupti it uses, so NVTX ranges arrive as CUPTI MARKER records. With ``preload``
    the library is also in ``LD_PRELOAD`` (before what the caller's environment already
    preloads), so that libtorch's calls into libcupti reach it first and torch.profiler
    shares a legacy CUPTI with it exactly (docs/cupti.md, "Sharing CUPTI").
    """
    lib = Path(lib) if lib else library_path()
    env = {"CUDA_INJECTION64_PATH": str(lib), "NVTX_INJECTION64_PATH": str(lib),
           "RIDGELINE_SOCKET": str(socket_path)}
    if preload:
        rest = os.environ.get("LD_PRELOAD", "") if inherited_preload is None else inherited_preload
        env["LD_PRELOAD"] = ":".join([str(lib)] + [p for p in rest.replace(" ", ":").split(":") if p and p != str(lib)])
    if mode:
        if mode not in ("always-on", "deep"):
            raise ValueError(f"mode must be 'always-on' or 'deep', not {mode!r}")
        env["RIDGELINE_MODE"] = mode
    if graph_level:
        env["RIDGELINE_GRAPH_LEVEL"] = "1"
    if libcupti == "auto":
        libcupti = find_libcupti()
    if libcupti:
        env["RIDGELINE_LIBCUPTI"] = str(libcupti)
    return env
