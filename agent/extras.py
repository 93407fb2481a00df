"""The optional extras a command needs, and the one line it says when one is missing.

The daemon (``ridgeline agent``) needs neither: ``terminal`` (rich) draws ``top``, the
text report of ``analyze`` and the demo's report; ``plot`` (matplotlib) draws the
roofline of ``analyze --plot`` and the demo. A fleet host installs ``ridgeline`` alone.
"""
from __future__ import annotations

import importlib.util

from ridgeline.probes.errors import RuntimeFailure

#: module -> the extra that installs it
EXTRAS = {"rich": "terminal", "matplotlib": "plot"}


def require(module: str, what: str) -> None:
    """Raise :class:`RuntimeFailure` (exit 1, one line) when ``module`` is not installed."""
    if importlib.util.find_spec(module) is None:
        raise RuntimeFailure(f"{what} needs {module}, which this install lacks: "
                             f"pip install 'ridgeline[{EXTRAS[module]}]'")
