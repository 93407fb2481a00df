"""The object-storage sink on ``/metrics`` (issue 23): what the agent's sink child wrote,
uploaded and dropped, from the health record's :class:`probes.records.SinkState`.

Only while ``[sink]`` is enabled; 13 series per host, whatever the GPUs and processes
(``Hostname`` only, and ``event`` from a fixed set of three):

* ``ridgeline_sink_up`` (1 while the recorder runs), ``ridgeline_sink_restarts_total``;
* ``ridgeline_sink_files_total`` and ``ridgeline_sink_bytes_total`` by ``event``
  (``written`` to the spool, ``uploaded`` to the store, ``dropped`` unsent past the spool
  cap or the free-space floor);
* ``ridgeline_sink_upload_retries_total`` (failed uploads, each retried),
  ``ridgeline_sink_messages_total`` (stream messages journaled),
  ``ridgeline_sink_missed_messages_total`` (published while no recorder ran: the gap a
  restart leaves), and the gauges ``ridgeline_sink_spool_bytes`` and
  ``ridgeline_sink_spool_files`` (complete files waiting for the store).
"""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ridgeline.probes.records import SinkState

#: The series one host's sink adds (tests/test_sink_agent.py counts them).
SERIES = 13


def families(host: str, s: SinkState | None):
    if s is None or s.state == "off":
        return
    up = GaugeMetricFamily("ridgeline_sink_up", "1 while the object-storage sink's recorder runs", labels=["Hostname"])
    up.add_metric([host], 1.0 if s.state == "running" else 0.0)
    yield up
    for name, doc, value in (
            ("ridgeline_sink_restarts", "Times the sink's recorder ended and was started again", s.restarts),
            ("ridgeline_sink_upload_retries", "Uploads to the store that failed (each retried with backoff)",
             s.upload_errors),
            ("ridgeline_sink_messages", "Stream messages the sink journaled", s.messages),
            ("ridgeline_sink_missed_messages", "Stream messages the sink never took (published while no recorder "
             "ran, past the agent's hand-off bound)",
             s.missed_messages)):
        fam = CounterMetricFamily(name, doc, labels=["Hostname"])
        fam.add_metric([host], float(value))
        yield fam
    files = CounterMetricFamily("ridgeline_sink_files", "Parquet files of the sink, by event (written to the spool, "
                                "uploaded to the store, dropped unsent)", labels=["Hostname", "event"])
    nbytes = CounterMetricFamily("ridgeline_sink_bytes", "Bytes of the sink's Parquet files, by event",
                                 labels=["Hostname", "event"])
    for ev, f, b in (("written", s.files_written, s.bytes_written), ("uploaded", s.files_uploaded, s.bytes_uploaded),
                     ("dropped", s.dropped_files, s.dropped_bytes)):
        files.add_metric([host, ev], float(f))
        nbytes.add_metric([host, ev], float(b))
    yield files
    yield nbytes
    for name, doc, value in (("ridgeline_sink_spool_bytes", "Bytes in the sink's local spool", s.spool_bytes),
                             ("ridgeline_sink_spool_files", "Complete files in the spool waiting for the store",
                              s.spool_files)):
        fam = GaugeMetricFamily(name, doc, labels=["Hostname"])
        fam.add_metric([host], float(value))
        yield fam
