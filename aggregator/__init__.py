"""Ridgeline aggregator: phases, roofline, verdicts and windows from columnar events.

Imports only ``probes`` (never ``agent``), and never zmq, bcc, cupti or pynvml.
"""
