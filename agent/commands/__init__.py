"""One module per ``ridgeline`` subcommand; each exposes ``register(subparsers)``.

:data:`COMMANDS` names them all, each the module of its command (``inject-unit`` lives in
``inject_unit.py``): the command line registers exactly these, and static tools see every
one (tests/test_cli_imports.py holds the list to the modules in this folder).
"""

import re

COMMANDS = ("agent", "analyze", "capacity", "check", "cupti", "demo", "export", "inject_unit", "keys", "record",
            "requests", "run", "sched", "scrape", "simulate", "tail", "top", "why")

_ROLE = re.compile(r":(?:func|mod|class|meth|data|attr):`~?([^`]+)`")


def description(doc: str | None, paragraph: int = 0) -> str | None:
    """One paragraph of a command module's docstring as plain text for ``--help``: argparse
    prints the text as it is, so reST markup (````code````, ``:mod:`x```) is taken out."""
    if not doc:
        return None
    parts = doc.strip().split("\n\n")
    text = parts[min(paragraph, len(parts) - 1)]
    text = _ROLE.sub(lambda m: m.group(1).split(".")[-1] if m.group(0).startswith(":func") else m.group(1), text)
    return " ".join(text.replace("``", "").split())
