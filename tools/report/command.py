"""`python -m tools.report`: the performance report (Markdown + PNG plots) from the plan, the cost model
and, with --measure, benchmarks run on this machine."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wafer_gpt2.cli.runner import run as run_command
from wafer_gpt2.core.arch import ARCHS
from wafer_gpt2.errors import UserError

if TYPE_CHECKING:  # tools.report draws with matplotlib: imported when a report is written, not at start-up
    from tools.report.measured import Measured, MeasuredRow


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.report",
        description=(
            "Write OUT/performance.md and its plots in OUT/performance/: the wafer map, where the time of a "
            "token goes, the latency/PE trade-off, throughput against batch size and replicas, the four GPT-2 "
            "sizes, SRAM per region, and comparisons with GPUs. The modeled figures (cost model) are written "
            "anew; the measured ones are those the last run with --measure kept in OUT/performance/measured.json, "
            "and the hand-written host section is carried over."
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
        help="also run the simulator and service benchmarks here (minutes) and keep their figures",
    )
    parser.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m tools.report ...`; user errors print one line (exit 2), as `wafer-gpt2`'s do."""
    return run_command(build_parser().parse_args(argv), "report")


def run(args: argparse.Namespace) -> int:
    from tools.report import default_command, generate_report
    from tools.report.data import ReportSettings

    if args.slots < 1:
        raise UserError(f"--slots must be at least 1, got {args.slots}")
    settings = ReportSettings(model=args.model, arch=args.arch, dtype=args.dtype, slots=args.slots)
    start = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - start:5.1f}s] {message}", file=sys.stderr, flush=True)

    command = default_command(Path(args.out), settings)
    measured = measure_all(progress) if args.measure else None
    report = generate_report(args.out, settings, measured=measured, command=command, progress=progress)
    print(
        f"wrote {report.markdown_path} and {len(report.figures)} figures in "
        f"{report.markdown_path.parent / 'performance'} ({time.perf_counter() - start:.1f} s)"
    )
    return 0


def measure_sim_rows(progress: Callable[[str], None]) -> tuple[list[MeasuredRow], str]:
    """`bench sim` with the report's settings: the simulator at batch 1 and 16 against transformers."""
    from tools.bench.bench_sim import measure_sim, print_sim_result
    from tools.report.measured import REPS, SIM_COMMAND, SIM_NEW_TOKENS, MeasuredRow
    from wafer_gpt2.model.config import PRESETS

    progress(f"measuring: {SIM_COMMAND} (minutes on a busy machine)")
    result = measure_sim(PRESETS["gpt2"], [1, 16], new_tokens=SIM_NEW_TOKENS, reps=REPS, log=progress)
    rows = [
        MeasuredRow(
            f"simulator, batch {rate.batch}",
            rate.tokens_per_s,
            "transformers, batch 1 (CPU, fp32)",
            result.peer_tokens_per_s,
            "GPT-2 124M, random weights, greedy; the simulator runs the whole wafer program in NumPy",
        )
        for rate in result.rates
    ]
    return rows, _printed(print_sim_result, result)


def measure_service_rows(progress: Callable[[str], None]) -> tuple[list[MeasuredRow], str]:
    """`bench service` with the report's settings: decode throughput at 16 streams, HTTP against direct."""
    from tools.bench.bench_service import measure, print_result
    from tools.report.measured import NEW_TOKENS, REPS, SERVICE_COMMAND, STREAMS, MeasuredRow
    from wafer_gpt2.model.config import PRESETS
    from wafer_gpt2.model.params import GPT2Params

    progress(f"measuring: {SERVICE_COMMAND}")
    params = GPT2Params.random(PRESETS["gpt2"], seed=0)
    result = measure(
        params, "gpt2 (random weights)", streams=STREAMS, new_tokens=NEW_TOKENS, reps=REPS, log=progress
    )
    # Decode throughput at 16 streams from the full-decode step times: the same work in both modes.
    row = MeasuredRow(
        f"HTTP service, {STREAMS} streams, decode",
        STREAMS * 1e3 / result.period_ms("http"),
        "direct backend steps, decode",
        STREAMS * 1e3 / result.period_ms("direct"),
        f"decode step {result.period_ms('http'):.1f} ms vs {result.period_ms('direct'):.1f} ms direct: service "
        f"overhead {result.overhead_pct('http'):+.1f}% of step time; end to end with the prompts "
        f"{result.tokens_per_s('http'):.1f} vs {result.tokens_per_s('direct'):.1f} tokens/s",
    )
    return [row], _printed(print_result, result)


def measure_all(progress: Callable[[str], None] | None = None) -> Measured:
    """Both benchmarks on GPT-2 124M (whatever model the modeled figures are about), as the report's rows."""
    from tools.report.measured import SERVICE_COMMAND, SIM_COMMAND, Measured, describe_machine

    say = progress or (lambda message: None)
    measured = Measured(
        describe_machine(), f"{SIM_COMMAND}; {SERVICE_COMMAND}", date=datetime.date.today().isoformat()
    )
    outputs = []
    for run_rows in (measure_sim_rows, measure_service_rows):
        rows, output = run_rows(say)
        measured.rows.extend(rows)
        outputs.append(output.strip())
    measured.text = "Their output:\n\n```\n" + "\n\n".join(outputs) + "\n```"
    return measured


def _printed(print_fn: Callable[[Any], None], result: Any) -> str:
    """What a benchmark's print function writes for `result` (quoted in the report)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_fn(result)
    return out.getvalue()
