"""`wafer-gpt2 cslc`, `wafer-gpt2 cs_python` and `wafer-gpt2 csl`: the project's CSL executor.

`cslc` and `cs_python` take the arguments of the Cerebras SDK's commands of the same names and run
the program on the executor (`wafer.csl`, docs/csl-executor.md); `csl examples PATH` runs a checkout
of Cerebras' csl-examples through their own `commands_*.sh`, `csl wrappers DIR` writes the two
one-line wrappers that make those scripts find `cslc` and `cs_python`.
"""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "cslc",
        help="compile CSL with the executor (takes Cerebras cslc's arguments)",
        add_help=False,
        prefix_chars="\0",
    )
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda a: _run("cslc", a.rest))

    p = subparsers.add_parser(
        "cs_python",
        help="run an SDK host script (run.py) on the executor",
        add_help=False,
        prefix_chars="\0",
    )
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda a: _run("cs_python", a.rest))

    p = subparsers.add_parser(
        "csl",
        help="executor tools: run a csl-examples checkout, write the cslc/cs_python wrappers",
        add_help=False,
        prefix_chars="\0",
    )
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda a: _run(a.rest[0] if a.rest else "", a.rest[1:]))


def _run(tool: str, rest: list[str]) -> int:
    from wafer.csl.cli import main

    return main([tool, *rest])
