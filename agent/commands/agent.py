"""``ridgeline agent``: the daemon (see :mod:`agent.daemon`)."""
from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("agent", help="run the profiling agent (the systemd service runs this)",
                       description="Poll the probes, fold into windows, publish on ZeroMQ and /metrics.")
    p.add_argument("--config", metavar="FILE",
                   help="TOML config laid over the embedded defaults (default: /etc/ridgeline/agent.toml if present)")
    p.add_argument("--print-config", action="store_true", help="print the merged configuration and exit")
    p.add_argument("--endpoint", help="override publisher.endpoint")
    p.add_argument("--probes", help="override probes.enabled (comma list)")
    p.add_argument("--replay", metavar="TRACE", help="add the replay probe on TRACE (Kineto JSON)")
    p.add_argument("--speed", type=float, help="override probes.replay.speed")
    p.add_argument("--run-for", type=float, metavar="S", help="stop after S seconds (override agent.run_for_s)")
    p.add_argument("--no-prometheus", action="store_true", help="do not serve /metrics")
    p.add_argument("--prometheus-listen", metavar="HOST:PORT", help="override prometheus.listen")
    p.set_defaults(func=run)


def overrides(args, cfg) -> dict:
    """The command line's settings as a config overlay (kept across SIGHUP reloads)."""
    over: dict = {}
    if getattr(args, "endpoint", None):
        over.setdefault("publisher", {})["endpoint"] = args.endpoint
    if getattr(args, "probes", None) is not None:
        over.setdefault("probes", {})["enabled"] = [x.strip() for x in args.probes.split(",") if x.strip()]
    if getattr(args, "replay", None):
        pr = over.setdefault("probes", {})
        pr.setdefault("replay", {})["path"] = args.replay
        enabled = pr.get("enabled", list(cfg.probes.enabled))
        pr["enabled"] = enabled + ([] if "replay" in enabled else ["replay"])
    if getattr(args, "speed", None) is not None:
        over.setdefault("probes", {}).setdefault("replay", {})["speed"] = args.speed
    if getattr(args, "run_for", None) is not None:
        over.setdefault("agent", {})["run_for_s"] = args.run_for
    if getattr(args, "no_prometheus", False):
        over.setdefault("prometheus", {})["enabled"] = False
    if getattr(args, "prometheus_listen", None):
        over.setdefault("prometheus", {})["listen"] = args.prometheus_listen
    return over


def load_config(args) -> tuple:
    """(merged configuration, command-line overlay)."""
    from ridgeline.agent import config
    cfg = config.load(args.config, missing_ok=args.config is None)
    over = overrides(args, cfg)
    return (config.overlay(cfg, over, "command line") if over else cfg), over


def run(args) -> int:
    from ridgeline.agent import config
    cfg, over = load_config(args)
    if args.print_config:
        sys.stdout.write(config.to_toml(cfg))
        return 0
    from ridgeline.agent.daemon import run_agent
    return run_agent(cfg, args.config, overrides=over)
