"""Where the project's own C libraries are and how they are opened: the fold
(aggregator/native) and the CUPTI decode (probes/cupti/native) libraries, built by the
package build (setup.py) and, in a source tree, by their Makefiles (scripts/setup.sh).

Each failure is one line that says what to build; the callers raise it as their own
error class (no fallback: a missing library is a broken install).
"""
from __future__ import annotations

import ctypes as ct
import os
from pathlib import Path


def path_of(env: str, native_dir: Path, name: str) -> Path:
    """The library ``name`` in ``native_dir``, or the path in the environment variable ``env``."""
    p = os.environ.get(env)
    return Path(p) if p else native_dir / name


def build_hint(native_dir: Path) -> str:
    """What to do to get the library built, for a source tree or an installed package."""
    if (native_dir / "Makefile").is_file():
        return f"run `make -C {native_dir}` (needs a C compiler) or `bash scripts/setup.sh`"
    return "reinstall from the source tree (`pip install .` builds it; needs a C compiler and make)"


def open_library(path: Path, what: str, hint: str, error: type[Exception]) -> ct.CDLL:
    """``ct.CDLL(path)``; ``error`` with one line naming ``what`` and ``hint`` when the file
    is missing or does not load."""
    if not path.is_file():
        raise error(f"ridgeline: the native {what} library {path} is missing: {hint}")
    try:
        return ct.CDLL(str(path))
    except OSError as exc:
        raise error(f"ridgeline: cannot load the native {what} library {path}: {exc}; {hint}") from None
