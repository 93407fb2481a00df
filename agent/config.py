"""The agent's TOML configuration: embedded defaults overlaid by the operator's file.

Contract:

* :func:`defaults` returns the embedded defaults (``agent/data/agent.toml``), which
  document every key.
* :func:`load(path)` reads ``path`` and overlays it on the defaults. Every key of the
  file must exist in the defaults and have the same type (an int is accepted where a
  float is expected); otherwise :class:`probes.errors.InputError` with one line naming
  the file and the key. A missing file is an error unless ``missing_ok`` (used for the
  default path ``/etc/ridgeline/agent.toml`` so a fresh host runs on the defaults).
* :func:`to_toml` writes a configuration back as TOML (for ``--print-config``).

Configurations are plain nested dicts; nothing here touches the probes.
"""
from __future__ import annotations

import copy
import tomllib
from importlib import resources
from pathlib import Path

from ridgeline.probes.errors import InputError

DEFAULT_PATH = Path("/etc/ridgeline/agent.toml")


def defaults() -> dict:
    text = resources.files("ridgeline.agent").joinpath("data/agent.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)


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
                value = float(value)
        elif isinstance(want, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(want, list):
            ok = isinstance(value, list) and all(isinstance(v, (str, int)) for v in value)
        else:
            ok = isinstance(value, type(want))
        if not ok:
            raise InputError(f"{origin}: '{dotted}' must be {type(want).__name__}, got {type(value).__name__}")
        base[key] = value


def _validate(cfg: dict, origin: str) -> None:
    a = cfg["agent"]
    if a["window_s"] <= 0:
        raise InputError(f"{origin}: 'agent.window_s' must be > 0")
    if a["log_level"] not in ("debug", "info", "warning", "error"):
        raise InputError(f"{origin}: 'agent.log_level' must be debug, info, warning or error")
    if cfg["publisher"]["sndhwm"] < 1:
        raise InputError(f"{origin}: 'publisher.sndhwm' must be >= 1")
    ep = cfg["publisher"]["endpoint"]
    if not (ep.startswith("tcp://") or ep.startswith("ipc://")):
        raise InputError(f"{origin}: 'publisher.endpoint' must start with tcp:// or ipc://, got {ep!r}")
    listen = cfg["prometheus"]["listen"]
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise InputError(f"{origin}: 'prometheus.listen' must be HOST:PORT, got {listen!r}")
    model = cfg["analysis"]["model"]
    if model:
        from ridgeline.aggregator import model_config
        try:
            model_config.load(model)
        except InputError as exc:
            raise InputError(f"{origin}: 'analysis.model': {exc}") from None
    if cfg["probes"]["replay"]["speed"] <= 0:
        raise InputError(f"{origin}: 'probes.replay.speed' must be > 0")


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
