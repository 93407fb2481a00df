"""The agent's object-storage sink: a child process the daemon starts and keeps running.

Why a child and not a thread: the sink writes Parquet through pyarrow (tens of MB of
libraries, seconds of import, a compression pool of its own), and the daemon stays lean
and never imports it (tests/test_layering.py); a recorder that crashes or is killed costs
the sink a restart, never the agent's windows. Why the daemon and not a unit of its own:
one configuration file (``[sink]``), one switch (off by default), its counters on the
agent's own /metrics and health record, and ``ridgeline check`` saying its state.

Contract of :class:`SinkSupervisor` (``settings``: :class:`agent.config.SinkSettings`):

* :meth:`start` starts ``python -m ridgeline.agent record --format parquet --sink URL -o
  SPOOL --endpoint E`` (agent/commands/record.py, agent/object_sink.py): a subscriber of
  the agent's own stream. Where pyarrow is not installed the state is ``unavailable``, said
  once, and nothing is started.
* :meth:`poll` (every loop of the daemon; a ``waitpid`` and at most one small file read a
  second): a child that ended is counted (``restarts``) and started again after a backoff
  of 1 s doubling to ``restart_max_s`` (back to 1 s once a child has lived 60 s).
* :meth:`state` is a :class:`probes.records.SinkState`: the child's counters, read from
  the status file it writes once a second (``SPOOL/status.json``, agent/object_sink.py),
  summed over the children this agent ran (each child counts from zero; what a child
  killed with -9 counted after its last status is not in the sums, its files and rows are
  in the store all the same).
* :meth:`keep` (the publisher's tap: every message the agent publishes) feeds the
  :class:`agent.sink_handoff.HandoffRing`: each child is started with the hand-off of
  what it may have missed (``handoff_max_bytes``; 0: none), so a restart of the recorder
  loses nothing within that bound. ``epoch`` names this agent's sequence numbering.
* :meth:`stop` sends SIGTERM (the child rolls its files and uploads for at most its close
  timeout) and waits ``stop_timeout_s``, then SIGKILL: what it had journaled goes with the
  next start.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import orjson

from ridgeline.probes.records import SinkState

from .config import SinkSettings
from .sink_handoff import HandoffRing

log = logging.getLogger("ridgeline.agent")

#: The counters of agent.object_sink's status that add up over children.
SUMMED = ("messages", "missed_messages", "files_written", "bytes_written", "files_uploaded", "bytes_uploaded",
          "upload_errors", "dropped_files", "dropped_bytes", "replayed_messages", "torn_frames",
          "handed_over_messages", "duplicate_messages")
#: A child that lived this long resets the restart backoff.
HEALTHY_AFTER_S = 60.0
#: The status file is at most this big (a few hundred bytes: bounded read).
MAX_STATUS_BYTES = 64 * 1024


def command(settings: SinkSettings, endpoint: str) -> list[str]:
    cmd = [sys.executable, "-m", "ridgeline.agent", "record", "--format", "parquet", "--sink", settings.url,
           "-o", settings.spool_dir, "--endpoint", endpoint, "--roll-s", repr(settings.roll_s),
           "--spool-max-bytes", str(settings.spool_max_bytes), "--min-free-bytes", str(settings.min_free_bytes),
           "--sink-scheme", settings.scheme,
           # stops as on SIGTERM once the agent is gone (killed with -9 too): no orphaned
           # recorder holds the spool's lock against the next agent's (a pre-exec prctl
           # would run in a forked child of a threaded process: not safe)
           "--stop-with-parent", str(os.getpid())]
    if settings.endpoint:
        cmd += ["--sink-endpoint", settings.endpoint]
    if settings.region:
        cmd += ["--sink-region", settings.region]
    if settings.handoff_max_bytes:
        cmd += ["--handoff-bytes", str(settings.handoff_max_bytes)]
    return cmd


class SinkSupervisor:
    def __init__(self, settings: SinkSettings, endpoint: str, clock=time.monotonic, stop_timeout_s: float = 10.0,
                 epoch: int | None = None):
        self.settings, self.endpoint, self.clock = settings, endpoint, clock
        self.epoch = epoch if epoch is not None else random.getrandbits(62)
        self.handoff = HandoffRing(self.epoch, settings.handoff_max_bytes, clock=clock)
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.unavailable = ""
        self._base = dict.fromkeys(SUMMED, 0)      # what ended children counted
        self._last: dict = {}                      # the running child's last status
        self._last_read = -1e9
        self._last_mono = 0.0
        self._gauges: dict = {}                    # the spool's figures as the last child left them
        self._started_at = 0.0
        self._backoff_s = 1.0
        self._restart_at: float | None = None
        self.status_path = Path(settings.spool_dir) / "status.json"

    def start(self) -> None:
        if importlib.util.find_spec("pyarrow") is None:
            self.unavailable = "pyarrow is not installed (pip install 'ridgeline[parquet]')"
            log.error("sink: not started: %s", self.unavailable)
            return
        self._spawn()

    def _spawn(self) -> None:
        Path(self.settings.spool_dir).mkdir(parents=True, exist_ok=True)
        # the last child's status is folded into the sums already: a new child starts from zero
        self.status_path.unlink(missing_ok=True)
        self._last, self._restart_at = {}, None
        if self.settings.handoff_max_bytes:
            self.handoff.open(Path(self.settings.spool_dir))   # before the child: it waits for this file
        self.proc = subprocess.Popen(command(self.settings, self.endpoint), stdin=subprocess.DEVNULL)
        self._started_at = self.clock()
        log.info("sink: recording to %s through the spool %s (pid %d)", self.settings.url, self.settings.spool_dir,
                 self.proc.pid)

    def _read_status(self) -> None:
        try:
            with open(self.status_path, "rb") as f:
                raw = f.read(MAX_STATUS_BYTES)
        except FileNotFoundError:
            return
        try:
            st = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return                      # replaced atomically, so only a foreign file: ignored
        if isinstance(st, dict) and self.proc is not None and st.get("pid") == self.proc.pid:
            self._last = st
            self._last_mono = self.clock()

    def keep(self, topic: str, seq: int, envelope: bytes) -> None:
        if self.settings.handoff_max_bytes and not self.unavailable:   # no recorder will ever take it
            self.handoff.keep(topic, seq, envelope)

    def poll(self) -> None:
        self.handoff.poll()
        if self.proc is None:
            if self._restart_at is not None and self.clock() >= self._restart_at:
                self._spawn()
            return
        now = self.clock()
        rc = self.proc.poll()
        if rc is None:
            if now - self._last_read >= 1.0:
                self._last_read = now
                self._read_status()
            return
        self._fold()
        self.handoff.close()                # a new file for the next child
        lived = now - self._started_at
        if lived >= HEALTHY_AFTER_S:
            self._backoff_s = 1.0
        self.restarts += 1
        self._restart_at = now + self._backoff_s
        log.warning("sink: recorder pid %d ended (%s) after %.0f s; starting it again in %.0f s",
                    self.proc.pid, f"exit {rc}" if rc >= 0 else f"signal {-rc}", lived, self._backoff_s)
        self._backoff_s = min(self.settings.restart_max_s, self._backoff_s * 2)
        self.proc = None

    def _fold(self) -> None:
        """An ended child's last status into the sums (and its spool figures kept)."""
        self._read_status()                 # its last word
        for k in SUMMED:
            self._base[k] += int(self._last.get(k) or 0)
        if self._last:
            self._gauges = {k: self._last.get(k) for k in ("spool_bytes", "spool_files", "last_error")}
        self._last = {}

    def reconfigure(self, settings: SinkSettings) -> None:
        """New settings (a reload): the child stopped and, when still enabled, started with them;
        the sums go on."""
        self.stop()
        self.settings, self.unavailable = settings, ""
        self.handoff.max_bytes = settings.handoff_max_bytes
        self.status_path = Path(settings.spool_dir) / "status.json"
        if settings.enabled:
            self.start()

    def state(self) -> SinkState:
        if self.unavailable:
            return SinkState(state="unavailable", url=self.settings.url, last_error=self.unavailable)
        last = self._last
        sums = {k: self._base[k] + int(last.get(k) or 0) for k in SUMMED}
        running = self.proc is not None and self.proc.poll() is None
        g = last or self._gauges
        age = self.clock() - self._last_mono if last else 0.0
        return SinkState(state="running" if running else "restarting", url=self.settings.url,
                         restarts=self.restarts, spool_bytes=int(g.get("spool_bytes") or 0),
                         spool_files=int(g.get("spool_files") or 0),
                         last_error=str(g.get("last_error") or "")[:300], status_age_s=round(age, 3),
                         handoff_ring_bytes=self.handoff.ring_bytes, handoff_ring_dropped=self.handoff.ring_dropped,
                         **sums)

    def state_record(self) -> dict:
        return msgspec.to_builtins(self.state())

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def stop(self) -> None:
        p = self.proc
        self._restart_at = None
        if p is None:
            return
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("sink: recorder pid %d did not stop within %.0f s; killed (its journal goes with the "
                            "next start)", p.pid, self.stop_timeout_s)
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
        self._fold()
        self.handoff.close()
        self.proc = None
