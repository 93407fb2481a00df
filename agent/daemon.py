"""The agent's main loop: poll probes, fold into windows, publish, stay cheap.

Contract of :class:`Agent`:

* :meth:`start` binds the publisher (refusing a clear-text non-loopback bind), starts the
  Prometheus endpoint, starts the probes through :mod:`agent.registry`, then tells systemd
  ``READY=1``.
* :meth:`run` loops on a monotonic deadline until :meth:`request_stop` (SIGTERM/SIGINT).
  It sleeps until something is due: a probe with a readiness descriptor
  (:class:`probes.probe.Readiness`, the CUPTI probe) is polled when that descriptor says
  it has data, every other probe every ``POLL_S`` (the loop then wakes at that rate; with
  only readiness probes it wakes for data, the window deadline, the watchdog, a deferred
  reload or a signal, which writes a wake-up pipe, so SIGTERM is seen at once). A probe
  raising in ``poll()`` is counted and the loop goes on. It routes the data (events into the window, sched/device/engine into the
  window and onto their topics), and every ``window_s`` closes the window and publishes
  ``window`` and ``health``. Missed deadlines are skipped, not queued. ``WATCHDOG=1`` is
  sent at half of ``WATCHDOG_USEC``, and only while windows are really published (the
  last one within two window lengths): a loop that fails at every window, or has lost
  its publisher, stops feeding the watchdog and systemd restarts it. A failing loop logs
  the first traceback of each kind of error and then one line a minute with a count.
* SIGHUP (:meth:`request_reload`) re-reads the config file and lays the command-line
  overrides (``overrides``) on it again. The whole new configuration is validated
  before anything is touched; if any value is wrong, or the new /metrics address or
  publisher endpoint cannot be bound, the running configuration stays as it was (and
  keeps publishing). Window length, log level, analysis, events publishing, the probe
  set, /metrics and the publisher endpoint are applied; sequence numbers continue.
* Text that came from peers (served processes' status lines, probe error messages) is
  escaped before it is logged (:mod:`probes.untrusted_text`).
* On stop, the open window is closed and published (flush), then ``STOPPING=1``, probes
  are stopped, and sockets closed.
"""
from __future__ import annotations

import logging
import os
import random
import selectors
import signal
import socket
import time

import msgspec

from ridgeline.aggregator.windows import WindowBuilder, plain
from ridgeline.probes.errors import InputError
from ridgeline.probes.heap_trim import trim_heap
from ridgeline.probes.probe import (
    CuptiControl,
    PollResult,
    ProcessNews,
    Readiness,
    Targeted,
    drain_fd,
    poke,
    poll_result,
    wake_pipe,
)
from ridgeline.probes.records import Window
from ridgeline.probes.untrusted_text import for_log

from . import config as config_mod
from . import reclaim_request, registry
from .cupti_takeover import TakeoverWatch
from .health import HealthMeter, rss_bytes
from .publisher import Publisher
from .sdnotify import Notifier

log = logging.getLogger("ridgeline.agent")

POLL_S = 0.05
#: A loop error is logged with its traceback once per kind; repeats are summed and
#: logged at most this often.
ERROR_LOG_EVERY_S = 60.0


# A config file modified less than this long ago is being written: a reload waits for it
# to settle instead of applying half a file. Issue 18.9: a SIGHUP storm while the file was
# rewritten parsed truncated files (valid TOML, so the defaults: every probe), started the
# eBPF probes and loaded bcc's compiler into the agent, RSS 47 -> 240 MiB.
RELOAD_SETTLE_S = 0.5


class Agent:
    def __init__(self, cfg: config_mod.Config, config_path: str | None = None, notifier: Notifier | None = None,
                 probes: list[registry.Running] | None = None, publisher_factory=Publisher, codec=None,
                 overrides: dict | None = None):
        self.cfg = cfg
        self.config_path = config_path
        # Command-line settings laid over the file again at every reload (`--probes` must
        # not come back as every probe after SIGHUP).
        self.overrides = overrides or {}
        self.notifier = notifier or Notifier()
        self._given_probes = probes
        self._publisher_factory = publisher_factory
        # The wire codec (aggregator.wire): encode_envelope, encode_window, encode_event_batch.
        self.codec = codec
        self.running: list[registry.Running] = []
        self.publisher: Publisher | None = None
        self.prometheus = None
        self.latest_window: Window | None = None
        self.windows_published = 0
        self.records_total = 0
        # Engine endpoints whose last scrape failed -> that error: warned once per outage.
        self.engine_down: dict[str, str] = {}
        self._stop = False
        self._reload = False
        self._reload_not_before = 0.0
        self.reloads = 0
        self.reloads_refused = 0
        self.reloads_deferred = 0    # SIGHUPs that found the file still being written
        self.loop_errors = 0
        self._error_log: dict[tuple, list] = {}       # (type, text) -> [repeats since logged, next log time]
        self.last_published_mono = time.monotonic()   # last window the publisher really took
        self.watchdog_skipped = 0
        self._unbound_seq: dict[str, int] = {}        # sequence numbers while no socket is bound
        # As dcgm-exporter names the host (NODE_NAME, set from spec.nodeName in Kubernetes,
        # else the host name), so the Hostname label joins its series: in a pod the host
        # name is the pod's, not the node's.
        self.host = cfg.agent.host or os.environ.get("NODE_NAME") or socket.gethostname()
        self.builder = WindowBuilder(host=self.host)
        self._apply_requests(cfg)
        self._apply_analysis(cfg)
        self.health = HealthMeter()
        self.probe_counters_removed: dict[str, dict] = {}
        # served processes whose CUPTI another tool took over; when to ask for it back
        self.takeovers = TakeoverWatch(cfg.probes.cupti.reclaim_after_s)
        self.reclaim_requests_rejected = 0
        self.sink = None        # agent.sink_supervisor.SinkSupervisor while [sink] is enabled
        self.heap = None        # agent.allocator.SpikeTrim where glibc keeps freed memory
        # names this process's sequence numbering (kept across publisher rebinds, as the
        # numbers are): a recorder tells from it whether its spool's last numbers are ours
        self.stream_epoch = random.getrandbits(62)
        # The loop's wait (see run): a selector over a wake-up pipe (written by the signal
        # handlers) and the running probes' readiness descriptors, rebuilt when the probe
        # set changes; built by run, closed by shutdown.
        self._sel: selectors.BaseSelector | None = None
        self._wake: tuple[int, int] | None = None
        self._sel_for: tuple | None = None       # (id of self.running, its length, the fds)
        # id(probe) -> (probe, is Readiness, is CuptiControl): see _protocols
        self._probe_protocols: dict[int, tuple] = {}
        self._on_timer = True                    # some probe is polled every POLL_S
        self._fd_probes: set[int] = set()        # ids of the Running polled on readiness
        self.loop_wakeups = 0                    # the loop's waits ended (tests: an idle loop's rate)

    def _apply_requests(self, cfg: config_mod.Config) -> None:
        """With the OTLP probe enabled, the window builder keeps the steps and requests the
        request join needs (from the first window on: a request's span comes at its end)."""
        o = cfg.probes.otlp
        if not {"otlp", "sglang_requests"} & set(cfg.probes.enabled):
            self.builder.requests = None      # no spans come: hold no steps for them
            return
        if self.builder.requests is None:
            from ridgeline.aggregator.request_history import RequestHistory
            self.builder.requests = RequestHistory(o.history_s, o.join_delay_s)
        else:
            self.builder.requests.configure(o.history_s, o.join_delay_s)

    def _apply_analysis(self, cfg: config_mod.Config) -> None:
        a = cfg.analysis
        model = None
        if a.model:
            from ridgeline.aggregator import model_config
            model = model_config.load(a.model)     # checked when the config was loaded
        self.builder.model, self.builder.gpu = model, a.gpu

    # -- signals ---------------------------------------------------------------------------
    def request_stop(self, *_):
        self._stop = True
        self._wake_loop()

    def request_reload(self, *_):
        self._reload = True
        self._wake_loop()

    def _wake_loop(self) -> None:
        # A signal's handler runs between the loop's bytecodes, and select() is retried
        # after it (PEP 475) with what is left of its timeout: only a byte in a descriptor
        # it waits on ends the wait now.
        if self._wake is not None:
            poke(self._wake[1])

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        signal.signal(signal.SIGHUP, self.request_reload)

    # -- life cycle ------------------------------------------------------------------------
    def _make_publisher(self, p: config_mod.PublisherSettings) -> Publisher:
        pub = self._publisher_factory(p.endpoint, host=self.host, sndhwm=p.sndhwm,
                                      encode=self.codec.encode_envelope,
                                      curve_secret_key_file=p.curve_secret_key_file,
                                      curve_allowed_clients_dir=p.curve_allowed_clients_dir,
                                      ipc_group=p.ipc_group)
        pub.tap = self._tap
        return pub

    def _tap(self, topic: str, seq: int, envelope: bytes) -> None:
        if self.sink is not None:
            self.sink.keep(topic, seq, envelope)

    def start(self) -> None:
        # The fold's native pass (aggregator/fold_native.py): without it no window can be
        # folded, so the agent says so once, here, and does not start (RuntimeFailure).
        from ridgeline.aggregator import fold_native
        fold_native.check()
        # Freed fold temporaries stay in the heap for the next fold (agent/allocator.py).
        from .allocator import SpikeTrim, keep_freed_memory
        if keep_freed_memory():
            self.heap = SpikeTrim()
        if self.codec is None:
            from ridgeline.aggregator import wire
            self.codec = wire
        self.notifier.status("starting: binding publisher")
        self.publisher = self._make_publisher(self.cfg.publisher)
        if self.cfg.prometheus.enabled:
            from .prometheus import MetricsServer
            try:
                pr = self.cfg.prometheus
                self.prometheus = MetricsServer(self, pr.listen, max_connections=pr.max_connections,
                                                timeout_s=pr.timeout_s)
            except OSError as exc:
                self.publisher.close()
                raise InputError(f"cannot serve Prometheus on {self.cfg.prometheus.listen}: "
                                 f"{exc.strerror or exc}") from None
        if self.cfg.sink.enabled:
            from .sink_supervisor import SinkSupervisor
            self.sink = SinkSupervisor(self.cfg.sink, self.cfg.publisher.endpoint, epoch=self.stream_epoch)
            self.sink.start()
        self.notifier.status("starting probes")
        self.running = self._given_probes if self._given_probes is not None else registry.start_all(self.cfg, log)
        names = ", ".join(r.step.name for r in self.running) or "none"
        log.info("agent ready: publishing on %s; probes: %s", self.cfg.publisher.endpoint, names)
        self.last_published_mono = time.monotonic()
        self.notifier.ready(f"publishing on {self.cfg.publisher.endpoint}; probes: {names}")

    def _poll_once(self, window_end: bool = False, ready: set | None = None) -> None:
        """Poll the probes: per-window ones only at ``window_end`` (then every probe);
        between windows, with ``ready`` (ids of the Running whose readiness descriptor
        woke the loop), a readiness probe only when it is in it."""
        for r in self.running:
            if not window_end:
                if r.step.per_window:
                    continue
                if ready is not None and id(r) in self._fd_probes and id(r) not in ready:
                    continue
            try:
                data = r.probe.poll()
            except Exception as exc:  # noqa: BLE001  (one probe's failure must not stop the others; counted, logged)
                r.poll_errors += 1
                if r.poll_errors == 1 or r.last_error != str(exc):
                    log.warning("probe %s: poll() raised %s: %s (counted; continuing)", r.step.name,
                                type(exc).__name__, for_log(exc))
                r.last_error = str(exc)
                continue
            if data is None or (isinstance(data, dict) and not data):
                continue
            try:
                self._route(r, data)
            except Exception as exc:  # noqa: BLE001  (data one probe handed over; counted in its errors, logged)
                r.poll_errors += 1
                log.warning("probe %s: data could not be used: %s: %s", r.step.name, type(exc).__name__,
                            for_log(exc))

    def _route(self, r: registry.Running, data) -> None:
        res: PollResult = poll_result(r.step.topic, data)
        self.records_total += res.records
        if res.trace is not None:
            src = res.trace.meta.get("source") or r.step.name
            self.builder.add_events(res.trace, source=src)
            if self.cfg.publisher.publish_events:
                self.publisher.publish("events", self.codec.encode_event_batch(res.trace))
        if res.requests is not None:
            self.builder.add_requests(res.requests, arrived_ns=time.time_ns())
        # A source may carry side figures (a simulator's engine view) next to its events.
        for topic, payload in (("engine", res.engine), ("device", res.device), ("sched", res.sched)):
            if payload is not None:
                if topic == "engine":
                    self._engine_news(payload)
                self._add_plain(topic, payload, r.step.name)
        # Process news (the CUPTI probe's new and closed pids, their status lines).
        if res.news is not None:
            self._process_news(r, res.news)

    def _engine_news(self, data: dict) -> None:
        """One warning when an engine endpoint stops answering (or never did), with the
        endpoint and the error; one line when it answers again. The probe retries with
        back-off and counts every failure (ridgeline_probe_errors_total)."""
        for e in data.get("errors") or []:
            if not isinstance(e, dict) or not isinstance(e.get("endpoint"), str):
                continue
            ep, err = e["endpoint"], str(e.get("error"))
            err = err[len(ep) + 2:] if err.startswith(ep + ": ") else err     # the endpoint is said once
            if ep not in self.engine_down:
                log.warning("engine endpoint %s not answering: %s (retrying with back-off; said once until it "
                            "answers)", for_log(ep), for_log(err))
            self.engine_down[ep] = err
        for s in data.get("scrapes") or []:
            ep = s.get("endpoint") if isinstance(s, dict) else None
            if ep in self.engine_down:
                del self.engine_down[ep]
                log.info("engine endpoint %s answering again", for_log(ep))

    def _process_news(self, r: registry.Running, news: ProcessNews) -> None:
        """New served processes (announced by the CUPTI library) become targets of the
        scheduling probes; ended ones stop being; status lines are logged once."""
        for item in news.new:
            pid = item[0] if isinstance(item, (list, tuple)) else item
            log.info("probe %s: served process %s appeared", r.step.name, for_log(item))
            for other in self.running:
                if other.step.topic == "sched" and isinstance(other.probe, Targeted):
                    try:
                        other.probe.add_target(int(pid))
                    except Exception as exc:  # noqa: BLE001  (bcc raises plain Exception; counted, logged)
                        other.poll_errors += 1
                        log.warning("probe %s: cannot watch pid %s: %s", other.step.name, for_log(pid),
                                    for_log(exc))
        for pid in news.closed:
            for other in self.running:
                if other.step.topic == "sched" and isinstance(other.probe, Targeted):
                    try:
                        other.probe.remove_target(int(pid))
                    except Exception as exc:  # noqa: BLE001  (bcc raises plain Exception; counted, logged)
                        other.poll_errors += 1
                        log.warning("probe %s: cannot stop watching pid %s: %s", other.step.name, for_log(pid),
                                    for_log(exc))
        for pid, text in news.status.items():
            log.warning("probe %s: process %s: %s", r.step.name, for_log(pid), for_log(text))
        if news.status:
            self.takeovers.status_lines(news.status)

    def _add_plain(self, topic: str, data: dict, source: str) -> None:
        payload = plain(data) if topic != "engine" else None
        if topic == "sched":
            self.builder.add_sched(payload, source)
        elif topic == "device":
            self.builder.add_device(payload, source)
        else:
            # Engine scrapes become figures when the window closes (rates need two
            # scrapes); the engine topic carries those figures, see close_window.
            self.builder.add_engine(data, source)
            return
        self.publisher.publish(topic, {"source": source, "data": payload})

    def probe_counters(self) -> dict:
        out = dict(self.probe_counters_removed)
        for r in self.running:
            try:
                c = dict(r.probe.counters())
            except Exception as exc:  # noqa: BLE001  (said in the health record: counters_error, errors 1)
                c = {"records": 0, "drops": 0, "errors": 1, "counters_error": str(exc)}
            c["errors"] = int(c.get("errors", 0) or 0) + r.poll_errors
            c["poll_errors"] = r.poll_errors
            out[r.step.name] = plain(c)
        return out

    def watch_takeovers(self) -> dict:
        """Once a window: take the operator's reclaim request, note which served
        processes' CUPTI is taken over, send the reclaims the policy asks for
        (:mod:`agent.cupti_takeover`); returns the health record's part."""
        cupti = next((r.probe for r in self.running if self._protocols(r.probe)[1]), None)
        if cupti is None:
            return {}
        sock = cupti.socket_path or self.cfg.probes.cupti.socket
        req, rejected = reclaim_request.take_request(sock)
        self.reclaim_requests_rejected += rejected
        if req is not None:
            self.takeovers.request(req["pid"])
        now = time.time()
        pids = self.takeovers.observe(cupti.taken_over_pids(), now)
        self.takeovers.owners(cupti.taken_over_owners())
        sent = []
        for pid in pids:
            try:
                if cupti.reclaim(pid):
                    sent.append(pid)
            except Exception as exc:  # noqa: BLE001  (the other pids' reclaims still go; logged)
                log.warning("cupti: reclaim of pid %d failed: %s", pid, for_log(exc))
        if sent:
            log.info("cupti: asked pid(s) %s to reclaim CUPTI from the other tool", ", ".join(map(str, sent)))
        if req is not None:
            try:
                reclaim_request.write_done(sock, req["id"], sent)
            except OSError as exc:
                log.warning("cupti: cannot answer the reclaim request: %s", for_log(exc))
        return {"cupti_taken_over": self.takeovers.report(now),
                "cupti_processes_taken_over": self.takeovers.count(),
                "cupti_taken_over_by_uid": self.takeovers.by_uid(),
                "cupti_reclaims_requested": self.takeovers.reclaims_requested,
                "cupti_reclaim_requests_rejected": self.reclaim_requests_rejected}

    def close_window(self, start_ns: int, end_ns: int, final: bool = False) -> Window:
        if self.publisher is None:
            self._lose_window()
            raise RuntimeError("no publisher: the stream socket could not be bound (retried every window)")
        pub = self.publisher.counters()
        takeover = self.watch_takeovers()
        agent = self.health.sample(self.probe_counters(), self.records_total,
                                   extra={"publisher_drops": sum(pub.get("drops", {}).values()),
                                          "window_drops": self.builder.drops,
                                          "window_fold_errors": self.builder.fold_errors,
                                          **self._request_counters(),
                                          "publisher_errors": pub.get("errors", 0),
                                          "publisher_stalls": pub.get("stalls", 0),
                                          "publisher_lossy_sent": pub.get("lossy_sent", 0),
                                          "publisher_drops_by_topic": pub.get("drops", {}),
                                          "publisher_bytes_sent": pub.get("bytes_sent", 0),
                                          "subscriptions": pub.get("subscriptions", 0),
                                          "bad_frames": pub.get("bad_frames", 0),
                                          "metrics_server": self.prometheus.counters() if self.prometheus else {},
                                          "reloads": self.reloads, "reloads_refused": self.reloads_refused,
                                          "reloads_deferred": self.reloads_deferred,
                                          "loop_errors": self.loop_errors, "watchdog_skipped": self.watchdog_skipped,
                                          **({"sink": self.sink.state_record()} if self.sink else {}),
                                          **takeover})
        window = self.builder.close(start_ns, end_ns, agent, final=final)
        self.latest_window = window
        if self.prometheus is not None:
            self.prometheus.observe(window)
        errors_before = self.publisher.errors
        self.publisher.publish("window", self.codec.encode_window(window))
        if window.engine:
            self.publisher.publish("engine", window.engine)
        if self.builder.stories:
            # Every story told this window (bounded): `ridgeline requests` and `why` read them.
            import msgspec
            self.publisher.publish("requests", {"end_ns": int(end_ns),
                                                "stories": msgspec.to_builtins(self.builder.stories)})
        self.publisher.publish("health", agent)
        self.windows_published += 1
        if self.heap is not None:
            # A spike's leftover (agent/allocator.py), read after the window's temporaries are freed.
            rss = rss_bytes()
            if self.heap.observe(rss):
                trim_heap()
                (log.info if self.heap.trims <= 2 else log.debug)(
                    "heap: freed fold memory given back (RSS %d -> %d MiB; trim %d: the first after start-up, "
                    "then after spikes, those from the third on at debug level)",
                    rss >> 20, rss_bytes() >> 20, self.heap.trims)
        if self.publisher.errors == errors_before:
            # Taken by the socket (a slow subscriber's drop still counts as published:
            # the agent works; the loss is counted and shows as a gap).
            self.last_published_mono = time.monotonic()
        return window

    def _request_counters(self) -> dict:
        h = self.builder.requests
        if h is None:
            return {}
        return {"requests_joined": h.requests_joined, "requests_dropped": h.requests_dropped,
                "request_steps_dropped": h.steps_dropped, "request_stories_unpublished": self.builder.stories_unpublished}

    def load_config(self) -> config_mod.Config:
        """The configuration file (or the defaults) with the command-line overrides on top,
        fully validated; raises :class:`InputError`."""
        new = config_mod.load(self.config_path, missing_ok=self.config_path is None)
        if self.overrides:
            new = config_mod.overlay(new, self.overrides, "command line")
        return new

    @staticmethod
    def _socket_settings(p: config_mod.PublisherSettings) -> dict:
        return {k: v for k, v in config_mod.as_table(p).items() if k != "publish_events"}

    def _refuse_reload(self, why: str) -> None:
        self.reloads_refused += 1
        log.error("reload refused, keeping the running configuration: %s", why)
        self.notifier.status(f"reload refused: {why}")
        self.notifier.ready()

    def _config_stat(self):
        """(inode, size, mtime_ns) of the config file, or None without one."""
        if self.config_path is None:
            return None
        try:
            st = os.stat(self.config_path)
        except OSError:
            return None       # load_config says why
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _defer_reload(self) -> None:
        self.reloads_deferred += 1
        self._reload_not_before = time.monotonic() + RELOAD_SETTLE_S

    def reload(self) -> None:
        """Apply the configuration file again (SIGHUP): all or nothing, and only a file
        that has settled (not modified for RELOAD_SETTLE_S, unchanged while read)."""
        before = self._config_stat()
        if before is not None and time.time_ns() - before[2] < RELOAD_SETTLE_S * 1e9:
            self._defer_reload()        # still being written; many SIGHUPs, one reload
            return
        self._reload = False
        if before is not None and before[1] == 0:
            self._refuse_reload(f"{self.config_path}: the config file is empty (truncated while written?)")
            return
        self.notifier.reloading()
        try:
            new = self.load_config()
            if before is not None and self._config_stat() != before:
                self._reload = True     # rewritten while read: read again once it settles
                self._defer_reload()
                self.notifier.ready()
                return
            if self._socket_settings(new.publisher) != self._socket_settings(self.cfg.publisher):
                from .publisher import check_settings
                check_settings(new.publisher)
        except InputError as exc:
            self._refuse_reload(str(exc))
            return
        old = self.cfg
        # Sockets first, each able to fail and leave the old one in place; the cheap
        # settings are applied only once both are settled.
        new_prom = self.prometheus
        if new.prometheus != old.prometheus:
            try:
                new_prom = self._swap_prometheus(old.prometheus, new.prometheus)
            except OSError as exc:
                self._refuse_reload(f"cannot serve Prometheus on {new.prometheus.listen}: "
                                    f"{exc.strerror or exc}")
                return
        if self._socket_settings(new.publisher) != self._socket_settings(old.publisher):
            try:
                self._swap_publisher(new.publisher)
            except InputError as exc:
                if new_prom is not self.prometheus and new_prom is not None:
                    new_prom.close()     # undo the /metrics change too: all or nothing
                self._refuse_reload(str(exc))
                return
        if new_prom is not self.prometheus:
            if self.prometheus is not None:
                self.prometheus.close()
                if new_prom is not None:
                    new_prom.collector = self.prometheus.collector   # counters go on
                    new_prom.registry = self.prometheus.registry
            self.prometheus = new_prom
        self.cfg = new
        self.reloads += 1
        logging.getLogger("ridgeline").setLevel(new.agent.log_level.upper())
        self._apply_analysis(new)
        self._apply_requests(new)
        self.takeovers.reclaim_after_s = new.probes.cupti.reclaim_after_s
        if new.sink != old.sink or (self.sink is not None and new.publisher.endpoint != old.publisher.endpoint):
            self._apply_sink(new)
        if self._given_probes is None and any(_probe_settings(new, n) != _probe_settings(old, n)
                                              for n in type(new.probes).__struct_fields__):
            keep = [r for r in self.running if r.step.name in new.probes.enabled
                    and _probe_settings(new, r.step.name) == _probe_settings(old, r.step.name)
                    and new.probes.pids == old.probes.pids]
            gone = [r for r in self.running if r not in keep]
            counters = self.probe_counters()
            for r in gone:
                self.probe_counters_removed[r.step.name] = counters[r.step.name]
            registry.stop_all(gone, log)
            have = {r.step.name for r in keep}
            added = registry.start_all(new, log, [n for n in new.probes.enabled if n not in have])
            self.running = keep + added
        log.info("configuration reloaded")
        self.notifier.ready(f"reloaded; probes: {', '.join(r.step.name for r in self.running) or 'none'}")

    def _apply_sink(self, new: config_mod.Config) -> None:
        if self.sink is not None:
            self.sink.endpoint = new.publisher.endpoint
            self.sink.reconfigure(new.sink)
            if not new.sink.enabled:
                self.sink = None
        elif new.sink.enabled:
            from .sink_supervisor import SinkSupervisor
            self.sink = SinkSupervisor(new.sink, new.publisher.endpoint, epoch=self.stream_epoch)
            self.sink.start()

    def _swap_prometheus(self, old: config_mod.PrometheusSettings, new: config_mod.PrometheusSettings):
        """The /metrics server for ``new`` (the running one when only its limits change);
        raises OSError, leaving the running server untouched, when ``new`` cannot be bound."""
        from .prometheus import MetricsServer
        if not new.enabled:
            return None
        if self.prometheus is not None and old.listen == new.listen:
            self.prometheus.configure(max_connections=new.max_connections, timeout_s=new.timeout_s)
            return self.prometheus
        return MetricsServer(self, new.listen, max_connections=new.max_connections,
                             timeout_s=new.timeout_s)

    def _swap_publisher(self, p: config_mod.PublisherSettings) -> None:
        """Rebind the stream with ``p``; when that fails, rebind the running settings and
        raise InputError. Sequence numbers go on either way."""
        old_pub = self.publisher
        seq = dict(old_pub.seq) if old_pub is not None else None
        if old_pub is not None:
            # The old socket must let go of its endpoint before a new one can bind it.
            old_pub.close()
        try:
            self.publisher = self._make_publisher(p)
        except InputError as exc:
            try:
                self.publisher = self._make_publisher(self.cfg.publisher)
            except InputError as exc2:
                # Neither binds (someone took the endpoint meanwhile): publish nothing,
                # retry every window, and let the watchdog see it.
                self.publisher = None
                self._unbound_seq = dict(seq or {})
                log.error("reload: the running publisher could not be bound again either: %s", exc2)
            else:
                if seq is not None:
                    self.publisher.seq = seq
            raise exc
        if seq is not None:
            self.publisher.seq = seq

    def run(self) -> int:
        window_ns = int(self.cfg.agent.window_s * 1e9)
        run_for = self.cfg.agent.run_for_s
        t0 = time.monotonic()
        wd = self.notifier.watchdog_interval_s()
        next_wd = time.monotonic()
        win_start_wall = time.time_ns()
        win_deadline = time.monotonic_ns() + window_ns
        ready = None      # ids of the probes whose descriptor ended the last wait; None: poll all
        if self._wake is None:
            self._wake = wake_pipe()     # before the first check of _stop: a signal from now on wakes the wait
        while not self._stop:
            now = time.monotonic()
            if run_for and now - t0 >= run_for:
                break
            try:
                if self._reload and now >= self._reload_not_before:
                    self.reload()
                    window_ns = int(self.cfg.agent.window_s * 1e9)
                self._poll_once(ready=ready)
                if self.sink is not None:
                    self.sink.poll()
                if self.publisher is not None:
                    self.publisher.service()
                mono = time.monotonic_ns()
                if mono >= win_deadline:
                    # Skip deadlines already missed (a stalled host) rather than bursting.
                    missed = (mono - win_deadline) // window_ns
                    win_deadline += (missed + 1) * window_ns
                    self._poll_once(window_end=True)
                    end_wall = time.time_ns()
                    if self.publisher is None:
                        self._rebind_publisher()
                    w = self.close_window(win_start_wall, end_wall)
                    win_start_wall = end_wall
                    self.notifier.status(_status_line(w))
            except Exception as exc:  # noqa: BLE001  (counted in loop_errors, logged with its traceback)
                # A bug met by odd data must cost one window, not the agent.
                self.loop_errors += 1
                self._log_loop_error(exc)
                self.builder = WindowBuilder(host=self.host, model=self.builder.model, gpu=self.builder.gpu,
                                             drops=self.builder.drops, _trackers=self.builder._trackers,
                                             fold_errors=self.builder.fold_errors,
                                             open_steps_cut=self.builder.open_steps_cut,
                                             requests=self.builder.requests,
                                             stories_unpublished=self.builder.stories_unpublished)
            if wd is not None and time.monotonic() >= next_wd:
                if self.publishing_healthy():
                    self.notifier.watchdog()
                else:
                    self.watchdog_skipped += 1
                next_wd = time.monotonic() + wd
            if self._stop:
                break
            now = time.monotonic()
            wait_s = (win_deadline - time.monotonic_ns()) / 1e9
            if wd is not None:
                wait_s = min(wait_s, next_wd - now)
            if run_for:
                wait_s = min(wait_s, t0 + run_for - now)
            if self._reload:
                wait_s = min(wait_s, self._reload_not_before - now)
            ready = self._wait(max(0.0, wait_s))
        return 0

    def _protocols(self, probe) -> tuple[bool, bool]:
        """Whether a running probe is a :class:`Readiness` and a :class:`CuptiControl`,
        checked once per probe object: a runtime Protocol check walks the protocol's members
        through typing (about 20 us warm), and the loop made one per probe at every wake-up
        and once a window. A probe's kind does not change while it runs; the probe is held
        with its answer so that its id is not reused meanwhile."""
        got = self._probe_protocols.get(id(probe))
        if got is None or got[0] is not probe:
            if len(self._probe_protocols) >= 64:     # probes replaced by reloads: start afresh
                self._probe_protocols.clear()
            got = self._probe_protocols[id(probe)] = (probe, isinstance(probe, Readiness),
                                                      isinstance(probe, CuptiControl))
        return got[1], got[2]

    def _wait_set(self) -> selectors.BaseSelector:
        """The selector the loop waits on, for the probes running now."""
        fds = []
        for r in self.running:
            fd = r.probe.ready_fd() if not r.step.per_window and self._protocols(r.probe)[0] else None
            fds.append(fd)
        key = (id(self.running), len(self.running), tuple(fds))
        if self._sel is not None and key == self._sel_for:
            return self._sel
        if self._sel is not None:
            self._sel.close()
        if self._wake is None:
            self._wake = wake_pipe()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake[0], selectors.EVENT_READ, None)
        self._fd_probes = set()
        self._on_timer = False
        for r, fd in zip(self.running, fds):
            if r.step.per_window:
                continue
            if fd is None:
                self._on_timer = True
                continue
            self._sel.register(fd, selectors.EVENT_READ, r)
            self._fd_probes.add(id(r))
        self._sel_for = key
        return self._sel

    def _wait(self, timeout_s: float) -> set[int]:
        """Sleep until a readiness descriptor or the wake-up pipe is readable, or
        ``timeout_s`` (at most POLL_S while a probe or the sink is polled on the timer);
        returns the ids of the Running whose descriptor was ready."""
        sel = self._wait_set()
        if self._on_timer or self.sink is not None:
            timeout_s = min(timeout_s, POLL_S)
        ready: set[int] = set()
        self.loop_wakeups += 1
        for key, _ in sel.select(timeout_s):
            if key.data is None:
                drain_fd(key.fd)
            else:
                ready.add(id(key.data))
        return ready

    def publishing_healthy(self, now: float | None = None) -> bool:
        """True while windows are really published: the last one within two window
        lengths (plus a second of slack for a slow close)."""
        now = time.monotonic() if now is None else now
        return now - self.last_published_mono <= 2 * self.cfg.agent.window_s + 1.0

    def _rebind_publisher(self) -> None:
        try:
            self.publisher = self._make_publisher(self.cfg.publisher)
        except InputError as exc:
            self._lose_window()
            raise RuntimeError(f"stream still unbound: {exc}") from None
        self.publisher.seq.update(self._unbound_seq)
        log.warning("publisher bound again on %s", self.cfg.publisher.endpoint)

    def _lose_window(self) -> None:
        """A window that could not be published still uses its sequence numbers, so
        subscribers see the gap once the stream is back."""
        for topic in ("window", "health"):
            self._unbound_seq[topic] = self._unbound_seq.get(topic, 0) + 1

    def _log_loop_error(self, exc: Exception) -> None:
        """First occurrence of each error with its traceback; repeats summed, one line a minute."""
        key = (type(exc).__name__, str(exc)[:200])
        now = time.monotonic()
        ent = self._error_log.get(key)
        if ent is None:
            if len(self._error_log) > 100:
                self._error_log.clear()
            self._error_log[key] = [0, now + ERROR_LOG_EVERY_S]
            log.exception("agent loop: %s: %s (counted; continuing)", type(exc).__name__, for_log(exc))
            return
        ent[0] += 1
        if now >= ent[1]:
            log.error("agent loop: %s: %s, %d more time(s) in the last %.0f s (counted; continuing)",
                      type(exc).__name__, for_log(exc), ent[0], ERROR_LOG_EVERY_S)
            ent[0], ent[1] = 0, now + ERROR_LOG_EVERY_S

    def shutdown(self) -> None:
        """Flush the open window, say STOPPING, stop probes, close sockets."""
        self.notifier.stopping("flushing the last window")
        try:
            if self.publisher is not None:
                # Flush what was collected; no further poll, so stopping costs at most
                # one window close.
                now = time.time_ns()
                start = (self.latest_window.end_ns if self.latest_window is not None
                         else now - int(self.cfg.agent.window_s * 1e9))
                self.close_window(start, now, final=True)     # the held open steps too
        except Exception as exc:  # noqa: BLE001  (the probes must still be stopped; logged with its traceback)
            log.warning("final window not flushed: %s", exc, exc_info=exc)
        registry.stop_all(self.running, log)
        if self.sink is not None:
            # after the last window went out: the recorder takes it, rolls and uploads
            self.sink.stop()
        if self.prometheus is not None:
            self.prometheus.close()
        if self.publisher is not None:
            # Give queued messages a moment to leave (bounded: never hang on stop).
            import zmq
            try:
                self.publisher.sock.setsockopt(zmq.LINGER, 500)
            except zmq.ZMQError:
                pass        # a socket already closed lingers no more
            self.publisher.close()
        if self._sel is not None:
            self._sel.close()
            self._sel = self._sel_for = None
        if self._wake is not None:
            os.close(self._wake[0])
            os.close(self._wake[1])
            self._wake = None
        self.notifier.close()


#: Keys of a probe's table that the agent applies itself: changing them restarts no probe.
_AGENT_SIDE_KEYS = {"cupti": ("reclaim_after_s",), "otlp": ("history_s", "join_delay_s")}


def _probe_settings(cfg: config_mod.Config, name: str):
    """What of the configuration a probe is built from (None: a probe with no table)."""
    v = getattr(cfg.probes, name, None)
    if isinstance(v, msgspec.Struct):
        return {k: x for k, x in config_mod.as_table(v).items() if k not in _AGENT_SIDE_KEYS.get(name, ())}
    return v


def _status_line(w: Window) -> str:
    a = w.agent
    kern = sum(g.kernels for g in w.gpus)
    return (f"window: {kern} kernels on {len(w.gpus)} GPU/process pairs; "
            f"agent {a.cpu_pct or 0:.1f}% CPU, {(a.rss_bytes or 0) / 2**20:.0f} MiB, "
            f"dropped {a.dropped_records or 0} records, {a.dropped_batches or 0} batches, "
            f"{a.publisher_drops or 0} stream messages")


def configure_logging(level: str) -> None:
    root = logging.getLogger("ridgeline")
    if not root.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("ridgeline[%(process)d] %(levelname)s %(message)s"))
        # peers can make lines (bad frames, per connection): limited per kind and per peer
        from ridgeline.probes.log_limit import LIMIT
        h.addFilter(LIMIT)
        root.addHandler(h)
    root.setLevel(level.upper())
    root.propagate = False


def run_agent(cfg: config_mod.Config, config_path: str | None, install_signals: bool = True,
              overrides: dict | None = None) -> int:
    """Start, loop, shut down (the body of ``ridgeline agent``); ``overrides`` are the
    command-line settings, kept across reloads."""
    configure_logging(cfg.agent.log_level)
    agent = Agent(cfg, config_path, overrides=overrides)
    if install_signals:
        agent.install_signal_handlers()
    agent.start()
    try:
        return agent.run()
    finally:
        agent.shutdown()
