"""Ridgeline probes: collectors that return plain columnar data.

Lowest layer of the import order ``agent -> aggregator -> probes``: nothing here
imports from ``aggregator`` or ``agent``.
"""
