"""The measured part of the report (`wafer-gpt2 report --measure`): the two benchmarks run here, each
against its peer in the same run, and a description of the machine they ran on.

- `wafer-gpt2 bench sim`: the simulator against Hugging Face `transformers` (CPU), batch 1 and 16;
  its figures are read from the one summary line the benchmark ends with.
- `wafer-gpt2 bench service`: the HTTP service against direct executor steps, 16 streams.
"""

from __future__ import annotations

import contextlib
import io
import os
import platform
import re
from dataclasses import dataclass, field

NEW_TOKENS = 16  # per stream, in the service benchmark
SIM_NEW_TOKENS = (
    32  # per sequence, in the simulator benchmark: its default, the figure issue #4 sets a goal for
)
REPS = 3
STREAMS = 16
SIM_COMMAND = f"wafer-gpt2 bench sim --batch 1,16 --new-tokens {SIM_NEW_TOKENS} --reps {REPS}"
SERVICE_COMMAND = f"wafer-gpt2 bench service --streams {STREAMS} --new-tokens {NEW_TOKENS} --reps {REPS}"


@dataclass(frozen=True)
class MeasuredRow:
    label: str
    tokens_per_s: float
    peer: str
    peer_tokens_per_s: float
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.tokens_per_s / self.peer_tokens_per_s


@dataclass
class Measured:
    machine: str
    command: str
    rows: list[MeasuredRow] = field(default_factory=list)
    text: str = ""  # the benchmarks' own output, quoted in the report


def describe_machine() -> str:
    """CPU model, cores, load, Python and library versions: what the measured figures depend on."""
    import numpy

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            cpu = names[0]
    parts = [
        f"{cpu}, {os.cpu_count()} logical CPUs",
        f"Python {platform.python_version()}",
        f"NumPy {numpy.__version__}",
    ]
    with contextlib.suppress(ImportError):
        import torch

        parts.append(f"torch {torch.__version__} (CPU, {torch.get_num_threads()} threads)")
    with contextlib.suppress(OSError):
        parts.append(f"load average {os.getloadavg()[0]:.1f} at the start")
    return "; ".join(parts) + "; no GPU, no Cerebras system"


SIM_PEER = re.compile(r"transformers batch 1 ([\d.]+) tok/s")
SIM_BATCH = re.compile(r"batch (\d+) ([\d.]+) tok/s = ([\d.]+)x")


def parse_sim_summary(output: str) -> tuple[float, dict[int, float]]:
    """(transformers batch-1 tokens/s, {batch: simulator tokens/s}) from `bench sim`'s summary line."""
    lines = [line for line in output.splitlines() if line.startswith("bench sim summary:")]
    if not lines:
        raise RuntimeError(f"`bench sim` printed no summary line; its output ended with: {output[-500:]!r}")
    peer = SIM_PEER.search(lines[-1])
    batches = {int(b): float(rate) for b, rate, _ in SIM_BATCH.findall(lines[-1])}
    if peer is None or not batches:
        raise RuntimeError(f"cannot read `bench sim`'s summary line: {lines[-1]!r}")
    return float(peer.group(1)), batches


def measure_sim(progress) -> tuple[list[MeasuredRow], str]:
    from service.cli import main

    progress(f"measuring: {SIM_COMMAND} (minutes on a busy machine)")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(SIM_COMMAND.split()[1:])
    if status:
        raise RuntimeError(f"`{SIM_COMMAND}` failed with exit status {status}: {out.getvalue()[-500:]}")
    peer, batches = parse_sim_summary(out.getvalue())
    rows = [
        MeasuredRow(
            f"simulator, batch {b}",
            rate,
            "transformers, batch 1 (CPU, fp32)",
            peer,
            "GPT-2 124M, random weights, greedy; the simulator runs the whole wafer program in NumPy",
        )
        for b, rate in sorted(batches.items())
    ]
    return rows, out.getvalue()


def measure_service(progress) -> tuple[list[MeasuredRow], str]:
    from service.commands.bench_service import measure, print_result
    from weights.config import PRESETS
    from weights.params import GPT2Params

    progress(f"measuring: {SERVICE_COMMAND}")
    params = GPT2Params.random(PRESETS["gpt2"], seed=0)
    result = measure(
        params, "gpt2 (random weights)", streams=STREAMS, new_tokens=NEW_TOKENS, reps=REPS, log=progress
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_result(result)
    # Decode throughput at 16 streams from the full-decode step times: the same work in both modes.
    row = MeasuredRow(
        f"HTTP service, {STREAMS} streams, decode",
        STREAMS * 1e3 / result.period_ms("http"),
        "direct executor steps, decode",
        STREAMS * 1e3 / result.period_ms("direct"),
        f"decode step {result.period_ms('http'):.1f} ms vs {result.period_ms('direct'):.1f} ms direct: service "
        f"overhead {result.overhead_pct('http'):+.1f}% of step time; end to end with the prompts "
        f"{result.tokens_per_s('http'):.1f} vs {result.tokens_per_s('direct'):.1f} tokens/s",
    )
    return [row], out.getvalue()


def measure_all(progress=None) -> Measured:
    """Both benchmarks (GPT-2 124M, whatever model the modeled figures are about)."""
    say = progress or (lambda message: None)
    measured = Measured(describe_machine(), f"{SIM_COMMAND}; {SERVICE_COMMAND}")
    outputs = []
    for run in (measure_sim, measure_service):
        rows, output = run(say)
        measured.rows.extend(rows)
        outputs.append(output.strip())
    measured.text = "Their output:\n\n```\n" + "\n\n".join(outputs) + "\n```"
    return measured
