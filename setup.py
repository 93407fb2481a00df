"""Build hook: the wheel carries the CUPTI injection library, built from probes/native, the
native trace reader, built from probes/native_json, and the native fold library, built from
aggregator/native.

Everything declarative lives in pyproject.toml; this file only adds what setuptools cannot
say there:

* ``build_py`` also runs probes/native/Makefile (on a copy of the folder under the build
  directory, so a source tree's own ``make`` output is neither used nor overwritten) and
  puts ``libridgeline_cupti.so`` at ``ridgeline/probes/native/`` in the wheel, which is
  where ``ridgeline.probes.cupti.library.library_path()`` looks for it.
* ``build_py`` likewise runs aggregator/native/Makefile and puts ``libridgeline_fold.so``
  (the per-kernel pass of the per-phase fold, ``ridgeline.aggregator.fold_native``) at
  ``ridgeline/aggregator/native/``. It needs only a C compiler and is always built: the
  agent and ``analyze`` cannot fold without it. probes/cupti/native/Makefile likewise
  (``libridgeline_cupti_decode.so``, the CUPTI probe's per-record decode passes,
  ``ridgeline.probes.cupti.decode_native``) goes to ``ridgeline/probes/cupti/native/``.
  probes/sched_native/Makefile likewise (``libridgeline_sched.so``, the scheduling probe's
  compare-and-swap slot free, ``ridgeline.probes.sched.slot_library``) goes to
  ``ridgeline/probes/sched_native/``.
* The CUPTI headers come from the ``nvidia-cuda-cupti`` wheel that pyproject.toml pins as
  a build requirement (``CUPTI_INCLUDE=DIR`` overrides: a CUDA toolkit's
  ``extras/CUPTI/include``). Nothing is linked against libcupti; the library dlopens it.
* ``build_py`` likewise runs probes/native_json/Makefile (g++ and the distribution's
  libsimdjson-dev) and puts ``libridgeline_json.so`` at ``ridgeline/probes/native_json/``,
  where ``ridgeline.probes.kineto_native.library_path()`` looks for it.
* The wheel is tagged for the platform (``py3-none-linux_<arch>``): it holds a native
  library, but no Python extension, so any CPython 3 of that platform can use it.

A failed native build fails the package build with the compiler's message: an install
whose ``ridgeline run`` cannot inject is worse than no install. ``RIDGELINE_SKIP_NATIVE=1``
builds without it on purpose (the CUPTI probe then says the library is missing).
Editable installs (``pip install -e .``) build none of them: a source tree uses ``make -C
probes/native``, ``make -C probes/native_json``, ``make -C probes/cupti/native``, ``make -C
probes/sched_native`` and ``make -C aggregator/native`` (``scripts/setup.sh`` runs them), and the
library_path() functions find those.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
NATIVE_SRC = HERE / "probes" / "native"
LIB_NAME = "libridgeline_cupti.so"
# Where the library goes inside the installed package (mirrors probes/cupti/library.py).
LIB_DEST = Path("ridgeline") / "probes" / "native" / LIB_NAME
JSON_SRC = HERE / "probes" / "native_json"
JSON_LIB_NAME = "libridgeline_json.so"
# mirrors probes/kineto_native.py's library_path()
JSON_LIB_DEST = Path("ridgeline") / "probes" / "native_json" / JSON_LIB_NAME
DECODE_SRC = HERE / "probes" / "cupti" / "native"
DECODE_LIB = "libridgeline_cupti_decode.so"
# Mirrors probes/cupti/decode_native.py's library_path().
DECODE_DEST = Path("ridgeline") / "probes" / "cupti" / "native" / DECODE_LIB
SCHED_SRC = HERE / "probes" / "sched_native"
SCHED_LIB = "libridgeline_sched.so"
# Mirrors probes/sched.py's slot_library_path().
SCHED_DEST = Path("ridgeline") / "probes" / "sched_native" / SCHED_LIB
FOLD_SRC = HERE / "aggregator" / "native"
FOLD_LIB = "libridgeline_fold.so"
# Mirrors aggregator/fold_native.py's library_path().
FOLD_DEST = Path("ridgeline") / "aggregator" / "native" / FOLD_LIB


def cupti_include_dir() -> str:
    """The folder holding cupti_activity.h: $CUPTI_INCLUDE, else the nvidia-cuda-cupti wheel."""
    env = os.environ.get("CUPTI_INCLUDE")
    if env:
        return str(Path(env).parent if env.endswith(".h") else Path(env))
    for dist_name in ("nvidia-cuda-cupti", "nvidia-cuda-cupti-cu12"):
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            continue
        for f in dist.files or ():
            if f.name == "cupti_activity.h":
                return str(Path(dist.locate_file(f)).parent)
    return ""   # the Makefile then looks for a CUDA toolkit itself


def _make(build_temp: Path, src: Path, folder: str, lib_name: str, what: str, extra: list[str],
          missing_hint: str, failed_hint: str) -> Path:
    """Run ``src``'s Makefile on a copy under ``build_temp``/``folder`` (no stale objects or
    libraries of a source tree's own build); return the built library ``lib_name``."""
    work = build_temp.resolve() / folder
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(src, work, ignore=shutil.ignore_patterns("*.so", "*.o", "build", "__pycache__"))
    lib = work / lib_name
    cmd = ["make", "-C", str(work), *[x.format(work=work) for x in extra], str(lib)]
    print(f"ridgeline: building the {what}:", " ".join(cmd), flush=True)
    try:
        subprocess.run(cmd, check=True)
    except FileNotFoundError as exc:
        raise SystemExit(f"ridgeline: cannot build {lib_name}: {exc.filename} not found ({missing_hint})") from None
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"ridgeline: building {lib_name} failed (exit {exc.returncode}, see above{failed_hint}") from None
    if not lib.is_file():
        raise SystemExit(f"ridgeline: {src.relative_to(HERE)}/Makefile did not produce {lib_name}")
    return lib


_C_HINT = "install make and a C compiler, e.g. apt-get install gcc make libc6-dev"


def build_native(build_temp: Path) -> Path:
    """The CUPTI injection library (probes/native)."""
    inc = cupti_include_dir()
    return _make(build_temp, NATIVE_SRC, "native", LIB_NAME, "CUPTI injection library",
                 ["VENV={work}/no-venv"] + ([f"CUPTI_INCLUDE={inc}"] if inc else []), _C_HINT,
                 "); set RIDGELINE_SKIP_NATIVE=1 to build without the CUPTI injection library")


def build_fold(build_temp: Path) -> Path:
    """The per-kernel fold library (aggregator/native): the agent and analyze need it."""
    return _make(build_temp, FOLD_SRC, "fold", FOLD_LIB, "native fold library", [], _C_HINT, ")")


def build_decode(build_temp: Path) -> Path:
    """The agent's native CUPTI decode passes (probes/cupti/native): a C compiler only."""
    return _make(build_temp, DECODE_SRC, "cupti_decode", DECODE_LIB, "native CUPTI decoder", [], _C_HINT, ")")


def build_sched(build_temp: Path) -> Path:
    """The scheduling probe's slot free (probes/sched_native): a C compiler only."""
    return _make(build_temp, SCHED_SRC, "sched_native", SCHED_LIB, "scheduling slot library", [], _C_HINT, ")")


def build_trace_reader(build_temp: Path) -> Path:
    """The columnar Kineto reader (probes/native_json), against libsimdjson-dev."""
    return _make(build_temp, JSON_SRC, "native_json", JSON_LIB_NAME, "native trace reader", [],
                 "install make, g++ and libsimdjson-dev", "; it needs g++ and libsimdjson-dev)")


class BuildPyWithNative(build_py):
    """build_py plus the injection library (see the module docstring)."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        build_temp = Path(self.get_finalized_command("build").build_temp)
        # The fold library and the CUPTI decoder always (C only; the agent and analyze cannot
        # fold without the first, the CUPTI probe decode without the second); the CUPTI
        # library and the trace reader unless RIDGELINE_SKIP_NATIVE=1.
        built = [(build_fold(build_temp), FOLD_DEST), (build_decode(build_temp), DECODE_DEST),
                 (build_sched(build_temp), SCHED_DEST)]
        if os.environ.get("RIDGELINE_SKIP_NATIVE") != "1":
            built += [(build_native(build_temp), LIB_DEST), (build_trace_reader(build_temp), JSON_LIB_DEST)]
        for lib, rel in built:
            dest = Path(self.build_lib) / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(lib, dest)
            os.chmod(dest, 0o755)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        out = super().get_outputs(include_bytecode)
        if not self.editable_mode:
            out += [str(Path(self.build_lib) / FOLD_DEST), str(Path(self.build_lib) / SCHED_DEST)]
        if not self.editable_mode and os.environ.get("RIDGELINE_SKIP_NATIVE") != "1":
            out += [str(Path(self.build_lib) / LIB_DEST), str(Path(self.build_lib) / JSON_LIB_DEST)]
        return out


class NativeDistribution(Distribution):
    """A distribution with platform code: installed to platlib, wheel root not pure."""

    def has_ext_modules(self) -> bool:
        return True


class PlatformWheel(bdist_wheel):
    """Tag the wheel py3-none-<platform>: it carries a native library, no CPython extension."""

    def get_tag(self) -> tuple[str, str, str]:
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(distclass=NativeDistribution, cmdclass={"build_py": BuildPyWithNative, "bdist_wheel": PlatformWheel})
