"""The names of the agent's probes, declared once, below both readers.

Contract: :data:`PROBE_NAMES` holds, in the order the registry lists and starts them, the
names ``probes.enabled`` of the configuration may hold. :mod:`agent.config` checks a loaded
configuration against it (an unknown name is one line and exit 2 at load and at reload);
:mod:`agent.registry` keys its steps by it (tests/test_agent_registry.py checks that the two
agree). It lives apart from the registry because the registry's factories take the typed
configuration: the configuration reading the registry closed an import circle.
"""
from __future__ import annotations

PROBE_NAMES: tuple[str, ...] = (
    "sched", "cuda_uprobes", "cupti", "nvml", "engine", "otlp", "sglang_requests", "simulator", "replay",
)
