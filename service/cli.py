"""`wafer-gpt2`: one entry point, one module per subcommand under `service/commands/`.

Each command module defines `register(subparsers)`, which adds its parser and sets `func`
(called with the parsed args, returning an exit code). Errors a user can fix print one line (exit 2);
a bug shows its traceback (exit 1).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from wafer.errors import WaferGPT2Error

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


class UserError(WaferGPT2Error, ValueError):
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


def user_errors() -> tuple[type[BaseException], ...]:
    """What the CLI reports as one line (exit 2): the project's own errors (all under WaferGPT2Error,
    the loaders', the program generator's and the runtime's included), and the operating system's (a
    missing file, a port in use). Anything else is a bug: its traceback shows, exit 1."""
    return (WaferGPT2Error, OSError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if not isinstance(exc, user_errors()):
            raise  # a bug: Python prints the traceback and exits 1
        # The message names the file, tensor, flag or limit at fault: that is the whole report.
        print(f"wafer-gpt2 {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
