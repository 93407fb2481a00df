"""``ridgeline check``: can each probe run here, and if not, why and what to do."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("check", help="print each probe's availability with reason and hint")
    p.add_argument("--config", metavar="FILE", help="config file (default: /etc/ridgeline/agent.toml if present)")
    p.add_argument("--probe", action="append", metavar="NAME", help="check only this probe (repeatable)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ridgeline.agent import config, registry
    cfg = config.load(args.config, missing_ok=args.config is None)
    enabled = set(cfg["probes"]["enabled"])
    names = args.probe or list(registry.STEPS)
    width = max(len(n) for n in names)
    for name in names:
        probe, av = registry.availability(name, cfg)
        mark = "ok" if av.ok else "unavailable"
        tag = "enabled" if name in enabled else "off"
        line = f"{name:<{width}}  {mark:<11}  [{tag}]"
        if av.reason:
            line += f"  {av.reason}"
        if av.hint:
            line += f"  (hint: {av.hint})"
        print(line, flush=True)
        if probe is not None:
            try:
                probe.stop()
            except Exception:
                pass
    # Exit 0 even when optional probes are missing: the agent runs without them.
    return 0
