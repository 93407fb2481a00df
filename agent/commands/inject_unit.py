"""``ridgeline inject-unit UNIT``: profile a systemd service with zero code changes.

Writes a drop-in ``/etc/systemd/system/UNIT.d/ridgeline.conf`` whose ``Environment=``
lines are the ones ``ridgeline run`` sets, so the served process (and its workers) load
the CUPTI injection library. ``--remove`` deletes it. ``--root`` writes under another
root (packaging, tests), ``--dry-run`` prints instead of writing. systemd reads the
drop-in after ``systemctl daemon-reload`` and applies it at the unit's next restart.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from ridgeline.agent.commands import description
from ridgeline.agent.commands.run import add_injection_options, injection_env_from_args
from ridgeline.probes.errors import InputError

DROPIN_NAME = "ridgeline.conf"
_UNIT_RE = re.compile(r"^[A-Za-z0-9:_.\\@-]+$")
_SUFFIXES = (".service", ".socket", ".target", ".scope", ".slice", ".mount", ".timer", ".path")


def register(sub) -> None:
    p = sub.add_parser("inject-unit", help="write a systemd drop-in that injects Ridgeline into a service",
                       description=description(__doc__) + " " + description(__doc__, 1))
    p.add_argument("unit", metavar="UNIT", help="the service, e.g. vllm or vllm.service")
    add_injection_options(p)
    p.add_argument("--root", default="/", help="filesystem root to write under (default /)")
    p.add_argument("--dry-run", action="store_true", help="print the drop-in instead of writing it")
    p.add_argument("--remove", action="store_true", help="remove Ridgeline's drop-in from the unit")
    p.set_defaults(func=run)


def unit_name(name: str) -> str:
    """Normalise and validate a unit name (``vllm`` -> ``vllm.service``)."""
    if not name or len(name) > 255 or not _UNIT_RE.match(name) or name.startswith(".") or "/" in name:
        raise InputError(f"not a valid systemd unit name: {name!r}")
    return name if name.endswith(_SUFFIXES) else name + ".service"


def _quote(assignment: str) -> str:
    # systemd Environment= takes C-style quoted words
    return '"' + assignment.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render(unit: str, env: dict[str, str]) -> str:
    lines = [f"# Written by `ridgeline inject-unit {unit}`; remove with `ridgeline inject-unit --remove {unit}`.",
             "# Loads Ridgeline's CUPTI injection library into the service (and the processes it starts).",
             "[Service]"]
    lines += [f"Environment={_quote(f'{k}={v}')}" for k, v in env.items()]
    return "\n".join(lines) + "\n"


def dropin_path(root: str, unit: str) -> Path:
    return Path(root) / "etc" / "systemd" / "system" / f"{unit}.d" / DROPIN_NAME


def run(args) -> int:
    unit = unit_name(args.unit)
    path = dropin_path(args.root, unit)
    if args.remove:
        if args.dry_run:
            print(f"would remove {path}")
            return 0
        try:
            path.unlink()
        except FileNotFoundError:
            print(f"ridgeline: no drop-in at {path}; nothing to remove", file=sys.stderr)
            return 0
        try:
            path.parent.rmdir()
        except OSError:
            pass      # other drop-ins live there
        print(f"removed {path}\nnext: systemctl daemon-reload && systemctl restart {unit}")
        return 0
    text = render(unit, injection_env_from_args(args))
    if args.dry_run:
        print(f"# {path}")
        sys.stdout.write(text)
        return 0
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except PermissionError as e:
        raise InputError(f"cannot write {path}: {e.strerror} (run as root, or use --root/--dry-run)") from None
    print(f"wrote {path}\nnext: systemctl daemon-reload && systemctl restart {unit}")
    return 0
