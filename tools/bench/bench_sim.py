"""`python -m tools.bench sim`: the embedded simulator against Hugging Face `transformers`, on this CPU.

Both run GPT-2 124M with the same random weights, the same prompt and the same number of new tokens
(greedy). The peer is `GPT2LMHeadModel` in fp32 with its KV cache, one sequence, driven by a plain
forward loop (no `generate` overhead). The simulator runs through the whole host path
(`wafer_gpt2.backends.registry.build_backend("sim")`: plan, SimRuntime, WaferGPT2, memcpy streams) at batch 1 and
with B concurrent sequences. One untimed round warms both up; then runs alternate and each figure is
the median of `--reps`; the machine is shared, so the ratios (measured in the same run) are the
result, not the absolute rates.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tools.bench import bench_service
from wafer_gpt2.backends.registry import BackendOptions, build_backend
from wafer_gpt2.cli.runner import run as run_command
from wafer_gpt2.engine.core import bare_greedy
from wafer_gpt2.errors import UserError
from wafer_gpt2.model.config import GPT2Config, resolve_config
from wafer_gpt2.model.params import GPT2Params
from wafer_gpt2.sim import parallel

GOAL_BATCH1 = 0.7  # simulator / transformers at batch 1
GOAL_BATCHED = 5.0  # simulator total at B sequences / transformers at batch 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench",
        description="The benchmarks, measured on this machine: sim (the embedded simulator against Hugging Face "
        "transformers) and service (the HTTP service against direct backend steps). Each option's help says "
        "which it applies to. The host stack's benchmark ships with the product: `wafer-gpt2 bench host`.",
    )
    parser.add_argument(
        "target",
        choices=("sim", "service"),
        help="what to benchmark: sim (the embedded simulator against transformers) or service "
        "(HTTP service against direct backend steps, tools/bench/bench_service.py)",
    )
    parser.add_argument(
        "--model",
        default="gpt2",
        help="GPT-2 size (gpt2, gpt2-medium, ...) or a config.json, random weights (gpt2)",
    )
    parser.add_argument(
        "--backend",
        choices=("sim", "csl"),
        default="sim",
        help="sim: what runs the wafer side is the embedded simulator (default); csl: the generated CSL on "
        "the CSL executor (compact plan; use a small --model config, the executor simulates every PE)",
    )
    parser.add_argument("--batch", default="1,16", help="comma-separated concurrent sequences (1,16)")
    parser.add_argument(
        "--new-tokens", type=int, default=32, metavar="N", help="tokens generated per sequence (32)"
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=16, metavar="P", help="prompt length in tokens (16)"
    )
    parser.add_argument(
        "--dtype", choices=("fp16", "fp32"), default="fp16", help="simulator precision (fp16)"
    )
    parser.add_argument("--reps", type=int, default=3, help="repetitions; medians are reported (3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompt")
    parser.add_argument(
        "--threads",
        type=int,
        help="CPU threads for both (torch.set_num_threads and the simulator's pool, WAFER_SIM_THREADS; "
        "default: the libraries' defaults)",
    )
    bench_service.add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m tools.bench TARGET ...`; user errors print one line (exit 2), as `wafer-gpt2`'s do."""
    args = build_parser().parse_args(argv)
    return run_command(args, f"bench {args.target}")


def run(args: argparse.Namespace) -> int:
    if args.target == "service":
        return bench_service.run(args)
    try:
        batches = sorted({int(part) for part in args.batch.split(",")})
    except ValueError:
        raise UserError(f"--batch must be comma-separated integers, got {args.batch!r}") from None
    if not batches or batches[0] < 1:
        raise UserError(f"--batch sizes must be positive, got {args.batch!r}")
    for flag, value in (
        ("--new-tokens", args.new_tokens),
        ("--prompt-tokens", args.prompt_tokens),
        ("--reps", args.reps),
    ):
        if value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    try:
        config = resolve_config(args.model)
    except (OSError, ValueError) as exc:
        raise UserError(f"--model {args.model!r}: {exc}") from None
    if args.prompt_tokens + args.new_tokens > config.n_positions:
        raise UserError(
            f"prompt + new tokens ({args.prompt_tokens + args.new_tokens}) exceed the context {config.n_positions}"
        )
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be at least 1, got {args.threads}")
    result = measure_sim(
        config,
        batches,
        new_tokens=args.new_tokens,
        prompt_tokens=args.prompt_tokens,
        dtype=args.dtype,
        reps=args.reps,
        seed=args.seed,
        backend=args.backend,
        threads=args.threads,
        log=lambda message: print(message, file=sys.stderr),
    )
    print_sim_result(result)
    return 0


@dataclass(frozen=True)
class SimBatchRate:
    """One batch size's medians: generated tokens per wall-clock second and per CPU-second."""

    batch: int
    tokens_per_s: float
    tokens_per_cpu_s: float


@dataclass(frozen=True)
class SimBenchResult:
    """What `bench sim` measured; `print_sim_result` prints it, `python -m tools.report --measure` tabulates it."""

    label: str  # "simulator" or "CSL executor"
    dtype: str
    peer_tokens_per_s: float  # transformers, batch 1
    peer_tokens_per_cpu_s: float
    rates: tuple[SimBatchRate, ...]
    same_tokens: bool  # the greedy tokens of both sides agree

    def ratio(self, rate: SimBatchRate) -> float:
        return rate.tokens_per_s / self.peer_tokens_per_s

    def summary_line(self) -> str:
        parts = []
        for rate in self.rates:
            ratio, cpu_ratio = self.ratio(rate), rate.tokens_per_cpu_s / self.peer_tokens_per_cpu_s
            goal = GOAL_BATCH1 if rate.batch == 1 else GOAL_BATCHED
            parts.append(
                f"batch {rate.batch} {rate.tokens_per_s:.1f} tok/s = {ratio:.2f}x (goal >= {goal}x: "
                f"{'met' if ratio >= goal else 'MISSED'}; {cpu_ratio:.2f}x per CPU-second)"
            )
        return (
            f"bench sim summary: transformers batch 1 {self.peer_tokens_per_s:.1f} tok/s; {self.label} "
            + "; ".join(parts)
        )


def measure_sim(
    config: GPT2Config,
    batches: list[int],
    new_tokens: int = 32,
    prompt_tokens: int = 16,
    dtype: str = "fp16",
    reps: int = 3,
    seed: int = 0,
    backend: str = "sim",
    threads: int | None = None,
    log: Callable[[str], None] = print,
) -> SimBenchResult:
    """The simulator (or CSL executor) against transformers at batch 1; every figure measured here.

    Raises UserError when torch or transformers is missing."""
    try:
        import torch
        from transformers import GPT2Config as HFConfig
        from transformers import GPT2LMHeadModel
    except ImportError:
        raise UserError("the peer needs torch and transformers: pip install -e '.[test]'") from None

    batches = sorted(batches)
    thread_note = f"torch {torch.get_num_threads()} threads, simulator {parallel.threads()}"
    if threads is not None:
        torch.set_num_threads(threads)
        parallel.SIM_THREADS = threads  # read when the simulator next splits work
        thread_note = f"{threads} thread(s) each"
    params = GPT2Params.random(config, seed=seed)
    prompt = np.random.default_rng(seed).integers(0, config.vocab_size, prompt_tokens).tolist()
    context = prompt_tokens + new_tokens

    log(
        f"bench sim: {config.name} random weights, prompt {prompt_tokens} tokens, {new_tokens} new tokens "
        f"per sequence, greedy, simulator {dtype}, {thread_note}, median of {reps}"
    )
    hf = GPT2LMHeadModel(HFConfig(**config.to_hf_dict())).eval()
    hf.load_state_dict(_hf_state_dict(params, torch), strict=False)
    runner = build_backend(backend, params, BackendOptions(slots=max(batches), context=context, dtype=dtype))

    label = "simulator" if backend == "sim" else "CSL executor"
    hf_runs: list[tuple[float, float]] = []
    sim_runs: dict[int, list[tuple[float, float]]] = {b: [] for b in batches}
    hf_tokens = sim_tokens = None
    try:
        # One untimed round first: the simulator builds its float32 weight caches on first use and
        # torch warms its allocator, neither of which a long-lived server pays per request.
        _run_transformers(hf, torch, prompt, 2)
        _run_simulator(runner, prompt, 2, max(batches))
        for _ in range(reps):
            wall, cpu, hf_tokens = _run_transformers(hf, torch, prompt, new_tokens)
            hf_runs.append((wall, cpu))
            for batch in batches:
                wall, cpu, tokens = _run_simulator(runner, prompt, new_tokens, batch)
                sim_runs[batch].append((wall, cpu))
                sim_tokens = sim_tokens or tokens
    finally:
        runner.close()

    # Rates: generated tokens per wall-clock second, and per CPU-second of this process (steadier
    # on a shared machine, comparable when both sides use the same number of threads).
    hf_wall, hf_cpu = (statistics.median(run[i] for run in hf_runs) for i in (0, 1))
    rates = tuple(
        SimBatchRate(batch, *(statistics.median(run[i] for run in sim_runs[batch]) for i in (0, 1)))
        for batch in batches
    )
    return SimBenchResult(label, dtype, hf_wall, hf_cpu, rates, hf_tokens == sim_tokens)


def print_sim_result(result: SimBenchResult) -> None:
    hf_wall, hf_cpu, label = result.peer_tokens_per_s, result.peer_tokens_per_cpu_s, result.label
    print(f"transformers   batch  1: {hf_wall:8.1f} tokens/s, {hf_cpu:8.1f} per CPU-second (measured)")
    for rate in result.rates:
        ratio, cpu_ratio = rate.tokens_per_s / hf_wall, rate.tokens_per_cpu_s / hf_cpu
        print(
            f"{label:<14} batch {rate.batch:2d}: {rate.tokens_per_s:8.1f} tokens/s, {rate.tokens_per_cpu_s:8.1f} "
            f"per CPU-second (measured); {ratio:.2f}x transformers batch 1 ({cpu_ratio:.2f}x per CPU-second)"
        )
    same = "identical" if result.same_tokens else "different"
    print(f"greedy tokens of {label} and transformers: {same} ({result.dtype} {label} vs fp32 transformers)")
    print(result.summary_line())


def _hf_state_dict(params: GPT2Params, torch) -> dict:
    """Our parameters under HF's names (Conv1D keeps [in, out], as we do); the LM head is tied."""
    return {
        f"transformer.{name}": torch.from_numpy(np.ascontiguousarray(value))
        for name, value in params.to_tensors().items()
    }


def _run_transformers(model, torch, prompt: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    """One sequence: prefill the prompt, then one forward per new token with the KV cache."""
    tokens: list[int] = []
    with torch.no_grad():
        start, start_cpu = time.perf_counter(), time.process_time()
        out = model(torch.tensor([prompt]), use_cache=True)
        for step in range(new_tokens):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            if step + 1 < new_tokens:
                out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    return new_tokens / elapsed, new_tokens / cpu, tokens


def _run_simulator(backend, prompt: list[int], new_tokens: int, batch: int) -> tuple[float, float, list[int]]:
    """`batch` sequences in slots 0..batch-1: every prompt in one step, then one step per new token."""
    backend.reset()
    start, start_cpu = time.perf_counter(), time.process_time()
    generated = bare_greedy(backend, [prompt] * batch, new_tokens)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    return batch * new_tokens / elapsed, batch * new_tokens / cpu, generated[0]
