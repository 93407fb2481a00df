"""The agent's main loop: poll probes, fold into windows, publish, stay cheap.

Contract of :class:`Agent`:

* :meth:`start` binds the publisher (refusing a clear-text non-loopback bind), starts the
  Prometheus endpoint, starts the probes through :mod:`agent.registry`, then tells systemd
  ``READY=1``.
* :meth:`run` loops on a monotonic deadline until :meth:`request_stop` (SIGTERM/SIGINT):
  every ``POLL_S`` it polls each probe (a probe raising in ``poll()`` is counted and the
  loop goes on), routes the data (events into the window, sched/device/engine into the
  window and onto their topics), and every ``window_s`` closes the window and publishes
  ``window`` and ``health``. Missed deadlines are skipped, not queued. ``WATCHDOG=1`` is
  sent at half of ``WATCHDOG_USEC``.
* SIGHUP (:meth:`request_reload`) re-reads the config file; a bad file is logged and the
  running configuration stays. Window length, log level, events publishing, the probe
  set and the publisher endpoint are applied; sequence numbers continue.
* On stop, the open window is closed and published (flush), then ``STOPPING=1``, probes
  are stopped, and sockets closed.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import time

from ridgeline.probes.errors import InputError
from ridgeline.probes.events import Trace

from ridgeline.aggregator.windows import WindowBuilder, plain

from . import config as config_mod
from . import registry
from .health import HealthMeter
from .publisher import Publisher
from .sdnotify import Notifier

log = logging.getLogger("ridgeline.agent")

POLL_S = 0.05


def _as_trace(data) -> Trace | None:
    if isinstance(data, Trace):
        return data
    if isinstance(data, dict) and isinstance(data.get("trace"), Trace):
        return data["trace"]
    return None


class Agent:
    def __init__(self, cfg: dict, config_path: str | None = None, notifier: Notifier | None = None,
                 probes: list[registry.Running] | None = None, publisher_factory=Publisher, codec=None):
        self.cfg = cfg
        self.config_path = config_path
        self.notifier = notifier or Notifier()
        self._given_probes = probes
        self._publisher_factory = publisher_factory
        # The wire codec (aggregator.wire): encode_envelope, encode_window, encode_event_batch.
        self.codec = codec
        self.running: list[registry.Running] = []
        self.publisher: Publisher | None = None
        self.prometheus = None
        self.latest_window: dict | None = None
        self.windows_published = 0
        self.records_total = 0
        self._stop = False
        self._reload = False
        self.reloads = 0
        self.loop_errors = 0
        # As dcgm-exporter names the host (NODE_NAME, set from spec.nodeName in Kubernetes,
        # else the host name), so the Hostname label joins its series: in a pod the host
        # name is the pod's, not the node's.
        self.host = cfg["agent"]["host"] or os.environ.get("NODE_NAME") or socket.gethostname()
        self.builder = WindowBuilder(host=self.host)
        self._apply_analysis(cfg)
        self.health = HealthMeter()
        self.probe_counters_removed: dict[str, dict] = {}

    def _apply_analysis(self, cfg: dict) -> None:
        a = cfg["analysis"]
        model = None
        if a["model"]:
            from ridgeline.aggregator import model_config
            model = model_config.load(a["model"])     # checked when the config was loaded
        self.builder.model, self.builder.gpu = model, a["gpu"]

    # -- signals ---------------------------------------------------------------------------
    def request_stop(self, *_):
        self._stop = True

    def request_reload(self, *_):
        self._reload = True

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        signal.signal(signal.SIGHUP, self.request_reload)

    # -- life cycle ------------------------------------------------------------------------
    def _make_publisher(self, p: dict) -> Publisher:
        return self._publisher_factory(p["endpoint"], host=self.host, sndhwm=p["sndhwm"],
                                       encode=self.codec.encode_envelope,
                                       curve_secret_key_file=p["curve_secret_key_file"],
                                       curve_allowed_clients_dir=p["curve_allowed_clients_dir"])

    def start(self) -> None:
        if self.codec is None:
            from ridgeline.aggregator import wire
            self.codec = wire
        self.notifier.status("starting: binding publisher")
        self.publisher = self._make_publisher(self.cfg["publisher"])
        if self.cfg["prometheus"]["enabled"]:
            from .prometheus import MetricsServer
            try:
                self.prometheus = MetricsServer(self, self.cfg["prometheus"]["listen"])
            except OSError as exc:
                self.publisher.close()
                raise InputError(f"cannot serve Prometheus on {self.cfg['prometheus']['listen']}: {exc.strerror or exc}") from None
        self.notifier.status("starting probes")
        self.running = self._given_probes if self._given_probes is not None else registry.start_all(self.cfg, log)
        names = ", ".join(r.step.name for r in self.running) or "none"
        log.info("agent ready: publishing on %s; probes: %s", self.cfg["publisher"]["endpoint"], names)
        self.notifier.ready(f"publishing on {self.cfg['publisher']['endpoint']}; probes: {names}")

    def _poll_once(self, window_end: bool = False) -> None:
        for r in self.running:
            if r.step.per_window and not window_end:
                continue
            try:
                data = r.probe.poll()
            except Exception as exc:
                r.poll_errors += 1
                if r.poll_errors == 1 or r.last_error != str(exc):
                    log.warning("probe %s: poll() raised %s: %s (counted; continuing)", r.step.name, type(exc).__name__, exc)
                r.last_error = str(exc)
                continue
            if data is None or (isinstance(data, dict) and not data):
                continue
            try:
                self._route(r, data)
            except Exception as exc:
                r.poll_errors += 1
                log.warning("probe %s: data could not be used: %s: %s", r.step.name, type(exc).__name__, exc)

    def _route(self, r: registry.Running, data) -> None:
        topic = r.step.topic
        trace = _as_trace(data)
        if trace is not None:
            src = trace.meta.get("source") or r.step.name
            self.builder.add_events(trace, source=src)
            self.records_total += len(trace.kernels) + len(trace.copies) + len(trace.api) + len(trace.ranges)
            if self.cfg["publisher"]["publish_events"]:
                self.publisher.publish("events", self.codec.encode_event_batch(trace))
            # A source may carry side figures (a simulator's engine view) and process
            # news (the CUPTI probe's new and closed pids) next to its events.
            if isinstance(data, dict):
                for key in ("engine", "device", "sched"):
                    if isinstance(data.get(key), dict):
                        self._add_plain(key, data[key], f"{r.step.name}")
                self._process_news(r, data)
            return
        if not isinstance(data, dict):
            raise TypeError(f"poll() returned {type(data).__name__}, expected a dict or a Trace")
        if topic == "events":
            # An event source's side news: processes that appeared or ended, their status.
            self._process_news(r, data)
            if isinstance(data.get("scrapes"), list):
                self._add_plain("engine", data, r.step.name)
            return
        self.records_total += 1
        self._add_plain(topic, data, r.step.name)

    def _process_news(self, r: registry.Running, data: dict) -> None:
        """New served processes (announced by the CUPTI library) become targets of the
        scheduling probes; ended ones stop being; status lines are logged once."""
        for item in data.get("new_pids") or []:
            pid = item[0] if isinstance(item, (list, tuple)) else item
            log.info("probe %s: served process %s appeared", r.step.name, item)
            for other in self.running:
                add = getattr(other.probe, "add_target", None)
                if other.step.topic == "sched" and add is not None:
                    try:
                        add(int(pid))
                    except Exception as exc:
                        log.warning("probe %s: cannot watch pid %s: %s", other.step.name, pid, exc)
        for pid in data.get("closed_pids") or []:
            for other in self.running:
                rm = getattr(other.probe, "remove_target", None)
                if other.step.topic == "sched" and rm is not None:
                    try:
                        rm(int(pid))
                    except Exception:
                        pass
        for pid, text in (data.get("status") or {}).items():
            log.warning("probe %s: process %s: %s", r.step.name, pid, text)

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
            except Exception as exc:
                c = {"records": 0, "drops": 0, "errors": 1, "counters_error": str(exc)}
            c["errors"] = int(c.get("errors", 0) or 0) + r.poll_errors
            c["poll_errors"] = r.poll_errors
            out[r.step.name] = plain(c)
        return out

    def close_window(self, start_ns: int, end_ns: int) -> dict:
        pub = self.publisher.counters() if self.publisher else {}
        agent = self.health.sample(self.probe_counters(), self.records_total,
                                   extra={"publisher_drops": sum(pub.get("drops", {}).values()),
                                          "window_drops": self.builder.drops,
                                          "window_fold_errors": self.builder.fold_errors,
                                          "publisher_stalls": pub.get("stalls", 0),
                                          "publisher_lossy_sent": pub.get("lossy_sent", 0),
                                          "publisher_drops_by_topic": pub.get("drops", {}),
                                          "publisher_bytes_sent": pub.get("bytes_sent", 0),
                                          "subscriptions": pub.get("subscriptions", 0),
                                          "bad_frames": pub.get("bad_frames", 0),
                                          "reloads": self.reloads, "loop_errors": self.loop_errors})
        window = self.builder.close(start_ns, end_ns, agent)
        self.latest_window = window
        if self.prometheus is not None:
            self.prometheus.observe(window)
        self.publisher.publish("window", self.codec.encode_window(window))
        if window.get("engine"):
            self.publisher.publish("engine", window["engine"])
        self.publisher.publish("health", agent)
        self.windows_published += 1
        return window

    def reload(self) -> None:
        self._reload = False
        self.notifier.reloading()
        try:
            new = config_mod.load(self.config_path, missing_ok=self.config_path is None)
        except InputError as exc:
            log.error("reload refused, keeping the running configuration: %s", exc)
            self.notifier.status(f"reload refused: {exc}")
            self.notifier.ready()
            return
        old = self.cfg
        self.cfg = new
        self.reloads += 1
        logging.getLogger("ridgeline").setLevel(new["agent"]["log_level"].upper())
        self._apply_analysis(new)
        if new["publisher"] != old["publisher"]:
            # The old socket must let go of its endpoint before a new one can bind it.
            seq = dict(self.publisher.seq)
            self.publisher.close()
            try:
                self.publisher = self._make_publisher(new["publisher"])
            except InputError as exc:
                log.error("reload: new publisher settings refused, keeping the old ones: %s", exc)
                self.cfg["publisher"] = old["publisher"]
                self.publisher = self._make_publisher(old["publisher"])
            self.publisher.seq = seq
        if new["prometheus"] != old["prometheus"]:
            if self.prometheus is not None:
                self.prometheus.close()
                self.prometheus = None
            if new["prometheus"]["enabled"]:
                from .prometheus import MetricsServer
                try:
                    self.prometheus = MetricsServer(self, new["prometheus"]["listen"])
                except OSError as exc:
                    log.error("reload: cannot serve Prometheus on %s: %s", new["prometheus"]["listen"], exc)
        if self._given_probes is None and (new["probes"] != old["probes"]):
            keep = [r for r in self.running if r.step.name in new["probes"]["enabled"]
                    and new["probes"].get(r.step.name) == old["probes"].get(r.step.name)]
            gone = [r for r in self.running if r not in keep]
            for r in gone:
                self.probe_counters_removed[r.step.name] = self.probe_counters()[r.step.name]
            registry.stop_all(gone, log)
            have = {r.step.name for r in keep}
            added = registry.start_all(new, log, [n for n in new["probes"]["enabled"] if n not in have])
            self.running = keep + added
        log.info("configuration reloaded")
        self.notifier.ready(f"reloaded; probes: {', '.join(r.step.name for r in self.running) or 'none'}")

    def run(self) -> int:
        window_ns = int(self.cfg["agent"]["window_s"] * 1e9)
        run_for = self.cfg["agent"]["run_for_s"]
        t0 = time.monotonic()
        wd = self.notifier.watchdog_interval_s()
        next_wd = time.monotonic()
        win_start_wall = time.time_ns()
        win_deadline = time.monotonic_ns() + window_ns
        while not self._stop:
            now = time.monotonic()
            if run_for and now - t0 >= run_for:
                break
            try:
                if self._reload:
                    self.reload()
                    window_ns = int(self.cfg["agent"]["window_s"] * 1e9)
                self._poll_once()
                self.publisher.service()
                mono = time.monotonic_ns()
                if mono >= win_deadline:
                    # Skip deadlines already missed (a stalled host) rather than bursting.
                    missed = (mono - win_deadline) // window_ns
                    win_deadline += (missed + 1) * window_ns
                    self._poll_once(window_end=True)
                    end_wall = time.time_ns()
                    w = self.close_window(win_start_wall, end_wall)
                    win_start_wall = end_wall
                    self.notifier.status(_status_line(w))
            except Exception as exc:
                # A bug met by odd data must cost one window, not the agent.
                self.loop_errors += 1
                log.exception("agent loop: %s: %s (counted; continuing)", type(exc).__name__, exc)
                self.builder = WindowBuilder(host=self.host, model=self.builder.model, gpu=self.builder.gpu,
                                             drops=self.builder.drops, _trackers=self.builder._trackers,
                                             fold_errors=self.builder.fold_errors)
            if wd is not None and time.monotonic() >= next_wd:
                self.notifier.watchdog()
                next_wd = time.monotonic() + wd
            sleep_s = min(POLL_S, max(0.0, (win_deadline - time.monotonic_ns()) / 1e9))
            if sleep_s > 0:
                time.sleep(sleep_s)
        return 0

    def shutdown(self) -> None:
        """Flush the open window, say STOPPING, stop probes, close sockets."""
        self.notifier.stopping("flushing the last window")
        try:
            if self.publisher is not None:
                # Flush what was collected; no further poll, so stopping costs at most
                # one window close.
                now = time.time_ns()
                start = (self.latest_window or {}).get("end_ns", now - int(self.cfg["agent"]["window_s"] * 1e9))
                self.close_window(start, now)
        except Exception as exc:
            log.warning("final window not flushed: %s", exc)
        registry.stop_all(self.running, log)
        if self.prometheus is not None:
            self.prometheus.close()
        if self.publisher is not None:
            # Give queued messages a moment to leave (bounded: never hang on stop).
            try:
                import zmq
                self.publisher.sock.setsockopt(zmq.LINGER, 500)
            except Exception:
                pass
            self.publisher.close()
        self.notifier.close()


def _status_line(w: dict) -> str:
    a = w.get("agent", {})
    kern = sum(g.get("kernels", 0) for g in w.get("gpus", []))
    return (f"window: {kern} kernels on {len(w.get('gpus', []))} GPU/process pairs; "
            f"agent {a.get('cpu_pct', 0):.1f}% CPU, {a.get('rss_bytes', 0) / 2**20:.0f} MiB, "
            f"drops {a.get('drops', 0) + a.get('publisher_drops', 0)}")


def configure_logging(level: str) -> None:
    root = logging.getLogger("ridgeline")
    if not root.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("ridgeline[%(process)d] %(levelname)s %(message)s"))
        root.addHandler(h)
    root.setLevel(level.upper())
    root.propagate = False


def run_agent(cfg: dict, config_path: str | None, install_signals: bool = True) -> int:
    """Start, loop, shut down (the body of ``ridgeline agent``)."""
    configure_logging(cfg["agent"]["log_level"])
    agent = Agent(cfg, config_path)
    if install_signals:
        agent.install_signal_handlers()
    agent.start()
    try:
        return agent.run()
    finally:
        agent.shutdown()
