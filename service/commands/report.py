"""`wafer-gpt2 report`: the performance report (Markdown + PNG plots) from the plan, the cost model
and, with --measure, benchmarks run on this machine."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from service.cli import UserError
from wafer.arch import ARCHS


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report",
        help="write the performance report (Markdown and PNG plots)",
        description=(
            "Write OUT/performance.md and its plots in OUT/performance/: the wafer map, where the time of a "
            "token goes, the latency/PE trade-off, throughput against batch size and replicas, the four GPT-2 "
            "sizes, SRAM per region, and comparisons with GPUs. Without --measure every figure is modeled "
            "(cost model) and the report takes well under a minute; --measure adds benchmarks measured here."
        ),
    )
    parser.add_argument("--out", default="docs", help="output directory (docs)")
    parser.add_argument("--model", default="gpt2", help="the model the detailed figures are about (gpt2)")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="wse2", help="target wafer (wse2)")
    parser.add_argument("--dtype", choices=("fp16", "fp32"), default="fp16", help="wafer precision (fp16)")
    parser.add_argument("--slots", type=int, default=16, help="KV-cache slots per replica (16)")
    parser.add_argument(
        "--measure",
        action="store_true",
        help="also run the simulator and service benchmarks here and include their measured figures",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from wafer.report import default_command, generate_report
    from wafer.report.data import ReportSettings

    if args.slots < 1:
        raise UserError(f"--slots must be at least 1, got {args.slots}")
    settings = ReportSettings(model=args.model, arch=args.arch, dtype=args.dtype, slots=args.slots)
    start = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - start:5.1f}s] {message}", file=sys.stderr, flush=True)

    command = default_command(Path(args.out), settings)
    report = generate_report(args.out, settings, measure=args.measure, command=command, progress=progress)
    print(
        f"wrote {report.markdown_path} and {len(report.figures)} figures in "
        f"{report.markdown_path.parent / 'performance'} ({time.perf_counter() - start:.1f} s)"
    )
    return 0
