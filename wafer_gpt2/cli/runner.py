"""Running a parsed command the way every command line of the project does: a user error prints one
line `PROG: error: ...` and exits 2, a bug shows its traceback and exits 1. `wafer-gpt2` (main.py) and
the tools' command lines (`python -m tools.bench`, `python -m tools.report`) share it; it imports no
command, so a tool that uses it does not load the server."""

from __future__ import annotations

import argparse
import sys

from csl_executor.errors import CslError
from wafer_gpt2.errors import WaferGPT2Error


def user_errors() -> tuple[type[BaseException], ...]:
    """What the CLI reports as one line (exit 2): the product's own errors (all under WaferGPT2Error,
    the loaders', the program generator's and the runtime's included), the CSL executor's (`csl`
    backend: a program it refuses at run time) and the operating system's (a missing file, a port in
    use). Anything else is a bug: its traceback shows, exit 1."""
    return (WaferGPT2Error, CslError, OSError)


def run(args: argparse.Namespace, prog: str) -> int:
    """Call the parsed command's `func` (returning its exit status) and report what it raises."""
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
