"""`wafer-gpt2`: one entry point, one module per subcommand under `service/commands/`.

Each command module defines `register(subparsers)`, which adds its parser and sets `func`
(called with the parsed args, returning an exit code). Errors a user can fix print one line.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order `--help` lists them.
COMMANDS = [
    "serve",
    "generate",
    "compile",
    "plan",
    "cost",
    "bench",
    "report",
    "csl",
]


class UserError(ValueError):
    """A problem the user can fix: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wafer-gpt2",
        description="GPT-2 inference on a Cerebras wafer (or its embedded simulator), served over HTTP.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"service.commands.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (UserError, ValueError, FileNotFoundError, RuntimeError) as exc:
        # The loaders, the planner and the runtime raise ValueError/RuntimeError subclasses whose
        # message names the file, tensor or limit at fault: that message is the whole report.
        print(f"wafer-gpt2 {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
