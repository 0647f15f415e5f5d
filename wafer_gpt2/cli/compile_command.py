"""`wafer-gpt2 compile`: build the CSL program for a model and compile it with cslc (or print how)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from wafer_gpt2.core.arch import ARCHS
from wafer_gpt2.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compile",
        help="lay out the CSL program for a model and compile it with cslc",
        description=(
            "Plan the model onto the wafer, write the PE programs and the plan's layout.csl to OUT/src, and "
            "compile OUT/src/layout.csl into OUT/bin: with cslc (on PATH in the Cerebras SDK container), or "
            "with --executor on the project's CSL executor, which checks and runs the CSL but is not cslc. "
            "--dry-run prints the cslc command instead. No real cslc has compiled this CSL yet."
        ),
    )
    parser.add_argument(
        "--model", default="gpt2", help="a preset (gpt2, gpt2-medium, ...) or a config.json / HF dir"
    )
    parser.add_argument("--arch", choices=sorted(ARCHS), default="wse2", help="target wafer (wse2)")
    parser.add_argument("--out", default="build/csl", help="output directory (build/csl)")
    parser.add_argument("--dtype", choices=("fp16", "fp32"), default="fp16", help="wafer precision (fp16)")
    parser.add_argument("--slots", type=int, default=16, help="KV-cache slots per replica (16)")
    parser.add_argument("--context", type=int, help="positions per slot (default: the model's n_positions)")
    parser.add_argument("--top-k", type=int, default=64, help="top-k the head reports per token (64)")
    parser.add_argument("--replicas", type=int, default=1, help="pipeline replicas side by side (1)")
    parser.add_argument("--channels", type=int, default=1, help="memcpy I/O channels, 1..16 (1)")
    parser.add_argument(
        "--simfabric",
        action="store_true",
        help="size the fabric for the SDK simulator instead of the whole wafer",
    )
    parser.add_argument(
        "--objective",
        choices=("latency", "throughput", "compact"),
        default="latency",
        help="what the plan optimises (latency; compact: the fewest PEs, for the executor)",
    )
    parser.add_argument(
        "--executor", action="store_true", help="compile with the project's CSL executor instead of cslc"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="write the sources, print the cslc command, stop"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from wafer_gpt2.codegen import ProgramError
    from wafer_gpt2.host.compile import CompileError, compile_program, prepare_sources
    from wafer_gpt2.model.config import resolve_config
    from wafer_gpt2.plan import PlanError, build_plan

    config = resolve_config(args.model)
    for name in ("slots", "top_k", "replicas"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    try:
        plan = build_plan(
            config,
            arch=args.arch,
            dtype=args.dtype,
            slots=args.slots,
            context=args.context or config.n_positions,
            replicas=args.replicas,
            top_k=args.top_k,
            objective=args.objective,
        )
        job = prepare_sources(plan, args.out, simfabric=args.simfabric, channels=args.channels)
    except (PlanError, ProgramError, CompileError, ValueError) as exc:
        raise UserError(str(exc)) from None
    print(job.shell())
    print(f"sources and layout.csl in {Path(job.src_dir)}", file=sys.stderr)
    if args.dry_run:
        print("dry run: cslc not started (no real cslc has compiled this CSL yet)", file=sys.stderr)
        return 0
    try:
        compile_program(job, executor=args.executor)
    except CompileError as exc:
        raise UserError(str(exc)) from None
    how = "the CSL executor (not cslc)" if args.executor else "cslc"
    print(f"compiled with {how} into {job.bin_dir}", file=sys.stderr)
    return 0
