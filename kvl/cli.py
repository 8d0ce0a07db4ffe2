"""The `kvl` command: one subcommand per module.

Owns: argument dispatch only. Each subcommand module exposes
`add_arguments(parser: argparse.ArgumentParser) -> None` and `run(args) -> int`; modules are
imported lazily so `kvl --help` and light subcommands stay fast and need no native library.
Errors meant for the user are raised as kvl.errors.UserError and printed without a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from kvl.errors import UserError

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvl.server.app", "serve OpenAI- and Anthropic-compatible HTTP APIs"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kvl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    name = argv[0]
    if name not in SUBCOMMANDS:
        parser.error(f"unknown command {name!r}; choose from {', '.join(SUBCOMMANDS)}")
    module = importlib.import_module(SUBCOMMANDS[name][0])
    sub_parser = argparse.ArgumentParser(prog=f"kvl {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(sub_parser)
    # intermixed: options may follow positionals (`kvl serve MODEL --port 8080`) or precede them
    args = sub_parser.parse_intermixed_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except UserError as exc:
        print(f"kvl {name}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"kvl {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
