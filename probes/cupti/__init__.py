"""Agent side of Ridgeline's CUPTI probe (the in-process side is probes/native).

Modules: ``protocol`` (wire format), ``layouts`` (CUPTI record dtypes by version),
``decode`` (raw records -> columnar events), ``server`` (the local socket),
``probe`` (:class:`CuptiProbe`), ``library`` (injection environment),
``pm_sampler`` (CUPTI PM sampling, hardware counters).

This package is ``probes.cupti``; cupti-python's top-level ``cupti`` module is only ever
imported absolutely (``from cupti import cupti``), so the two never shadow each other.
"""
from ridgeline.probes.cupti.probe import CuptiProbe

__all__ = ["CuptiProbe"]
