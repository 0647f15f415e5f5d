"""`wafer-gpt2 bench host`: the host stack's tokens/s, and how busy it keeps a modeled wafer, over the
stand-in backends (the benchmark itself is `wafer_gpt2/benchmarks/host.py`; this module only registers it).

Every figure it prints is measured on this machine, except the wafer's busy time, which is modeled.
"""

from __future__ import annotations

import argparse

from wafer_gpt2.benchmarks import host


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks measured on this machine (host: the host stack over stand-in backends)",
        description="Benchmarks of the product, measured on this machine.",
    )
    targets = parser.add_subparsers(dest="target", required=True, metavar="TARGET")
    host_parser = targets.add_parser(
        "host",
        help="the host stack's tokens/s over the null and modeled-wafer stand-ins",
        description="The real server (HTTP, engine, sampler, detokenizer) on 127.0.0.1 over backends that "
        "stand in for the wafer (null: no model, no time; modeled: the cost model's step time for a "
        "GPT-2 124M plan), loaded by a raw-socket client in a process of its own. Prints tokens/s, the "
        "server's CPU per token and the modeled wafer's busy share per (stand-in, streams, route), and a "
        "summary line against the host's goals.",
    )
    host.add_arguments(host_parser)
    host_parser.set_defaults(func=host.run)
