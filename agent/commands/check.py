"""``ridgeline check``: can each probe run here, and if not, why and what to do.

Exit 0 when every enabled probe (``[probes] enabled`` of the configuration, or the probes
named with ``--probe``) can run, 1 when one of them cannot (runtime failure), 2 for an
unknown probe name or a bad configuration. ``--json`` prints one object:
``{"ok": bool, "probes": [{"name", "ok", "enabled", "checked", "reason", "hint"}, ...],
"agent": {"reachable", "endpoint", "reason", "cupti_processes_taken_over", "cupti_taken_over":
[{"pid", "since_unix_s", "taken_over_s", "status", "reclaims_requested"}, ...]}}`` (at most
64 listed; the count covers all).

Each row tells the state the probe would meet now: a configured engine endpoint is asked
once (one that does not answer is unavailable, with the endpoint and the error); the
CUPTI row says when a running agent already listens on its socket, or when this host has
no NVIDIA driver (nothing here can connect).

The running agent's side comes from its own health record: ``check`` subscribes to the
agent's stream (``publisher.endpoint`` of the configuration, or ``--endpoint``) and waits
at most ``--agent-timeout`` seconds for one. An agent that is not running or not
reachable is reported, not a failure; served processes whose CUPTI another tool
(torch.profiler) took over are a failure (exit 1): their GPU records are paused.

The object-storage sink (``[sink]``, agent/sink_supervisor.py): with it enabled, ``check``
says whether this host can run it (pyarrow installed) and what the running agent's health
record says of it (``"sink"`` in ``--json``: running or restarting, files uploaded, files
and bytes in the spool, files dropped, failed uploads, the last error). A sink enabled that
cannot run here is a failure (exit 1); one that runs but drops or retries is reported.
"""
from __future__ import annotations

import json
import os
import sys
import time

from ridgeline.agent.commands import description
from ridgeline.probes.errors import InputError, RuntimeFailure


def register(sub) -> None:
    p = sub.add_parser("check", help="print each probe's availability with reason and hint",
                       description=description(__doc__))
    p.add_argument("--config", metavar="FILE", help="config file (default: /etc/ridgeline/agent.toml if present)")
    p.add_argument("--probe", action="append", metavar="NAME", help="check only this probe (repeatable); "
                                                                    "it must be able to run")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--agent-timeout", type=float, default=None, metavar="S",
                   help="wait at most S seconds for the running agent's health record (default: two windows "
                        "and a second, at most 30; 0: do not ask the agent)")
    from ridgeline.agent.subscriber import add_stream_arguments
    add_stream_arguments(p, topics=False)
    p.set_defaults(func=run)


def agent_view(args, cfg) -> dict:
    """What the running agent says about itself: its latest health record's CUPTI takeovers."""
    from ridgeline.agent.subscriber import open_stream
    timeout_s = args.agent_timeout
    if timeout_s is None:
        timeout_s = min(2 * cfg.agent.window_s + 1.0, 30.0)
    args.endpoint = args.endpoint or cfg.publisher.endpoint
    out = {"reachable": False, "endpoint": args.endpoint, "reason": "", "cupti_processes_taken_over": 0,
           "cupti_taken_over": [], "sink": None}
    if timeout_s == 0:
        out["reason"] = "not asked (--agent-timeout 0)"
        return out
    if args.endpoint.startswith("ipc://") and not os.path.exists(args.endpoint[len("ipc://"):]):
        out["reason"] = "no agent is publishing there (is `ridgeline agent` running?)"
        return out
    try:
        sub = open_stream(args, topics=["health"])
    except RuntimeFailure as exc:
        out["reason"] = str(exc)
        return out
    try:
        end = time.monotonic() + timeout_s
        while True:
            msg = sub.receive(max(0.0, min(0.2, end - time.monotonic())))
            if sub.refused:
                out["reason"] = sub.refused
                return out
            if msg is not None and msg.topic == "health" and isinstance(msg.payload, dict):
                taken = msg.payload.get("cupti_taken_over")
                out["reachable"] = True
                out["cupti_taken_over"] = [t for t in taken if isinstance(t, dict)] if isinstance(taken, list) else []
                n = msg.payload.get("cupti_processes_taken_over")
                out["cupti_processes_taken_over"] = n if isinstance(n, int) else len(out["cupti_taken_over"])
                out["sink"] = _sink_record(msg.payload.get("sink"))
                return out
            if time.monotonic() >= end:
                out["reason"] = f"no health record within {timeout_s:g} s (is `ridgeline agent` running?)"
                return out
    finally:
        sub.close()


def _sink_record(raw) -> dict | None:
    """The health record's sink part, typed (probes.records.SinkState), as plain values."""
    import msgspec

    from ridgeline.probes.records import SinkState
    if not isinstance(raw, dict):
        return None
    try:
        return msgspec.to_builtins(msgspec.convert(raw, SinkState))
    except msgspec.ValidationError:
        return {"state": "unreadable"}


def sink_view(cfg, agent: dict) -> dict:
    """The sink as configured here and as the running agent reports it."""
    import importlib.util
    s = cfg.sink
    out = {"enabled": s.enabled, "url": s.url, "ok": True, "reason": "", "agent": agent.get("sink")}
    if not s.enabled:
        out["reason"] = "off ([sink] enabled = false)"
        return out
    if importlib.util.find_spec("pyarrow") is None:
        out["ok"], out["reason"] = False, "pyarrow is not installed (hint: pip install 'ridgeline[parquet]')"
    return out


def _sink_line(sink: dict) -> str:
    if not sink["enabled"]:
        return f"sink   {sink['reason']}"
    if not sink["ok"]:
        return f"sink   unavailable  {sink['url']}: {sink['reason']}"
    a = sink["agent"]
    if not a:
        return f"sink   enabled  {sink['url']}: the running agent did not report it (not reached, or not enabled there)"
    line = (f"sink   {a.get('state')}  {sink['url']}: {a.get('files_uploaded', 0)} files "
            f"({a.get('bytes_uploaded', 0)} bytes) uploaded, {a.get('spool_files', 0)} waiting in the spool "
            f"({a.get('spool_bytes', 0)} bytes), {a.get('dropped_files', 0)} dropped over the cap, "
            f"{a.get('upload_errors', 0)} failed uploads retried, {a.get('restarts', 0)} restarts")
    if a.get("missed_messages"):
        line += f", {a['missed_messages']} messages published while it restarted"
    if a.get("last_error"):
        line += f"; last error: {a['last_error']}"
    return line


def _takeover_line(t: dict) -> str:
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(t.get("since_unix_s") or 0)))
    line = (f"  pid {t.get('pid')}: CUPTI taken over by another tool since {since} "
            f"({float(t.get('taken_over_s') or 0):.0f} s); records paused")
    if t.get("status"):
        line += f"; library: {t['status']}"
    return line + f"  (hint: once that tool is done, `ridgeline cupti reclaim --pid {t.get('pid')}`)"


def _real_state(name: str, probe, row: dict) -> dict:
    """What the probe would meet now, beyond whether it can start: an agent already
    holding the CUPTI socket is the CUPTI side working (the agent is running), not a
    failure; a configured engine endpoint is asked once, and one that does not answer
    makes the engine row unavailable with the endpoint and the error."""
    if name == "cupti" and getattr(probe, "socket_in_use", False):
        return dict(row, ok=True, reason=f"a running agent listens on {probe.socket_path} (injected processes "
                                         "connect there)", hint="")
    if name == "engine" and row["ok"] and hasattr(probe, "endpoints"):
        from ridgeline.probes import engine as engine_probe
        down = []
        for url in probe.endpoints():
            try:
                res = engine_probe.scrape(url, probe.timeout_s, max_body_bytes=probe.max_body_bytes,
                                          follow_redirects=probe.follow_redirects)
            except InputError as exc:
                err = str(exc)
                down.append(f"{url} not answering: {err[len(url) + 2:] if err.startswith(url + ': ') else err}")
                continue
            if not engine_probe.is_engine_exposition(res["exposition"]):
                down.append(f"{url} answers, but without vLLM or SGLang metrics")
        if down:
            return dict(row, ok=False, reason="; ".join(down),
                        hint="start the engine or set probes.engine.url to where it serves /metrics; "
                             "the agent retries with back-off and warns once")
        if probe.endpoints():
            return dict(row, reason=f"{row['reason']}, answering ({', '.join(probe.endpoints())})")
    return row


def run(args) -> int:
    from ridgeline.agent import config, registry
    cfg = config.load(args.config, missing_ok=args.config is None)
    unknown = [n for n in args.probe or () if n not in registry.STEPS]
    if unknown:
        raise InputError(f"check: unknown probe {', '.join(map(repr, unknown))} (known: {', '.join(registry.STEPS)})")
    enabled = set(cfg.probes.enabled)
    names = args.probe or list(registry.STEPS)
    # What must be able to run: the probes named, else the enabled ones.
    required = set(args.probe) if args.probe else enabled
    rows = []
    for name in names:
        probe, av = registry.availability(name, cfg)
        row = {"name": name, "ok": bool(av.ok), "enabled": name in enabled, "checked": name in required,
               "reason": av.reason or "", "hint": av.hint or ""}
        rows.append(_real_state(name, probe, row))
        if probe is not None:
            try:
                probe.stop()
            except Exception as exc:  # noqa: BLE001  (any probe's stop() failing must not cost the other rows; said)
                print(f"ridgeline check: probe {name}: stop() raised {type(exc).__name__}: {exc}", file=sys.stderr)
    failing = [r["name"] for r in rows if r["checked"] and not r["ok"]]
    agent = agent_view(args, cfg)
    sink = sink_view(cfg, agent)
    taken = agent["cupti_taken_over"]
    n_taken = agent["cupti_processes_taken_over"]
    if args.json:
        print(json.dumps({"ok": not failing and not n_taken and sink["ok"], "probes": rows, "agent": agent,
                          "sink": sink}))
    else:
        width = max(len(n) for n in names)
        for r in rows:
            mark = "ok" if r["ok"] else "unavailable"
            tag = "enabled" if r["enabled"] else "off"
            line = f"{r['name']:<{width}}  {mark:<11}  [{tag}]"
            if r["reason"]:
                line += f"  {r['reason']}"
            if r["hint"]:
                line += f"  (hint: {r['hint']})"
            print(line, flush=True)
        if agent["reachable"]:
            print(f"agent  reachable at {agent['endpoint']}: {n_taken} served process(es) with CUPTI "
                  "taken over", flush=True)
            for t in taken:
                print(_takeover_line(t), flush=True)
            if n_taken > len(taken):
                print(f"  ... and {n_taken - len(taken)} more", flush=True)
        else:
            print(f"agent  not reached at {agent['endpoint']}: {agent['reason']}", flush=True)
        if sink["enabled"]:
            print(_sink_line(sink), flush=True)
    if failing:
        raise RuntimeFailure(f"check: {'probe' if len(failing) == 1 else 'probes'} {', '.join(failing)} "
                             f"cannot run here (see above)")
    if n_taken:
        raise RuntimeFailure(f"check: CUPTI of {n_taken} served process(es) is taken over by another tool; "
                             "their GPU records are paused (see above)")
    if not sink["ok"]:
        raise RuntimeFailure(f"check: the sink is enabled but cannot run here: {sink['reason']}")
    return 0
