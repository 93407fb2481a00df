"""The agent's TOML configuration: embedded defaults overlaid by the operator's file,
decoded into one typed record (:class:`Config`).

Contract:

* :class:`Config` and its sections are msgspec Structs: every key with its type, and every
  number with its inclusive range declared beside it (``Annotated[..., Meta(ge=, le=)]``),
  so no value reaches a socket option or a timer unchecked. msgspec checks keys, types
  and ranges when the TOML is decoded (unknown keys are refused; an int is accepted where
  a float is expected); what it reports is turned into one line naming the file and the
  key (:func:`_problem`). What only this host can answer is checked by hand after
  (:func:`_validate`): endpoints and ports, socket folders, groups, key files, probe
  names (:data:`agent.probe_names.PROBE_NAMES`), the model file.
* :func:`defaults` returns the embedded defaults (``agent/data/agent.toml``, which
  documents every key) as a :class:`Config`.
* :func:`load(path)` reads ``path`` and overlays it on the defaults; otherwise
  :class:`probes.errors.InputError` with one line. Nothing is bound, created or started
  here: a configuration that loads is one the agent can apply. A missing file is an error
  unless ``missing_ok`` (used for the default path ``/etc/ridgeline/agent.toml`` so a
  fresh host runs on the defaults).
* :func:`overlay` lays a table of overrides (the command line's) on a configuration, with
  the same checks; :func:`to_toml` writes a configuration back as TOML (``--print-config``).

Nothing here touches the probes.
"""
from __future__ import annotations

import math
import os
import re
import tomllib
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ridgeline.probes.errors import InputError

from .probe_names import PROBE_NAMES

DEFAULT_PATH = Path("/etc/ridgeline/agent.toml")

#: The largest integer a key may hold (TOML integers are unbounded in Python; C sockets
#: options are not).
_INT_MAX = 2**31 - 1
#: Linux's PID_MAX_LIMIT: no pid is above it.
PID_MAX = 4_194_304
#: sun_path of a unix socket holds 108 bytes including the final NUL.
_SUN_PATH_MAX = 107


#: agent.log_level's words, least to most severe (the order the one-line error names them).
LOG_LEVELS = ("debug", "info", "warning", "error")


def _range(lo, hi):
    return Meta(ge=lo, le=hi)


class _Section(msgspec.Struct, forbid_unknown_fields=True):
    """A table of the file: unknown keys refused."""


class AgentSettings(_Section):
    window_s: Annotated[float, _range(0.05, 3600.0)]
    host: Annotated[str, Meta(max_length=255)]
    log_level: Literal[LOG_LEVELS]
    run_for_s: Annotated[float, _range(0.0, 1e7)]


class AnalysisSettings(_Section):
    model: str
    gpu: str


class PublisherSettings(_Section):
    endpoint: str
    ipc_group: str
    sndhwm: Annotated[int, _range(1, 1_000_000)]
    curve_secret_key_file: str
    curve_allowed_clients_dir: str
    publish_events: bool


class PrometheusSettings(_Section):
    enabled: bool
    listen: str
    allow_remote: bool
    max_connections: Annotated[int, _range(1, 1024)]
    timeout_s: Annotated[float, _range(0.1, 300.0)]


class EngineSettings(_Section):
    url: str
    interval_s: Annotated[float, _range(0.25, 3600.0)]
    timeout_s: Annotated[float, _range(0.1, 60.0)]
    max_body_bytes: Annotated[int, _range(64 * 1024, 256 * 2**20)]
    follow_redirects: bool


class OtlpSettings(_Section):
    listen: str
    allow_remote: bool
    max_body_bytes: Annotated[int, _range(1024, 64 * 2**20)]
    max_connections: Annotated[int, _range(1, 1024)]
    request_timeout_s: Annotated[float, _range(0.1, 300.0)]
    spans_per_s: Annotated[float, _range(1.0, 1_000_000.0)]
    max_attributes: Annotated[int, _range(1, 4096)]
    max_attribute_bytes: Annotated[int, _range(16, 2**20)]
    max_queued_spans: Annotated[int, _range(1, 10_000_000)]
    history_s: Annotated[float, _range(10.0, 3600.0)]
    join_delay_s: Annotated[float, _range(0.0, 600.0)]


class SglangRequestsSettings(_Section):
    dir: str
    max_bytes_per_poll: Annotated[int, _range(4096, 256 * 2**20)]
    max_line_bytes: Annotated[int, _range(1024, 16 * 2**20)]


class CuptiSettings(_Section):
    socket: str
    socket_group: str
    reclaim_after_s: Annotated[float, _range(0.0, 86400.0)]
    idle_peer_s: Annotated[float, _range(5.0, 86400.0)]


class ReplaySettings(_Section):
    path: str
    speed: Annotated[float, _range(0.001, 1000.0)]
    loop: bool


class SimulatorSettings(_Section):
    gpu: str
    model: str
    rate_per_s: Annotated[float, _range(0.0, 100_000.0)]
    seed: Annotated[int, _range(0, _INT_MAX)]
    engine: str
    speed: Annotated[float, _range(0.001, 1000.0)]
    pid: Annotated[int, _range(0, PID_MAX)]
    scrape_interval_s: Annotated[float, _range(0.05, 3600.0)]
    engine_metrics: bool
    otlp_endpoint: str


class ProbesSettings(_Section):
    enabled: list[str]
    pids: list[Annotated[int, _range(1, PID_MAX)]]
    engine: EngineSettings
    otlp: OtlpSettings
    sglang_requests: SglangRequestsSettings
    cupti: CuptiSettings
    replay: ReplaySettings
    simulator: SimulatorSettings


class SinkSettings(_Section):
    """The object-storage sink (agent/sink_supervisor.py): off by default."""
    enabled: bool
    url: Annotated[str, Meta(max_length=2048)]
    spool_dir: Annotated[str, Meta(max_length=4096)]
    endpoint: Annotated[str, Meta(max_length=255)]
    scheme: Literal["http", "https"]
    region: Annotated[str, Meta(max_length=64)]
    roll_s: Annotated[float, _range(1.0, 86400.0)]
    spool_max_bytes: Annotated[int, _range(1 << 20, 1 << 50)]
    min_free_bytes: Annotated[int, _range(0, 1 << 50)]
    restart_max_s: Annotated[float, _range(1.0, 3600.0)]
    handoff_max_bytes: Annotated[int, _range(0, 1 << 32)]


class Config(_Section):
    """The agent's whole configuration (``agent/data/agent.toml`` documents each key)."""
    agent: AgentSettings
    analysis: AnalysisSettings
    publisher: PublisherSettings
    prometheus: PrometheusSettings
    probes: ProbesSettings
    sink: SinkSettings


#: What a list key must hold, for the line naming a bad element.
_LIST_ELEMENTS = {"probes.pids": f"must hold process ids (integers 1..{PID_MAX})",
                  "probes.enabled": "must hold probe names"}


def _defaults_table() -> dict:
    text = resources.files("ridgeline.agent").joinpath("data/agent.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)


def defaults() -> Config:
    return _decode(_defaults_table(), "defaults")


def _merge(base: dict, over: dict) -> dict:
    """``over`` laid on ``base`` (tables merged key by key; anything else replaces)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _decode(table: dict, origin: str) -> Config:
    try:
        return msgspec.convert(table, Config)
    except msgspec.ValidationError as exc:
        raise InputError(f"{origin}: {_problem(str(exc), table)}") from None


#: msgspec's "<what> - at `$.a.b[0]`" (no "at" part for the top level)
_AT = re.compile(r"(.*?)(?: - at `\$((?:\.\w+|\[\d+\])*)`)?")


def _type_name(t) -> str:
    return {msgspec.inspect.IntType: "int", msgspec.inspect.FloatType: "float", msgspec.inspect.StrType: "str",
            msgspec.inspect.BoolType: "bool", msgspec.inspect.ListType: "list",
            msgspec.inspect.StructType: "table"}.get(type(t), "?")


def _problem(text: str, table: dict) -> str:
    """msgspec's account of a bad table as this module's one line: the dotted key, and what
    it must be by its declared type and range, with the value found."""
    m = _AT.fullmatch(text)
    if not m:
        return text
    what, path = m.group(1), m.group(2) or ""
    keys, index = [], None
    for name, i in re.findall(r"\.(\w+)|\[(\d+)\]", path):
        if name:
            keys.append(name)
        else:
            index = int(i)
    dotted = ".".join(keys)
    if what.startswith("Object contains unknown field"):
        field = what.split("`")[1]
        return f"unknown key '{dotted + '.' if dotted else ''}{field}'"
    t, value = msgspec.inspect.type_info(Config), table
    for k in keys:
        t = next(f.type for f in t.fields if f.name == k)
        value = value[k]
    if index is not None:
        return f"'{dotted}' {_LIST_ELEMENTS.get(dotted, 'has a bad element')}, got {value[index]!r}"
    if isinstance(t, msgspec.inspect.StructType):
        return f"'{dotted}' must be a table"
    if isinstance(t, msgspec.inspect.LiteralType):
        words = list(LOG_LEVELS) if dotted == "agent.log_level" else sorted(str(v) for v in t.values)
        return f"'{dotted}' must be {', '.join(words[:-1])} or {words[-1]}"
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(t, msgspec.inspect.FloatType) and number:
        if not math.isfinite(value):
            return f"'{dotted}' must be a finite number, got {value}"
        return f"'{dotted}' must be between {t.ge:g} and {t.le:g}, got {float(value)}"
    if isinstance(t, msgspec.inspect.IntType) and isinstance(value, int) and number:
        return f"'{dotted}' must be between {t.ge:g} and {t.le:g}, got {value}"
    if isinstance(t, msgspec.inspect.StrType) and isinstance(value, str) and t.max_length is not None:
        return f"'{dotted}' must be at most {t.max_length} characters, got {len(value)}"
    return f"'{dotted}' must be {_type_name(t)}, got {type(value).__name__}"


#: Folders under which a missing socket folder may be created (one level, by systemd's
#: RuntimeDirectory or the agent); anywhere else the folder must already exist, so a
#: configuration can never make the agent (root) create folders in /etc or elsewhere.
SOCKET_ROOTS = ("/run",)


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


def _validate(cfg: Config, origin: str) -> None:
    """The checks only this host can answer (types and ranges were checked by decoding)."""
    def bad(key: str, why: str):
        raise InputError(f"{origin}: '{key}' {why}")

    a = cfg.agent
    if not a.host.isprintable():
        bad("agent.host", "must be a printable name of at most 255 characters")
    p = cfg.publisher
    why = _endpoint_problem(p.endpoint)
    if why:
        bad("publisher.endpoint", why)
    from .publisher import is_loopback
    if not is_loopback(p.endpoint) and not p.curve_secret_key_file:
        raise InputError(
            f"refusing to publish on {p.endpoint} in the clear: a non-loopback bind needs CURVE keys "
            "(set publisher.curve_secret_key_file and publisher.curve_allowed_clients_dir)")
    if p.curve_secret_key_file:
        if not p.curve_allowed_clients_dir:
            bad("publisher.curve_allowed_clients_dir", "must name the folder of allowed client keys when "
                "publisher.curve_secret_key_file is set")
        if not os.path.isfile(p.curve_secret_key_file):
            bad("publisher.curve_secret_key_file", f"{p.curve_secret_key_file} is not a file")
        if not os.path.isdir(p.curve_allowed_clients_dir):
            bad("publisher.curve_allowed_clients_dir", f"{p.curve_allowed_clients_dir} is not a folder")
    if p.ipc_group:
        import grp
        try:
            grp.getgrnam(p.ipc_group)
        except KeyError:
            bad("publisher.ipc_group", f"names no group on this host ({p.ipc_group!r})")
    pr = cfg.prometheus
    host, port = _host_port(pr.listen)
    if not host or port is None:
        bad("prometheus.listen", f"must be HOST:PORT with a port in 1..65535, got {pr.listen!r}")
    if pr.enabled and not pr.allow_remote and not is_loopback(f"tcp://{host}:{port}"):
        bad("prometheus.listen", f"{pr.listen} is not a loopback address: /metrics has no authentication, "
            "so serving it beyond this host needs prometheus.allow_remote = true")
    model = cfg.analysis.model
    if model:
        from ridgeline.aggregator import model_config
        try:
            model_config.load(model)
        except InputError as exc:
            raise InputError(f"{origin}: 'analysis.model': {exc}") from None
    probes = cfg.probes
    for name in probes.enabled:
        if name not in PROBE_NAMES:
            bad("probes.enabled", f"names an unknown probe {name!r} (known: {', '.join(PROBE_NAMES)})")
    if len(set(probes.enabled)) != len(probes.enabled):
        bad("probes.enabled", "names a probe twice")
    url = probes.engine.url
    if url:
        scheme, _, rest = url.partition("://")
        if scheme not in ("http", "https") or not rest or rest.startswith("/"):
            bad("probes.engine.url", f"must be an http:// or https:// URL, got {url!r}")
    otlp = probes.otlp.listen
    if otlp.startswith("unix:"):
        why = socket_path_problem(otlp[len("unix:"):])
        if why:
            bad("probes.otlp.listen", why)
    else:
        host, port = _host_port(otlp)
        if not host or port is None:
            bad("probes.otlp.listen", f"must be HOST:PORT with a port in 1..65535 or unix:/path, got {otlp!r}")
        if not probes.otlp.allow_remote and not is_loopback(f"tcp://{host}:{port}"):
            bad("probes.otlp.listen", f"{otlp} is not a loopback address: the span receiver has no "
                "authentication, so taking spans from beyond this host needs probes.otlp.allow_remote = true")
    sg_dir = probes.sglang_requests.dir
    if len(sg_dir) > 4096 or "\x00" in sg_dir:
        bad("probes.sglang_requests.dir", "must be a folder path (at most 4096 characters, no NUL)")
    if "sglang_requests" in probes.enabled and not sg_dir:
        bad("probes.sglang_requests.dir", "must be set when the sglang_requests probe is enabled (SGLang's "
            "--export-metrics-to-file-dir)")
    sim_otlp = probes.simulator.otlp_endpoint
    if sim_otlp and (not sim_otlp.startswith(("http://", "https://")) or len(sim_otlp) > 2048):
        bad("probes.simulator.otlp_endpoint", f"must be an http:// or https:// URL, got {sim_otlp[:80]!r}")
    why = socket_path_problem(probes.cupti.socket)
    if why:
        bad("probes.cupti.socket", why)
    _validate_sink(cfg.sink, bad, p)
    group = probes.cupti.socket_group
    if group:
        import grp
        try:
            grp.getgrnam(group)
        except KeyError:
            bad("probes.cupti.socket_group", f"names no group on this host ({group!r})")


def _validate_sink(s: SinkSettings, bad, p: PublisherSettings) -> None:
    if not s.enabled:
        return
    if not s.url:
        bad("sink.url", "must be set when the sink is enabled (s3://BUCKET[/PREFIX] or an absolute folder)")
    if s.url.startswith("s3://"):
        if not s.url[len("s3://"):].strip("/"):
            bad("sink.url", f"names no bucket (s3://BUCKET[/PREFIX]), got {s.url!r}")
    elif not (s.url.startswith("file:///") or s.url.startswith("/")):
        bad("sink.url", f"must be s3://BUCKET[/PREFIX], file:///FOLDER or an absolute folder, got {s.url[:80]!r}")
    if not s.spool_dir.startswith("/") or "\x00" in s.spool_dir:
        bad("sink.spool_dir", f"must be an absolute folder, got {s.spool_dir[:80]!r}")
    if s.endpoint and _host_port(s.endpoint)[1] is None:
        bad("sink.endpoint", f"must be HOST:PORT with a port in 1..65535, got {s.endpoint!r}")
    if p.curve_secret_key_file:
        # the sink subscribes to the agent's own stream as a local client: a CURVE stream
        # would need a client key of its own, which this version does not manage
        bad("sink.enabled", "cannot subscribe to a CURVE stream (publisher.curve_secret_key_file is set); "
            "run `ridgeline record --format parquet --sink URL` with a client key instead")


def load(path: str | Path | None = None, missing_ok: bool = False) -> Config:
    """Defaults overlaid by ``path`` (default ``/etc/ridgeline/agent.toml``)."""
    table = _defaults_table()
    p = Path(path) if path is not None else DEFAULT_PATH
    origin = str(p)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        if missing_ok:
            cfg = _decode(table, "defaults")
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
    cfg = _decode(_merge(table, user), origin)
    _validate(cfg, origin)
    return cfg


def overlay(cfg: Config, over: dict, origin: str = "override") -> Config:
    """A new configuration: ``cfg`` with the table ``over`` laid on it (same checks as a file)."""
    out = _decode(_merge(msgspec.to_builtins(cfg), over), origin)
    _validate(out, origin)
    return out


def as_table(section) -> dict:
    """A configuration or one of its sections as plain nested dicts (TOML's shape)."""
    return msgspec.to_builtins(section)


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


def to_toml(cfg: Config) -> str:
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

    emit(as_table(cfg), "")
    return "\n".join(lines).rstrip() + "\n"
