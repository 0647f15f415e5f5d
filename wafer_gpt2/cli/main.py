"""`wafer-gpt2`: one entry point, one module per subcommand (`wafer_gpt2/cli/*_command.py`).

Each command module defines `register(subparsers)`, which adds its parser and sets `func`
(called with the parsed args, returning an exit code). Errors a user can fix print one line (exit 2);
a bug shows its traceback (exit 1).
"""

from __future__ import annotations

import argparse
import sys

from csl_executor.errors import CslError
from wafer_gpt2.cli import compile_command, cost_command, generate_command, plan_command, serve_command
from wafer_gpt2.errors import UserError, WaferGPT2Error

# Subcommand modules, in the order `--help` lists them.
COMMANDS = [serve_command, generate_command, compile_command, plan_command, cost_command]

__all__ = ["COMMANDS", "UserError", "build_parser", "main", "run", "user_errors"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wafer-gpt2",
        description="GPT-2 inference on a Cerebras wafer (or its embedded simulator), served over HTTP.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(subparsers)
    return parser


def user_errors() -> tuple[type[BaseException], ...]:
    """What the CLI reports as one line (exit 2): the product's own errors (all under WaferGPT2Error,
    the loaders', the program generator's and the runtime's included), the CSL executor's (`csl`
    backend: a program it refuses at run time) and the operating system's (a missing file, a port in
    use). Anything else is a bug: its traceback shows, exit 1."""
    return (WaferGPT2Error, CslError, OSError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(args, f"wafer-gpt2 {args.command}")


def run(args: argparse.Namespace, prog: str) -> int:
    """Call the parsed command's `func`; a user error prints one line `PROG: error: ...` (exit 2), a bug
    its traceback (exit 1). The tools' command lines (`python -m tools.bench`, `python -m tools.report`)
    report errors the same way."""
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if not isinstance(exc, user_errors()):
            raise  # a bug: Python prints the traceback and exits 1
        # The message names the file, tensor, flag or limit at fault: that is the whole report.
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
