"""`wafer-gpt2`: one entry point, one module per subcommand (`wafer_gpt2/cli/*_command.py`).

Each command module defines `register(subparsers)`, which adds its parser and sets `func`
(called with the parsed args, returning an exit code). Errors a user can fix print one line (exit 2);
a bug shows its traceback (exit 1).
"""

from __future__ import annotations

import argparse
import sys

from wafer_gpt2.cli import (
    bench_command,
    compile_command,
    cost_command,
    generate_command,
    plan_command,
    serve_command,
)
from wafer_gpt2.cli.runner import run, user_errors
from wafer_gpt2.errors import UserError

# Subcommand modules, in the order `--help` lists them.
COMMANDS = [serve_command, generate_command, compile_command, plan_command, cost_command, bench_command]

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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(args, f"wafer-gpt2 {args.command}")


if __name__ == "__main__":
    sys.exit(main())
