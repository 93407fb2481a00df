"""Ridgeline: a low-overhead profiling agent for GPU hosts that serve large language models.

The repository keeps ``agent/``, ``probes/`` and ``aggregator/`` at its top (the design's
layout); the distribution installs them under this one import name, as ``ridgeline.agent``,
``ridgeline.probes`` and ``ridgeline.aggregator`` (see ``[tool.setuptools.package-dir]`` in
pyproject.toml), so that they never collide with other distributions' top-level packages.
"""
from __future__ import annotations

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("ridgeline")
except _metadata.PackageNotFoundError:   # a source tree that was never installed
    __version__ = "0+unknown"
