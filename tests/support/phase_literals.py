"""Hand-built phase maps for the tests of phase consumers (roofline, analysis, perfetto).

Those tests give literal steps and per-kernel labels instead of running
:func:`aggregator.phases.map_phases`, so that a failure there is the consumer's, not
the phase mapper's. They use the real :class:`aggregator.phases.Step` and
:class:`aggregator.phases.PhaseMap`.
"""
import numpy as np

from ridgeline.aggregator.phases import PHASE_NAMES, PhaseMap, Step

NAMES = PHASE_NAMES
__all__ = ["NAMES", "Step", "phase_map"]


def phase_map(steps: list[Step], kernel_phase: np.ndarray, kernel_step: np.ndarray) -> PhaseMap:
    """A PhaseMap of literal ``steps`` and labels; every kernel's evidence is "literal"."""
    return PhaseMap(steps, kernel_phase, kernel_step,
                    np.zeros(len(kernel_phase), np.int32), ["literal"])
