"""Ridgeline: a low-overhead profiling agent for GPU hosts that serve large language models.

The repository keeps ``agent/``, ``probes/`` and ``aggregator/`` at its top (the design's
layout); the distribution installs them under this one import name, as ``ridgeline.agent``,
``ridgeline.probes`` and ``ridgeline.aggregator`` (see ``[tool.setuptools.package-dir]`` in
pyproject.toml), so that they never collide with other distributions' top-level packages.
"""
from __future__ import annotations


def __getattr__(name: str):
    # __version__ found when asked: importlib.metadata is some 0.1-0.4 s of imports that
    # every command (analyze above all, issue 21.3) would otherwise pay at start-up
    if name == "__version__":
        from importlib import metadata
        try:
            return metadata.version("ridgeline")
        except metadata.PackageNotFoundError:   # a source tree that was never installed
            return "0+unknown"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
