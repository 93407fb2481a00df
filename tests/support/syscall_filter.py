"""systemd's SystemCallFilter= semantics, for checking a unit against what the probes call.

Group contents come from the installed systemd (``systemd-analyze syscall-filter``), never
from a list of ours. The combination rules are those of systemd.exec(5) and of
``config_parse_syscall_filter``: the first assignment decides the mode (a plain list is an
allow list and implicitly includes ``@default``; a ``~`` list is a deny list); later
plain assignments add to an allow list (or take from a deny list), later ``~``
assignments take from an allow list (or add to a deny list); an empty assignment resets.
"""
from __future__ import annotations

import re
import subprocess


def parse_groups(text: str) -> dict[str, list[str]]:
    """``systemd-analyze syscall-filter`` output -> {"@group": [member or "@subgroup", ...]}."""
    groups: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), [])
        elif not line.strip():
            current = None
        elif current is not None:
            item = line.strip()
            if not item.startswith("#"):
                current.append(item)
    return groups


def systemd_groups() -> dict[str, list[str]]:
    r = subprocess.run(["systemd-analyze", "syscall-filter", "--no-pager"], capture_output=True, text=True,
                       timeout=60, check=True)
    return parse_groups(r.stdout)


def expand(item: str, groups: dict[str, list[str]], _seen: frozenset = frozenset()) -> set[str]:
    """One filter item (a syscall or an @group, nested groups followed) -> syscall names."""
    if not item.startswith("@"):
        return {item}
    if item not in groups:
        raise KeyError(f"unknown syscall group {item}")
    if item in _seen:
        return set()
    out: set[str] = set()
    for member in groups[item]:
        out |= expand(member, groups, _seen | {item})
    return out


def unit_filter_lines(unit_text: str) -> list[str]:
    """The SystemCallFilter= values of a unit, in order."""
    return [m.group(1).strip() for m in re.finditer(r"^\s*SystemCallFilter=(.*)$", unit_text, re.M)]


def effective_filter(values: list[str], groups: dict[str, list[str]]) -> tuple[bool, set[str]]:
    """Combine SystemCallFilter= values as systemd does -> (is_allow_list, syscalls)."""
    allow_list: bool | None = None
    calls: set[str] = set()
    for value in values:
        if not value:
            allow_list, calls = None, set()
            continue
        invert = value.startswith("~")
        items = value[1:].split() if invert else value.split()
        names: set[str] = set()
        for item in items:
            names |= expand(item, groups)
        if allow_list is None:
            allow_list = not invert
            calls = (expand("@default", groups) | names) if allow_list else names
        elif invert == allow_list:    # "~" on an allow list, or plain on a deny list: take away
            calls -= names
        else:
            calls |= names
    return bool(allow_list), calls


def permitted(syscall: str, allow_list: bool, calls: set[str]) -> bool:
    return (syscall in calls) if allow_list else (syscall not in calls)


def oci_seccomp_profile(calls: set[str]) -> dict:
    """An OCI/containers seccomp profile allowing exactly ``calls`` (EPERM for the rest), as the
    unit's SystemCallFilter + SystemCallErrorNumber=EPERM do; for Kubernetes' Localhost type."""
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": 1,
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"],
        "syscalls": [{"names": sorted(calls), "action": "SCMP_ACT_ALLOW"}],
    }


if __name__ == "__main__":
    # python tests/support/syscall_filter.py > deploy/kubernetes/seccomp/ridgeline-agent.json
    import json
    from pathlib import Path
    unit = (Path(__file__).resolve().parents[2] / "systemd" / "ridgeline.service").read_text()
    allow, calls = effective_filter(unit_filter_lines(unit), systemd_groups())
    assert allow
    print(json.dumps(oci_seccomp_profile(calls), indent=1))
