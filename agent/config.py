"""The agent's TOML configuration: embedded defaults overlaid by the operator's file.

Contract:

* :func:`defaults` returns the embedded defaults (``agent/data/agent.toml``), which
  document every key.
* :func:`load(path)` reads ``path`` and overlays it on the defaults. Every key of the
  file must exist in the defaults and have the same type (an int is accepted where a
  float is expected), every number must be finite and inside its range
  (:data:`RANGES`), endpoints, ports, pids, probe names and socket paths are checked;
  otherwise :class:`probes.errors.InputError` with one line naming the file and the key.
  Nothing is bound, created or started here: a configuration that loads is one the
  agent can apply. A missing file is an error unless ``missing_ok`` (used for the
  default path ``/etc/ridgeline/agent.toml`` so a fresh host runs on the defaults).
* :func:`to_toml` writes a configuration back as TOML (for ``--print-config``).

Configurations are plain nested dicts; nothing here touches the probes.
"""
from __future__ import annotations

import copy
import math
import os
import tomllib
from importlib import resources
from pathlib import Path

from ridgeline.probes.errors import InputError

DEFAULT_PATH = Path("/etc/ridgeline/agent.toml")


def defaults() -> dict:
    text = resources.files("ridgeline.agent").joinpath("data/agent.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)


#: The largest integer a key may hold (TOML integers are unbounded in Python; C sockets
#: options are not).
_INT_MAX = 2**31 - 1
#: Linux's PID_MAX_LIMIT: no pid is above it.
PID_MAX = 4_194_304
#: sun_path of a unix socket holds 108 bytes including the final NUL.
_SUN_PATH_MAX = 107

#: Inclusive ranges of numeric keys (dotted name -> (low, high)). Every numeric key of the
#: defaults is listed (a test checks it), so no value reaches a socket option or a timer
#: unchecked.
RANGES: dict[str, tuple[float, float]] = {
    "agent.window_s": (0.05, 3600.0),
    "agent.run_for_s": (0.0, 1e7),
    "publisher.sndhwm": (1, 1_000_000),
    "prometheus.max_connections": (1, 1024),
    "prometheus.timeout_s": (0.1, 300.0),
    "probes.engine.interval_s": (0.25, 3600.0),
    "probes.engine.timeout_s": (0.1, 60.0),
    "probes.engine.max_body_bytes": (64 * 1024, 256 * 2**20),
    "probes.replay.speed": (0.001, 1000.0),
    "probes.simulator.rate_per_s": (0.0, 100_000.0),
    "probes.simulator.seed": (0, _INT_MAX),
    "probes.simulator.speed": (0.001, 1000.0),
    "probes.simulator.pid": (0, PID_MAX),
    "probes.simulator.scrape_interval_s": (0.05, 3600.0),
    "probes.cupti.reclaim_after_s": (0.0, 86400.0),
    "probes.otlp.max_body_bytes": (1024, 64 * 2**20),
    "probes.otlp.max_connections": (1, 1024),
    "probes.otlp.request_timeout_s": (0.1, 300.0),
    "probes.otlp.spans_per_s": (1.0, 1_000_000.0),
    "probes.otlp.max_attributes": (1, 4096),
    "probes.otlp.max_attribute_bytes": (16, 2**20),
    "probes.otlp.max_queued_spans": (1, 10_000_000),
    "probes.otlp.history_s": (10.0, 3600.0),
    "probes.otlp.join_delay_s": (0.0, 600.0),
    "probes.sglang_requests.max_bytes_per_poll": (4096, 256 * 2**20),
    "probes.sglang_requests.max_line_bytes": (1024, 16 * 2**20),
    "probes.cupti.idle_peer_s": (5.0, 86400.0),
}

#: Folders under which a missing socket folder may be created (one level, by systemd's
#: RuntimeDirectory or the agent); anywhere else the folder must already exist, so a
#: configuration can never make the agent (root) create folders in /etc or elsewhere.
SOCKET_ROOTS = ("/run",)


def _overlay(base: dict, over: dict, where: str, origin: str) -> None:
    for key, value in over.items():
        dotted = f"{where}.{key}" if where else key
        if key not in base:
            raise InputError(f"{origin}: unknown key '{dotted}'")
        want = base[key]
        if isinstance(want, dict):
            if not isinstance(value, dict):
                raise InputError(f"{origin}: '{dotted}' must be a table")
            _overlay(want, value, dotted, origin)
            continue
        if isinstance(want, bool):
            ok = isinstance(value, bool)
        elif isinstance(want, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if ok:
                try:
                    value = float(value)
                except OverflowError:
                    raise InputError(f"{origin}: '{dotted}' is out of range ({value})") from None
                if not math.isfinite(value):
                    raise InputError(f"{origin}: '{dotted}' must be a finite number, got {value}")
        elif isinstance(want, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(want, list):
            ok = isinstance(value, list) and all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in value)
        else:
            ok = isinstance(value, type(want))
        if not ok:
            raise InputError(f"{origin}: '{dotted}' must be {type(want).__name__}, got {type(value).__name__}")
        base[key] = value


def _get(cfg: dict, dotted: str):
    v = cfg
    for part in dotted.split("."):
        v = v[part]
    return v


def _port(text: str) -> int | None:
    if not text.isdigit() or len(text) > 5:
        return None
    n = int(text)
    return n if 1 <= n <= 65535 else None


def _host_port(value: str) -> tuple[str, int | None]:
    host, _, port = value.rpartition(":")
    return host, _port(port)


def socket_path_problem(path: str) -> str | None:
    """Why ``path`` may not be used for a unix socket the agent binds, or None.

    Absolute, short enough for ``sun_path``, and in a folder that exists or sits directly
    under one of :data:`SOCKET_ROOTS` (the only place a missing folder may be created)."""
    if not path.startswith("/"):
        return f"must be an absolute path, got {path!r}"
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        return f"is longer than {_SUN_PATH_MAX} bytes (a unix socket path limit)"
    if "\0" in path or any(part in (".", "..") for part in path.split("/")):
        return f"must be a plain path without '.' or '..' parts, got {path!r}"
    folder = os.path.dirname(path)
    if os.path.isdir(folder):
        return None
    if os.path.dirname(folder) in SOCKET_ROOTS:
        return None
    return (f"folder {folder} does not exist (the agent creates a missing socket folder only directly "
            f"under {', '.join(SOCKET_ROOTS)}; create it first)")


def _endpoint_problem(ep: str) -> str | None:
    if ep.startswith("ipc://"):
        return socket_path_problem(ep[len("ipc://"):])
    if not ep.startswith("tcp://"):
        return f"must start with tcp:// or ipc://, got {ep!r}"
    rest = ep[len("tcp://"):]
    if rest.startswith("["):
        host, _, port = rest[1:].partition("]:")
    else:
        host, _, port = rest.rpartition(":")
    if not host or _port(port) is None:
        return f"must be tcp://HOST:PORT with a port in 1..65535, got {ep!r}"
    return None


def _validate(cfg: dict, origin: str) -> None:
    def bad(key: str, why: str):
        raise InputError(f"{origin}: '{key}' {why}")

    for key, (lo, hi) in RANGES.items():
        v = _get(cfg, key)
        if not lo <= v <= hi:
            bad(key, f"must be between {lo:g} and {hi:g}, got {v}")
    a = cfg["agent"]
    if a["log_level"] not in ("debug", "info", "warning", "error"):
        bad("agent.log_level", "must be debug, info, warning or error")
    if len(a["host"]) > 255 or not a["host"].isprintable():
        bad("agent.host", "must be a printable name of at most 255 characters")
    p = cfg["publisher"]
    why = _endpoint_problem(p["endpoint"])
    if why:
        bad("publisher.endpoint", why)
    from .publisher import is_loopback
    if not is_loopback(p["endpoint"]) and not p["curve_secret_key_file"]:
        raise InputError(
            f"refusing to publish on {p['endpoint']} in the clear: a non-loopback bind needs CURVE keys "
            "(set publisher.curve_secret_key_file and publisher.curve_allowed_clients_dir)")
    if p["curve_secret_key_file"]:
        if not p["curve_allowed_clients_dir"]:
            bad("publisher.curve_allowed_clients_dir", "must name the folder of allowed client keys when "
                "publisher.curve_secret_key_file is set")
        if not os.path.isfile(p["curve_secret_key_file"]):
            bad("publisher.curve_secret_key_file", f"{p['curve_secret_key_file']} is not a file")
        if not os.path.isdir(p["curve_allowed_clients_dir"]):
            bad("publisher.curve_allowed_clients_dir", f"{p['curve_allowed_clients_dir']} is not a folder")
    if p["ipc_group"]:
        import grp
        try:
            grp.getgrnam(p["ipc_group"])
        except KeyError:
            bad("publisher.ipc_group", f"names no group on this host ({p['ipc_group']!r})")
    pr = cfg["prometheus"]
    host, port = _host_port(pr["listen"])
    if not host or port is None:
        bad("prometheus.listen", f"must be HOST:PORT with a port in 1..65535, got {pr['listen']!r}")
    if pr["enabled"] and not pr["allow_remote"] and not is_loopback(f"tcp://{host}:{port}"):
        bad("prometheus.listen", f"{pr['listen']} is not a loopback address: /metrics has no authentication, "
            "so serving it beyond this host needs prometheus.allow_remote = true")
    model = cfg["analysis"]["model"]
    if model:
        from ridgeline.aggregator import model_config
        try:
            model_config.load(model)
        except InputError as exc:
            raise InputError(f"{origin}: 'analysis.model': {exc}") from None
    probes = cfg["probes"]
    from .registry import STEPS
    for name in probes["enabled"]:
        if not isinstance(name, str) or name not in STEPS:
            bad("probes.enabled", f"names an unknown probe {name!r} (known: {', '.join(STEPS)})")
    if len(set(probes["enabled"])) != len(probes["enabled"]):
        bad("probes.enabled", "names a probe twice")
    for pid in probes["pids"]:
        if not isinstance(pid, int) or not 1 <= pid <= PID_MAX:
            bad("probes.pids", f"must hold process ids (integers 1..{PID_MAX}), got {pid!r}")
    url = probes["engine"]["url"]
    if url:
        scheme, _, rest = url.partition("://")
        if scheme not in ("http", "https") or not rest or rest.startswith("/"):
            bad("probes.engine.url", f"must be an http:// or https:// URL, got {url!r}")
    otlp = probes["otlp"]["listen"]
    if otlp.startswith("unix:"):
        why = socket_path_problem(otlp[len("unix:"):])
        if why:
            bad("probes.otlp.listen", why)
    else:
        host, port = _host_port(otlp)
        if not host or port is None:
            bad("probes.otlp.listen", f"must be HOST:PORT with a port in 1..65535 or unix:/path, got {otlp!r}")
        if not probes["otlp"]["allow_remote"] and not is_loopback(f"tcp://{host}:{port}"):
            bad("probes.otlp.listen", f"{otlp} is not a loopback address: the span receiver has no "
                "authentication, so taking spans from beyond this host needs probes.otlp.allow_remote = true")
    sg_dir = probes["sglang_requests"]["dir"]
    if len(sg_dir) > 4096 or "\x00" in sg_dir:
        bad("probes.sglang_requests.dir", "must be a folder path (at most 4096 characters, no NUL)")
    if "sglang_requests" in probes["enabled"] and not sg_dir:
        bad("probes.sglang_requests.dir", "must be set when the sglang_requests probe is enabled (SGLang's "
            "--export-metrics-to-file-dir)")
    sim_otlp = probes["simulator"]["otlp_endpoint"]
    if sim_otlp and (not sim_otlp.startswith(("http://", "https://")) or len(sim_otlp) > 2048):
        bad("probes.simulator.otlp_endpoint", f"must be an http:// or https:// URL, got {sim_otlp[:80]!r}")
    why = socket_path_problem(probes["cupti"]["socket"])
    if why:
        bad("probes.cupti.socket", why)
    group = probes["cupti"]["socket_group"]
    if group:
        import grp
        try:
            grp.getgrnam(group)
        except KeyError:
            bad("probes.cupti.socket_group", f"names no group on this host ({group!r})")


def load(path: str | Path | None = None, missing_ok: bool = False) -> dict:
    """Defaults overlaid by ``path`` (default ``/etc/ridgeline/agent.toml``)."""
    cfg = defaults()
    p = Path(path) if path is not None else DEFAULT_PATH
    origin = str(p)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        if missing_ok:
            _validate(cfg, "defaults")
            return cfg
        raise InputError(f"{origin}: config file not found") from None
    except OSError as exc:
        raise InputError(f"{origin}: cannot read config: {exc.strerror}") from None
    try:
        user = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise InputError(f"{origin}: config is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{origin}: invalid TOML: {exc}") from None
    _overlay(cfg, user, "", origin)
    _validate(cfg, origin)
    return cfg


def overlay(cfg: dict, over: dict, origin: str = "override") -> dict:
    """A copy of ``cfg`` with ``over`` laid on it (same checks as a file)."""
    out = copy.deepcopy(cfg)
    _overlay(out, over, "", origin)
    _validate(out, origin)
    return out


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(type(v))


def to_toml(cfg: dict) -> str:
    """TOML text of a configuration (tables after plain keys, as TOML requires)."""
    lines: list[str] = []

    def emit(table: dict, prefix: str) -> None:
        plain = [(k, v) for k, v in table.items() if not isinstance(v, dict)]
        subs = [(k, v) for k, v in table.items() if isinstance(v, dict)]
        if prefix and plain:
            lines.append(f"[{prefix}]")
        for k, v in plain:
            lines.append(f"{k} = {_toml_value(v)}")
        if plain:
            lines.append("")
        for k, v in subs:
            emit(v, f"{prefix}.{k}" if prefix else k)

    emit(cfg, "")
    return "\n".join(lines).rstrip() + "\n"
