"""``ridgeline check``: can each probe run here, and if not, why and what to do.

Exit 0 when every enabled probe (``[probes] enabled`` of the configuration, or the probes
named with ``--probe``) can run, 1 when one of them cannot (runtime failure), 2 for an
unknown probe name or a bad configuration. ``--json`` prints one object:
``{"ok": bool, "probes": [{"name", "ok", "enabled", "checked", "reason", "hint"}, ...]}``.
"""
from __future__ import annotations

import json

from ridgeline.probes.errors import InputError, RuntimeFailure


def register(sub) -> None:
    p = sub.add_parser("check", help="print each probe's availability with reason and hint",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--config", metavar="FILE", help="config file (default: /etc/ridgeline/agent.toml if present)")
    p.add_argument("--probe", action="append", metavar="NAME", help="check only this probe (repeatable); "
                                                                    "it must be able to run")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from ridgeline.agent import config, registry
    cfg = config.load(args.config, missing_ok=args.config is None)
    unknown = [n for n in args.probe or () if n not in registry.STEPS]
    if unknown:
        raise InputError(f"check: unknown probe {', '.join(map(repr, unknown))} (known: {', '.join(registry.STEPS)})")
    enabled = set(cfg["probes"]["enabled"])
    names = args.probe or list(registry.STEPS)
    # What must be able to run: the probes named, else the enabled ones.
    required = set(args.probe) if args.probe else enabled
    rows = []
    for name in names:
        probe, av = registry.availability(name, cfg)
        rows.append({"name": name, "ok": bool(av.ok), "enabled": name in enabled, "checked": name in required,
                     "reason": av.reason or "", "hint": av.hint or ""})
        if probe is not None:
            try:
                probe.stop()
            except Exception:
                pass
    failing = [r["name"] for r in rows if r["checked"] and not r["ok"]]
    if args.json:
        print(json.dumps({"ok": not failing, "probes": rows}))
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
    if failing:
        raise RuntimeFailure(f"check: {'probe' if len(failing) == 1 else 'probes'} {', '.join(failing)} "
                             f"cannot run here (see above)")
    return 0
