"""`wafer-gpt2 cost gemv`: the modeled cycles of one standalone GEMV with the planner's algorithm.
`wafer-gpt2 cost calibrate`: the model's fitted constants against the published hardware runs.

`gemv` prints the phases (input injection, multicast, FMAC, reduction, bias) and, on the last line,
the total. Every figure is modeled by `wafer_gpt2.core.cost`, not measured; `calibrate` prints measured cycles
(published, from a CS-3) beside modeled ones.
"""

from __future__ import annotations

import argparse

from wafer_gpt2.core import calibration
from wafer_gpt2.core.arch import ARCHS
from wafer_gpt2.core.cost import CLOCK_HZ, SDK_CLOCK_HZ, cycles_to_us, standalone_gemv_cost
from wafer_gpt2.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "cost",
        help="modeled cycles of one operation (gemv), and the model's calibration (calibrate)",
        description="Modeled cost of one operation on the wafer, from the cycle model in wafer_gpt2/core/cost.py.",
    )
    ops = parser.add_subparsers(dest="op", required=True, metavar="OP")
    gemv = ops.add_parser(
        "gemv",
        help="y[N] = x[K] @ W[K, N] on a P x Q grid",
        description="Modeled cycles of one GEMV y = x @ W with W (K x N) tiled over P x Q PEs: P PEs along K "
        "(the reduction axis), Q PEs along N. The input enters at the grid's edge; the reduction (chain or "
        "two-level) is the one the model finds faster.",
    )
    gemv.add_argument("--arch", choices=tuple(ARCHS), default="wse2")
    gemv.add_argument("--grid", required=True, metavar="PxQ", help="PEs along K x PEs along N, e.g. 16x8")
    gemv.add_argument("--shape", required=True, metavar="KxN", help="weight shape, e.g. 768x3072")
    gemv.add_argument("--dtype", choices=("fp16", "fp32"), default="fp16")
    gemv.set_defaults(func=run)
    calibrate = ops.add_parser(
        "calibrate",
        help="the fitted constants against published hardware runs",
        description="Fit the cost model's per-hop latency and DSD-operation start on WaferLLM's MeshGEMV "
        "runs on a CS-3 with P <= 80, and print every published run beside the model (wafer_gpt2/core/calibration.py).",
    )
    calibrate.set_defaults(func=run_calibrate)


def parse_pair(text: str, flag: str, names: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    try:
        a, b = (int(p) for p in parts)
    except ValueError:
        raise UserError(f"{flag} must look like {names} with two positive integers, got {text!r}") from None
    if a < 1 or b < 1:
        raise UserError(f"{flag} must look like {names} with two positive integers, got {text!r}")
    return a, b


def run(args: argparse.Namespace) -> int:
    rows, cols = parse_pair(args.grid, "--grid", "PxQ")
    k, n = parse_pair(args.shape, "--shape", "KxN")
    if rows > k or cols > n:
        raise UserError(f"--grid {rows}x{cols} has more PEs than the {k}x{n} weight has rows/columns")
    cost = standalone_gemv_cost(args.arch, rows, cols, k, n, args.dtype)
    arch = ARCHS[args.arch]
    tile_k, tile_n = -(-k // rows), -(-n // cols)
    print(
        f"modeled GEMV {k}x{n} on a {rows}x{cols} grid of {arch.name} PEs ({args.dtype}): tile {tile_k}x{tile_n} "
        f"per PE, {cost.name}"
    )
    for phase, cycles in cost.phases.items():
        print(f"  {phase:<28} {cycles:>9,} cycles (modeled)")
    total = cost.cycles
    print(
        f"modeled total: {total:,} cycles = {cycles_to_us(total, CLOCK_HZ):.3f} us at 1.1 GHz, "
        f"{cycles_to_us(total, SDK_CLOCK_HZ):.3f} us at 0.85 GHz"
    )
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    print(calibration.report())
    return 0
