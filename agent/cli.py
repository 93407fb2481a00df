"""The ``ridgeline`` command line.

Each subcommand lives in its own module in :mod:`agent.commands` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to a callable taking
the parsed arguments and returning an exit code. :data:`agent.commands.COMMANDS` names
every module, so adding a command adds its name there and never edits this file. A module is named for its command (``inject-unit`` lives
in ``inject_unit.py``): ``ridgeline CMD ...`` imports that module alone, so a command
pays only for its own imports (tests/test_cli_imports.py holds every module to it).

One convention for every command (the table is in the README):

* 0: done;
* 1: a runtime failure: the input was fine but what the command needed did not happen
  (no agent answering or no data within ``--timeout``, an endpoint unreachable, an
  enabled probe unavailable): :class:`probes.errors.RuntimeFailure`;
* 2: bad input or usage: an unknown command, option or choice, a bad value, a bad
  configuration or input file: :class:`probes.errors.InputError` and argparse's errors;
* 130: interrupted (SIGINT).

Every error is one line on stderr starting ``ridgeline: error: `` (the command's name
follows for usage errors), never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from ridgeline.probes.errors import InputError, RuntimeFailure

from . import commands

PREFIX = "ridgeline: error: "


def version() -> str:
    from importlib import metadata
    try:
        return metadata.version("ridgeline")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


class Parser(argparse.ArgumentParser):
    """argparse with the project's error line: ``ridgeline: error: CMD: message`` and exit 2."""

    def error(self, message: str):
        cmd = self.prog.split(" ", 1)[1] if " " in self.prog else ""
        where = f"{cmd}: " if cmd else ""
        self.exit(2, f"{PREFIX}{where}{message} (see `{self.prog} --help`)\n")


class _Version(argparse.Action):
    """``--version``, its text found only when asked: importlib.metadata costs every
    other command tens of milliseconds of imports."""

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(f"ridgeline {version()}\n")   # on stdout, as argparse's own action
        parser.exit(0)


def _command_module(argv: list[str]) -> str | None:
    """The module of the command ``argv`` starts with (``inject-unit`` -> inject_unit),
    or None. Only that module is imported then: each command imports what it needs,
    and ``ridgeline analyze`` has no use for zmq or the CUPTI server (issue 21.3)."""
    if not argv or argv[0].startswith("-"):
        return None
    return argv[0].replace("-", "_")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only`` (a command's module name), that command alone is
    registered (every command when the name is not a command's)."""
    parser = Parser(
        prog="ridgeline",
        description="Which cost face holds this LLM server back: GPU memory, compute vs bandwidth, or queueing.",
        epilog="Exit codes: 0 done, 1 runtime failure (no agent or data, unreachable endpoint, probe "
               "unavailable), 2 bad input or usage, 130 interrupted.",
    )
    parser.add_argument("--version", action=_Version, nargs=0, help="show the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    names = [only] if only in commands.COMMANDS else sorted(commands.COMMANDS)
    for name in names:
        importlib.import_module(f"{commands.__name__}.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    parser = build_parser(_command_module(argv))
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse's own message would not name the command the option was given to.
        cmd = getattr(args, "command", None)
        where = f"{cmd}: " if cmd else ""
        help_of = f"ridgeline {cmd}" if cmd else "ridgeline"
        print(f"{PREFIX}{where}unrecognized arguments: {' '.join(extra)} (see `{help_of} --help`)", file=sys.stderr)
        return 2
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        code = args.func(args)
    except (InputError, RuntimeFailure) as exc:
        print(f"{PREFIX}{exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
